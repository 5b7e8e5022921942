"""KL-divergence statistics exactly as llama.cpp's `llama-perplexity --kl-divergence` computes them.

Source followed: tools/perplexity/perplexity.cpp (b11434), functions `log_softmax` (the base-file
writer and the KLD reader) and `kl_divergence`:
- per token, KLD = sum over i with log p_base_i > -16 of p_base_i * (log p_base_i - log q_i)
  (truncated, not renormalised); "same top" compares argmax q with the FIRST argmax of the base
  log-probs; dp = q(tok) - p_base(tok); nll = -log q(tok), nll_base = -log p_base(tok);
- mean uncertainty sqrt((E[x^2] - mean^2)/(n-1)), 0 when n <= 10 (`mean_and_uncertainty`);
- percentiles interpolate at f*(n-1) of the sorted values; the median is the middle value(s);
- same-top uncertainty sqrt(p(1-p)/(n-1)); RMS dp from the mean of dp^2 with uncertainty
  0.5/rms * unc(dp^2); ln(PPL(Q)/PPL(base)) uncertainty uses the covariance of nll and nll_base.

Per-token values are kept as arrays (`TokenStats`), so statistics merge across chunks by concatenation
and percentiles stay exact. `summary_from_sums` covers the case where only llama's running sums exist.

Also here: the base-file log-prob codec (uint16 per vocab entry, two float32 in front) and the top-K
estimate of KLD used when a baseline keeps only its K most likely tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from moebench.json_types import JsonObject

LOG_P_FLOOR = -16.0          # llama.cpp drops base terms with log p <= -16 from the KLD sum
LADDER = (("max", 1.0), ("p999", 0.999), ("p99", 0.99), ("p95", 0.95), ("p90", 0.90), ("median", None),
          ("p10", 0.10), ("p5", 0.05), ("p1", 0.01), ("p01", 0.001), ("min", 0.0))
DP_LADDER = (("max", 1.0), ("p999", 0.999), ("p99", 0.99), ("p95", 0.95), ("p90", 0.90), ("p75", 0.75),
             ("median", None), ("p25", 0.25), ("p10", 0.10), ("p5", 0.05), ("p1", 0.01), ("p01", 0.001),
             ("min", 0.0))
MIN_TOKENS_FOR_LADDER = 100  # llama.cpp prints no final statistics below this many tokens


# ---- llama.cpp's base-file log-prob codec ---------------------------------------------------------

def row_width(n_vocab: int) -> int:
    """uint16 values per scored token in a llama.cpp base file: two float32, then one per vocab entry."""
    return 2 * ((n_vocab + 1) // 2) + 4


def encode_logprobs(logits: np.ndarray) -> np.ndarray:
    """[n, vocab] logits -> [n, row_width] uint16 rows, as llama.cpp's base-file writer does (float32)."""
    logits = np.asarray(logits, dtype=np.float32)
    n, v = logits.shape
    out = np.zeros((n, row_width(v)), dtype=np.uint16)
    mx = logits.max(axis=1)
    mn = np.maximum(logits.min(axis=1), mx - np.float32(16))
    lse = np.log(np.exp((logits - mx[:, None]).astype(np.float64)).sum(axis=1)).astype(np.float32)
    min_log_prob = (mn - mx - lse).astype(np.float32)
    scale = ((mx - mn) / np.float32(65535)).astype(np.float32)
    head = np.stack([scale, min_log_prob], axis=1).astype(np.float32).view(np.uint16)   # [n, 4]
    out[:, :4] = head
    safe = np.where(scale > 0, scale, np.float32(1))
    inv = (np.float32(1) / safe).astype(np.float32)
    q = np.rint(inv[:, None] * (logits - mn[:, None])).astype(np.int64)   # rint: round half to even, as nearest_int
    q = np.where(logits > mn[:, None], np.clip(q, 0, 65535), 0)
    q[scale == 0] = 0
    out[:, 4:4 + v] = q.astype(np.uint16)
    return out


