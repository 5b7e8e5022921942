"""Per-request latency figures every speed reader shares: the percentile summary of a list of values
and a record's time per output token. A leaf of the speed wing: speed/compare.py (closed-loop speed),
speed/load_compare.py (open-loop serving load), speed/ab_compare.py and speed/open_loop.py build on it.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np


def percentiles(values: list[float]) -> dict[str, Any] | None:
    """n, median, p25/p75/iqr, p50/p90/p99, min, max of the finite values (numpy's linear quantiles)."""
    vals = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=np.float64)
    if vals.size == 0:
        return None
    p25, p50, p75, p90, p99 = (float(x) for x in np.quantile(vals, [0.25, 0.5, 0.75, 0.9, 0.99]))
    return {"n": int(vals.size), "median": p50, "p25": p25, "p75": p75, "iqr": p75 - p25,
            "p50": p50, "p90": p90, "p99": p99, "min": float(vals.min()), "max": float(vals.max())}


def tpot(r: dict[str, Any]) -> float | None:
    """Seconds per output token after the first, from the record's own timing fields."""
    n, ttft, e2e = r.get("output_tokens"), r.get("ttft_s"), r.get("e2e_s")
    if not n or n < 2 or ttft is None or e2e is None:
        dec = r.get("decode_tok_s")
        return 1.0 / dec if dec else None
    t = (e2e - ttft) / (n - 1)
    return t if t > 0 else None
