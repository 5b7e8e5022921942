"""Speed statistics from stored speed records: percentiles per prompt length and client count, and the
candidate/baseline ratios with bootstrap intervals for compare.json["speed"]. Reads the store only.

Per request (a speed record): ttft_s, prefill_tok_s, decode_tok_s, e2e_s (last token's arrival),
tpot_s = (e2e_s - ttft_s) / (output_tokens - 1), the time per output token after the first.
Per token: itl_s, the inter-token latency, the gaps between consecutive streamed chunks after the
first (from speed_token_times.jsonl beside items.jsonl; a chunk may hold more than one token).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moebench.scoring.stats import bootstrap_ratio_ci
from moebench.speed.latency import percentiles, tpot
from moebench.speed.load_compare import load_compare

METRICS = ("ttft_s", "prefill_tok_s", "decode_tok_s", "tpot_s", "e2e_s")
# compare row name of each metric: rows keep the short names of compare.json's first version
RATIO_NAMES = {"ttft_s": "ttft", "prefill_tok_s": "prefill", "decode_tok_s": "decode", "tpot_s": "tpot",
               "e2e_s": "e2e", "itl_s": "itl"}
# for these a larger candidate/baseline ratio is better; for the latencies a smaller one
HIGHER_IS_BETTER = {"prefill_tok_s", "decode_tok_s"}
TOKEN_TIMES_FILE = "speed_token_times.jsonl"


def _value(r: dict[str, Any], metric: str) -> float | None:
    return tpot(r) if metric == "tpot_s" else r.get(metric)


def read_token_times(run_dir: str | Path) -> dict[str, list[float]]:
    """item_id -> token arrival times (s from the request start); the last line per item wins (resume)."""
    path = Path(run_dir) / TOKEN_TIMES_FILE
    out: dict[str, list[float]] = {}
    if not path.is_file():
        return out
    lines = path.read_text(encoding="utf-8").splitlines()
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):
                break            # a torn last line, as items.jsonl
            raise ValueError(f"{path}: line {n} is not valid JSON") from None
        if isinstance(row, dict) and isinstance(row.get("token_times"), list):
            out[str(row.get("item_id"))] = [float(t) for t in row["token_times"]]
    return out


def _gaps(times: list[float] | None) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])] if times and len(times) > 1 else []


def _groups(records: list[dict[str, Any]]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in records:
        if r.get("status", "ok") != "ok" or r.get("ttft_s") is None or r.get("rate") is not None:
            continue             # open-loop records (a request rate) are load_compare.py's
        key = (int(r.get("prompt_length") or _from_id(r, 1)), int(r.get("clients") or _from_id(r, 2)))
        groups.setdefault(key, []).append(r)
    return groups


def summarize_speed(records: list[dict[str, Any]],
                    token_times: dict[str, list[float]] | None = None) -> dict[str, dict[str, Any]]:
    """{prompt_length: {clients: {metric: {n, median, p25, p75, iqr, p50, p90, p99, min, max}}}} over ok records.

    `itl_s` (per token) is there when `token_times` are given. With several clients,
    `aggregate_decode_tok_s` is the median per-client decode rate times clients.
    """
    out: dict[str, dict[str, Any]] = {}
    for (length, clients), recs in sorted(_groups(records).items()):
        entry: dict[str, Any] = {m: percentiles([_value(r, m) for r in recs]) for m in METRICS}
        if token_times:
            entry["itl_s"] = percentiles([g for r in recs for g in _gaps(token_times.get(str(r.get("item_id"))))])
        entry["prompt_tokens"] = percentiles([r.get("prompt_tokens") for r in recs])
        entry["output_tokens"] = percentiles([r.get("output_tokens") for r in recs])
        dec = entry["decode_tok_s"]
        entry["aggregate_decode_tok_s"] = dec["median"] * clients if dec else None
        draft = draft_summary(recs)
        if draft:
            entry["draft"] = draft
        out.setdefault(str(length), {})[str(clients)] = entry
    return out


def _sampling(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The sampling settings of a side's speed records (older runs, greedy, carry none: null)."""
    return next((r["sampling"] for r in records if isinstance(r.get("sampling"), dict)), None)


def draft_summary(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Speculative decoding over a group: pooled acceptance rate (accepted / drafted over all requests),
    the per-request rates' spread, tokens per verification step; None where no record has counters."""
    recs = [r for r in records if isinstance(r.get("draft_n"), int)]
    if not recs:
        group = next((r["group_spec_decode"] for r in records if isinstance(r.get("group_spec_decode"), dict)), None)
        if group is None:
            return None
        return {"n": len(records), "draft_n": group.get("draft_n"), "draft_n_accepted": group.get("draft_n_accepted"),
                "acceptance_rate": group.get("acceptance_rate"), "acceptance_rate_stats": None,
                "tokens_per_step": None, "source": group.get("source")}
    drafted = sum(r["draft_n"] for r in recs)
    accepted = sum(r.get("draft_n_accepted") or 0 for r in recs)
    return {"n": len(recs), "draft_n": drafted, "draft_n_accepted": accepted, "source": "per request",
            "acceptance_rate": accepted / drafted if drafted else None,
            "acceptance_rate_stats": percentiles([r.get("acceptance_rate") for r in recs]),
            "tokens_per_step": percentiles([r.get("tokens_per_step") for r in recs])}


def _from_id(r: dict[str, Any], part: int) -> int:
    return int(str(r["item_id"]).split("/")[part])


def _ratio(a: float | None, b: float | None) -> float | None:
    return (b / a) if a and b is not None and a > 0 and b > 0 else None


def _speed_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if str(r.get("item_id", "")).startswith("speed/")]


