"""KLD task and statistics against llama.cpp's own `llama-perplexity`, on the zoo's tiny MoE and WikiText-2.

Skips only where llama.cpp's tools are not built (the zoo is built from the committed weights into a
temp folder when models/zoo is absent). Context 256 and 2-4 chunks keep each run to seconds.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from moebench import api
from moebench.datasets import data_dir, read_text
from moebench.runners.base import CapabilityError
from moebench.kld import stats as ks
from moebench.kld import perplexity_tool as lp

CONTEXT = 256


def _llamacpp_or_skip() -> None:
    from moebench.tools import llamacpp
    try:
        llamacpp.tool("llama-perplexity")
        llamacpp.tool("llama-quantize")
    except Exception as e:   # ToolError: not built on this machine
        pytest.skip(f"llama.cpp tools not built: {e}")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> dict[str, Path]:
    _llamacpp_or_skip()
    from moebench.zoo.build import build_zoo
    repo_zoo = Path(__file__).resolve().parent.parent / "models" / "zoo"
    names = {"hf": "tiny-moe", "bf16": "tiny-moe-bf16.gguf", "q8_0": "tiny-moe-q8_0.gguf", "q4_0": "tiny-moe-q4_0.gguf"}
    if all((repo_zoo / n).exists() for n in names.values()):
        return {k: repo_zoo / n for k, n in names.items()}
    out = tmp_path_factory.mktemp("zoo") / "zoo"
    build_zoo(str(out))
    return {k: out / n for k, n in names.items()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    # The first 200k characters of WikiText-2 test (LF): plenty for 4 chunks of 256 tokens.
    p = tmp_path_factory.mktemp("corpus") / "wiki.txt"
    p.write_text(read_text(data_dir() / "wikitext2" / "wiki.test.raw")[:200_000], encoding="utf-8")
    return p


@pytest.fixture(scope="module")
def bf16_base(zoo, corpus, tmp_path_factory) -> lp.BaseFile:
    out = tmp_path_factory.mktemp("lp")
    return lp.write_base(zoo["bf16"], corpus, out / "bf16.kld", CONTEXT, 4, log_path=out / "bf16.log")


def _write_profiles(tmp: Path, zoo: dict[str, Path], chunks: int = 2, top_k: int = 256, full_chunks: int = 2) -> dict[str, Path]:
    suite = tmp / "kld-test.toml"
    suite.write_text(f'name = "kld-test"\n[[tasks]]\ntask = "kld"\ncontext = {CONTEXT}\nchunks = {chunks}\n'
                     f'top_k = {top_k}\nfull_chunks = {full_chunks}\n[probes]\nnvml = false\n')
    prof = {"suite": suite}
    for name, model, dtype in (("eng32", zoo["hf"], "float32"), ("eng16", zoo["hf"], "bfloat16")):
        p = tmp / f"{name}.toml"
        p.write_text(f'kind = "engine"\nmodel = "{model}"\ndtype = "{dtype}"\ndevice = "cpu"\n')
        prof[name] = p
    for q in ("bf16", "q4_0"):
        p = tmp / f"llama-{q}.toml"
        p.write_text(f'kind = "llama-server"\nmodel = "{zoo[q]}"\nctx_size = 1024\nconcurrency = 1\n')
        prof[f"llama-{q}"] = p
    return prof


def _run(prof, runner: str, out: Path, baseline: Path | None = None) -> Path:
    run_dir, code = api.run(api.RunOptions(suite=str(prof["suite"]), runner=str(prof[runner]), out=str(out),
                                           baseline=str(baseline) if baseline else None,
                                           as_baseline=baseline is None, quiet=True))
    items = [json.loads(x) for x in (run_dir / "items.jsonl").read_text().splitlines() if x.strip()]
    errors = [r.get("error") for r in items if r["status"] != "ok"]
    assert code == 0 and not errors, f"run {runner} exited {code}: {errors}\n{(run_dir / 'manifest.json').read_text()[-2000:]}"
    return run_dir


# ---- statistics parity with llama-perplexity -----------------------------------------------------------

@pytest.mark.parametrize("quant", ["q4_0", "q8_0"])
def test_statistics_match_llama_perplexity(zoo, corpus, bf16_base, quant, tmp_path):
    """The same pair (llama.cpp BF16 vs llama.cpp Q4_0/Q8_0), same text and context: llama-perplexity
    prints its statistics; moebench computes them from the two models' base files (the candidate's
    distributions are llama.cpp's own, written by --kl-divergence-base on the quantized model)."""
    printed = lp.kl_divergence(zoo[quant], bf16_base.path, CONTEXT, log_path=tmp_path / "kld.log").to_json()
    cand = lp.write_base(zoo[quant], corpus, tmp_path / f"{quant}.kld", CONTEXT, 4)
    assert (cand.tokens == bf16_base.tokens).all() and cand.n_vocab == bf16_base.n_vocab
    parts = [ks.full_kld(bf16_base.logprobs(j), cand.logprobs(j), bf16_base.tokens[j][CONTEXT // 2 + 1:],
                         cand_is_logp=True) for j in range(bf16_base.n_chunk)]
    ours = ks.summarize(ks.TokenStats.concat(parts), per_chunk=parts).to_json()
    assert ours["n_tokens"] == 4 * (CONTEXT - 1 - CONTEXT // 2)
    print(f"\n{quant}: mean KLD llama {printed['mean']} moebench {ours['mean']:.8f}; same top "
          f"{printed['same_top_p']} vs {ours['same_top_p']:.5f}; ln ratio {printed['ln_ppl_ratio']} vs "
          f"{ours['ln_ppl_ratio']:.7f}")
    half_unit = 5e-7          # llama prints KLD with %10.6lf: a figure is only known to +-0.5e-6
    assert ours["mean"] > 0
    assert abs(ours["mean"] - printed["mean"]) <= 0.02 * printed["mean"] + half_unit
    assert abs(ours["same_top_p"] - printed["same_top_p"]) <= 0.005
    # ln PPL ratio averages log q(tok) - log p(tok), read here from the two uint16-coded base files: each
    # value is rounded to a step of at most 16/65535, so the mean carries rounding noise of standard error
    # (16/65535)/sqrt(6)/sqrt(n) (the difference of two uniform roundings); allow three of those.
    coding = 3 * (16 / 65535) / math.sqrt(6) / math.sqrt(ours["n_tokens"])
    assert abs(ours["ln_ppl_ratio"] - printed["ln_ppl_ratio"]) <= (0.02 * abs(printed["ln_ppl_ratio"])
                                                                    + half_unit + coding)
    # Per token, llama scores its candidate's exact logits and we score the coded rows: each coded
    # log-prob is off by at most half a step (8/65535), so each token's KLD, and so every order
    # statistic, by at most that. It shows where a quantile is near zero (Q8_0's p10 is 2.9e-05).
    cand_coding = 8 / 65535
    for key in ("median", "p99", "p90", "p10", "max", "min"):
        assert abs(ours[key] - printed[key]) <= 0.02 * abs(printed[key]) + 2 * half_unit + cand_coding, key
    assert abs(ours["delta_p"]["rms"] - printed["delta_p"]["rms"]) <= 0.02 * printed["delta_p"]["rms"] + 5e-5
    # The base-file codec: our writer codes llama.cpp's decoded rows back to within half a coding step
    # (at most 16/65535), after the one change a writer makes to rows that are not quite normalised:
    # it treats them as logits and renormalises (the mass of the floored tail, up to ~0.005 here).
    lpr = bf16_base.logprobs(0).astype(np.float64)
    again = ks.encode_logprobs(lpr)
    renormalised = ks.log_softmax(lpr)
    assert np.abs(ks.decode_logprobs(again, bf16_base.n_vocab) - renormalised).max() <= 0.5 * 16 / 65535 + 1e-5


# ---- engine runs: baseline, candidate, compare ---------------------------------------------------------

def test_engine_baseline_candidate_compare(zoo, tmp_path):
    from moebench.demo import pack_tiered
    prof = _write_profiles(tmp_path, zoo)
    tiered = pack_tiered(zoo["hf"], tmp_path / "tiered", log=lambda *a: None)
    (tmp_path / "tiered.toml").write_text(f'kind = "engine"\nmodel = "{tiered}"\ndtype = "float32"\ndevice = "cpu"\n')
    prof["tiered"] = tmp_path / "tiered.toml"
    base = _run(prof, "eng32", tmp_path / "base")
    cand = _run(prof, "tiered", tmp_path / "cand", baseline=base)

    meta = json.loads((base / "kld" / "kld" / "meta.json").read_text())
    assert meta["context"] == CONTEXT and meta["top_k"] == 256 and meta["full_chunks"] == 2
    b0 = np.load(base / "kld" / "kld" / "base" / "chunk_00000.npz")
    assert b0["top_logp"].dtype == np.float16 and b0["top_ids"].dtype == np.uint16
    assert b0["routes"].dtype == np.uint8 and b0["routes"].shape[1] == CONTEXT

    out_dir, cmp = api.compare(str(base), str(cand), out=str(tmp_path / "cmp"), write_report=False)
    k = cmp["kld"]
    for key in ("n_tokens", "mean", "mean_err", "median", "p99", "max", "same_top_p", "ln_ppl_ratio", "ppl_ratio",
                "p999", "p95", "p90", "p10", "p5", "p1", "p01", "min", "delta_p", "histogram", "per_chunk",
                "topk_vs_exact", "per_layer", "expert_usage", "load_skew"):
        assert key in k, key
    assert k["n_tokens"] == 2 * (CONTEXT - 1 - CONTEXT // 2) and k["method"] == "exact"
    assert k["mean"] > 0 and 0 <= k["same_top_p"] <= 1 and len(k["per_chunk"]) == 2
    assert sum(k["histogram"]["counts"]) == k["n_tokens"]
    assert k["min"] <= k["p01"] <= k["p1"] <= k["median"] <= k["p99"] <= k["p999"] <= k["max"]
    # The top-K estimate is a lower bound of the exact KLD that tightens as K grows.
    by_k = k["topk_vs_exact"]["by_k"]
    exact = k["topk_vs_exact"]["exact_mean"]
    assert set(by_k) == {"5", "16", "20", "64", "100", "256"}
    assert (by_k["5"]["mean"] <= by_k["16"]["mean"] <= by_k["20"]["mean"] <= by_k["64"]["mean"]
            <= by_k["100"]["mean"] <= by_k["256"]["mean"] <= exact * 1.02)
    print(f"\ntiered vs bf16: mean KLD {k['mean']:.6g}, same top {k['same_top_p']:.4f}; top-K vs exact "
          + ", ".join(f"K={kk}: {v['rel_err']:+.3%}" for kk, v in by_k.items())
          + f"; base bytes/token top-K: {json.loads((base / 'manifest.json').read_text())['summary']['kld'].get('topk_bytes_per_token')}")
    n_layers = len(k["per_layer"]["router_agreement"])
    assert n_layers == b0["routes"].shape[0]
    assert all(0 <= x <= 1 for x in k["per_layer"]["router_agreement"] + k["per_layer"]["identical_set_share"])
    # Tiering compresses experts only: the first MoE layer's router sees the same input in both runs.
    assert k["per_layer"]["router_agreement"][0] == 1.0 and k["per_layer"]["identical_set_share"][0] == 1.0
    usage = np.array(k["expert_usage"]["baseline"])
    assert usage.shape[0] == n_layers and usage.sum() == n_layers * 2 * CONTEXT * b0["routes"].shape[2]
    assert all(0.25 <= s <= 1 for s in k["load_skew"]["baseline"] + k["load_skew"]["candidate"])
    # Both runs used the same tokens.
    b = {json.loads(x)["item_id"]: json.loads(x)["prompt_hash"] for x in (base / "items.jsonl").read_text().splitlines()}
    c = {json.loads(x)["item_id"]: json.loads(x)["prompt_hash"] for x in (cand / "items.jsonl").read_text().splitlines()}
    assert b == c and "token_mismatch" not in k


def test_engine_candidate_against_llama_baseline(zoo, tmp_path):
    """llama.cpp BF16 baseline (base.kld via llama-perplexity) vs the engine on the same weights: near zero."""
    prof = _write_profiles(tmp_path, zoo)
    base = _run(prof, "llama-bf16", tmp_path / "base")
    assert lp.read_base_file(base / "kld" / "kld" / "base.kld").n_chunk == 2
    cand = _run(prof, "eng32", tmp_path / "cand", baseline=base)
    _, cmp = api.compare(str(base), str(cand), out=str(tmp_path / "cmp"), write_report=False)
    k = cmp["kld"]
    print(f"\nengine fp32 vs llama.cpp bf16: mean KLD {k['mean']:.3g}, same top {k['same_top_p']:.4f}")
    assert k["method"] == "exact" and k["n_tokens"] == 2 * (CONTEXT - 1 - CONTEXT // 2)
    assert k["mean"] < 1e-3 and k["same_top_p"] >= 0.98


def test_llama_candidate_against_engine_baseline(zoo, tmp_path):
    """The reverse: an engine baseline exported as a llama.cpp base file, llama-perplexity measures Q4_0 on it."""
    prof = _write_profiles(tmp_path, zoo)
    base = _run(prof, "eng32", tmp_path / "base")
    cand = _run(prof, "llama-q4_0", tmp_path / "cand", baseline=base)
    conv = lp.read_base_file(cand / "kld" / "kld" / "baseline-converted.kld")
    assert (conv.tokens == np.load(base / "kld" / "kld" / "tokens.npy")).all()
    _, cmp = api.compare(str(base), str(cand), out=str(tmp_path / "cmp"), write_report=False)
    k = cmp["kld"]
    print(f"\nllama.cpp q4_0 vs engine fp32 baseline: mean KLD {k['mean']}, same top {k['same_top_p']}")
    assert k["method"] == "llama-perplexity" and k["mean"] > 0 and len(k["per_chunk"]) == 2


def test_llama_base_file_rejects_other_files(tmp_path):
    bad = tmp_path / "x.kld"
    bad.write_bytes(b"_notlog_" + bytes(64))
    with pytest.raises(lp.PerplexityError, match="not a llama-perplexity base file"):
        lp.read_base_file(bad)


def test_http_runner_without_prompt_logprobs_fails_before_work(tmp_path, zoo):
    prof = _write_profiles(tmp_path, zoo)
    http = tmp_path / "http.toml"
    http.write_text('kind = "http"\nbase_url = "http://127.0.0.1:9/v1"\nmodel = "m"\n')
    with pytest.raises(CapabilityError, match="prompt_logprobs"):
        api.run(api.RunOptions(suite=str(prof["suite"]), runner=str(http), out=str(tmp_path / "r"), quiet=True))
    assert not (tmp_path / "r" / "items.jsonl").exists()


def test_kld_meta_round_trips_and_names_file_and_key_on_bad_input(tmp_path):
    """meta.json is written through KldMeta.to_json and read back through one from_json: every format's
    keys come back in the order written, and a bad meta.json is refused naming the file and the key."""
    from moebench.kld.runs import META_KEYS, KldError, KldMeta, read_meta, task_dir, write_json
    metas = [KldMeta(format="npz", corpus="c.txt", context=8, n_chunk=2, n_vocab=100, add_bos=True, bos_token_id=1,
                     top_k=4, full_chunks=1, first=4, n_scored=3, num_experts=None, runner_kind="engine", how="logits"),
             KldMeta(format="llama", corpus="c.txt", context=8, n_chunk=2, n_vocab=100, top_k=None, full_chunks=2,
                     first=4, n_scored=3, runner_kind="llama-server", how="tool", base_file="base.kld",
                     bytes_per_token=12.5),
             KldMeta(format="sampled", method="sampled", corpus="c.txt", prompts=2, prompt_tokens=8, continuations=2,
                     tokens=4, seed=0, n_vocab=100, add_bos=False, bos_token_id=1, runner_kind="vllm",
                     sampling="temperature 1")]
    for m in metas:
        write_json(task_dir(tmp_path, m.format) / "meta.json", m.to_json())
        doc = json.loads((task_dir(tmp_path, m.format) / "meta.json").read_text())
        assert list(doc) == list(META_KEYS[m.format])
        assert read_meta(tmp_path, m.format) == m
    path = task_dir(tmp_path, "npz") / "meta.json"
    for doc, key in (({**metas[0].to_json(), "context": "8"}, "'context'"),
                     ({k: v for k, v in metas[0].to_json().items() if k != "n_chunk"}, "'n_chunk'"),
                     ({**metas[0].to_json(), "format": "zip"}, "'format'")):
        write_json(path, doc)
        with pytest.raises(KldError, match=f"meta.json: key {key}"):
            read_meta(tmp_path, "npz")
    path.write_text("[1, 2]")
    with pytest.raises(KldError, match="meta.json: not a JSON object"):
        read_meta(tmp_path, "npz")
