"""KLD item records read back (kld/chunk_records.KldItem): what the tasks write parses into the same
fields, and a record whose keys are not the tasks' is refused naming the file, the item and the key."""
from __future__ import annotations

import json

import numpy as np
import pytest

from moebench.kld.chunk_records import (CandidateChunk, ChunkHead, HeadedChunk, KldEstimate, KldItem,
                                        LlamaCandidateChunk, RecordFormatError, read_items)
from moebench.kld.sampled_task import SampledCandidate
from moebench.kld.stats import TokenStats
from moebench.store.records import ItemRecord

WHERE = "/runs/cand/items.jsonl"


def _written(fields: dict, item_id: str = "kld/wiki.test/3") -> dict:
    """A record as items.jsonl holds it: through ItemRecord and JSON, as the run writes it."""
    return json.loads(json.dumps(ItemRecord.from_fields("kld", item_id, fields).to_dict()))


def test_a_candidate_chunk_reads_back_with_its_estimate():
    ts = TokenStats(kld=np.array([0.1, 0.3]), p_diff=np.array([0.0, -0.1]), same_top=np.array([True, False]),
                    nll=np.array([1.0, 2.0]), nll_base=np.array([1.1, 1.9]))
    est = KldEstimate(k=20, baseline_k=64, fixed_ids=True, lower_bound=True)
    rec = HeadedChunk(ChunkHead(3, "abc", 2, k=20, complete=False, fixed_ids=True),
                      CandidateChunk("topk-lower-bound", "kld/kld/cand/chunk_00003.npz", ts, est,
                                     topk_vs_exact={"exact_mean": 0.2, "top20_mean": 0.1}))
    item = KldItem.from_json(_written(rec.to_json()), WHERE)
    assert (item.item_id, item.status, item.task, item.role, item.method, item.chunk) == \
        ("kld/wiki.test/3", "ok", "kld", "candidate", "topk-lower-bound", 3)
    assert item.file == "kld/kld/cand/chunk_00003.npz" and item.n_tokens == 2 and item.prompt_hash == "abc"
    assert item.estimate == est and item.has_topk_vs_exact and item.is_ok_candidate


def test_llama_and_sampled_candidates_read_back():
    llama = KldItem.from_json(_written(LlamaCandidateChunk(chunk=1, n_tokens=31, kld_mean=0.01).to_json()), WHERE)
    assert (llama.method, llama.chunk, llama.n_tokens, llama.file) == ("llama-perplexity", 1, 31, None)
    sampled = SampledCandidate(2, 1, 7, 6, "h", "kld/kld/cand/seq_00005.npz", estimator="plain", kld_sum=0.3,
                               kld_mean=0.05)
    got = KldItem.from_json(_written(sampled.to_json(), "kld/wiki.test/p2/c1"), WHERE)
    assert (got.prompt, got.cont, got.method, got.estimator, got.file) == \
        (2, 1, "sampled", "plain", "kld/kld/cand/seq_00005.npz")


def test_an_errored_record_holds_only_its_id_and_status():
    doc = ItemRecord.failed("kld", "kld/wiki.test/0", "RunnerError: boom").to_dict()
    [item] = read_items([doc], WHERE)
    assert item.status == "error" and item.role is None and not item.is_ok_candidate


@pytest.mark.parametrize("change, message", [
    ({"chunk": "3"}, "key 'chunk' is a string, expected an integer"),
    ({"n_tokens": True}, "key 'n_tokens' is true or false, expected an integer"),
    ({"file": 5}, "key 'file' is an integer, expected a string"),
    ({"nll_sum": "1.5"}, "key 'nll_sum' is a string, expected a number"),
    ({"estimate": {"k": 20, "baseline_k": 64, "fixed_ids": False}},
     "estimate: key 'lower_bound' is missing, expected true or false"),
    ({"estimate": [20]}, "key 'estimate' is a list, expected an object"),
])
def test_a_bad_record_names_the_file_the_item_and_the_key(change, message):
    doc = {"task": "kld", "item_id": "kld/wiki.test/3", "status": "ok", "chunk": 3, "role": "candidate",
           "method": "exact", "file": "f.npz", "n_tokens": 2, **change}
    with pytest.raises(RecordFormatError) as e:
        KldItem.from_json(doc, WHERE)
    assert str(e.value).startswith(f"{WHERE} item 'kld/wiki.test/3'") and message in str(e.value)


