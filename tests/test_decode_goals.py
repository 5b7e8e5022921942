"""benchmarks/decode_goals.py over the committed H200 results: the goals table says which goal each
figure meets, one SSD plan is enough, and missing figures count as missed."""
from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "benchmarks"))

from decode_goals import goals  # noqa: E402

BF16_BYTES = 6_083_739_648      # decode_engine.active_bytes_per_token of the Qwen3-30B-A3B shape, bf16


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


def test_the_recorded_call_misses_bf16_and_base3_only(tmp_path):
    ab, tiers = recorded()
    rows = {goal: (figures, met) for goal, figures, met in goals(ab, tiers)}
    assert not rows["bf16 >= 65% of the roofline"][1] and "64.9% of 695.3" in rows["bf16 >= 65% of the roofline"][0]
    assert not rows["int8hot_ternarycold_gpu above bf16"][1]
    assert rows["int4 above bf16"][1] and rows["int8hot_ternary2cold_host_a8 >= 70% of its bound"][1]
    assert "73.6%" in rows["int8hot_ternary2cold_host_a8 >= 70% of its bound"][0]
    assert rows["plan_gpu_host_ssd_ahead >= 60% of its bound"][1] and not rows["plan_gpu_host_ssd >= 60% of its bound"][1]
    assert "read_from_disk 41.1%" in rows["plan_gpu_host_ssd_ahead >= 60% of its bound"][0]
    out = run(tmp_path, ab, tiers)
    assert out.returncode == 1
    assert out.stdout.splitlines()[-1] == ("goals: not met: bf16 >= 65% of the roofline; "
                                           "int8hot_ternarycold_gpu above bf16")


def test_every_goal_met_exits_zero_and_missing_figures_do_not(tmp_path):
    ab, tiers = recorded()
    met = copy.deepcopy(ab)
    met["variants"]["bf16"]["tok_s"] = 0.651 * ab["bandwidth"]["roofline_tok_s"]      # 452.6 tok/s
    met["variants"]["int8hot_ternarycold_gpu"]["tok_s"] = met["variants"]["bf16"]["tok_s"] + 1
    out = run(tmp_path, met, tiers)
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "goals: all met", out.stdout
    del met["bandwidth"]["roofline_tok_s"]                 # a decode_ab file from before the roofline field
    no_ssd = copy.deepcopy(tiers)
    no_ssd["variants"] = {k: v for k, v in tiers["variants"].items() if "ssd" not in k}
    out = run(tmp_path, met, no_ssd)
    assert out.returncode == 1
    assert "missing: bf16 rate or roofline_tok_s" in out.stdout and "missing: no SSD plan" in out.stdout
