"""Speculative decoding on a real llama-server: the zoo model drafting for itself (a valid, if trivial,
pair). The speed task's acceptance figures must be the server's own counters, at two temperatures, and
the report must show them beside decode speed."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from moebench import api
from test_llama_server_runner import gguf_model  # noqa: F401 (fixture)


def _speed_run(tmp: Path, model: Path, name: str, sampling: str) -> Path:
    suite = tmp / f"{name}.toml"
    suite.write_text(f'name = "{name}"\n[[tasks]]\ntask = "speed"\nprompt_lengths = [64, 256]\noutput_tokens = 48\n'
                     f'repeats = 2\nwarmup = 0\n{sampling}[probes]\nnvml = false\n')
    runner = tmp / "draft.toml"
    runner.write_text(f'kind = "llama-server"\nmodel = "{model}"\nctx_size = 2048\nstartup_timeout_s = 120\n'
                      f'args = ["--threads", "1", "-md", "{model}", "--spec-type", "draft-simple", '
                      f'"--spec-draft-n-max", "4", "--spec-draft-n-min", "1"]\n')
    run_dir, code = api.run(api.RunOptions(suite=str(suite), runner=str(runner), out=str(tmp / name), quiet=True))
    assert code == 0, (run_dir / "manifest.json").read_text()
    return run_dir


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "items.jsonl").read_text().splitlines() if x.strip()]


def test_self_drafting_acceptance_matches_the_server_counters_at_two_temperatures(gguf_model, tmp_path):  # noqa: F811
    greedy = _speed_run(tmp_path, gguf_model, "greedy", "")
    hot = _speed_run(tmp_path, gguf_model, "hot", "temperature = 1.0\ntop_k = 40\nseed = 3\n")
    rates = {}
    for run in (greedy, hot):
        recs = _records(run)
        assert recs and all(r["status"] == "ok" for r in recs), recs[:1]
        drafted = accepted = 0
        for r in recs:
            t = r["timings"]                                  # the server's own timings object
            if "draft_n" not in t:
                pytest.skip(f"this llama-server reports no draft counters: {sorted(t)}")
            assert r["draft_n"] == t["draft_n"] and r["draft_n_accepted"] == t["draft_n_accepted"]
            assert r["acceptance_rate"] == pytest.approx(t["draft_n_accepted"] / t["draft_n"])
            drafted += t["draft_n"]
            accepted += t["draft_n_accepted"]
        summary = json.loads((run / "manifest.json").read_text())["summary"]["speed"]
        pooled = [g["1"]["draft"] for g in summary["by_prompt_length"].values()]
        assert sum(d["draft_n"] for d in pooled) == drafted and sum(d["draft_n_accepted"] for d in pooled) == accepted
        rates[run.name] = accepted / drafted
    # Greedy, a model drafting for itself is nearly always right; sampled at temperature 1 it is not.
    assert rates["greedy"] >= 0.9, rates
    assert rates["hot"] < rates["greedy"], rates
    out, cmp = api.compare(str(greedy), str(hot), str(tmp_path / "cmp"))
    rows = cmp["speed"]["rows"]
    assert {r["prompt_length"] for r in rows} == {64, 256}
    assert all(r["acceptance_baseline"] is not None and r["acceptance_candidate"] is not None for r in rows)
    html = (out / "report.html").read_text(encoding="utf-8")
    assert "Speculative decoding" in html and "draft acceptance baseline" in html and "decode tok/s baseline" in html
    assert "candidate temperature 1, top_k 40, seed 3" in html
    print(f"acceptance: greedy {rates['greedy']:.3f}, temperature 1.0 {rates['hot']:.3f}")
