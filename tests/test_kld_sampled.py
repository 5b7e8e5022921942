"""KLD method = "sampled": Monte Carlo KL(baseline || candidate) on the baseline's own samples.

Estimators against an analytic KL; then the zoo model: the engine (float32) baseline samples, the tiered
candidate scores the same ids through the engine runner and through `moebench serve` (echo), the
baseline sampled again through `moebench serve` gives the same ids from the same seeds, and compare and
the report show the estimate with its interval. vLLM: tests/test_kld_sampled_vllm.py.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from moebench import api
from moebench.runners.base import RunnerError
from moebench.kld import sampled_stats as sk

REPO = Path(__file__).resolve().parent.parent
PROMPTS, CONTS, TOKENS = 4, 2, 16
SUITE = (f'name = "kld-sampled-test"\n[[tasks]]\ntask = "kld"\nmethod = "sampled"\nprompts = {PROMPTS}\n'
         f'prompt_tokens = 16\ncontinuations = {CONTS}\ntokens = {TOKENS}\nseed = 7\n[probes]\nnvml = false\n')


def _coverage(p: np.ndarray, q: np.ndarray, repeats: int, rng) -> dict[str, int]:
    kl = float((p * np.log(p / q)).sum())
    covered = {"low-variance": 0, "plain": 0}
    for rep in range(repeats):
        seqs = []
        for _ in range(32):                                   # 32 sequences of 32 tokens
            x = rng.choice(p.size, size=32, p=p)
            seqs.append((np.log(p[x]), np.log(q[x])))
        for est in covered:
            e = sk.estimate(seqs, seed=rep, estimator=est).to_json()
            lo, hi = e["interval"]
            covered[est] += lo <= kl <= hi
            assert e["n_tokens"] == 1024 and e["n_sequences"] == 32 and e["method"] == "sampled"
    return covered


def _softmax(x: np.ndarray) -> np.ndarray:
    return np.exp(x - x.max()) / np.exp(x - x.max()).sum()


def test_estimators_cover_an_analytic_kl():
    """x ~ p from a known categorical: the 95% interval covers KL(p || q) about 95 times in 100."""
    rng = np.random.default_rng(0)
    logits = 2 * rng.normal(size=200)
    p = _softmax(logits)
    near = _softmax(logits + 0.3 * rng.normal(size=200))        # KL 0.06: a quantised model's drift
    covered = _coverage(p, near, 100, rng)
    assert covered["low-variance"] >= 90 and covered["plain"] >= 90, covered
    # Far apart (an unrelated q, KL ~ 1 nat), r = q/p is heavy-tailed and the low-variance estimator's
    # interval under-covers; the plain one still holds (docs/kld.md: use estimator = "plain" there).
    far = _softmax(2 * rng.normal(size=200))
    covered_far = _coverage(p, far, 40, rng)
    print(f"\ncoverage of 95% intervals: near {covered} of 100, far {covered_far} of 40")
    assert covered_far["plain"] >= 34, covered_far
    q = near
    assert (sk.per_token(np.log(p), np.log(q), "low-variance") >= 0).all()
    with pytest.raises(ValueError, match="differ in shape"):
        sk.per_token(np.zeros(3), np.zeros(4), "plain")
    with pytest.raises(ValueError, match="estimator 'k2'"):
        sk.per_token(np.zeros(3), np.zeros(3), "k2")


def test_sampled_reply_parsing_names_what_is_wrong():
    from moebench.runners import sampled_logprobs as sl
    legacy = {"choices": [{"logprobs": {"tokens": ["token_id:5", "token_id:9"], "token_logprobs": [-1.0, -2.5]}}]}
    assert sl.parse(legacy, 2, "srv") == ([5, 9], [-1.0, -2.5])
    content = {"choices": [{"logprobs": {"content": [{"id": 3, "token": "a", "logprob": -0.5}]}}]}
    assert sl.parse(content, 1, "srv") == ([3], [-0.5])
    text = {"choices": [{"logprobs": {"tokens": ["hello"], "token_logprobs": [-1.0]}}]}
    with pytest.raises(RunnerError, match="ignored return_tokens_as_token_ids"):
        sl.parse(text, 1, "srv")
    with pytest.raises(RunnerError, match=r"1 sampled tokens came back, asked for 2"):
        sl.parse({"choices": [{"logprobs": {"tokens": ["token_id:5"], "token_logprobs": [-1.0]}}]}, 2, "srv")
    with pytest.raises(RunnerError, match=r"log-probs for 1 of 2 sampled tokens: llama-server leaves out .* UTF-8"):
        sl.parse(content, 2, "srv")
    body = sl.request("m", [1, 2], 4, 11)
    assert body["temperature"] == 1.0 and body["top_p"] == 1.0 and body["top_k"] == -1 and body["min_p"] == 0.0
    assert body["ignore_eos"] and body["seed"] == 11 and body["logprobs"] == 1


def _hf_zoo() -> Path:
    zoo = REPO / "models" / "zoo" / "tiny-moe"
    if not (zoo / "model.safetensors").is_file():
        pytest.skip("zoo model not built (moebench zoo build)")
    return zoo


def _run(suite: Path, runner: Path, out: Path, baseline: Path | None = None) -> tuple[Path, list[dict]]:
    run_dir, code = api.run(api.RunOptions(suite=str(suite), runner=str(runner), out=str(out),
                                           baseline=str(baseline) if baseline else None,
                                           as_baseline=baseline is None, quiet=True))
    items = [json.loads(x) for x in (run_dir / "items.jsonl").read_text().splitlines() if x.strip()]
    errors = [(r["item_id"], r.get("error")) for r in items if r["status"] != "ok"]
    assert code == 0 and not errors, f"{runner.name}: exit {code}, errors {errors[:3]}"
    return run_dir, items


def _seqs(run_dir: Path, role: str) -> dict[str, np.ndarray]:
    folder = run_dir / "kld" / "kld" / role
    return {p.name: np.load(p) for p in sorted(folder.glob("seq_*.npz"))}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from moebench.demo import pack_tiered
    tmp = tmp_path_factory.mktemp("kld-sampled")
    hf = _hf_zoo()
    tiered = pack_tiered(hf, tmp / "tiered", log=lambda *a: None)
    suite = tmp / "kld-sampled.toml"
    suite.write_text(SUITE)
    prof = {"suite": suite, "hf": hf, "tiered": tiered, "tmp": tmp}
    for name, model in (("base", hf), ("cand", tiered)):
        p = tmp / f"engine-{name}.toml"
        p.write_text(f'kind = "engine"\nmodel = "{model}"\ndtype = "float32"\ndevice = "cpu"\n')
        prof[name] = p
    prof["base_run"], prof["base_items"] = _run(suite, prof["base"], tmp / "base")
    prof["engine_run"], _ = _run(suite, prof["cand"], tmp / "engine-cand", prof["base_run"])
    return prof


def _engine_runner(model: Path):
    from moebench.runners.engine import EngineRunner
    return EngineRunner({"model": str(model), "dtype": "float32", "device": "cpu"})


def test_engine_pair_compare_and_report(pair):
    """Done-when (engine side): compare.json["kld"] carries method, estimator, the interval and counts;
    the report shows them with the sentence on contexts."""
    assert {r["role"] for r in pair["base_items"]} == {"baseline"}
    base = _seqs(pair["base_run"], "base")
    assert len(base) == PROMPTS * CONTS and all(d["ids"].size == TOKENS for d in base.values())
    out = pair["tmp"] / "cmp-engine"
    _, cmp = api.compare(str(pair["base_run"]), str(pair["engine_run"]), out=str(out), write_report=True)
    k = cmp["kld"]
    lo, hi = k["interval"]
    print(f"\nsampled KLD (engine tiered vs engine float32, {k['n_tokens']} tokens): {k['mean']:.5f} "
          f"[{lo:.5f}, {hi:.5f}], plain {k['plain']['mean']:.5f}")
    assert k["method"] == "sampled" and k["estimator"] == "low-variance"
    assert k["n_tokens"] == PROMPTS * CONTS * TOKENS and k["n_sequences"] == PROMPTS * CONTS
    assert 0 < lo <= k["mean"] <= hi and k["confidence"] == 0.95
    # the tiered pack's drift on this model is a few hundredths of a nat (docs/kld.md)
    assert 0.003 < k["mean"] < 0.3
    html = (out / "report.html").read_text()
    assert "sampled" in html and "measures other contexts" in html and f"{lo:.4f}" in html


def test_serve_candidate_scores_the_same_ids_as_the_engine(pair):
    """`moebench serve` (echo, K = 1) over the tiered engine gives the engine runner's log q."""
    from moebench.serve import BackgroundServer, ServeOptions
    with BackgroundServer(_engine_runner(pair["tiered"]), ServeOptions(port=0)) as srv:
        prof = pair["tmp"] / "serve-cand.toml"
        prof.write_text(f'kind = "http"\nbase_url = "{srv.url}"\nmodel = "zoo"\ntoken_prompts = true\n'
                        f'prompt_logprobs = "echo"\ntokenizer = "{pair["hf"]}"\ntimeout_s = 900\n')
        run, items = _run(pair["suite"], prof, pair["tmp"] / "serve-cand", pair["base_run"])
    assert {r["method"] for r in items} == {"sampled"}
    via_http, via_engine = _seqs(run, "cand"), _seqs(pair["engine_run"], "cand")
    assert via_http.keys() == via_engine.keys()
    worst = max(float(np.abs(via_http[n]["logq"] - via_engine[n]["logq"]).max()) for n in via_http)
    assert worst < 1e-3, worst
    _, a = api.compare(str(pair["base_run"]), str(run), out=str(pair["tmp"] / "cmp-serve"), write_report=False)
    _, b = api.compare(str(pair["base_run"]), str(pair["engine_run"]), out=str(pair["tmp"] / "cmp-eng2"),
                       write_report=False)
    assert a["kld"]["mean"] == pytest.approx(b["kld"]["mean"], rel=1e-2)


