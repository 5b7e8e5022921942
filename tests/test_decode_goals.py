"""moebench.bench.goals and benchmarks/decode_goals.py over the committed H200 results: the goals
table says which goal each figure meets, one SSD plan is enough, and missing figures count as missed."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

from moebench.bench.goals import goals

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

BF16_BYTES = 6_083_739_648      # reference_model.active_bytes_per_token of the Qwen3-30B-A3B shape, bf16


def recorded() -> tuple[dict, dict]:
    ab = json.loads((RESULTS / "decode_ab_defaults.json").read_text())
    ab["bandwidth"].setdefault("roofline_tok_s", ab["bandwidth"]["copy_Bps"] / BF16_BYTES)
    return ab, json.loads((RESULTS / "tiers_h200.json").read_text())


def run(tmp_path: Path, ab: dict, tiers: dict) -> subprocess.CompletedProcess:
    (tmp_path / "ab.json").write_text(json.dumps(ab))
    (tmp_path / "tiers.json").write_text(json.dumps(tiers))
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_goals.py"), "--decode-ab",
                           str(tmp_path / "ab.json"), "--tiers", str(tmp_path / "tiers.json")],
                          capture_output=True, text=True, timeout=60)


def test_the_recorded_call_meets_every_goal(tmp_path):
    ab, tiers = recorded()
    rows = {goal: (figures, met) for goal, figures, met in goals(ab, tiers)}
    assert all(met for _, met in rows.values()), rows
    assert "65.7% of 699.9" in rows["bf16 >= 65% of the roofline"][0]
    assert "(+1.1%)" in rows["int8hot_ternarycold_gpu above bf16"][0]
    assert "75.4%" in rows["int8hot_ternary2cold_host_a8 >= 70% of its bound"][0]
    assert "read_from_disk 37.0%" in rows["plan_gpu_host_ssd >= 60% of its bound"][0]
    out = run(tmp_path, ab, tiers)
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "goals: all met", out.stdout


def test_missed_goals_and_missing_figures_exit_one(tmp_path):
    ab, tiers = recorded()
    missed = copy.deepcopy(ab)
    missed["variants"]["bf16"]["tok_s"] = 0.649 * ab["bandwidth"]["roofline_tok_s"]     # 454.2 tok/s
    missed["variants"]["int8hot_ternarycold_gpu"]["tok_s"] = missed["variants"]["bf16"]["tok_s"] - 1
    out = run(tmp_path, missed, tiers)
    assert out.returncode == 1
    assert out.stdout.splitlines()[-1] == ("goals: not met: bf16 >= 65% of the roofline; "
                                           "int8hot_ternarycold_gpu above bf16"), out.stdout
    slow_ssd = copy.deepcopy(tiers)
    for name, v in slow_ssd["variants"].items():
        if "ssd" in name:
            v["pct_of_bound"] = 59.9
    out = run(tmp_path, ab, slow_ssd)
    assert out.returncode == 1 and out.stdout.count("NOT MET") == 3, out.stdout      # every SSD plan missed
    assert out.stdout.splitlines()[-1].startswith("goals: not met: plan_gpu_host_ssd >= 60% of its bound")
    del missed["bandwidth"]["roofline_tok_s"]              # a decode_ab file from before the roofline field
    no_ssd = copy.deepcopy(tiers)
    no_ssd["variants"] = {k: v for k, v in tiers["variants"].items() if "ssd" not in k}
    out = run(tmp_path, missed, no_ssd)
    assert out.returncode == 1
    assert "missing: bf16 rate or roofline_tok_s" in out.stdout and "missing: no SSD plan" in out.stdout
