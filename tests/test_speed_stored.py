"""Stored speed data read back into its classes: a bad record, compare section or A/B pass file is
refused naming the file (and item or row) and the key, with the type expected."""
from __future__ import annotations

import json

import pytest

from moebench.speed.ab import read_pass
from moebench.speed.ab_compare import AbSection, format_rounds
from moebench.speed.load_compare import LoadSection, format_load
from moebench.speed.stored import StoredRequest, read_records


def _record(**over):
    rec = {"task": "speed", "item_id": "speed/256/1/0/0", "status": "ok", "ttft_s": 0.5, "prefill_tok_s": 512.0,
           "decode_tok_s": 40.0, "e2e_s": 0.75, "output_tokens": 11, "prompt_tokens": 256, "prompt_length": 256,
           "clients": 1, "sampling": {"temperature": 0, "top_p": None, "top_k": None, "seed": 0}}
    rec.update(over)
    return rec


def test_a_stored_record_reads_back_typed():
    r = StoredRequest.from_json(_record(), "run/items.jsonl")
    assert (r.item_id, r.ok, r.measured, r.prompt_length, r.clients, r.rate) == ("speed/256/1/0/0", True, True,
                                                                                256, 1, None)
    assert r.times.tpot_s == pytest.approx((0.75 - 0.5) / 10)
    assert r.sampling is not None and r.sampling.to_json() == {"temperature": 0, "top_p": None, "top_k": None,
                                                               "seed": 0}
    err = StoredRequest.from_json({"item_id": "speed/256/r2/0", "status": "error"}, "run/items.jsonl")
    assert not err.measured and err.times.ttft_s is None


@pytest.mark.parametrize("over, key, expected", [
    ({"ttft_s": "fast"}, "ttft_s", "a number"),
    ({"output_tokens": 10.5}, "output_tokens", "an integer"),
    ({"slo_met": "yes"}, "slo_met", "true or false"),
    ({"sampling": {"top_p": 0.9, "seed": 0}}, "temperature", "a number"),
    ({"group": {"arrival": "poisson", "rate": 2.0}}, "duration_s", "a number"),
    ({"output_token_ids": [1, "2"]}, "output_token_ids", "a list of integers"),
    ({"group": {"arrival": "closed", "clients": 1, "duration_s": 1.0, "n_sent": 2, "server": {"source": "vllm"}}},
     "server", "lacks n_samples"),
    ({"group": {"arrival": "poisson", "rate": 2.0, "duration_s": 1.0, "n_sent": 2, "last_send_s": 0.5,
                "max_in_flight": 1, "sweep": {"step": 0, "error_rate": "none"}}}, "error_rate", "a number"),
])
def test_a_bad_stored_record_is_refused_naming_file_item_and_key(over, key, expected):
    with pytest.raises(ValueError) as e:
        read_records([_record(**over)], "runs/a/items.jsonl")
    msg = str(e.value)
    assert "runs/a/items.jsonl" in msg and "speed/256/1/0/0" in msg and repr(key) in msg and expected in msg, msg


def test_a_record_without_an_item_id_is_refused():
    with pytest.raises(ValueError, match=r"runs/a/items.jsonl: key 'item_id' is missing \(expected a string\)"):
        read_records([{"task": "speed", "ttft_s": 0.5}], "runs/a/items.jsonl")
    with pytest.raises(ValueError, match="runs/a/items.jsonl: expected a JSON object, got list"):
        read_records([[1, 2]], "runs/a/items.jsonl")


def test_a_bad_load_section_is_refused_naming_row_and_key():
    with pytest.raises(ValueError, match=r"cmp/compare.json speed.load, rows\[0\]: key 'rate' must be a number"):
        LoadSection.from_json({"rows": [{"prompt_length": 256, "rate": "2", "baseline": {}, "candidate": {}}]},
                              "cmp/compare.json speed.load")
    with pytest.raises(ValueError, match=r"rows\[0\], key 'baseline': key 'n_sent' is missing"):
        format_load({"rows": [{"prompt_length": 256, "rate": 2.0, "baseline": {"prompt_length": 256, "rate": 2.0},
                               "candidate": {"prompt_length": 256, "rate": 2.0}}]}, "cmp/compare.json speed.load")
    with pytest.raises(ValueError, match="key 'goodput_ratio_ci95' must be two numbers"):
        row = {"prompt_length": 256, "rate": 2.0, "sweep_skipped": True, "n_sent": 0}
        LoadSection.from_json({"rows": [{"prompt_length": 256, "rate": 2.0, "baseline": row, "candidate": row,
                                         "goodput_ratio_ci95": [0.5]}]}, "x")


def test_a_bad_speed_ab_section_is_refused_naming_round_and_key():
    with pytest.raises(ValueError, match=r"ab/compare.json speed_ab, rounds\[1\]: key 'b_pass' is missing"):
        format_rounds({"rounds": [{"round": 1, "a_pass": 0, "b_pass": 1}, {"round": 2, "a_pass": 3}]},
                      "ab/compare.json speed_ab")
    with pytest.raises(ValueError, match="key 'differ' must be a list of strings"):
        AbSection.from_json({"identity": {"differ": [3]}}, "ab.json")


def test_a_bad_pass_file_is_refused_naming_the_file_and_key(tmp_path):
    path = tmp_path / "pass0_A.json"
    path.write_text(json.dumps({"pid": 12, "load_s": 0.5, "records": [_record()]}))
    with pytest.raises(ValueError, match=f"{path}: key 'summary' is missing"):
        read_pass(path, "A", 0, 1.0)
    path.write_text(json.dumps({"pid": "12", "load_s": 0.5, "records": [], "summary": {"n_ok": 0, "n_errors": 0}}))
    with pytest.raises(ValueError, match=f"{path}: key 'pid' must be an integer"):
        read_pass(path, "A", 0, 1.0)
    path.write_text(json.dumps({"pid": 12, "load_s": 0.5, "records": [_record(e2e_s=[1])],
                                "summary": {"n_ok": 1, "n_errors": 0}}))
    with pytest.raises(ValueError, match=f"{path}, item speed/256/1/0/0: key 'e2e_s' must be a number"):
        read_pass(path, "A", 0, 1.0)
    path.write_text(json.dumps({"pid": 12, "load_s": 0.5, "records": [_record()], "summary": {"n_ok": 1, "n_errors": 0}}))
    p = read_pass(path, "A", 0, 1.0)
    assert (p.pid, p.n_ok, p.n_errors, list(p.ok())) == (12, 1, 0, ["speed/256/1/0/0"])
