"""A task's summary is typed (tasks.records.AccuracySummary and a task's subclass) and read from the
items.jsonl lines through ItemRecord: a malformed line is refused naming the task's lines and the key."""
from __future__ import annotations

from pathlib import Path

import pytest

from moebench.store.records import ItemRecord, RecordError
from moebench.tasks.base import TaskContext
from moebench.tasks.cmmlu import CmmluSummary, CmmluTask
from moebench.tasks.needle import LengthFound, NeedleTask

CTX = TaskContext(data_dir=Path("/nonexistent"))


def _line(i, status="ok", correct=True, **extra):
    return {"task": "needle", "item_id": f"needle/{i}", "correct": correct, "answer": None, "reference": None,
            "output": "", "status": status, **extra}


def test_needle_summary_counts_found_per_length_and_flags():
    lines = [_line(0, length=2048, prompt_tokens=2050), _line(1, correct=False, length=2048, prompt_tokens=2040),
             _line(2, length=4096, prompt_tokens=4100, prompt_tokens_flagged=True),
             _line(3, status="error", correct=None, error="Unreachable: x")]
    task = NeedleTask({}, CTX)
    s = task.summary([ItemRecord.from_dict(r) for r in lines])
    assert (s.n, s.n_scored, s.n_correct, s.n_errors) == (4, 3, 2, 1) and s.accuracy == pytest.approx(2 / 3)
    assert s.by_length == {"2048": LengthFound(2, 1, 0.5), "4096": LengthFound(1, 1, 1.0)}
    assert s.max_prompt_tokens == 4100 and s.n_prompt_tokens_flagged == 1
    assert task.summarize(lines) == s.to_json()
    assert list(s.to_json()) == ["n", "n_scored", "n_correct", "n_errors", "accuracy", "by_length",
                                 "max_prompt_tokens", "n_prompt_tokens_flagged"]


def test_cmmlu_summary_counts_abstentions_apart():
    lines = [{**_line(0, scoring="logprobs"), "task": "cmmlu"},
             {**_line(1, correct=None, scoring="logprobs", abstained=True), "task": "cmmlu"},
             {**_line(2, correct=False, scoring="generate"), "task": "cmmlu"}]
    out = CmmluTask({}, CTX).summarize(lines)
    assert out == CmmluSummary(n=3, n_scored=2, n_correct=1, n_errors=0, accuracy=0.5, n_abstained=1,
                               scoring=["generate", "logprobs"]).to_json()


@pytest.mark.parametrize("bad, message", [
    ({"status": "maybe"}, "items.jsonl (needle): key 'status' is 'maybe', expected one of 'ok', 'error'"),
    ({"correct": "yes"}, "items.jsonl (needle): key 'correct' is a string, expected true or false or null"),
])
def test_a_malformed_line_is_refused_naming_the_key(bad, message):
    with pytest.raises(RecordError) as e:
        NeedleTask({}, CTX).summarize([{**_line(0, length=2048), **bad}])
    assert str(e.value) == message
