"""Per-request latency figures every speed reader shares: the percentile summary of a list of values
and a record's time per output token. A leaf of the speed wing: speed/compare.py (closed-loop speed),
speed/load_compare.py (open-loop serving load), speed/ab_compare.py and speed/open_loop.py build on it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
import numpy as np

from moebench.json_types import JsonObject
from moebench.json_fields import Fields


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

    @staticmethod
    def from_json(f: Fields) -> Percentiles:
        """A stored spread (median and iqr are not read: they follow from p50, p25 and p75)."""
        return Percentiles(f.need_int("n"), f.need_num("p25"), f.need_num("p50"), f.need_num("p75"),
                           f.need_num("p90"), f.need_num("p99"), f.need_num("min"), f.need_num("max"))

    def to_json(self) -> JsonObject:
        """As compare.json writes a figure's spread: n, median, p25/p75/iqr, p50/p90/p99, min, max."""
        return {"n": self.n, "median": self.p50, "p25": self.p25, "p75": self.p75, "iqr": self.p75 - self.p25,
                "p50": self.p50, "p90": self.p90, "p99": self.p99, "min": self.min, "max": self.max}


@dataclass(frozen=True)
class RequestTimes:
    """The timing fields of one request's record that the speed readers and SLO checks judge."""

    ttft_s: float | None
    prefill_tok_s: float | None
    decode_tok_s: float | None
    e2e_s: float | None
    output_tokens: int | None

    @property
    def tpot_s(self) -> float | None:
        """Seconds per output token after the first, from the record's own timing fields."""
        n, ttft, e2e = self.output_tokens, self.ttft_s, self.e2e_s
        if not n or n < 2 or ttft is None or e2e is None:
            return 1.0 / self.decode_tok_s if self.decode_tok_s else None
        t = (e2e - ttft) / (n - 1)
        return t if t > 0 else None

    def metric(self, name: str) -> float | None:
        """One of ttft_s, prefill_tok_s, decode_tok_s, tpot_s, e2e_s by name."""
        if name == "tpot_s":
            return self.tpot_s
        if name not in _TIME_FIELDS:
            raise KeyError(f"no request metric {name!r} (one of {', '.join(_TIME_FIELDS + ('tpot_s',))})")
        value: float | None = getattr(self, name)
        return value


_TIME_FIELDS = ("ttft_s", "prefill_tok_s", "decode_tok_s", "e2e_s")