def decode_logprobs(rows: np.ndarray, n_vocab: int) -> np.ndarray:
    """[n, row_width] uint16 rows -> [n, vocab] float32 log-probs (scale * q + min_log_prob)."""
    rows = np.ascontiguousarray(rows, dtype=np.uint16)
    if rows.ndim != 2 or rows.shape[1] != row_width(n_vocab):
        raise ValueError(f"log-prob rows have shape {rows.shape}, expected [n, {row_width(n_vocab)}] "
                         f"for a vocabulary of {n_vocab}")
    head = rows[:, :4].copy().view(np.float32)          # [n, 2]: scale, min_log_prob
    scale, min_lp = head[:, 0], head[:, 1]
    return (scale[:, None] * rows[:, 4:4 + n_vocab].astype(np.float32) + min_lp[:, None]).astype(np.float32)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    mx = x.max(axis=-1, keepdims=True)
    return (x - mx - np.log(np.exp(x - mx).sum(axis=-1, keepdims=True))).astype(np.float64)


# ---- per-token values ------------------------------------------------------------------------------

@dataclass
class TokenStats:
    """Per scored token: kld, dp (q(tok) - p(tok)), same_top (bool), nll (candidate), nll_base."""

    kld: np.ndarray = field(default_factory=lambda: np.zeros(0))
    p_diff: np.ndarray = field(default_factory=lambda: np.zeros(0))
    same_top: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    nll: np.ndarray = field(default_factory=lambda: np.zeros(0))
    nll_base: np.ndarray = field(default_factory=lambda: np.zeros(0))

    @property
    def n(self) -> int:
        return int(self.kld.size)

    @staticmethod
    def concat(parts: list["TokenStats"]) -> "TokenStats":
        if not parts:
            return TokenStats()
        return TokenStats(*(np.concatenate([getattr(p, f) for p in parts])
                            for f in ("kld", "p_diff", "same_top", "nll", "nll_base")))

    def arrays(self) -> dict[str, np.ndarray]:
        return {"kld": self.kld.astype(np.float32), "p_diff": self.p_diff.astype(np.float32),
                "same_top": self.same_top.astype(bool), "nll": self.nll.astype(np.float32),
                "nll_base": self.nll_base.astype(np.float32)}

    @staticmethod
    def from_arrays(d: Any) -> "TokenStats":
        return TokenStats(np.asarray(d["kld"], np.float64), np.asarray(d["p_diff"], np.float64),
                          np.asarray(d["same_top"], bool), np.asarray(d["nll"], np.float64),
                          np.asarray(d["nll_base"], np.float64))

    def sums(self) -> "TokenSums":
        """llama.cpp's running sums (kl_divergence_result)."""
        k, d, a, b = self.kld, self.p_diff, self.nll, self.nll_base
        return TokenSums(count=self.n, sum_kld=float(k.sum()), sum_kld2=float((k * k).sum()),
                         sum_p_diff=float(d.sum()), sum_p_diff2=float((d * d).sum()),
                         sum_p_diff4=float((d ** 4).sum()),
                         max_p_diff=float(np.abs(d).max()) if self.n else 0.0,
                         n_same_top=int(self.same_top.sum()), sum_nll=float(a.sum()), sum_nll2=float((a * a).sum()),
                         sum_nll_base=float(b.sum()), sum_nll_base2=float((b * b).sum()),
                         sum_nll_nll_base=float((a * b).sum()))


