"""The manifest's typed parts (events, counts, error causes), the lock file's holder and the speed rows
of compare.json: bad input names the file and the key; what the store writes reads back the same."""
from __future__ import annotations

import json

import pytest

from moebench.store import RunStore, StoreError
from moebench.store.lock import LockHolder, RunLock
from moebench.store.records import ErrorCause, Manifest, RecordError, RunCounts, TaskSummary
from moebench.store.sections import SpeedRow, speed_rows


def _manifest(**keys: object) -> dict:
    return {"schema_version": 1, "run_id": "abc", "status": "complete", **keys}


@pytest.mark.parametrize("keys,message", [
    ({"events": [{"time": "t", "event": "resumed"}, {"time": "t"}]},
     r"runs/a/manifest\.json: events\[1\]: missing key 'event' \(expected a string\)"),
    ({"events": [{"event": 3}]}, r"runs/a/manifest\.json: events\[0\]: key 'event' is an integer, expected a string"),
    ({"events": {"event": "x"}}, r"runs/a/manifest\.json: key 'events' is an object, expected a list or null"),
    ({"counts": {"asked": "6"}}, r"runs/a/manifest\.json: counts: key 'asked' is a string, expected an integer"),
    ({"counts": [6]}, r"runs/a/manifest\.json: key 'counts' is a list, expected an object or null"),
    ({"error_causes": [{"error": "boom"}]},
     r"runs/a/manifest\.json: error_causes\[0\]: missing key 'count' \(expected an integer\)"),
    ({"resumes": "2"}, r"runs/a/manifest\.json: key 'resumes' is a string, expected an integer or null"),
    ({"summary": {"gsm8k": [1]}}, r"runs/a/manifest\.json: summary\['gsm8k'\]: expected a JSON object, got a list"),
    ({"summary": {"gsm8k": {"n": "3"}}},
     r"runs/a/manifest\.json: summary\['gsm8k'\]: key 'n' is a string, expected an integer or null"),
])
def test_bad_manifest_part_names_file_key_and_type(keys, message):
    with pytest.raises(RecordError, match=message):
        Manifest.from_dict(_manifest(**keys), "runs/a/manifest.json")


def test_manifest_parts_read_typed_and_write_back_in_their_order():
    raw = _manifest(label="x", counts={"asked": 2, "errors": 1}, resumes=1,
                    events=[{"time": "t0", "event": "resumed", "previous_status": "running"},
                            {"event": "restart", "reason": "exit", "time": "t1", "restarts": 1}],
                    error_causes=[{"error": "RunnerError: boom", "count": 1}], ended_at=None, limit=3,
                    summary={"kld": {"n": 2, "n_scored": 0, "n_correct": 0, "accuracy": None, "mean_kld": 0.1},
                             "needle": {"by_length": {}, "n": 1, "accuracy": 1.0}})
    m = Manifest.from_dict(raw, "manifest.json")
    assert m.counts == RunCounts(asked=2, errors=1) and m.resumes == 1
    assert [e.event for e in m.events] == ["resumed", "restart"] and m.events[1].details == {"reason": "exit",
                                                                                            "restarts": 1}
    assert m.error_causes == [ErrorCause("RunnerError: boom", 1)] and m.extra == {"limit": 3}
    assert m.summary["kld"] == TaskSummary(n=2, n_scored=0, n_correct=0, extra={"mean_kld": 0.1})
    assert (m.summary["needle"].n, m.summary["needle"].n_errors) == (1, None)
    assert json.dumps(m.to_dict()) == json.dumps(raw)          # same keys, same order, null kept
    with pytest.raises(TypeError, match="manifest key 'counts' takes RunCounts"):
        m.set(counts={"asked": 1})


def test_resumed_run_keeps_its_identity_and_records_the_resume_typed(tmp_path):
    first = RunStore.create_or_resume(tmp_path / "r", {"run_id": "abc", "label": "x"})
    first.finish("interrupted", counts=RunCounts(asked=0))
    first.close()
    again = RunStore.create_or_resume(tmp_path / "r", {"run_id": "new", "label": "x"})
    again.close()
    m = again.read_manifest()
    assert (m.run_id, m.status, m.resumes, m.ended_at) == ("abc", "running", 1, None)
    assert [(e.event, e.details) for e in m.events] == [("resumed", {"previous_status": "interrupted"})]
    assert list(json.loads((tmp_path / "r" / "manifest.json").read_text()))[:2] == ["schema_version", "run_id"]


def test_lock_holder_reads_back_and_names_a_bad_key(tmp_path):
    with RunLock(tmp_path) as lock:
        held = LockHolder.from_json(json.loads(lock.path.read_text()), str(lock.path))
        assert held.pid is not None and held.released_at is None
    released = LockHolder.from_json(json.loads((tmp_path / ".lock").read_text()), ".lock")
    assert released.pid == held.pid and released.released_at is not None
    with pytest.raises(StoreError, match=r"runs/a/\.lock: key 'pid' is str, expected an integer"):
        LockHolder.from_json({"pid": "12", "host": "h"}, "runs/a/.lock")


def test_speed_rows_hold_exactly_the_keys_speed_row_names():
    rows = speed_rows({"rows": [{"prompt_length": 256, "clients": 2, "baseline_decode_tok_s": 20.0,
                                 "candidate_decode_tok_s": 15.0, "n_baseline": 5, "n_candidate": 5}]})
    assert len(rows) == 1 and list(rows[0]) == list(SpeedRow.__annotations__)
    assert rows[0]["decode_tok_s_ratio"] == pytest.approx(0.75) and rows[0]["clients"] == 2


def test_resume_of_a_manifest_off_the_contract_names_file_and_key_and_writes_nothing(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    bad = json.dumps(_manifest(status="interrupted", counts={"asked": "six"}), indent=2)
    (run / "manifest.json").write_text(bad, encoding="utf-8")
    with pytest.raises(RecordError, match=r"r/manifest\.json: counts: key 'asked' is a string, expected an integer"):
        RunStore.create_or_resume(run, {"run_id": "new", "label": "x"})
    assert (run / "manifest.json").read_text(encoding="utf-8") == bad