def test_a_record_without_item_id_or_not_an_object_is_refused():
    with pytest.raises(RecordFormatError, match=r"^/runs/cand/items.jsonl: key 'item_id' is missing"):
        KldItem.from_json({"status": "ok"}, WHERE)
    with pytest.raises(RecordFormatError, match=r"^/runs/cand/items.jsonl: a record is a list, expected an object"):
        KldItem.from_json([1], WHERE)
    with pytest.raises(RecordFormatError, match=r"item 'x': key 'status' is missing, expected a string"):
        KldItem.from_json({"item_id": "x"}, WHERE)


# ---- llama_stats.json: what llama-perplexity printed, written and read back -----------------------

LLAMA_TAIL = """
chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p
   1      12.5 ±    1.2       0.01000 ±    0.00200       0.02000 ±    0.00300     1.500 ±    0.200 %    90.000 ±    2.000 %
   2      12.0 ±    1.0       0.01200 ±    0.00200       0.03000 ±    0.00300     1.600 ±    0.200 %    91.000 ±    2.000 %
====== Perplexity statistics ======
Mean PPL(Q)                   :  12.000 ±   1.000
Mean PPL(base)                :  11.800 ±   1.000
Cor(ln(PPL(Q)), ln(PPL(base))):  99.50%
Mean ln(PPL(Q)/PPL(base))     :   0.012 ±   0.002
Mean PPL(Q)/PPL(base)         :   1.012 ±   0.002
Mean PPL(Q)-PPL(base)         :   0.200 ±   0.030

====== KL divergence statistics ======
Mean    KLD:   0.030000 ±   0.003000
Maximum KLD:   1.000000
Median  KLD:   0.010000
Minimum KLD:   0.000001

====== Token probability statistics ======
Mean    Δp: -0.100 ± 0.050 %
Maximum Δp: 20.000%
Median  Δp: -0.001%
Minimum Δp: -30.000%
RMS Δp    :  1.600 ± 0.200 %
Same top p: 91.000 ± 2.000 %
"""


def test_printed_statistics_round_trip_in_the_order_llama_prints_them():
    from moebench.kld.perplexity_tool import PrintedKld, parse_kld_output
    printed = parse_kld_output(LLAMA_TAIL)
    doc = printed.to_json()
    assert list(doc) == ["ppl", "ppl_err", "ppl_base", "ppl_base_err", "cor_ln_ppl", "ln_ppl_ratio",
                         "ln_ppl_ratio_err", "ppl_ratio", "ppl_ratio_err", "ppl_diff", "ppl_diff_err", "mean",
                         "mean_err", "max", "median", "min", "same_top_p", "same_top_p_err", "delta_p",
                         "per_chunk_cumulative", "per_chunk"]
    assert list(doc["delta_p"]) == ["mean", "mean_err", "max", "median", "min", "rms", "rms_err"]
    assert doc["per_chunk"] == pytest.approx([0.02, 0.04]) and doc["cor_ln_ppl"] == pytest.approx(0.995)
    again = PrintedKld.from_json(json.loads(json.dumps(doc)), "llama_stats.json")
    assert json.dumps(again.to_json()) == json.dumps(doc)


@pytest.mark.parametrize("change, message", [
    ({"mean": "0.03"}, "llama_stats.json: key 'mean' must be a number"),
    ({"delta_p": [1]}, "llama_stats.json: key 'delta_p' must be an object"),
    ({"delta_p": {"rms": None}}, "llama_stats.json delta_p: key 'rms' must be a number"),
    ({"per_chunk_cumulative": [{"chunk": 1}]}, "llama_stats.json: a 'per_chunk_cumulative' line lacks or mistypes"),
])
def test_a_bad_llama_stats_file_names_the_key(change, message):
    from moebench.kld.perplexity_tool import PerplexityError, PrintedKld, parse_kld_output
    doc = {**parse_kld_output(LLAMA_TAIL).to_json(), **change}
    with pytest.raises(PerplexityError) as e:
        PrintedKld.from_json(doc, "llama_stats.json")
    assert str(e.value).startswith(message)