@dataclass(frozen=True)
class TokenSums:
    """llama.cpp's running sums over a set of tokens (kl_divergence_result in perplexity.cpp): all the
    means and uncertainties it prints follow from them. A chunk record keeps them as `sums`."""

    count: int
    sum_kld: float
    sum_kld2: float
    sum_p_diff: float
    sum_p_diff2: float
    sum_p_diff4: float
    max_p_diff: float
    n_same_top: int
    sum_nll: float
    sum_nll2: float
    sum_nll_base: float
    sum_nll_base2: float
    sum_nll_nll_base: float

    def to_json(self) -> dict[str, float]:
        """The record's `sums` object, keys in this order."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


def full_kld(base_logp: np.ndarray, cand_logits: np.ndarray, next_tokens: np.ndarray,
             cand_is_logp: bool = False) -> TokenStats:
    """Per-token statistics of a candidate's full logits against a base's full log-probs (llama's formula).

    base_logp [n, V]: the base log-probs (decoded from a base file, or exact); cand_logits [n, V]:
    the candidate's raw logits (any offset); next_tokens [n]: the token each position predicts.
    cand_is_logp: the candidate rows are already log-probs (decoded from a base file): they are used as
    they are, since renormalising coded rows moves each by its coding error (on the zoo's Q8_0 that
    added 12% to a mean KLD of 0.00024).
    """
    base_logp = np.asarray(base_logp, dtype=np.float64)
    if base_logp.shape != cand_logits.shape:
        raise ValueError(f"base log-probs {base_logp.shape} and candidate logits {tuple(cand_logits.shape)} differ: "
                         "vocabularies or positions do not match")
    q = np.asarray(cand_logits, dtype=np.float64) if cand_is_logp else log_softmax(cand_logits)
    n = base_logp.shape[0]
    rows = np.arange(n)
    mask = base_logp > LOG_P_FLOOR
    p = np.exp(np.where(mask, base_logp, -np.inf))
    kld = (p * np.where(mask, base_logp - q, 0.0)).sum(axis=1)
    same = np.argmax(np.asarray(cand_logits), axis=1) == np.argmax(base_logp, axis=1)
    nll, nll_base = -q[rows, next_tokens], -base_logp[rows, next_tokens]
    return TokenStats(kld, np.exp(-nll) - np.exp(-nll_base), same, nll, nll_base)


def topk_kld(top_ids: np.ndarray, top_logp: np.ndarray, tail_logp: np.ndarray, cand_logits: np.ndarray,
             next_tokens: np.ndarray, next_logp_base: np.ndarray, k: int | None = None) -> TokenStats:
    """Per-token statistics from a baseline that kept only its top-K tokens (sorted, most likely first).

    KLD estimate = sum over the K kept tokens (log p > -16, as llama.cpp) of p (log p - log q), plus
    one term for the lumped rest: p_rest (log p_rest - log q_rest). The lumped term makes it a lower
    bound of the full KLD (log-sum inequality) that tightens as K grows. `k` < stored K uses the first
    k columns, moving the dropped columns' mass into the rest.
    """
    top_ids = np.asarray(top_ids)
    top_logp = np.asarray(top_logp, dtype=np.float64)
    tail_p = np.exp(np.asarray(tail_logp, dtype=np.float64))
    # float16 log-probs are off by up to ~|log p| * 2^-11; rescale the kept probabilities so they and
    # the exactly stored rest sum to one: the estimate is then a true KLD of two lumped distributions
    # (never negative) and the float16 error enters only to second order.
    kept = np.exp(top_logp).sum(axis=1)
    top_logp = top_logp + (np.log(np.clip(1.0 - tail_p, 1e-300, None)) - np.log(kept))[:, None]
    if k is not None and k < top_ids.shape[1]:
        tail_p = tail_p + np.exp(top_logp[:, k:]).sum(axis=1)
        top_ids, top_logp = top_ids[:, :k], top_logp[:, :k]
    q = log_softmax(cand_logits)
    n = q.shape[0]
    rows = np.arange(n)
    q_top = q[rows[:, None], top_ids]
    mask = top_logp > LOG_P_FLOOR
    kld = (np.exp(top_logp) * np.where(mask, top_logp - q_top, 0.0)).sum(axis=1)
    q_rest = np.clip(1.0 - np.exp(q_top).sum(axis=1), 1e-30, None)
    with np.errstate(divide="ignore", invalid="ignore"):
        rest = np.where((tail_p > 0) & (np.log(np.maximum(tail_p, 1e-300)) > LOG_P_FLOOR),
                        tail_p * (np.log(np.maximum(tail_p, 1e-300)) - np.log(q_rest)), 0.0)
    kld = kld + rest
    same = np.argmax(np.asarray(cand_logits), axis=1) == top_ids[:, 0]
    nll, nll_base = -q[rows, next_tokens], -np.asarray(next_logp_base, dtype=np.float64)
    return TokenStats(kld, np.exp(-nll) - np.exp(-nll_base), same, nll, nll_base)


def sparse_kld(top_ids: np.ndarray, top_logp: np.ndarray, tail_logp: np.ndarray, next_logp_base: np.ndarray,
               cand: list[dict[int, float]], cand_next_logp: np.ndarray, k: int | None = None) -> TokenStats:
    """Per-token statistics when the candidate, too, gave only some log-probs per position (a server's
    top-K prompt log-probs, or its log-probs of the baseline's top-K ids where it can score fixed ids).

    The estimate lumps the vocabulary into bins: each baseline top-K token whose candidate log-prob
    is known, plus one bin for everything else (its candidate mass is one minus the known ones). A
    KLD between lumped distributions never exceeds the full one (log-sum inequality), so this is a
    LOWER BOUND; it is exact when the candidate knows every baseline token above llama.cpp's
    log p > -16 floor and the rest is negligible. Same top p and Δp need only each side's top token
    and the actual token's log-prob, which both sides return: they are exact.
    """
    top_ids = np.asarray(top_ids, dtype=np.int64)
    top_logp = np.asarray(top_logp, dtype=np.float64)
    tail_p = np.exp(np.asarray(tail_logp, dtype=np.float64))
    kept = np.exp(top_logp).sum(axis=1)                       # float16 rescale, as in topk_kld
    top_logp = top_logp + (np.log(np.clip(1.0 - tail_p, 1e-300, None)) - np.log(kept))[:, None]
    if k is not None and k < top_ids.shape[1]:
        top_ids, top_logp = top_ids[:, :k], top_logp[:, :k]
    n = top_ids.shape[0]
    if len(cand) != n:
        raise ValueError(f"candidate log-probs cover {len(cand)} positions, the baseline {n}")
    kld = np.zeros(n)
    same = np.zeros(n, dtype=bool)
    for i in range(n):
        row = cand[i]
        q = np.array([row.get(int(t), np.nan) for t in top_ids[i]])
        known = ~np.isnan(q)
        p_known = np.exp(top_logp[i][known])
        lp_known = top_logp[i][known]
        mask = lp_known > LOG_P_FLOOR
        term = float((p_known * np.where(mask, lp_known - q[known], 0.0)).sum())
        p_rest = max(0.0, 1.0 - float(p_known.sum()))
        q_rest = max(1e-30, 1.0 - float(np.exp(q[known]).sum()))
        if p_rest > 0 and np.log(p_rest) > LOG_P_FLOOR:
            term += p_rest * (np.log(p_rest) - np.log(q_rest))
        kld[i] = max(term, 0.0) if abs(term) < 1e-12 else term
        same[i] = bool(row) and max(row, key=row.get) == int(top_ids[i, 0])
    nll, nll_base = -np.asarray(cand_next_logp, np.float64), -np.asarray(next_logp_base, np.float64)
    return TokenStats(kld, np.exp(-nll) - np.exp(-nll_base), same, nll, nll_base)


# ---- statistics -----------------------------------------------------------------------------------

def mean_and_uncertainty(total: float, total2: float, count: int) -> tuple[float, float]:
    if count < 1:
        return 0.0, 0.0
    f = total / count
    df = total2 / count - f * f
    return f, (math.sqrt(df / (count - 1)) if df > 0 and count > 10 else 0.0)


def _covariance(suma: float, sumb: float, sumab: float, count: int) -> float:
    if count < 10:
        return 0.0
    return (sumab / count - (suma / count) * (sumb / count)) / (count - 1)


def percentile(sorted_values: np.ndarray, fraction: float) -> float:
    """llama.cpp's percentile: linear interpolation at fraction * (n - 1) of the sorted values."""
    v = sorted_values
    if fraction <= 0:
        return float(v[0])
    if fraction >= 1:
        return float(v[-1])
    p = np.float32(fraction) * (v.size - 1)      # llama.cpp computes the position in float
    ip = int(p)
    p -= ip
    return float((1 - p) * v[ip] + p * v[min(ip + 1, v.size - 1)])


def _median(sorted_values: np.ndarray) -> float:
    n = sorted_values.size
    return float(0.5 * (sorted_values[n // 2] + sorted_values[n // 2 - 1]) if n % 2 == 0 else sorted_values[n // 2])


def _ladder(values: np.ndarray, ladder) -> dict[str, float]:
    v = np.sort(np.asarray(values, dtype=np.float32))   # llama.cpp sorts float32 values
    return {name: (_median(v) if frac is None else percentile(v, frac)) for name, frac in ladder}


@dataclass(frozen=True)
class DeltaP:
    """q(tok) - p_base(tok) over the scored tokens: mean and RMS with their uncertainties, the largest
    magnitude, and (from per-token values) the DP_LADDER percentiles by name."""

    mean: float
    mean_err: float
    rms: float
    rms_err: float
    max_abs: float
    ladder: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> JsonObject:
        return {"mean": self.mean, "mean_err": self.mean_err, "rms": self.rms, "rms_err": self.rms_err,
                "max_abs": self.max_abs, **self.ladder}


@dataclass(frozen=True)
class SumFigures:
    """The means and uncertainties llama.cpp prints, from its running sums (at least one token)."""

    mean: float
    mean_err: float
    same_top_p: float
    same_top_p_err: float
    ppl: float
    ppl_err: float
    ppl_base: float
    ppl_base_err: float
    ln_ppl_ratio: float
    ln_ppl_ratio_err: float
    ppl_ratio: float
    ppl_ratio_err: float
    ppl_diff: float
    cor_ln_ppl: float | None
    delta_p: DeltaP

    def to_json(self) -> JsonObject:
        return {"mean": self.mean, "mean_err": self.mean_err, "same_top_p": self.same_top_p,
                "same_top_p_err": self.same_top_p_err, "ppl": self.ppl, "ppl_err": self.ppl_err,
                "ppl_base": self.ppl_base, "ppl_base_err": self.ppl_base_err, "ln_ppl_ratio": self.ln_ppl_ratio,
                "ln_ppl_ratio_err": self.ln_ppl_ratio_err, "ppl_ratio": self.ppl_ratio,
                "ppl_ratio_err": self.ppl_ratio_err, "ppl_diff": self.ppl_diff, "cor_ln_ppl": self.cor_ln_ppl,
                "delta_p": self.delta_p.to_json()}


@dataclass(frozen=True)
class Histogram:
    """Per-token KLD in log-spaced bins (`edges` one longer than `counts`); `below_lo` tokens fell
    under the first edge and are counted in the first bin."""

    edges: list[float]
    counts: list[int]
    below_lo: int

    def to_json(self) -> JsonObject:
        return {"edges": self.edges, "counts": self.counts, "below_lo": self.below_lo}


@dataclass(frozen=True)
class KldSummary:
    """All KLD statistics of a set of tokens (compare.json["kld"]'s figures): the sums' figures where
    any token was scored, and from per-token values the LADDER percentiles by name, the histogram,
    whether there are enough tokens for the ladder, and each chunk's mean where chunks were given."""

    n_tokens: int
    figures: SumFigures | None = None
    ladder: dict[str, float] = field(default_factory=dict)
    histogram: Histogram | None = None
    ladder_reliable: bool | None = None
    per_chunk: list[float | None] | None = None

    def to_json(self) -> JsonObject:
        out: JsonObject = {"n_tokens": self.n_tokens}
        if self.figures is None:
            return out
        out.update(self.figures.to_json())
        out.update(self.ladder)
        if self.histogram is not None:
            out["histogram"] = self.histogram.to_json()
        if self.ladder_reliable is not None:
            out["ladder_reliable"] = self.ladder_reliable
        if self.per_chunk is not None:
            out["per_chunk"] = self.per_chunk
        return out


def summary_from_sums(s: TokenSums) -> KldSummary:
    """The means and uncertainties llama.cpp prints, from its running sums."""
    n = int(s.count)
    if n == 0:
        return KldSummary(n_tokens=n)
    log_ppl = mean_and_uncertainty(s.sum_nll, s.sum_nll2, n)
    log_ppl_base = mean_and_uncertainty(s.sum_nll_base, s.sum_nll_base2, n)
    cov = _covariance(s.sum_nll, s.sum_nll_base, s.sum_nll_nll_base, n)
    ratio = log_ppl[0] - log_ppl_base[0]
    ratio_unc = math.sqrt(max(0.0, log_ppl[1] ** 2 + log_ppl_base[1] ** 2 - 2 * cov))
    kl = mean_and_uncertainty(s.sum_kld, s.sum_kld2, n)
    dp = mean_and_uncertainty(s.sum_p_diff, s.sum_p_diff2, n)
    mse = mean_and_uncertainty(s.sum_p_diff2, s.sum_p_diff4, n)
    rms = math.sqrt(mse[0])
    same = s.n_same_top / n
    ppl, ppl_base = math.exp(log_ppl[0]), math.exp(log_ppl_base[0])
    return KldSummary(n_tokens=n, figures=SumFigures(
        mean=kl[0], mean_err=kl[1],
        same_top_p=same, same_top_p_err=math.sqrt(same * (1 - same) / (n - 1)) if n > 1 else 0.0,
        ppl=ppl, ppl_err=ppl * log_ppl[1], ppl_base=ppl_base, ppl_base_err=ppl_base * log_ppl_base[1],
        ln_ppl_ratio=ratio, ln_ppl_ratio_err=ratio_unc,
        ppl_ratio=math.exp(ratio), ppl_ratio_err=math.exp(ratio) * ratio_unc,
        ppl_diff=ppl - ppl_base,
        cor_ln_ppl=(cov / (log_ppl[1] * log_ppl_base[1])) if log_ppl[1] and log_ppl_base[1] else None,
        delta_p=DeltaP(mean=dp[0], mean_err=dp[1], rms=rms, rms_err=(0.5 / rms * mse[1]) if rms > 0 else 0.0,
                       max_abs=s.max_p_diff)))


def histogram(kld: np.ndarray, lo: float = 1e-6, hi: float = 100.0, per_decade: int = 4) -> Histogram:
    """Log-spaced bins from lo to hi; values below lo fall in the first bin, above hi in the last."""
    n_bins = int(round(math.log10(hi / lo) * per_decade))
    edges = np.logspace(math.log10(lo), math.log10(hi), n_bins + 1)
    counts, _ = np.histogram(np.clip(np.asarray(kld, dtype=np.float64), lo, hi), bins=edges)
    return Histogram(edges=[float(e) for e in edges], counts=[int(c) for c in counts],
                     below_lo=int((np.asarray(kld) < lo).sum()))


def summarize(ts: TokenStats, per_chunk: list[TokenStats] | None = None) -> KldSummary:
    """All KLD statistics of a set of tokens, keyed as compare.json["kld"] expects."""
    sums = summary_from_sums(ts.sums())
    if ts.n == 0 or sums.figures is None:
        return sums
    figures = replace(sums.figures, delta_p=replace(sums.figures.delta_p, ladder=_ladder(ts.p_diff, DP_LADDER)))
    return KldSummary(n_tokens=sums.n_tokens, figures=figures, ladder=_ladder(ts.kld, LADDER),
                      histogram=histogram(ts.kld), ladder_reliable=ts.n >= MIN_TOKENS_FOR_LADDER,
                      per_chunk=None if per_chunk is None else [float(c.kld.mean()) if c.n else None
                                                                for c in per_chunk])