def test_serve_baseline_samples_the_same_ids_from_the_same_seeds(pair):
    """Sampling through `moebench serve` over the engine (temperature 1, top_k -1, seed per item) draws
    the engine runner's ids, with the same log p; a second run draws them again."""
    from moebench.serve import BackgroundServer, ServeOptions
    with BackgroundServer(_engine_runner(pair["hf"]), ServeOptions(port=0)) as srv:
        prof = pair["tmp"] / "serve-base.toml"
        prof.write_text(f'kind = "http"\nbase_url = "{srv.url}"\nmodel = "zoo"\ntoken_prompts = true\n'
                        f'tokenizer = "{pair["hf"]}"\ntimeout_s = 900\n')
        run, items = _run(pair["suite"], prof, pair["tmp"] / "serve-base")
    assert {r["role"] for r in items} == {"baseline"}
    got, want = _seqs(run, "base"), _seqs(pair["base_run"], "base")
    assert got.keys() == want.keys()
    for name in got:
        assert got[name]["ids"].tolist() == want[name]["ids"].tolist(), name
        assert np.abs(got[name]["logp"] - want[name]["logp"]).max() < 1e-3
    # that baseline serves a candidate like the engine's own
    cand, _ = _run(pair["suite"], pair["cand"], pair["tmp"] / "cand-of-serve-base", run)
    _, c = api.compare(str(run), str(cand), out=str(pair["tmp"] / "cmp-serve-base"), write_report=False)
    assert c["kld"]["method"] == "sampled" and c["kld"]["n_tokens"] == PROMPTS * CONTS * TOKENS


