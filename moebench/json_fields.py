"""Checked reads of a JSON object's keys, shared by every record's `from_json`: a key's value checked
against the JSON types expected, and a refusal naming where the object came from, the key and what was
expected. A leaf: it imports only the standard library and json_types.

Each family of records words its refusals its own way and raises its own exception class (tests and
users read them), so the reader takes a `Wording`: the class and three message templates. The rules
are the same for all: bool is never a number (JSON's true is not 1), and `float` stands for any JSON
number (an integer is kept as written, so a record read back writes the same JSON). `Fields` reads
one object key by key where absent and null both mean "not given"; `as_object`, `as_number` and
`as_integer` are the lenient reads (anything else reads as empty or None, never an error).
"""
from __future__ import annotations

from dataclasses import dataclass

from moebench.json_types import JsonObject, JsonValue

TYPE_NAMES: dict[type, str] = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
                               dict: "an object", list: "a list", type(None): "null"}


def json_kind(v: object) -> str:
    """The JSON name of a value's type ("an integer", "null"...), its Python name where it is no JSON type."""
    return next((name for t, name in TYPE_NAMES.items() if type(v) is t), type(v).__name__)


def expected_of(types: tuple[type, ...]) -> str:
    """The types a key may hold, in words: (str, NoneType) -> "a string or null"."""
    return " or ".join(TYPE_NAMES.get(t, t.__name__) for t in types)


def is_of(v: object, types: tuple[type, ...]) -> bool:
    """Whether `v` is one of `types`: a bool only where bool is named, an int also where float is."""
    if isinstance(v, bool):
        return bool in types
    return isinstance(v, types) or (float in types and isinstance(v, int))


# Lenient reads, for readers that show what is there and never refuse (the report, compare's figures).

def as_object(v: JsonValue | object) -> JsonObject:
    """A JSON object as read, or an empty one for anything else."""
    return v if isinstance(v, dict) else {}


def as_number(v: JsonValue | object) -> int | float | None:
    """A number as written (an int stays an int); None for anything else, a bool included."""
    return v if is_of(v, (float,)) else None  # type: ignore[return-value]


def as_integer(v: JsonValue | object) -> int | None:
    """An integer; None for anything else, a bool included."""
    return v if is_of(v, (int,)) else None  # type: ignore[return-value]


@dataclass(frozen=True)
class Wording:
    """How one family of records refuses bad input: its exception class and message templates.

    The templates are `str.format` strings over `where` (the file, item or key path), `key`,
    `expected` (in words), `value` (the value found), `kind` (its JSON type in words) and `type` (its
    Python type name); a template uses the ones it names.
    """

    error: type[Exception]
    not_object: str = "{where}: expected a JSON object, got {kind}"
    missing: str = "{where}: missing key {key!r} (expected {expected})"
    wrong: str = "{where}: key {key!r} is {kind}, expected {expected}"

    def _raise(self, template: str, where: str, key: str = "", expected: str = "",
               value: JsonValue | object = None) -> Exception:
        return self.error(template.format(where=where, key=key, expected=expected, value=value,
                                          kind=json_kind(value), type=type(value).__name__))

    def refuse(self, where: str, key: str, value: object, expected: str) -> Exception:
        """The error for `key` holding `value` where `expected` was (to raise)."""
        return self._raise(self.wrong, where, key, expected, value)

    def refuse_missing(self, where: str, key: str, expected: str) -> Exception:
        return self._raise(self.missing, where, key, expected)

    def object(self, v: JsonValue | object, where: str) -> JsonObject:
        """`v` if it is a JSON object, else the refusal naming `where`."""
        if not isinstance(v, dict):
            raise self._raise(self.not_object, where, value=v)
        return v

    def value(self, d: JsonObject, key: str, where: str, types: tuple[type, ...], expected: str | None = None, *,
              required: bool = False, null_is_absent: bool = False,
              choices: tuple[str, ...] | None = None) -> JsonValue:
        """d[key] checked against `types` (and `choices`); where absent (or null, with `null_is_absent`):
        None, or the missing-key refusal where required. `expected` words the types (else expected_of)."""
        words = expected_of(types) if expected is None else expected
        v = d.get(key)
        if key not in d or (v is None and null_is_absent):
            if required:
                raise self.refuse_missing(where, key, words)
            return None
        if not is_of(v, types):
            raise self.refuse(where, key, v, words)
        if choices is not None and v not in choices:
            raise self.error(f"{where}: key {key!r} is {v!r}, expected one of {', '.join(map(repr, choices))}")
        return v


