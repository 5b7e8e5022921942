"""The one way moebench writes JSON: standard JSON only (RFC 8259 has no NaN or Infinity, and strict
parsers such as jq, JavaScript and Go reject them).

- `dumps`: json.dumps with allow_nan=False; a non-finite number raises NonFiniteValue naming where it
  sits ("timings.prompt_ms", "rows[3].delta"), never writes "NaN".
- `standard`: a copy with every non-finite number replaced by null, and the places it replaced.
- `document`: `standard` for a whole document (manifest, compare.json, gate.json, ...): the places are
  kept in the document itself, under `non_finite`, so a null that was a NaN is not mistaken for one
  that was never measured.
Item records take another road (moebench.store.RunStore.append): a non-finite field makes the item an
error record naming the field.
"""
from __future__ import annotations

import json
import math
from typing import Any, Callable

NON_FINITE_KEY = "non_finite"


class NonFiniteValue(ValueError):
    """A number that standard JSON cannot hold; `paths` says where."""

    def __init__(self, paths: list[str]):
        self.paths = paths
        super().__init__(f"non-finite value{'s' if len(paths) > 1 else ''} at {', '.join(paths)}")


def _join(where: str, key: Any) -> str:
    return f"{where}.{key}" if where else str(key)


def standard(obj: Any, where: str = "") -> tuple[Any, list[str]]:
    """(a copy of `obj` with NaN and +-Infinity as None, the dotted paths of the values replaced)."""
    paths: list[str] = []

    def walk(o: Any, at: str) -> Any:
        if isinstance(o, float) and not math.isfinite(o):
            paths.append(at or "(the value itself)")
            return None
        if isinstance(o, dict):
            return {k: walk(v, _join(at, k)) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [walk(v, f"{at}[{i}]") for i, v in enumerate(o)]
        return o

    return walk(obj, where), paths


def spelling(value: float) -> str:
    """How JavaScript (and Python's json) spell a non-finite number: NaN, Infinity, -Infinity."""
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def non_finite_values(obj: Any, where: str = "") -> dict[str, str]:
    """{dotted path: spelling} of every non-finite number in `obj`."""
    found: dict[str, str] = {}

    def walk(o: Any, at: str) -> None:
        if isinstance(o, float) and not math.isfinite(o):
            found[at or "(the value itself)"] = spelling(o)
        elif isinstance(o, dict):
            for k, v in o.items():
                walk(v, _join(at, k))
        elif isinstance(o, (list, tuple)):
            for i, v in enumerate(o):
                walk(v, f"{at}[{i}]")

    walk(obj, where)
    return found


def dumps(obj: Any, **kwargs: Any) -> str:
    """json.dumps that refuses non-finite numbers: NonFiniteValue names where they are."""
    try:
        return json.dumps(obj, allow_nan=False, **kwargs)
    except ValueError as e:
        found = non_finite_values(obj)
        if not found:
            raise
        raise NonFiniteValue(list(found)) from e


def dumper(**kwargs: Any) -> Callable[[Any], str]:
    """`dumps` with these keyword arguments, its encoder built once rather than on every call (json.dumps
    builds one per call whenever it is given options): for text written once per item."""
    encode = json.JSONEncoder(allow_nan=False, **kwargs).encode

    def dump(obj: Any) -> str:
        try:
            return encode(obj)
        except ValueError as e:
            found = non_finite_values(obj)
            if not found:
                raise
            raise NonFiniteValue(list(found)) from e
    return dump


def document(obj: Any) -> Any:
    """`obj` ready to write as a whole JSON file: non-finite numbers as null, and, for an object, their
    places listed under `non_finite` (added only when there are any)."""
    clean, paths = standard(obj)
    if paths and isinstance(clean, dict):
        clean[NON_FINITE_KEY] = list(clean.get(NON_FINITE_KEY) or []) + paths
    return clean


def document_text(obj: Any, **kwargs: Any) -> str:
    """`document(obj)` as standard JSON text."""
    return dumps(document(obj), **kwargs)