def test_a_candidate_must_match_the_baseline_suite(pair):
    """Different sampling keys would sample other tokens: refused naming the key; a sampled key in a
    teacher-forced task is refused naming it."""
    other = pair["tmp"] / "other.toml"
    other.write_text(SUITE.replace("seed = 7", "seed = 8"))
    from moebench.kld.runs import KldError
    with pytest.raises(KldError, match="used seed = 7, this suite 8: the sampled tokens would differ"):
        api.run(api.RunOptions(suite=str(other), runner=str(pair["cand"]), out=str(pair["tmp"] / "x"),
                               baseline=str(pair["base_run"]), quiet=True))
    tf = pair["tmp"] / "tf.toml"
    tf.write_text(SUITE.replace('method = "sampled"\n', ""))
    with pytest.raises(Exception, match="is for method = \"sampled\""):
        api.run(api.RunOptions(suite=str(tf), runner=str(pair["base"]), out=str(pair["tmp"] / "y"),
                               as_baseline=True, quiet=True))


def test_tampered_baseline_ids_are_caught_by_the_candidate_server(pair, tmp_path):
    """Token ids checked on the candidate side: a server that echoes other ids than sent is an error
    naming the position (here the baseline's ids are past the vocabulary, which the engine refuses)."""
    bad = tmp_path / "base"
    shutil.copytree(pair["base_run"], bad)
    f = bad / "kld" / "kld" / "base" / "seq_00000.npz"
    d = dict(np.load(f))
    d["ids"] = d["ids"].copy()
    d["ids"][3] = 60000
    np.savez(f, **d)
    run_dir, code = api.run(api.RunOptions(suite=str(pair["suite"]), runner=str(pair["cand"]),
                                           out=str(tmp_path / "c"), baseline=str(bad), quiet=True))
    items = [json.loads(x) for x in (run_dir / "items.jsonl").read_text().splitlines() if x.strip()]
    err = [r for r in items if r["status"] != "ok"]
    assert err and "60000" in str(err[0].get("error")), err[:1]


