"""Three candidates against a BF16 baseline, all real: llama-server on the zoo's BF16, Q8_0 and Q4_0 GGUFs
(runners/llama-*.toml) and the in-repo engine on the tiered pack (runners/engine-tiered.toml), the smoke
suite's tasks with a short speed task, through the CLI: one compare, one report, a CSV with three rows,
a gate over all three, and a trend over the runs."""
from __future__ import annotations

import csv
import io
import json
import re

from conftest import moebench_cli, read_items


# smoke.toml's tasks with small limits (CMMLU: the first three subjects), plus enough timed requests
# per side for the speed rules' default min_samples.
SUITE = """name = "smoke-matrix"
[[tasks]]
task = "gsm8k"
limit = 4
shots = 2
max_tokens = 48
[[tasks]]
task = "cmmlu"
per_subject_limit = 2
limit = 6
shots = 5
[[tasks]]
task = "humaneval"
limit = 2
max_tokens = 96
[[tasks]]
task = "kld"
context = 512
chunks = 2
full_chunks = 2
[[tasks]]
task = "speed"
prompt_lengths = [128]
output_tokens = 16
repeats = 6
clients = 1
warmup = 1
[probes]
nvml = true
"""


def test_three_candidates_compare_report_csv_gate_and_trend(zoo_tiered, tmp_path):
    suite = tmp_path / "smoke-matrix.toml"
    suite.write_text(SUITE)
    base = tmp_path / "llama-bf16"
    moebench_cli("run", str(suite), "--runner", "runners/llama-bf16.toml", "--out", str(base), check=True)
    cands = []
    for profile in ("llama-q8_0", "llama-q4_0", "engine-tiered"):
        run = tmp_path / profile
        moebench_cli("run", str(suite), "--runner", f"runners/{profile}.toml", "--out", str(run),
                     "--baseline", str(base), check=True)
        cands.append(run)
    out = tmp_path / "cmp"
    proc = moebench_cli("compare", str(base), *map(str, cands), "--out", str(out), "--format", "csv", check=True)
    rows = list(csv.DictReader(io.StringIO(proc.stdout)))
    assert [r["candidate"] for r in rows] == ["llama-q8_0", "llama-q4_0", "engine-tiered"]
    for r in rows:
        assert int(r["gsm8k.n_paired"]) == 4 and int(r["cmmlu.n_paired"]) == 6
        assert float(r["kld.mean"]) > 0 and 0 < float(r["kld.same_top_p"]) <= 1
        assert float(r["speed.decode_ratio"]) > 0 and int(r["model_bytes"]) > 0
    sizes = {r["candidate"]: int(r["model_bytes"]) for r in rows}
    assert sizes["llama-q4_0"] < sizes["llama-q8_0"]
    kld = {r["candidate"]: float(r["kld.mean"]) for r in rows}
    assert kld["llama-q8_0"] < kld["llama-q4_0"]            # coarser quantization drifts further
    cmp = json.loads((out / "02_llama-q4_0" / "compare.json").read_text())
    assert set(cmp["tasks"]["cmmlu"]["per_subject"]) == {"agronomy", "anatomy", "ancient_chinese"}
    row = cmp["speed"]["rows"][0]
    assert row["n_baseline"] == row["n_candidate"] == 6 and row["decode_ratio_ci95"][0] <= row["decode_ratio"]
    # one gap per pair of streamed chunks (a chunk may carry more than one token)
    chunks = [r["n_chunks"] for r in read_items(cands[1]) if r["task"] == "speed" and r["status"] == "ok"]
    assert row["candidate_stats"]["itl_s"]["n"] == sum(n - 1 for n in chunks) > 0
    html = (out / "report.html").read_text(encoding="utf-8")
    points = re.findall(r"<title>(llama-q8_0|llama-q4_0|engine-tiered): x=", html)
    assert sorted(points) == ["engine-tiered", "llama-q4_0", "llama-q8_0"]     # all three on the scatter

    rules = tmp_path / "rules.toml"
    # Six timed requests a side on a shared CPU: a decode-ratio interval can straddle even 0.01 (a request
    # whose tokens arrive in one burst reads a huge rate), so the speed rule may be inconclusive, which
    # on_inconclusive = "pass" lets through. The quality rules must pass and no rule may fail.
    rules.write_text("[gsm8k]\nmin_paired = 4\n[kld]\nmin_same_top_p = 0.01\n[speed]\nmin_decode_ratio = 0.01\n"
                     "[gate]\non_inconclusive = \"pass\"\n")
    gate = moebench_cli("gate", str(out), "--rules", str(rules))
    assert gate.returncode == 0, gate.stdout + gate.stderr
    for r in rows:
        checks = json.loads((out / r["compare_dir"] / "gate.json").read_text())["checks"]
        assert {c["section"] for c in checks} == {"gsm8k", "kld", "speed"}, checks
        assert all(c["verdict"] == "pass" for c in checks if c["section"] != "speed"), checks
        assert all(c["verdict"] in ("pass", "inconclusive") for c in checks if c["section"] == "speed"), checks

    trend = moebench_cli("trend", str(base), *map(str, cands), "--out", str(tmp_path / "trend"), check=True)
    data = json.loads((tmp_path / "trend" / "trend.json").read_text())
    assert [r["label"] for r in data["runs"]] == ["llama-bf16", "llama-q8_0", "llama-q4_0", "engine-tiered"]
    for figure in ("gsm8k accuracy", "cmmlu accuracy", "kld KLD mean", "decode tok/s at 128 tokens, 1 client",
                   "model size (MiB)"):
        assert figure in data["figures"], data["figures"]
    trend_html = (tmp_path / "trend" / "trend.html").read_text(encoding="utf-8")
    assert trend_html.count('<svg class="plot"') == len(data["figures"])
    assert str(tmp_path / "trend") == trend.stdout.strip().splitlines()[-1]
