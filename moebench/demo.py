"""The demo's model work: calibrate the zoo's tiny MoE on real text, plan and pack a tiered candidate
(hot experts int8 on the compute device, cold experts ternary in host RAM). `api.demo` runs the
smoke suite on both with the engine runner, compares them and writes the report.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

from moebench.datasets import data_dir, data_file, read_text

ZOO = Path("models/zoo")
CALIBRATION_TOKENS = 16384      # from the haystack (War and Peace), never from the KLD corpus
CALIBRATION_SEQ = 512


def calibration_batches(engine, n_tokens: int = CALIBRATION_TOKENS, seq: int = CALIBRATION_SEQ) -> list[list[int]]:
    """Token sequences from the middle of the haystack text."""
    text = read_text(data_file(data_dir(), "haystack/war_and_peace.txt"))
    start = len(text) // 2
    ids = engine.tokenize(text[start:start + n_tokens * 8])[:n_tokens]
    return [ids[i:i + seq] for i in range(0, len(ids) - seq + 1, seq)]


def calibrate_zoo(checkpoint: Path, n_tokens: int = CALIBRATION_TOKENS):
    """Expert usage and input statistics of the BF16 checkpoint on the haystack text."""
    from moebench.engine import Engine
    from moebench.engine.tiering import calibrate
    engine = Engine.load(checkpoint, device="cpu", dtype="float32")
    return calibrate(engine, calibration_batches(engine, n_tokens))


def pack_tiered(checkpoint: Path, out_dir: Path, hot_fraction: float = 0.25, hot: str = "int8",
                cold: str = "ternary", cold_home: str = "host", log=print, stats=None) -> Path:
    """calibrate -> plan -> pack, with the calibration statistics and plan kept beside the artifact."""
    from moebench.engine.tiering import pack, plan_hot_cold
    t0 = time.perf_counter()
    stats = stats if stats is not None else calibrate_zoo(checkpoint)
    plan = plan_hot_cold(stats, hot_fraction=hot_fraction, hot=hot, cold=cold, cold_home=cold_home)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    pack(checkpoint, plan, out_dir)
    stats.save(out_dir / "calibration.pt")
    counts = plan.count() if hasattr(plan, "count") else {}
    log(f"tiered: calibrated on {int(stats.tokens)} tokens, plan {counts}, packed to {out_dir} "
        f"in {time.perf_counter() - t0:.1f}s")
    return out_dir


def _fresh(run_dir: Path) -> Path:
    """The demo always measures anew: remove an earlier demo run (only if it is a moebench run)."""
    if (run_dir / "manifest.json").is_file():
        shutil.rmtree(run_dir)
    return run_dir