@dataclass(frozen=True)
class RatioFigure:
    """One metric of a compared group: each side's median, candidate / baseline, its 95% interval."""

    baseline: float | None
    candidate: float | None
    ratio: float | None
    ratio_ci95: tuple[float, float] | None


@dataclass(frozen=True)
class SpeedRow:
    """compare.json["speed"]["rows"][i]: one (prompt length, clients) group of both sides."""

    prompt_length: int
    clients: int
    figures: dict[str, RatioFigure]          # metric (METRICS order, then itl_s) -> figure
    acceptance_baseline: float | None        # speculative decoding's pooled acceptance rate
    acceptance_candidate: float | None
    n_baseline: int
    n_candidate: int
    baseline_stats: dict[str, Any]           # metric -> summarize_speed's percentiles (or None)
    candidate_stats: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"prompt_length": self.prompt_length, "clients": self.clients}
        for m, f in self.figures.items():
            name = RATIO_NAMES[m]
            out[f"{name}_baseline"], out[f"{name}_candidate"], out[f"{name}_ratio"] = f.baseline, f.candidate, f.ratio
            out[f"{name}_ratio_ci95"] = list(f.ratio_ci95) if f.ratio_ci95 else None
        out.update(acceptance_baseline=self.acceptance_baseline, acceptance_candidate=self.acceptance_candidate,
                   n_baseline=self.n_baseline, n_candidate=self.n_candidate,
                   baseline_stats=self.baseline_stats, candidate_stats=self.candidate_stats)
        return out


def speed_compare(base_records: list[dict[str, Any]], cand_records: list[dict[str, Any]],
                  base_times: dict[str, list[float]] | None = None,
                  cand_times: dict[str, list[float]] | None = None, n_boot: int = 2000) -> dict[str, Any]:
    """compare.json["speed"]: per prompt length and client count, both sides' percentiles and the
    candidate/baseline ratio of the medians with its 95% bootstrap interval (each side resampled on its
    own: the runs timed different requests).

    ttft/tpot/itl/e2e ratios < 1 and prefill/decode ratios > 1 mean the candidate is faster.
    """
    base_recs, cand_recs = _speed_records(base_records), _speed_records(cand_records)
    base, cand = summarize_speed(base_recs, base_times), summarize_speed(cand_recs, cand_times)
    bgroups, cgroups = _groups(base_recs), _groups(cand_recs)
    metrics = METRICS + (("itl_s",) if base_times and cand_times else ())
    rows = []
    for length in sorted(set(base) & set(cand), key=int):
        for clients in sorted(set(base[length]) & set(cand[length]), key=int):
            b, c = base[length][clients], cand[length][clients]
            key = (int(length), int(clients))
            figures = {}
            for m in metrics:
                bm = b[m]["median"] if b.get(m) else None
                cm = c[m]["median"] if c.get(m) else None
                ratio = _ratio(bm, cm)
                if m == "itl_s":
                    bv = [g for r in bgroups[key] for g in _gaps((base_times or {}).get(str(r.get("item_id"))))]
                    cv = [g for r in cgroups[key] for g in _gaps((cand_times or {}).get(str(r.get("item_id"))))]
                else:
                    bv = [_value(r, m) for r in bgroups[key]]
                    cv = [_value(r, m) for r in cgroups[key]]
                ci = bootstrap_ratio_ci(bv, cv, n_boot=n_boot) if ratio is not None else None
                figures[m] = RatioFigure(bm, cm, ratio, ci)
            rows.append(SpeedRow(
                int(length), int(clients), figures,
                acceptance_baseline=(b.get("draft") or {}).get("acceptance_rate"),
                acceptance_candidate=(c.get("draft") or {}).get("acceptance_rate"),
                n_baseline=b["ttft_s"]["n"] if b["ttft_s"] else 0, n_candidate=c["ttft_s"]["n"] if c["ttft_s"] else 0,
                baseline_stats={m: b.get(m) for m in metrics}, candidate_stats={m: c.get(m) for m in metrics}))

    def geomean(m: str) -> float | None:
        vals = [v for r in rows if (v := r.figures[m].ratio) and v > 0]
        return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None

    only = sorted({f"{l}/{c}" for l in base for c in base[l]} ^ {f"{l}/{c}" for l in cand for c in cand[l]})
    load = load_compare(base_records, cand_records)
    return {"rows": [r.to_json() for r in rows], **({"load": load} if load is not None else {}),
            "sampling": {"baseline": _sampling(base_recs), "candidate": _sampling(cand_recs)},
            "geomean": {RATIO_NAMES[m]: geomean(m) for m in metrics},
            "unpaired_groups": only,
            "interval": "95% percentile bootstrap of the ratio of medians, 2000 resamples per side",
            "ratio_meaning": "candidate / baseline; ttft, tpot, itl, e2e < 1 and prefill, decode > 1 "
                             "mean the candidate is faster"}