# The plain wording: ValueError, naming the value found as written.
PLAIN = Wording(ValueError, not_object="{where}: expected a JSON object, got {type}",
                missing="{where}: key {key!r} is missing (expected {expected})",
                wrong="{where}: key {key!r} must be {expected}, got {value!r}")

_NUMBER = (float,)


class Fields:
    """The keys of one JSON object, read with their types checked; absent and null both read as None
    (unless required). `source` names the file (and item); `wording` how refusals read (PLAIN: a
    ValueError)."""

    def __init__(self, obj: JsonValue, source: str, wording: Wording = PLAIN):
        self.obj: JsonObject = wording.object(obj, source)
        self.source = source
        self.wording = wording

    def _get(self, key: str, types: tuple[type, ...], expected: str, required: bool = False) -> JsonValue:
        return self.wording.value(self.obj, key, self.source, types, expected, required=required,
                                  null_is_absent=True)

    def num(self, key: str, required: bool = False) -> float | None:
        """A number (an integer is one too, kept as written so it is written back the same); None where
        absent or null, unless required."""
        v = self._get(key, _NUMBER, "a number", required)
        assert v is None or isinstance(v, (int, float))
        return v

    def need_num(self, key: str) -> float:
        v = self.num(key, required=True)
        assert v is not None
        return v

    def integer(self, key: str, required: bool = False) -> int | None:
        v = self._get(key, (int,), "an integer", required)
        assert v is None or isinstance(v, int)
        return v

    def need_int(self, key: str) -> int:
        v = self.integer(key, required=True)
        assert v is not None
        return v

    def text(self, key: str, required: bool = False) -> str | None:
        v = self._get(key, (str,), "a string", required)
        assert v is None or isinstance(v, str)
        return v

    def need_str(self, key: str) -> str:
        v = self.text(key, required=True)
        assert v is not None
        return v

    def flag(self, key: str) -> bool | None:
        v = self._get(key, (bool,), "true or false")
        assert v is None or isinstance(v, bool)
        return v

    def object(self, key: str) -> JsonObject | None:
        """A nested JSON object, still to be parsed by its own class; None where absent or null."""
        v = self._get(key, (dict,), "a JSON object")
        assert v is None or isinstance(v, dict)
        return v

    def numbers(self, key: str) -> dict[str, float] | None:
        """An object of numbers (SLO limits, a stop rule)."""
        sub = self.at(key)
        return None if sub is None else {k: sub.need_num(k) for k in sub.obj}

    def number_list(self, key: str) -> list[float] | None:
        """A list of numbers (rates run); None where absent or null."""
        v = self._get(key, (list,), "a list of numbers")
        if v is None:
            return None
        assert isinstance(v, list)
        out: list[float] = []
        for x in v:
            if not is_of(x, _NUMBER):
                raise self.wording.refuse(self.source, key, v, "a list of numbers")
            assert isinstance(x, (int, float))
            out.append(x)
        return out

    def interval(self, key: str) -> tuple[float, float] | None:
        """Two numbers (an interval's ends); None where absent or null."""
        ends = self.number_list(key)
        if ends is None:
            return None
        if len(ends) != 2:
            raise self.wording.refuse(self.source, key, self.obj.get(key), "two numbers (an interval) or null")
        return ends[0], ends[1]

    def strings(self, key: str) -> list[str] | None:
        v = self._get(key, (list,), "a list of strings")
        if v is None:
            return None
        assert isinstance(v, list)
        if not all(isinstance(x, str) for x in v):
            raise self.wording.refuse(self.source, key, v, "a list of strings")
        return [x for x in v if isinstance(x, str)]

    def items(self, key: str) -> list[JsonValue]:
        """A list (of anything still to be parsed); [] where absent or null."""
        v = self.obj.get(key)
        if v is None:
            return []
        if not isinstance(v, list):
            raise self.wording.error(f"{self.source}: key {key!r} must be a list, got {v!r:.80}")
        return v

    def objects(self, key: str) -> list[Fields]:
        """A list of JSON objects to read in turn, each named `key[i]` in errors; [] where absent."""
        return [Fields(v, f"{self.source}, {key}[{i}]", self.wording) for i, v in enumerate(self.items(key))]

    def at(self, key: str) -> Fields | None:
        """The nested object under `key` to read in turn (errors name both keys)."""
        obj = self.object(key)
        return None if obj is None else Fields(obj, f"{self.source}, key {key!r}", self.wording)
