"""Reading the zoo's own JSON files (training.json) back into the dataclasses that wrote them.

`from_fields(cls, obj, where)` is `cls(**obj)` for a document `asdict(cls(...))` produced: every field
present, no other key, and each number, string or flag of its declared type; nested parts are
parsed by the `parts` the caller names. A bad document raises ZooFileError naming the file and
key path (`where`) and what was expected.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Callable, TypeVar

from moebench.json_fields import Wording
from moebench.json_types import JsonObject, JsonValue

T = TypeVar("T")

_SCALARS = (int, float, bool, str)
_BY_NAME = {t.__name__: t for t in _SCALARS}


class ZooFileError(ValueError):
    """A zoo file whose structure is not the one the zoo writes; the message names file and key."""


# The zoo's wording of a refusal (tests and users read these messages).
WORDING = Wording(ZooFileError, not_object="{where}: expected an object, got {type}",
                  missing="{where}: key {key!r} missing",
                  wrong="{where}: key {key!r} is {value!r}, expected {expected}")


def json_object(v: JsonValue, where: str) -> JsonObject:
    return WORDING.object(v, where)


def from_fields(cls: type[T], obj: JsonValue, where: str,
                parts: dict[str, Callable[[JsonValue, str], object]] | None = None) -> T:
    """cls(**obj), checked: `parts` maps a key to the parser of its value (given the value and its place)."""
    d = json_object(obj, where)
    names = [f.name for f in fields(cls)]
    for name in names:
        if name not in d:
            raise WORDING.refuse_missing(where, name, "")
    unknown = [k for k in d if k not in names]
    if unknown:
        raise ZooFileError(f"{where}: unknown key {unknown[0]!r} (expected {', '.join(names)})")
    # A field's declared type as written (a string under postponed annotations): the scalar ones are checked.
    declared = {f.name: _BY_NAME.get(f.type) if isinstance(f.type, str) else f.type for f in fields(cls)}

    def value(name: str) -> object:
        if parts and name in parts:
            return parts[name](d[name], f"{where}.{name}")
        t = declared[name]
        if t in _SCALARS:
            return WORDING.value(d, name, where, (t,), required=True)
        return d[name]
    return cls(**{name: value(name) for name in names})


def strings(v: JsonValue, where: str) -> tuple[str, ...]:
    """A list of strings, as the tuple a dataclass field holds."""
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise ZooFileError(f"{where}: expected a list of strings, got {v!r}")
    return tuple(v)
