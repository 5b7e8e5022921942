"""Paired statistics for per-item comparisons (DESIGN.md section 6)."""
from __future__ import annotations

import math
import random
from typing import Sequence


def mcnemar_exact_p(wins: int, losses: int) -> float:
    """Exact two-sided McNemar test: binomial test of `wins` against wins + losses at p = 0.5.

    Doubles the smaller tail (capped at 1), the usual exact two-sided form; 1.0 when there are no flips.
    """
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    # P(X <= k) for X ~ Binomial(n, 0.5), summed in log space to stay exact-ish for large n.
    log_half_n = -n * math.log(2.0)
    tail = 0.0
    for i in range(k + 1):
        tail += math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + log_half_n)
    return min(1.0, 2.0 * tail)


def paired_bootstrap_ci(base: Sequence[bool], cand: Sequence[bool], n_boot: int = 2000,
                        seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap CI of mean(cand) - mean(base), resampling item pairs together."""
    n = len(base)
    if n != len(cand):
        raise ValueError("paired samples differ in length")
    if n == 0:
        return (0.0, 0.0)
    diffs = [int(c) - int(b) for b, c in zip(base, cand)]
    rng = random.Random(seed)
    means = []
    for _ in range(n_boot):
        s = 0
        for _ in range(n):
            s += diffs[rng.randrange(n)]
        means.append(s / n)
    means.sort()
    lo_q = (1.0 - level) / 2.0
    return (_quantile(means, lo_q), _quantile(means, 1.0 - lo_q))


def wilson_ci(correct: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval for an accuracy."""
    if n == 0:
        return (0.0, 0.0)
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation at q * (n - 1), as numpy's default and llama-perplexity do."""
    n = len(sorted_values)
    if n == 1:
        return float(sorted_values[0])
    pos = q * (n - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, n - 1)
    frac = pos - lo
    return float(sorted_values[lo] * (1 - frac) + sorted_values[hi] * frac)
