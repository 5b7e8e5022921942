"""KLD over HTTP: prompt log-probs in vLLM's, SGLang's and the legacy echo shapes, on the zoo model.

Baseline: the engine (float32, whole distributions kept for every chunk). Candidate: the tiered zoo
model, measured (a) by the engine runner (exact), (b) through `moebench serve` over the engine
(echo, K = the whole vocabulary: must equal (a)), (c) through a protocol server answering in vLLM's
and SGLang's shapes with top-K (a lower bound, tighter with SGLang's fixed ids).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moebench import api
from moebench.runners.base import RunnerError

CONTEXT, CHUNKS, VOCAB = 64, 2, 50257
REPO = Path(__file__).resolve().parent.parent


def _hf_zoo(tmp_path_factory) -> Path:
    zoo = REPO / "models" / "zoo" / "tiny-moe"
    if (zoo / "model.safetensors").is_file():
        return zoo
    from moebench.tools import llamacpp
    from moebench.zoo.build import WEIGHTS_DIR, write_hf_dir
    out = tmp_path_factory.mktemp("zoo") / "tiny-moe"
    write_hf_dir(out, WEIGHTS_DIR, Path(llamacpp.source_dir()))
    return out


def _run(suite: Path, runner: Path, out: Path, baseline: Path | None = None) -> tuple[Path, list[dict]]:
    run_dir, code = api.run(api.RunOptions(suite=str(suite), runner=str(runner), out=str(out),
                                           baseline=str(baseline) if baseline else None,
                                           as_baseline=baseline is None, quiet=True))
    items = [json.loads(x) for x in (run_dir / "items.jsonl").read_text().splitlines() if x.strip()]
    errors = [r.get("error") for r in items if r["status"] != "ok"]
    assert code == 0 and not errors, f"{runner.name}: exit {code}, errors {errors[:3]}"
    return run_dir, items


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Profiles, the engine baseline run and the engine (exact) candidate run of the tiered model."""
    from moebench.demo import pack_tiered
    tmp = tmp_path_factory.mktemp("httpkld")
    hf = _hf_zoo(tmp_path_factory)
    tiered = pack_tiered(hf, tmp / "tiered", log=lambda *a: None)
    suite = tmp / "kld.toml"
    suite.write_text(f'name = "kld-http"\n[[tasks]]\ntask = "kld"\ncontext = {CONTEXT}\nchunks = {CHUNKS}\n'
                     f'top_k = 256\nfull_chunks = {CHUNKS}\n[probes]\nnvml = false\n')
    prof = {"suite": suite, "hf": hf, "tiered": tiered, "tmp": tmp}
    for name, model in (("base", hf), ("cand", tiered)):
        p = tmp / f"engine-{name}.toml"
        p.write_text(f'kind = "engine"\nmodel = "{model}"\ndtype = "float32"\ndevice = "cpu"\n')
        prof[name] = p
    prof["base_run"], _ = _run(suite, prof["base"], tmp / "base")
    prof["exact_run"], _ = _run(suite, prof["cand"], tmp / "exact", prof["base_run"])
    _, cmp = api.compare(str(prof["base_run"]), str(prof["exact_run"]), out=str(tmp / "cmp-exact"),
                         write_report=False)
    prof["exact"] = cmp["kld"]
    assert prof["exact"]["method"] == "exact" and prof["exact"]["mean"] > 0
    return prof


def _http_profile(path: Path, url: str, mode: str, k: int, tokenizer: Path, extra: str = "") -> Path:
    path.write_text(f'kind = "http"\nbase_url = "{url}"\nmodel = "zoo"\ntoken_prompts = true\n'
                    f'prompt_logprobs = "{mode}"\nprompt_logprobs_k = {k}\ntokenizer = "{tokenizer}"\n'
                    f'timeout_s = 900\n{extra}')
    return path


def _engine_runner(model: Path):
    from moebench.runners.engine import EngineRunner
    return EngineRunner({"model": str(model), "dtype": "float32", "device": "cpu"})


