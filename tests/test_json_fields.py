"""The shared checked reader of JSON objects: the type rules, each wording's messages, the lenient reads."""
import json

import pytest

from moebench.json_fields import (PLAIN, Fields, Wording, as_integer, as_number, as_object, expected_of, is_of,
                                  json_kind)


class OddError(ValueError):
    pass


def test_bool_is_never_a_number_and_an_int_is_one():
    doc = json.loads('{"t": true, "i": 3, "f": 2.5, "s": "x", "n": null}')
    assert is_of(doc["i"], (float,)) and is_of(doc["f"], (float,)) and is_of(doc["i"], (int,))
    assert not is_of(doc["t"], (int,)) and not is_of(doc["t"], (float,)) and is_of(doc["t"], (bool,))
    assert not is_of(doc["f"], (int,)) and not is_of(doc["s"], (float,))
    assert is_of(doc["n"], (str, type(None))) and not is_of(doc["n"], (str,))
    assert [json_kind(doc[k]) for k in "tifsn"] == ["true or false", "an integer", "a number", "a string", "null"]
    assert expected_of((str, type(None))) == "a string or null"


def test_a_wording_names_where_key_and_expected_in_its_own_templates():
    w = Wording(OddError, not_object="{where}: not an object but {type}", missing="{where}: no {key!r}",
                wrong="{where}: {key!r} holds {value!r} ({kind}), wanted {expected}")
    d = {"a": True, "b": None}
    with pytest.raises(OddError, match=r"^f\.json: not an object but list$"):
        w.object([], "f.json")
    with pytest.raises(OddError, match=r"^f\.json: no 'c'$"):
        w.value(d, "c", "f.json", (int,), required=True)
    with pytest.raises(OddError, match=r"^f\.json: 'a' holds True \(true or false\), wanted an integer$"):
        w.value(d, "a", "f.json", (int,))
    with pytest.raises(OddError, match=r"^f\.json: 'b' holds None \(null\), wanted a number$"):
        w.value(d, "b", "f.json", (float,), "a number")
    assert w.value(d, "b", "f.json", (float,), null_is_absent=True) is None
    assert w.value(d, "c", "f.json", (float,)) is None
    with pytest.raises(OddError, match=r"key 'k' is 'z', expected one of 'x', 'y'"):
        w.value({"k": "z"}, "k", "f.json", (str,), choices=("x", "y"))


def test_fields_reads_absent_and_null_alike_and_refuses_in_plain_words():
    f = Fields(json.loads('{"n": 1, "x": null, "flag": 1, "rates": [1, 2.5], "sub": {"a": 2}}'), "run/items.jsonl")
    assert f.num("n") == 1 and isinstance(f.num("n"), int) and f.num("x") is None and f.num("gone") is None
    assert f.number_list("rates") == [1, 2.5] and f.at("sub").need_int("a") == 2
    with pytest.raises(ValueError, match=r"^run/items\.jsonl: key 'x' is missing \(expected a number\)$"):
        f.need_num("x")
    with pytest.raises(ValueError, match=r"^run/items\.jsonl: key 'flag' must be true or false, got 1$"):
        f.flag("flag")
    with pytest.raises(ValueError, match=r"^run/items\.jsonl, key 'sub': key 'a' must be a string, got 2$"):
        f.at("sub").text("a")
    with pytest.raises(ValueError, match=r"^run/items\.jsonl, key 'sub': key 'a' is missing \(expected a number\)$"):
        Fields({"sub": {"a": None}}, "run/items.jsonl").numbers("sub")
    with pytest.raises(ValueError, match=r"^x: expected a JSON object, got list$"):
        Fields([], "x", PLAIN)


def test_the_lenient_reads_never_raise():
    assert as_object([1]) == {} and as_object({"a": 1}) == {"a": 1} and as_object(None) == {}
    assert as_number(True) is None and as_number("1") is None and as_number(3) == 3 and as_number(0.5) == 0.5
    assert as_integer(True) is None and as_integer(2.0) is None and as_integer(7) == 7