def test_llama_server_as_a_sampled_baseline_and_its_limit(pair):
    """llama-server's OpenAI endpoint (b11434, the zoo's BF16 GGUF) through an http profile: the sampled
    ids come back in `logprobs.content[].id` with log-probs that the engine (float32, the same BF16
    weights) reproduces, and the same seed draws the same ids. Its limit: a sampled token ending inside
    a multi-byte UTF-8 character gets no log-prob entry, and such an item is an error saying so; the
    run is therefore not a usable baseline (docs/kld.md)."""
    import asyncio
    import torch
    from moebench.engine import Engine
    from moebench.runners.llama_server import LlamaServerRunner
    gguf = REPO / "models" / "zoo" / "tiny-moe-bf16.gguf"
    if not gguf.is_file():
        pytest.skip("zoo GGUF not built (moebench zoo build)")
    loop = asyncio.new_event_loop()
    server = LlamaServerRunner({"model": str(gguf), "ctx_size": 1024, "startup_timeout_s": 120.0,
                                "args": ["--threads", "1"]})
    loop.run_until_complete(server.start(str(pair["tmp"])))
    runs = []
    try:
        prof = pair["tmp"] / "llama-http.toml"
        prof.write_text(f'kind = "http"\nbase_url = "{server.base_url}/v1"\nmodel = "zoo"\ntoken_prompts = true\n'
                        f'tokenizer = "{pair["hf"]}"\ntimeout_s = 900\n')
        for n in (1, 2):
            run_dir, _ = api.run(api.RunOptions(suite=str(pair["suite"]), runner=str(prof),
                                                out=str(pair["tmp"] / f"llama-base-{n}"), as_baseline=True, quiet=True))
            runs.append((run_dir, [json.loads(x) for x in (run_dir / "items.jsonl").read_text().splitlines() if x]))
    finally:
        loop.run_until_complete(server.close())
        loop.close()
    (first, items), (again, _) = runs
    ok = [r for r in items if r["status"] == "ok"]
    bad = [r for r in items if r["status"] != "ok"]
    assert ok, "no continuation came back whole"
    assert all("multi-byte UTF-8" in str(r.get("error")) for r in bad), [r.get("error") for r in bad]
    a, b = _seqs(first, "base"), _seqs(again, "base")
    assert a.keys() == b.keys() and len(a) == len(ok)
    eng = Engine.load(pair["hf"], device="cpu", dtype="float32")
    prompts = np.load(first / "kld" / "kld" / "prompts.npy")
    worst = 0.0
    for r in ok:
        d = a[Path(r["file"]).name]
        assert d["ids"].tolist() == b[Path(r["file"]).name]["ids"].tolist()       # same seed, same ids
        prompt = [int(t) for t in prompts[r["prompt"]]]
        lp = torch.log_softmax(eng.logits(prompt + d["ids"].tolist())[len(prompt) - 1:-1].double(), -1)
        lq = lp[torch.arange(d["ids"].size), torch.from_numpy(d["ids"].astype(np.int64))].numpy()
        worst = max(worst, float(np.abs(lq - d["logp"]).max()))
    print(f"\nllama-server: {len(ok)} of {len(items)} continuations whole, {len(bad)} refused (UTF-8); "
          f"largest |log p(llama BF16) - log p(engine fp32)| {worst:.3g}")
    assert worst < 0.2


