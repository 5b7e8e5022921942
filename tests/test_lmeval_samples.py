"""lm-eval sample rows parsed (lmeval/importer.LmEvalSample) and turned into records (ImportedRecord):
the written keys and their order, the run summary, and rows refused naming the task and key.
No lm_eval import: the importer does not need it."""
from __future__ import annotations

import json

import pytest

from moebench.lmeval.importer import LmEvalSample, SamplesError, records_from_samples, summarize
from moebench.store.records import ItemRecord


def _gen_row(doc_id: int, filt: str, answer: str, em: float) -> dict:
    return {"doc_id": doc_id, "filter": filt, "target": "#### 4", "arguments": {"gen_args_0": {"arg_0": "Q?", "arg_1": {}}},
            "resps": [["The answer is 4"]], "filtered_resps": [answer], "metrics": ["exact_match"],
            "exact_match": em, "doc_hash": "d", "prompt_hash": "p", "target_hash": "t"}


def test_a_generation_row_becomes_a_native_record_in_the_written_key_order():
    [rec] = records_from_samples("gsm8k", [_gen_row(17, "strict-match", "4", 1.0)])
    doc = rec.to_dict()
    assert list(doc) == ["task", "item_id", "status", "correct", "prompt_hash", "lm_eval_task", "lm_eval_filter",
                         "lm_eval_doc_id", "lm_eval_main_metric", "lm_eval_metrics", "doc_hash", "target_hash",
                         "answer", "output", "reference"]
    assert (doc["task"], doc["item_id"], doc["correct"], doc["answer"], doc["output"], doc["reference"]) == \
        ("gsm8k", "gsm8k/test/17", True, "4", "The answer is 4", "#### 4")
    assert doc["lm_eval_metrics"] == {"exact_match": 1.0} and doc["lm_eval_main_metric"] == "exact_match"


def test_a_multiple_choice_row_keeps_its_choice_logprobs_and_a_failed_item_says_why():
    row = {"doc_id": 3, "filter": "none", "target": 1, "metrics": ["acc"], "acc": 0.0,
           "arguments": [["ctx", " A"], ["ctx", " B"]], "resps": [], "filtered_resps": [["-2.0", "False"], ["-0.5", "True"]]}
    [rec] = records_from_samples("cmmlu_anatomy", [row])
    assert (rec.answer, rec.reference, rec.choice_logprobs, rec.correct) == ("B", "B", [-2.0, -0.5], False)
    rec.floored_tokens = 2
    rec.fail("RunnerError: gone")
    doc = rec.to_dict()
    assert list(doc)[-4:] == ["choice_logprobs", "reference", "floored_tokens", "error"]
    assert (doc["status"], doc["correct"], doc["error"]) == ("error", None, "RunnerError: gone")


def test_the_summary_counts_imported_and_stored_records_alike():
    recs = records_from_samples("gsm8k", [_gen_row(0, "strict-match", "4", 1.0), _gen_row(1, "strict-match", "5", 0.0),
                                          _gen_row(0, "flexible-extract", "4", 1.0)])
    recs[1].fail("RunnerError: x")
    imported = summarize(recs)
    stored = summarize([ItemRecord.from_dict(json.loads(json.dumps(r.to_dict()))) for r in recs])
    assert imported == stored == {
        "gsm8k": {"n": 2, "n_scored": 1, "n_correct": 1, "n_errors": 1, "accuracy": 1.0},
        "gsm8k:flexible-extract": {"n": 1, "n_scored": 1, "n_correct": 1, "n_errors": 0, "accuracy": 1.0}}


@pytest.mark.parametrize("drop", ["doc_id", "filter", "filtered_resps"])
def test_a_row_without_a_needed_key_is_refused_naming_task_and_key(drop):
    row = _gen_row(1, "strict-match", "4", 1.0)
    del row[drop]
    with pytest.raises(SamplesError, match=f"sample of task 'gsm8k' lacks key '{drop}'"):
        LmEvalSample.from_json(row, "gsm8k")


def test_metrics_that_are_not_a_list_or_arguments_not_objects_are_refused():
    row = {**_gen_row(5, "strict-match", "4", 1.0), "metrics": "exact_match"}
    with pytest.raises(SamplesError, match="task 'gsm8k' doc_id 5: key 'metrics' is str, expected a list"):
        LmEvalSample.from_json(row, "gsm8k")
    row = {**_gen_row(6, "strict-match", "4", 1.0), "arguments": {"gen_args_0": "Q?"}}
    with pytest.raises(SamplesError, match=r"doc_id 6: arguments\['gen_args_0'\] is str, expected an object"):
        records_from_samples("gsm8k", [row])
