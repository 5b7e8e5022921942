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

from dataclasses import dataclass

import numpy as np

from moebench.json_types import JsonObject

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


@dataclass(frozen=True)
class Interval:
    """One estimator's mean per token and its bootstrap interval [low, high]."""

    mean: float
    interval: tuple[float, float]

    def to_json(self) -> JsonObject:
        return {"mean": self.mean, "interval": list(self.interval)}


@dataclass(frozen=True)
class SampledEstimate:
    """The sampled KLD of a set of sequences: the headline `estimator`'s mean and interval, the other
    estimator's beside it, and along the baseline's samples the mean -log p (`nll_base`) and -log q
    (`nll_cand`) where any token was sampled."""

    estimator: str
    n_tokens: int
    n_sequences: int
    confidence: float
    bootstrap: int
    headline: Interval
    other: Interval
    nll_base: float | None = None
    nll_cand: float | None = None

    @property
    def mean(self) -> float:
        return self.headline.mean

    @property
    def interval(self) -> tuple[float, float]:
        return self.headline.interval

    def to_json(self) -> JsonObject:
        other = next(n for n in ESTIMATORS if n != self.estimator)
        out: JsonObject = {"method": "sampled", "estimator": self.estimator, "n_tokens": self.n_tokens,
                           "n_sequences": self.n_sequences, "confidence": self.confidence,
                           "bootstrap": self.bootstrap, "interval_over": "sequences", "mean": self.headline.mean,
                           "interval": list(self.headline.interval), other.replace("-", "_"): self.other.to_json()}
        if self.nll_base is not None:
            out["nll_base"] = self.nll_base
            out["nll_cand"] = self.nll_cand
        return out


def estimate(seqs: list[tuple[np.ndarray, np.ndarray]], seed: int = 0, estimator: str = "low-variance",
             confidence: float = CONFIDENCE, n_boot: int = BOOTSTRAP) -> SampledEstimate:
    """The estimate from per-sequence (log p, log q) arrays of the sampled tokens: mean, interval and
    counts for `estimator`, and the other estimator's mean and interval beside it."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"KLD estimator {estimator!r} (expected one of {', '.join(ESTIMATORS)})")
    counts = np.array([np.asarray(lp).size for lp, _ in seqs], np.float64)
    n_tokens = int(counts.sum())
    by: dict[str, Interval] = {}
    for name in ESTIMATORS:
        sums = np.array([per_token(lp, lq, name).sum() for lp, lq in seqs], np.float64)
        mean = float(sums.sum() / n_tokens) if n_tokens else float("nan")
        by[name] = Interval(mean, bootstrap_interval(sums, counts, seed, confidence, n_boot))
    other = next(n for n in ESTIMATORS if n != estimator)
    nll_base = nll_cand = None
    if n_tokens:
        # Along the baseline's samples: mean -log p is the baseline's own per-token entropy estimate,
        # mean -log q the candidate's cross-entropy on the same tokens.
        nll_base = float(-np.concatenate([np.asarray(lp, np.float64) for lp, _ in seqs]).mean())
        nll_cand = float(-np.concatenate([np.asarray(lq, np.float64) for _, lq in seqs]).mean())
    return SampledEstimate(estimator=estimator, n_tokens=n_tokens, n_sequences=len(seqs), confidence=confidence,
                           bootstrap=n_boot, headline=by[estimator], other=by[other], nll_base=nll_base,
                           nll_cand=nll_cand)
