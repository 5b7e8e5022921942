"""The smoke suite through a real llama-server on the zoo's GGUFs, BF16 baseline against Q4_0, through the
CLI: GSM8K, CMMLU and HumanEval items and KLD (llama-perplexity), then compare and report."""
from __future__ import annotations

import json

from conftest import REPO, moebench_cli, read_items


def test_smoke_suite_bf16_vs_q4_0_through_llama_server(zoo, tmp_path):
    base, cand, cmp_dir = tmp_path / "bf16", tmp_path / "q4_0", tmp_path / "cmp"
    moebench_cli("run", "suites/smoke.toml", "--runner", "runners/llama-bf16.toml", "--out", str(base),
                 "--limit", "4", check=True)
    moebench_cli("run", "suites/smoke.toml", "--runner", "runners/llama-q4_0.toml", "--out", str(cand),
                 "--limit", "4", "--baseline", str(base), check=True)
    for run in (base, cand):
        m = json.loads((run / "manifest.json").read_text())
        assert m["status"] == "complete"
        assert m["build"]["build_number"] == 11434 or "11434" in json.dumps(m["build"])
        assert (run / "llama-server.log").is_file()
        recs = read_items(run)
        tasks = {r["task"] for r in recs}
        assert {"gsm8k", "cmmlu", "humaneval", "kld"} <= tasks
        assert all(r["status"] == "ok" for r in recs), [r.get("error") for r in recs if r["status"] != "ok"]
        cmmlu = [r for r in recs if r["task"] == "cmmlu"]
        assert all(set(r["choice_logprobs"]) == {"A", "B", "C", "D"} for r in cmmlu)
        assert all(r["scoring"] == "choice_logprobs:renormalized" and r["answer"] in "ABCD" for r in cmmlu)
    moebench_cli("compare", str(base), str(cand), "--out", str(cmp_dir), check=True)
    cmp = json.loads((cmp_dir / "compare.json").read_text())
    for task in ("gsm8k", "cmmlu", "humaneval"):
        assert cmp["tasks"][task]["n_paired"] == 4, cmp["tasks"][task]
    k = cmp["kld"]
    assert k["n_tokens"] > 0 and k["mean"] > 0 and 0 < k["same_top_p"] <= 1
    assert (cmp_dir / "report.html").stat().st_size > 5000


def test_llama_server_choice_logprobs_keep_the_models_ranking(zoo):
    """The grammar-restricted choice scores are the model's probabilities renormalised over the choices:
    same differences of log-probs as the full distribution (n_probs = the whole vocabulary)."""
    import asyncio
    import math

    from moebench.runners.base import GenerateRequest
    from moebench.runners.llama_server import LlamaServerRunner

    async def main():
        r = LlamaServerRunner({"model": str(zoo / "tiny-moe-bf16.gguf"), "ctx_size": 1024, "args": ["--threads", "1"]})
        await r.start()
        try:
            prompt = "Question: which letter comes first?\nA. one\nB. two\nC. three\nD. four\nAnswer:"
            choices = [" A", " B", " C", " D"]
            lps, kind = await r.choice_logprobs(prompt, choices)
            full = await r.generate(GenerateRequest(prompt=prompt, max_tokens=1, top_logprobs=50257))
            return lps, kind, full.top_logprobs[0]
        finally:
            await r.close()

    lps, kind, full = asyncio.run(main())
    assert kind == "renormalized" and all(v is not None for v in lps.values())
    # Renormalised over every token the grammar allows first (a bare " " can start " A" too): at most 1.
    assert 0.5 < sum(math.exp(v) for v in lps.values()) <= 1.0 + 1e-6
    for a in lps:
        for b in lps:
            assert abs((lps[a] - lps[b]) - (full[a] - full[b])) < 2e-3, (a, b, lps, {c: full[c] for c in lps})


def test_compare_says_when_the_greedy_sampler_chains_differ(zoo, tmp_path):
    """A speed run whose greedy requests name the argmax against one that sends llama-server's default
    chain: the same tokens, another cost per token, so compare says so first."""
    suite = tmp_path / "speed.toml"
    suite.write_text('name = "chain"\n[[tasks]]\ntask = "speed"\nprompt_lengths = [32]\noutput_tokens = 8\n'
                     'repeats = 1\nwarmup = 0\n[probes]\nnvml = false\n')
    default_chain = tmp_path / "llama-default-chain.toml"
    default_chain.write_text((REPO / "runners" / "llama-bf16.toml").read_text().replace(
        'model = "', f'model = "{REPO}/') + "greedy_argmax = false\n")
    argmax, default = tmp_path / "argmax", tmp_path / "default"
    moebench_cli("run", str(suite), "--runner", "runners/llama-bf16.toml", "--out", str(argmax), check=True)
    moebench_cli("run", str(suite), "--runner", str(default_chain), "--out", str(default), check=True)
    chains = [json.loads((run / "manifest.json").read_text())["build"]["greedy_samplers"] for run in (argmax, default)]
    assert chains == [{"samplers": ["top_k"], "top_k": 1, "backend_sampling": False}, None]
    moebench_cli("compare", str(argmax), str(default), "--out", str(tmp_path / "cmp"), check=True)
    said = json.loads((tmp_path / "cmp" / "compare.json").read_text())["setup_differences"]
    assert said == ["llama-server greedy requests named other sampler chains: ['top_k'] (top_k 1) (baseline) vs "
                    "the server's default chain (candidate); the same tokens, but its cost per token is in the "
                    "decode rates"]
    moebench_cli("compare", str(argmax), str(argmax), "--out", str(tmp_path / "same"), check=True)
    assert "setup_differences" not in json.loads((tmp_path / "same" / "compare.json").read_text())
