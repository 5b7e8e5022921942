"""Paired statistics for per-item comparisons (docs/design.md section 6)."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np


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
    """Percentile bootstrap CI of mean(cand) - mean(base), resampling item pairs together.

    A paired difference takes only the values -1, 0 and 1, so a resample of n pairs is fully
    described by how many of each it drew: one multinomial draw per replicate gives exactly the
    distribution of resampling indices, in O(n_boot) instead of O(n_boot * n).
    """
    n = len(base)
    if n != len(cand):
        raise ValueError("paired samples differ in length")
    if n == 0:
        return (0.0, 0.0)
    diffs = np.asarray(cand, dtype=np.int8).astype(np.int64) - np.asarray(base, dtype=np.int8)
    means = bootstrap_means(diffs, n_boot=n_boot, seed=seed)
    return percentile_interval(means, level)


def bootstrap_means(values: Sequence[float] | np.ndarray, n_boot: int = 2000, seed: int = 0) -> np.ndarray:
    """`n_boot` bootstrap replicates of the mean of `values` (vectorised).

    Few distinct values (paired correctness): multinomial counts over the distinct values, exact.
    Many: index resampling in blocks that keep memory near 32 MiB.
    """
    x = np.asarray(values, dtype=np.float64)
    n = x.size
    rng = np.random.default_rng(seed)
    distinct, counts = np.unique(x, return_counts=True)
    if distinct.size <= 64:
        draws = rng.multinomial(n, counts / n, size=n_boot)
        return draws @ distinct / n
    out = np.empty(n_boot)
    block = max(1, (1 << 22) // max(n, 1))
    for start in range(0, n_boot, block):
        stop = min(n_boot, start + block)
        idx = rng.integers(0, n, size=(stop - start, n))
        out[start:stop] = x[idx].mean(axis=1)
    return out


def bootstrap_ratio_ci(base: Sequence[float], cand: Sequence[float], stat: str = "median",
                       n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> tuple[float, float] | None:
    """Percentile bootstrap CI of stat(cand) / stat(base) for two independent samples.

    Each side is resampled on its own (the runs measured different requests); `stat` is "median"
    or "mean". None when either side is empty or a replicate of the baseline is not positive.
    """
    b = np.asarray([v for v in base if v is not None and math.isfinite(v)], dtype=np.float64)
    c = np.asarray([v for v in cand if v is not None and math.isfinite(v)], dtype=np.float64)
    if b.size == 0 or c.size == 0:
        return None
    rng = np.random.default_rng(seed)
    f = np.median if stat == "median" else np.mean
    rb = f(b[rng.integers(0, b.size, size=(n_boot, b.size))], axis=1)
    rc = f(c[rng.integers(0, c.size, size=(n_boot, c.size))], axis=1)
    if np.any(rb <= 0):
        return None
    return percentile_interval(rc / rb, level)


def bootstrap_paired_ratio_ci(ratios: Sequence[float], n_boot: int = 2000, seed: int = 0,
                              level: float = 0.95) -> tuple[float, float] | None:
    """Percentile bootstrap CI of the median of paired ratios (same prompt, two builds: A/B)."""
    r = np.asarray([v for v in ratios if v is not None and math.isfinite(v) and v > 0], dtype=np.float64)
    if r.size == 0:
        return None
    rng = np.random.default_rng(seed)
    meds = np.median(r[rng.integers(0, r.size, size=(n_boot, r.size))], axis=1)
    return percentile_interval(meds, level)


def percentile_interval(replicates: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    """The central `level` interval of bootstrap replicates (linear interpolation, numpy's default)."""
    lo_q = (1.0 - level) / 2.0
    lo, hi = np.quantile(replicates, [lo_q, 1.0 - lo_q])
    return (float(lo), float(hi))


def holm_adjust(pvalues: Sequence[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values, in the input order.

    Sorted ascending, p_(i) becomes max over j <= i of min(1, (m - j + 1) * p_(j)) (1-based j):
    comparing the adjusted p with alpha controls the family-wise error rate over all m tests.
    """
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * float(pvalues[i])))
        adjusted[i] = running
    return adjusted


def wilson_ci(correct: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval for an accuracy."""
    if n == 0:
        return (0.0, 0.0)
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))
