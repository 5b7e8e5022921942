"""The smoke suite through a real llama-server on the zoo's GGUFs, BF16 baseline against Q4_0, through the
CLI: GSM8K, CMMLU and HumanEval items and KLD (llama-perplexity), then compare and report."""
from __future__ import annotations

import json

from conftest import moebench_cli, read_items


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
    moebench_cli("compare", str(base), str(cand), "--out", str(cmp_dir), check=True)
    cmp = json.loads((cmp_dir / "compare.json").read_text())
    for task in ("gsm8k", "cmmlu", "humaneval"):
        assert cmp["tasks"][task]["n_paired"] == 4, cmp["tasks"][task]
    k = cmp["kld"]
    assert k["n_tokens"] > 0 and k["mean"] > 0 and 0 < k["same_top_p"] <= 1
    assert (cmp_dir / "report.html").stat().st_size > 5000
