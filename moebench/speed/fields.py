"""Typed reads of one stored JSON object (a speed record, its group, a pass file), each refusal naming
where the object came from, the key and the type expected. A leaf of the speed wing: the `from_json`
of records.py and stored.py read through it.
"""
from __future__ import annotations

from moebench.json_types import JsonObject, JsonValue


class Fields:
    """The keys of one JSON object, read with their types checked; `source` names the file (and item)."""

    def __init__(self, obj: JsonValue, source: str):
        if not isinstance(obj, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(obj).__name__}")
        self.obj: JsonObject = obj
        self.source = source

    def _bad(self, key: str, expected: str) -> ValueError:
        return ValueError(f"{self.source}: key {key!r} must be {expected}, got {self.obj.get(key)!r}")

    def _present(self, key: str, required: bool, expected: str) -> bool:
        if self.obj.get(key) is not None:
            return True
        if required:
            raise ValueError(f"{self.source}: key {key!r} is missing (expected {expected})")
        return False

    def num(self, key: str, required: bool = False) -> float | None:
        """A number (an integer is one too, kept as written so it is written back the same); None where
        absent or null, unless required."""
        if not self._present(key, required, "a number"):
            return None
        v = self.obj[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self._bad(key, "a number")
        return v

    def need_num(self, key: str) -> float:
        v = self.num(key, required=True)
        assert v is not None
        return v

    def integer(self, key: str, required: bool = False) -> int | None:
        if not self._present(key, required, "an integer"):
            return None
        v = self.obj[key]
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._bad(key, "an integer")
        return v

    def need_int(self, key: str) -> int:
        v = self.integer(key, required=True)
        assert v is not None
        return v

    def text(self, key: str, required: bool = False) -> str | None:
        if not self._present(key, required, "a string"):
            return None
        v = self.obj[key]
        if not isinstance(v, str):
            raise self._bad(key, "a string")
        return v

    def need_str(self, key: str) -> str:
        v = self.text(key, required=True)
        assert v is not None
        return v

    def flag(self, key: str) -> bool | None:
        if self.obj.get(key) is None:
            return None
        v = self.obj[key]
        if not isinstance(v, bool):
            raise self._bad(key, "true or false")
        return v

    def object(self, key: str) -> JsonObject | None:
        """A nested JSON object, still to be parsed by its own class; None where absent or null."""
        v = self.obj.get(key)
        if v is None:
            return None
        if not isinstance(v, dict):
            raise self._bad(key, "a JSON object")
        return v

    def numbers(self, key: str) -> dict[str, float] | None:
        """An object of numbers (SLO limits, a stop rule)."""
        obj = self.object(key)
        if obj is None:
            return None
        sub = Fields(obj, f"{self.source}, key {key!r}")
        return {k: sub.need_num(k) for k in obj}

    def number_list(self, key: str) -> list[float] | None:
        """A list of numbers (rates run); None where absent or null."""
        v = self.obj.get(key)
        if v is None:
            return None
        if not isinstance(v, list):
            raise self._bad(key, "a list of numbers")
        out: list[float] = []
        for x in v:
            if isinstance(x, bool) or not isinstance(x, (int, float)):
                raise self._bad(key, "a list of numbers")
            out.append(x)
        return out

    def interval(self, key: str) -> tuple[float, float] | None:
        """Two numbers (an interval's ends); None where absent or null."""
        ends = self.number_list(key)
        if ends is None:
            return None
        if len(ends) != 2:
            raise self._bad(key, "two numbers (an interval) or null")
        return ends[0], ends[1]

    def strings(self, key: str) -> list[str] | None:
        v = self.obj.get(key)
        if v is None:
            return None
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise self._bad(key, "a list of strings")
        return [x for x in v if isinstance(x, str)]

    def items(self, key: str) -> list[JsonValue]:
        """A list (of anything still to be parsed); [] where absent or null."""
        v = self.obj.get(key)
        if v is None:
            return []
        if not isinstance(v, list):
            raise ValueError(f"{self.source}: key {key!r} must be a list, got {v!r:.80}")
        return v

    def objects(self, key: str) -> list[Fields]:
        """A list of JSON objects to read in turn, each named `key[i]` in errors; [] where absent."""
        return [Fields(v, f"{self.source}, {key}[{i}]") for i, v in enumerate(self.items(key))]

    def at(self, key: str) -> Fields | None:
        """The nested object under `key` to read in turn (errors name both keys)."""
        obj = self.object(key)
        return None if obj is None else Fields(obj, f"{self.source}, key {key!r}")
