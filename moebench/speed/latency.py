"""Per-request latency figures every speed reader shares: the percentile summary of a list of values
and a record's time per output token. A leaf of the speed wing: speed/compare.py (closed-loop speed),
speed/load_compare.py (open-loop serving load), speed/ab_compare.py and speed/open_loop.py build on it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Percentiles:
    """The spread of one figure over a group of requests (numpy's linear quantiles)."""

    n: int
    p25: float
    p50: float
    p75: float
    p90: float
    p99: float
    min: float
    max: float

    @staticmethod
    def of(values: list[float | None]) -> Percentiles | None:
        """Over the finite values; None where there are none."""
        vals = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=np.float64)
        if vals.size == 0:
            return None
        p25, p50, p75, p90, p99 = (float(x) for x in np.quantile(vals, [0.25, 0.5, 0.75, 0.9, 0.99]))
        return Percentiles(int(vals.size), p25, p50, p75, p90, p99, float(vals.min()), float(vals.max()))

    def to_json(self) -> dict[str, float]:
        """As compare.json writes a figure's spread: n, median, p25/p75/iqr, p50/p90/p99, min, max."""
        return {"n": self.n, "median": self.p50, "p25": self.p25, "p75": self.p75, "iqr": self.p75 - self.p25,
                "p50": self.p50, "p90": self.p90, "p99": self.p99, "min": self.min, "max": self.max}


def percentiles(values: list[float | None]) -> dict[str, float] | None:
    """Percentiles.of(values) as compare.json writes it, or None."""
    st = Percentiles.of(values)
    return st.to_json() if st is not None else None


def tpot(r: dict[str, Any]) -> float | None:
    """Seconds per output token after the first, from the record's own timing fields."""
    n, ttft, e2e = r.get("output_tokens"), r.get("ttft_s"), r.get("e2e_s")
    if not n or n < 2 or ttft is None or e2e is None:
        dec = r.get("decode_tok_s")
        return 1.0 / dec if dec else None
    t = (e2e - ttft) / (n - 1)
    return t if t > 0 else None
