"""Compare says why a task pairs nothing, and `moebench report` on a corrupt run is a clear error
(exit 2, the file and line named), as compare already was."""
from __future__ import annotations

from conftest import moebench_cli
from moebench.compare.pairs import pair_runs
from moebench.store import RunStore
from moebench.store.records import ItemRecord


def _rec(task: str, item_id: str, status: str = "ok", correct: bool | None = True, **kw) -> dict:
    return {"task": task, "item_id": item_id, "status": status, "correct": correct, **kw}


def _tasks(base: list[dict], cand: list[dict]) -> dict:
    """compare.json's "tasks" of the two runs' records."""
    typed = lambda recs: [ItemRecord.from_dict(r) for r in recs]  # noqa: E731
    return pair_runs(typed(base), typed(cand)).to_json()["tasks"]


def test_only_one_side_has_the_task_names_the_near_twin():
    base = [_rec("gsm8k", f"gsm8k/test/{i}") for i in range(3)]
    cand = [_rec("gsm8k:strict-match", f"gsm8k/{i}") for i in range(3)]
    t = _tasks(base, cand)
    assert t["gsm8k"]["n_paired"] == 0 and t["gsm8k:strict-match"]["n_paired"] == 0
    assert t["gsm8k"]["unpaired_reason"] == (
        "task 'gsm8k' is only in the baseline run; the candidate has 'gsm8k:strict-match': the same task under "
        "another name (an lm-eval filter name? re-import with `moebench import-lm-eval` to use moebench's names)")
    assert t["gsm8k:strict-match"]["unpaired_reason"].startswith(
        "task 'gsm8k:strict-match' is only in the candidate run; the baseline has 'gsm8k'")


def test_no_common_ids_and_all_excluded_are_told_apart():
    base = [_rec("cmmlu", f"cmmlu/anatomy/{i}") for i in range(3)] + [_rec("gsm8k", f"gsm8k/test/{i}") for i in range(4)]
    cand = [_rec("cmmlu", f"cmmlu_anatomy/{i}") for i in range(3)] + [
        _rec("gsm8k", "gsm8k/test/0", status="error", correct=None, error="HTTP 500"),
        _rec("gsm8k", "gsm8k/test/1", status="error", correct=None, error="HTTP 500"),
        _rec("gsm8k", "gsm8k/test/2", correct=None),
        _rec("gsm8k", "gsm8k/test/3", prompt_hash="aaaa")]
    base[-1]["prompt_hash"] = "bbbb"
    t = _tasks(base, cand)
    assert t["cmmlu"]["unpaired_reason"] == (
        "no item ids in common: the baseline has e.g. 'cmmlu/anatomy/0', the candidate e.g. 'cmmlu_anatomy/0' "
        "(different datasets, splits or id schemes)")
    assert t["gsm8k"]["unpaired_reason"] == ("all 4 items in both runs were excluded: 2 error in candidate, "
                                             "1 not scored, 1 prompt hash differs (the suites differ)")


def test_a_task_that_pairs_is_not_given_a_reason():
    recs = [_rec("gsm8k", "gsm8k/test/0")]
    assert "unpaired_reason" not in _tasks(recs, recs)["gsm8k"]


def test_report_on_a_corrupt_line_is_a_clear_error_exit_2(tmp_path):
    store = RunStore.create_or_resume(tmp_path / "r", {"label": "x", "suite": {"name": "s"}})
    for i in range(3):
        store.append(_rec("gsm8k", f"gsm8k/test/{i}"))
    store.finish("complete")
    store.close()
    items = tmp_path / "r" / "items.jsonl"
    lines = items.read_text().splitlines()
    lines[1] = lines[1][:20]
    items.write_text("\n".join(lines) + "\n")
    for args in (("report", str(tmp_path / "r")), ("compare", str(tmp_path / "r"), str(tmp_path / "r"),
                                                    "--out", str(tmp_path / "c"))):
        r = moebench_cli(*args, timeout=300)
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr
        assert r.stderr.strip() == f"error: {items}: line 2 is not valid JSON " \
                                   f"(Unterminated string starting at: line 1 column 19 (char 18))", r.stderr
