"""benchmarks/tiers_h200.py's table, on the committed results of the three H100 calls of the SSD plans."""
from __future__ import annotations

import json

from conftest import REPO, load_benchmark


def test_ssd_rows_show_the_bytes_read_per_second_waited() -> None:
    """The default plan (whole reads) read 11.8 MB a token over 5.10-5.33 ms of waits in the three calls:
    2.21-2.31 GB/s, the figure docs/engine-speed.md cites beside the disk's own rates."""
    mod = load_benchmark("tiers_h200")
    calls = json.loads((REPO / "benchmarks" / "results" / "tiers_h200.json").read_text())["ssd_calls_h100"]
    rates = []
    for call in calls:
        table = mod.table({"variants": call["variants"], "errors": {}})
        rows = [line for line in table.splitlines() if line.startswith("plan_gpu_host_ssd_whole ")]
        assert len(rows) == 2                       # the wide table's row and the SSD summary's
        summary = rows[1].split()
        assert summary[1:4] == ["4", "x", "whole"]
        rates.append(float(summary[-1]))
        r = call["variants"]["plan_gpu_host_ssd_whole"]
        waited = r["counters"]["ssd_wait_s"] / r["counters"]["decode_steps"]
        assert abs(rates[-1] - r["bound"]["disk_bytes_read_per_token"] / waited / 1e9) < 0.006
    assert rates == [2.31, 2.21, 2.28]
