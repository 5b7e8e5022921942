"""benchmarks/engine_paths_h200.py on the CPU (--small): every path gives a decode rate, the speed
suite's runs through the engine runner included."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from moebench.datasets import data_dir

REPO = Path(__file__).resolve().parent.parent


def test_every_path_is_measured_on_a_small_shape(tmp_path: Path) -> None:
    env = {**os.environ, "MOEBENCH_DATA_DIR": str(data_dir())}
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "engine_paths_h200.py"), "--small",
                           "--out", str(tmp_path), "--work", str(tmp_path / "work"), "--prompt", "32",
                           "--tokens", "8", "--reps", "1"], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    res = json.loads((tmp_path / "engine_paths.json").read_text())
    assert res["experts"] == 16 and res["prompt"] == 32 and res["tokens"] == 8
    for key in ("views", "load", "runner_probe", "runner_no_probe"):
        assert res[key] > 0, (key, res)
    items = [json.loads(line) for line in (tmp_path / "run-probe" / "items.jsonl").read_text().splitlines()]
    assert len(items) == 5 and all(r["status"] == "ok" and r["output_tokens"] == 8 for r in items)
    assert "| runner_no_probe |" in done.stdout