def test_serve_echo_with_whole_vocabulary_equals_engine_exact(pair):
    """Done-when: K = vocabulary through `moebench serve` equals the engine runner's exact KLD."""
    from moebench.serve import BackgroundServer, ServeOptions
    with BackgroundServer(_engine_runner(pair["tiered"]), ServeOptions(port=0, max_logprobs=VOCAB)) as srv:
        prof = _http_profile(pair["tmp"] / "serve-echo.toml", srv.url, "echo", VOCAB, pair["hf"],
                             "max_response_bytes = 2000000000\n")     # whole distributions: ~90 MB a chunk
        run, items = _run(pair["suite"], prof, pair["tmp"] / "serve-echo", pair["base_run"])
    assert all(r["complete"] and r["method"] == "exact" for r in items)
    _, cmp = api.compare(str(pair["base_run"]), str(run), out=str(pair["tmp"] / "cmp-echo"), write_report=False)
    k, exact = cmp["kld"], pair["exact"]
    print(f"\nserve echo K={VOCAB}: mean KLD {k['mean']:.6f} vs engine exact {exact['mean']:.6f}; "
          f"same top {k['same_top_p']:.4f} vs {exact['same_top_p']:.4f}")
    assert k["method"] == "exact" and k["n_tokens"] == exact["n_tokens"] == CHUNKS * (CONTEXT - 1 - CONTEXT // 2)
    assert abs(k["mean"] - exact["mean"]) <= 0.01 * exact["mean"]
    assert abs(k["same_top_p"] - exact["same_top_p"]) <= 0.005
    assert abs(k["ln_ppl_ratio"] - exact["ln_ppl_ratio"]) <= 0.01 * abs(exact["ln_ppl_ratio"]) + 1e-6


def test_vllm_and_sglang_shapes_give_a_lower_bound(pair):
    from prompt_logprobs_server import PromptLogprobServer
    k = 20
    with PromptLogprobServer(_engine_runner(pair["tiered"])) as srv:
        vllm = _http_profile(pair["tmp"] / "vllm.toml", srv.url + "/v1", "vllm", k, pair["hf"])
        sg = _http_profile(pair["tmp"] / "sglang.toml", srv.url + "/v1", "sglang", k, pair["hf"])
        sg_ids = _http_profile(pair["tmp"] / "sglang-ids.toml", srv.url + "/v1", "sglang", k, pair["hf"],
                               "prompt_logprob_ids = true\n")
        runs = {name: _run(pair["suite"], p, pair["tmp"] / name, pair["base_run"])[0]
                for name, p in (("vllm", vllm), ("sglang", sg), ("sglang-ids", sg_ids))}
        asked_ids = [r for r in srv.requests if r.get("token_ids_logprob")]
    exact = pair["exact"]
    got = {}
    for name, run in runs.items():
        _, cmp = api.compare(str(pair["base_run"]), str(run), out=str(pair["tmp"] / f"cmp-{name}"),
                             write_report=False)
        got[name] = cmp["kld"]
        kk = got[name]
        assert kk["method"] == "topk-lower-bound" and kk["estimate"]["lower_bound"] and kk["estimate"]["k"] == k
        # the bound is said beside the figure, not only inside the kld section
        said = f"kld: mean {kk['mean']!r} is a top-{k} lower bound of the full KLD"
        assert any(w.startswith(said) for w in cmp["warnings"]), cmp.get("warnings")
        assert f"- warning: {said}" in (pair["tmp"] / f"cmp-{name}" / "summary.md").read_text()
        # Same top p and delta-p need only each side's top token and the actual token: exact.
        assert kk["same_top_p"] == pytest.approx(exact["same_top_p"], abs=1e-9)
        assert kk["delta_p"]["rms"] == pytest.approx(exact["delta_p"]["rms"], rel=1e-3, abs=1e-6)
        assert 0 < kk["mean"] <= exact["mean"] * (1 + 1e-3)
    assert got["vllm"]["mean"] == pytest.approx(got["sglang"]["mean"], rel=1e-5)
    assert asked_ids and got["sglang-ids"]["mean"] >= got["sglang"]["mean"] * (1 - 1e-5)
    print(f"\nK={k}: vllm {got['vllm']['mean']:.6f}, sglang {got['sglang']['mean']:.6f}, sglang+ids "
          f"{got['sglang-ids']['mean']:.6f}, exact {exact['mean']:.6f}")


def test_http_baseline_and_candidate(pair):
    """Both sides over HTTP (vLLM shape): the baseline keeps top-K, the candidate is a lower bound."""
    from prompt_logprobs_server import PromptLogprobServer
    with PromptLogprobServer(_engine_runner(pair["hf"])) as srv:
        base_prof = _http_profile(pair["tmp"] / "vllm-base.toml", srv.url + "/v1", "vllm", 20, pair["hf"])
        base, items = _run(pair["suite"], base_prof, pair["tmp"] / "http-base")
    assert {r["role"] for r in items} == {"baseline"}
    assert np.load(base / "kld" / "kld" / "tokens.npy").tolist() == np.load(
        pair["base_run"] / "kld" / "kld" / "tokens.npy").tolist()
    with PromptLogprobServer(_engine_runner(pair["tiered"])) as srv:
        cand_prof = _http_profile(pair["tmp"] / "vllm-cand.toml", srv.url + "/v1", "vllm", 20, pair["hf"])
        cand, _ = _run(pair["suite"], cand_prof, pair["tmp"] / "http-cand", base)
    _, cmp = api.compare(str(base), str(cand), out=str(pair["tmp"] / "cmp-http"), write_report=False)
    assert cmp["kld"]["method"] == "topk-lower-bound"
    assert 0 < cmp["kld"]["mean"] <= pair["exact"]["mean"] * (1 + 1e-3)
    assert cmp["kld"]["same_top_p"] == pytest.approx(pair["exact"]["same_top_p"], abs=1e-9)


def test_token_mismatch_is_a_clear_error(pair):
    import asyncio

    from moebench.runners.http import HttpRunner
    from prompt_logprobs_server import PromptLogprobServer
    ids = [464, 3797, 3332, 319, 262, 2603]
    with PromptLogprobServer(_engine_runner(pair["tiered"]), tamper_position=3) as srv:
        for mode, words in (("vllm", "lacks the prompt's own token 319"),
                            ("sglang", "position 3: the server reports token")):
            runner = HttpRunner({"base_url": srv.url + "/v1", "model": "m", "prompt_logprobs": mode,
                                 "token_prompts": True})

            async def ask() -> None:
                try:
                    await runner.prompt_logprobs(ids, 5)
                finally:
                    await runner.close()
            with pytest.raises(RunnerError, match=words):
                asyncio.run(ask())


def test_echo_text_tokens_map_through_the_local_tokenizer(pair):
    """A server that ignores return_tokens_as_token_ids answers token text: mapped back to ids through
    the profile's tokenizer; text several ids decode to is refused, naming it."""
    from moebench.runners.local_tokenizer import load_tokenizer
    from moebench.runners.prompt_logprobs import parse_echo
    tok = load_tokenizer(str(pair["hf"]), "test")
    ids = tok.encode("The cat sat on the mat.")
    pieces = [tok.piece(t) for t in ids]
    data = {"choices": [{"text": "", "logprobs": {
        "tokens": pieces, "token_logprobs": [None] + [-1.0] * (len(ids) - 1),
        "top_logprobs": [None] + [{pieces[i]: -1.0, " dog": -2.0} for i in range(1, len(ids))]}}]}
    rows = parse_echo(data, ids, "test", tok.id_of_piece)
    assert rows[0] is None and rows[1][1][ids[1]] == -1.0 and rows[1][1][tok.encode(" dog")[0]] == -2.0
    bad = json.loads(json.dumps(data))
    bad["choices"][0]["logprobs"]["top_logprobs"][1] = {"\ufffd": -3.0}      # several byte tokens decode to it
    with pytest.raises(RunnerError, match="several token ids"):
        parse_echo(bad, ids, "test", tok.id_of_piece)
    shifted = json.loads(json.dumps(data))
    shifted["choices"][0]["logprobs"]["tokens"][2] = " dog"
    with pytest.raises(RunnerError, match="position 2: the server echoed token"):
        parse_echo(shifted, ids, "test", tok.id_of_piece)
