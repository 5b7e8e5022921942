"""benchmarks/tiered_prefill.py on the CPU (--small): every plan is timed by both paths, beside the
bf16 checkpoint, and the grouped path's first token and top-5 log-probs are the per-expert path's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from moebench.datasets import data_dir

REPO = Path(__file__).resolve().parent.parent


def test_both_paths_are_timed_and_agree_on_a_small_shape(tmp_path: Path) -> None:
    env = {**os.environ, "MOEBENCH_DATA_DIR": str(data_dir())}
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "tiered_prefill.py"), "--small", "--out",
                           str(tmp_path), "--prompts", "48", "--reps", "1"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    res = json.loads((tmp_path / "tiered_prefill.json").read_text())
    assert res["device"] == "cpu" and res["grouped_impl"] == "grouped_mm" and res["prompts"] == [48]
    rows = {(r["plan"], r["path"]): r for r in res["rows"]}
    assert set(rows) == {("bf16", "dense")} | {(p, path) for p in ("int8", "int4", "mixed")
                                                for path in ("per_expert", "grouped")}
    assert all(r["prefill_tok_s"] > 0 and len(r["top5"]) == 5 for r in rows.values())
    for plan in ("int8", "int4", "mixed"):
        agrees = rows[(plan, "grouped")]["agrees"]
        assert agrees["same_first"] and agrees["shared_top5"] == 5 and agrees["max_logprob_diff"] < 1e-3, agrees
    assert "| mixed | 48 |" in done.stdout
    assert not (tmp_path / "tiered-prefill-work").exists()
