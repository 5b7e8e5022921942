"""Reading the zoo's own JSON files (training.json) back into the dataclasses that wrote them.

`from_fields(cls, obj, where)` is `cls(**obj)` for a document `asdict(cls(...))` produced: every field
present, no other key, and each number, string or flag of its declared type; nested parts are
parsed by the `parts` the caller names. A bad document raises ZooFileError naming the file and
key path (`where`) and what was expected.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Callable, TypeVar

from moebench.json_types import JsonObject, JsonValue

T = TypeVar("T")

_SCALARS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
_BY_NAME = {t.__name__: t for t in _SCALARS}


class ZooFileError(ValueError):
    """A zoo file whose structure is not the one the zoo writes; the message names file and key."""


def json_object(v: JsonValue, where: str) -> JsonObject:
    if not isinstance(v, dict):
        raise ZooFileError(f"{where}: expected an object, got {type(v).__name__}")
    return v


def _is(v: JsonValue, t: type) -> bool:
    if t is bool:
        return isinstance(v, bool)
    if isinstance(v, bool):
        return False
    return isinstance(v, (int, float)) if t is float else isinstance(v, t)


def from_fields(cls: type[T], obj: JsonValue, where: str,
                parts: dict[str, Callable[[JsonValue, str], object]] | None = None) -> T:
    """cls(**obj), checked: `parts` maps a key to the parser of its value (given the value and its place)."""
    d = json_object(obj, where)
    names = [f.name for f in fields(cls)]
    for name in names:
        if name not in d:
            raise ZooFileError(f"{where}: key {name!r} missing")
    unknown = [k for k in d if k not in names]
    if unknown:
        raise ZooFileError(f"{where}: unknown key {unknown[0]!r} (expected {', '.join(names)})")
    # A field's declared type as written (a string under postponed annotations): the scalar ones are checked.
    declared = {f.name: _BY_NAME.get(f.type) if isinstance(f.type, str) else f.type for f in fields(cls)}

    def value(name: str) -> object:
        v = d[name]
        if parts and name in parts:
            return parts[name](v, f"{where}.{name}")
        t = declared[name]
        if t in _SCALARS and not _is(v, t):
            raise ZooFileError(f"{where}: key {name!r} is {v!r}, expected {_SCALARS[t]}")
        return v
    return cls(**{name: value(name) for name in names})


def strings(v: JsonValue, where: str) -> tuple[str, ...]:
    """A list of strings, as the tuple a dataclass field holds."""
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise ZooFileError(f"{where}: expected a list of strings, got {v!r}")
    return tuple(v)
