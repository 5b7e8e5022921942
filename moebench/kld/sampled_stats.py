"""Monte Carlo KL(baseline || candidate) from one log-prob per token, on the baseline's own samples.

Continuations x ~ p are sampled from the baseline (temperature 1, no truncation); per sampled token
the baseline's log p(x_t) and the candidate's log q(x_t) of the same token id in the same context
are known. With r = q/p, both
- "plain":        log p - log q            (E_p[-log r] = KL(p || q))
- "low-variance": (r - 1) - log r          (E_p[r] = 1, so also KL; never negative)
are unbiased for the per-token KL along the baseline's own contexts. The mean is a ratio of sums
over sequences (tokens per sequence may differ: a sample can end at EOS), its interval a percentile
bootstrap that resamples whole sequences (tokens of one sequence share their context, so they are
not independent).
"""
from __future__ import annotations

from typing import Any

import numpy as np

ESTIMATORS = ("low-variance", "plain")
CONFIDENCE = 0.95
BOOTSTRAP = 4000


def per_token(logp: np.ndarray, logq: np.ndarray, estimator: str) -> np.ndarray:
    """Per sampled token: the estimator's value from the baseline's and the candidate's log-probs."""
    lp, lq = np.asarray(logp, np.float64), np.asarray(logq, np.float64)
    if lp.shape != lq.shape:
        raise ValueError(f"baseline log-probs {lp.shape} and candidate log-probs {lq.shape} differ in shape")
    log_r = lq - lp
    if estimator == "plain":
        return -log_r
    if estimator == "low-variance":
        return np.expm1(log_r) - log_r          # (r - 1) - log r, accurate for r near 1
    raise ValueError(f"KLD estimator {estimator!r} (expected one of {', '.join(ESTIMATORS)})")


def bootstrap_interval(seq_sums: np.ndarray, seq_counts: np.ndarray, seed: int,
                       confidence: float = CONFIDENCE, n_boot: int = BOOTSTRAP) -> tuple[float, float]:
    """Percentile bootstrap interval of sum(seq_sums) / sum(seq_counts), resampling sequences."""
    sums, counts = np.asarray(seq_sums, np.float64), np.asarray(seq_counts, np.float64)
    n = sums.size
    if n < 2:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(n_boot, n))
    stats = sums[idx].sum(axis=1) / np.maximum(counts[idx].sum(axis=1), 1.0)
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(stats, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


def estimate(seqs: list[tuple[np.ndarray, np.ndarray]], seed: int = 0, estimator: str = "low-variance",
             confidence: float = CONFIDENCE, n_boot: int = BOOTSTRAP) -> dict[str, Any]:
    """The estimate from per-sequence (log p, log q) arrays of the sampled tokens: mean, interval and
    counts for `estimator`, and the other estimator's mean and interval beside it."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"KLD estimator {estimator!r} (expected one of {', '.join(ESTIMATORS)})")
    counts = np.array([np.asarray(lp).size for lp, _ in seqs], np.float64)
    n_tokens = int(counts.sum())
    out: dict[str, Any] = {"method": "sampled", "estimator": estimator, "n_tokens": n_tokens,
                           "n_sequences": len(seqs), "confidence": confidence, "bootstrap": n_boot,
                           "interval_over": "sequences"}
    by: dict[str, dict[str, Any]] = {}
    for name in ESTIMATORS:
        sums = np.array([per_token(lp, lq, name).sum() for lp, lq in seqs], np.float64)
        mean = float(sums.sum() / n_tokens) if n_tokens else float("nan")
        lo, hi = bootstrap_interval(sums, counts, seed, confidence, n_boot)
        by[name] = {"mean": mean, "interval": [lo, hi]}
    out.update(mean=by[estimator]["mean"], interval=by[estimator]["interval"])
    other = next(n for n in ESTIMATORS if n != estimator)
    out[other.replace("-", "_")] = by[other]
    lp_all = np.concatenate([np.asarray(lp, np.float64) for lp, _ in seqs]) if seqs else np.zeros(0)
    lq_all = np.concatenate([np.asarray(lq, np.float64) for _, lq in seqs]) if seqs else np.zeros(0)
    if n_tokens:
        # Along the baseline's samples: mean -log p is the baseline's own per-token entropy estimate,
        # mean -log q the candidate's cross-entropy on the same tokens.
        out["nll_base"] = float(-lp_all.mean())
        out["nll_cand"] = float(-lq_all.mean())
    return out