def test_shipped_suite_through_the_cli_with_a_serve_baseline(pair):
    """Done-when: `moebench run suites/kld-sampled.toml` with `moebench serve` (over the float32 engine)
    sampling the baseline, the tiered engine as the candidate, and `moebench compare` printing the
    sampled KLD with its interval."""
    from conftest import moebench_cli
    from moebench.serve import BackgroundServer, ServeOptions
    tmp = pair["tmp"] / "cli"
    tmp.mkdir()
    suite = REPO / "suites" / "kld-sampled.toml"
    with BackgroundServer(_engine_runner(pair["hf"]), ServeOptions(port=0)) as srv:
        prof = tmp / "serve.toml"
        prof.write_text(f'kind = "http"\nbase_url = "{srv.url}"\nmodel = "zoo"\ntoken_prompts = true\n'
                        f'tokenizer = "{pair["hf"]}"\ntimeout_s = 900\n')
        base = moebench_cli("run", str(suite), "--runner", str(prof), "--out", str(tmp / "base"), "--as-baseline")
    assert base.returncode == 0, base.stderr
    assert "role=baseline (sampled continuations recorded" in base.stdout and "tokens=1024" in base.stdout
    cand = moebench_cli("run", str(suite), "--runner", str(pair["cand"]), "--out", str(tmp / "cand"),
                        "--baseline", str(tmp / "base"))
    assert cand.returncode == 0, cand.stderr
    assert "sampled tokens=1024 kld_mean=" in cand.stdout
    cmp = moebench_cli("compare", str(tmp / "base"), str(tmp / "cand"), "--out", str(tmp / "cmp"))
    assert cmp.returncode == 0, cmp.stderr
    k = json.loads((tmp / "cmp" / "compare.json").read_text())["kld"]
    lo, hi = k["interval"]
    print(f"\nshipped suite, serve baseline, tiered candidate: {k['mean']:.5f} [{lo:.5f}, {hi:.5f}] "
          f"({k['n_tokens']} tokens)")
    assert k["method"] == "sampled" and k["n_tokens"] == 1024 and k["n_sequences"] == 32 and lo < k["mean"] < hi
    assert f"kld (sampled, low-variance): mean={k['mean']:.6g} 95% interval=[{lo:.6g}, {hi:.6g}]" in cmp.stdout, \
        cmp.stdout


def test_teacher_forced_and_sampled_in_one_suite(pair):
    """Beside a teacher-forced KLD the sampled one is compare.json["kld"]["sampled"], and the report shows
    both blocks with the sentence on their different contexts."""
    suite = pair["tmp"] / "both.toml"
    suite.write_text('name = "kld-both"\n[[tasks]]\ntask = "kld"\ncontext = 64\nchunks = 2\ntop_k = 64\n'
                     'full_chunks = 2\n[[tasks]]\ntask = "kld"\nname = "kld-sampled"\nmethod = "sampled"\n'
                     'prompts = 4\nprompt_tokens = 16\ncontinuations = 2\ntokens = 8\n[probes]\nnvml = false\n')
    base, _ = _run(suite, pair["base"], pair["tmp"] / "both-base")
    cand, _ = _run(suite, pair["cand"], pair["tmp"] / "both-cand", base)
    _, cmp = api.compare(str(base), str(cand), out=str(pair["tmp"] / "cmp-both"), write_report=True)
    k = cmp["kld"]
    assert k["method"] == "exact" and k["n_tokens"] == 2 * (64 - 1 - 32)
    assert k["sampled"]["method"] == "sampled" and k["sampled"]["n_tokens"] == 4 * 2 * 8
    assert "kld-sampled" not in cmp["tasks"] and "kld" not in cmp["tasks"]
    html = (pair["tmp"] / "cmp-both" / "report.html").read_text()
    assert "teacher-forced)</h2>" in html and "sampled from the baseline)</h2>" in html
    assert "measure different contexts" in html
