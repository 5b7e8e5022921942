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

from moebench.json_types import JsonObject, JsonValue
from moebench.scoring.stats import bootstrap_ratio_ci
from moebench.speed.latency import Percentiles
from moebench.speed.load_compare import LoadSection, load_section
from moebench.speed.records import Sampling
from moebench.speed.stored import StoredRequest, read_records

METRICS = ("ttft_s", "prefill_tok_s", "decode_tok_s", "tpot_s", "e2e_s")
# compare row name of each metric: rows keep the short names of compare.json's first version
RATIO_NAMES = {"ttft_s": "ttft", "prefill_tok_s": "prefill", "decode_tok_s": "decode", "tpot_s": "tpot",
               "e2e_s": "e2e", "itl_s": "itl"}
# for these a larger candidate/baseline ratio is better; for the latencies a smaller one
HIGHER_IS_BETTER = {"prefill_tok_s", "decode_tok_s"}
TOKEN_TIMES_FILE = "speed_token_times.jsonl"
INTERVAL = "95% percentile bootstrap of the ratio of medians, 2000 resamples per side"
RATIO_MEANING = ("candidate / baseline; ttft, tpot, itl, e2e < 1 and prefill, decode > 1 "
                 "mean the candidate is faster")


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


GroupKey = tuple[int, int]               # (prompt length, clients)


def _groups(records: list[StoredRequest]) -> dict[GroupKey, list[StoredRequest]]:
    groups: dict[GroupKey, list[StoredRequest]] = {}
    for r in records:
        if not r.measured or r.rate is not None:
            continue             # open-loop records (a request rate) are load_compare.py's
        key = (r.prompt_length or _from_id(r, 1), r.clients or _from_id(r, 2))
        groups.setdefault(key, []).append(r)
    return groups


def _from_id(r: StoredRequest, part: int) -> int:
    return int(r.item_id.split("/")[part])


PER_REQUEST = "per request"             # DraftSummary.source where the records carry their own counters


@dataclass(frozen=True)
class DraftSummary:
    """Speculative decoding over a group: pooled acceptance rate (accepted / drafted over all requests),
    the per-request rates' spread and tokens per verification step; from the server's group counters
    (source "/metrics ...") where no record has its own."""

    n: int
    draft_n: int | None
    draft_n_accepted: int | None
    acceptance_rate: float | None
    acceptance_rate_stats: Percentiles | None
    tokens_per_step: Percentiles | None
    source: str | None

    def to_json(self) -> JsonObject:
        stats = {"acceptance_rate_stats": _stats_json(self.acceptance_rate_stats),
                 "tokens_per_step": _stats_json(self.tokens_per_step)}
        head: JsonObject = {"n": self.n, "draft_n": self.draft_n, "draft_n_accepted": self.draft_n_accepted}
        if self.source == PER_REQUEST:       # each source keeps its own key order in compare.json
            return {**head, "source": self.source, "acceptance_rate": self.acceptance_rate, **stats}
        return {**head, "acceptance_rate": self.acceptance_rate, **stats, "source": self.source}


def _stats_json(p: Percentiles | None) -> JsonObject | None:
    return p.to_json() if p is not None else None


def draft_summary(records: list[StoredRequest]) -> DraftSummary | None:
    """A group's speculative decoding; None where no record has counters."""
    drafts = [r.draft for r in records if r.draft is not None]
    if not drafts:
        group = next((r.group_spec_decode for r in records if r.group_spec_decode is not None), None)
        if group is None:
            return None
        return DraftSummary(len(records), group["draft_n"], group["draft_n_accepted"], group["acceptance_rate"],
                            None, None, group["source"])
    drafted = sum(d.draft_n for d in drafts)
    accepted = sum(d.draft_n_accepted for d in drafts)
    return DraftSummary(len(drafts), drafted, accepted, accepted / drafted if drafted else None,
                        Percentiles.of([d.acceptance_rate for d in drafts]),
                        Percentiles.of([d.tokens_per_step for d in drafts]), PER_REQUEST)


@dataclass(frozen=True)
class GroupStats:
    """One (prompt length, clients) group of one side: each metric's spread over its ok records."""

    metrics: dict[str, Percentiles | None]   # METRICS, then itl_s where token times were given
    prompt_tokens: Percentiles | None
    output_tokens: Percentiles | None
    aggregate_decode_tok_s: float | None     # median per-client decode rate times clients
    draft: DraftSummary | None

    def median(self, metric: str) -> float | None:
        p = self.metrics.get(metric)
        return p.p50 if p is not None else None

    def to_json(self) -> JsonObject:
        out: JsonObject = {m: _stats_json(p) for m, p in self.metrics.items()}
        out.update(prompt_tokens=_stats_json(self.prompt_tokens), output_tokens=_stats_json(self.output_tokens),
                   aggregate_decode_tok_s=self.aggregate_decode_tok_s)
        if self.draft is not None:
            out["draft"] = self.draft.to_json()
        return out


def speed_summary(records: list[StoredRequest],
                  token_times: dict[str, list[float]] | None = None) -> dict[GroupKey, GroupStats]:
    """Per (prompt length, clients), in that order, the group's spread over its ok records.

    `itl_s` (per token) is there when `token_times` are given."""
    out: dict[GroupKey, GroupStats] = {}
    for (length, clients), recs in sorted(_groups(records).items()):
        metrics = {m: Percentiles.of([r.times.metric(m) for r in recs]) for m in METRICS}
        if token_times:
            metrics["itl_s"] = Percentiles.of([g for r in recs for g in _gaps(token_times.get(r.item_id))])
        dec = metrics["decode_tok_s"]
        out[(length, clients)] = GroupStats(
            metrics, Percentiles.of([r.prompt_tokens for r in recs]),
            Percentiles.of([r.times.output_tokens for r in recs]),
            dec.p50 * clients if dec else None, draft_summary(recs))
    return out


def summary_json(summary: dict[GroupKey, GroupStats]) -> JsonObject:
    """{prompt_length: {clients: {metric: {n, median, p25, p75, iqr, p50, p90, p99, min, max}}}}."""
    out: JsonObject = {}
    for (length, clients), stats in summary.items():
        by_clients = out.setdefault(str(length), {})
        assert isinstance(by_clients, dict)
        by_clients[str(clients)] = stats.to_json()
    return out


def summarize_speed(records: list[JsonValue], token_times: dict[str, list[float]] | None = None,
                    source: str = "speed records") -> JsonObject:
    """speed_summary of stored records (JSON as read, parsed here) as the task summary and ab.json write it."""
    return summary_json(speed_summary(read_records(records, source), token_times))


def _sampling(records: list[StoredRequest]) -> Sampling | None:
    """The sampling settings of a side's speed records (older runs, greedy, carry none: None)."""
    return next((r.sampling for r in records if r.sampling is not None), None)


def _ratio(a: float | None, b: float | None) -> float | None:
    return (b / a) if a and b is not None and a > 0 and b > 0 else None


def _speed_records(records: list[StoredRequest]) -> list[StoredRequest]:
    return [r for r in records if r.item_id.startswith("speed/")]


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
    baseline_stats: dict[str, Percentiles | None]    # metric -> each side's spread
    candidate_stats: dict[str, Percentiles | None]

    def to_json(self) -> JsonObject:
        out: JsonObject = {"prompt_length": self.prompt_length, "clients": self.clients}
        for m, f in self.figures.items():
            name = RATIO_NAMES[m]
            out[f"{name}_baseline"], out[f"{name}_candidate"], out[f"{name}_ratio"] = f.baseline, f.candidate, f.ratio
            out[f"{name}_ratio_ci95"] = list(f.ratio_ci95) if f.ratio_ci95 else None
        out.update(acceptance_baseline=self.acceptance_baseline, acceptance_candidate=self.acceptance_candidate,
                   n_baseline=self.n_baseline, n_candidate=self.n_candidate,
                   baseline_stats={m: _stats_json(p) for m, p in self.baseline_stats.items()},
                   candidate_stats={m: _stats_json(p) for m, p in self.candidate_stats.items()})
        return out


@dataclass(frozen=True)
class SpeedSection:
    """compare.json["speed"]: the compared groups, the serving-load part, each side's sampling, the
    geometric mean of each ratio over the groups and the groups only one side ran."""

    rows: list[SpeedRow]
    load: LoadSection | None
    sampling_baseline: Sampling | None
    sampling_candidate: Sampling | None
    geomean: dict[str, float | None]         # metric -> geometric mean of its ratios
    unpaired_groups: list[str]               # "<length>/<clients>"

    def to_json(self) -> JsonObject:
        return {"rows": [r.to_json() for r in self.rows],
                **({"load": self.load.to_json()} if self.load is not None else {}),
                "sampling": {"baseline": _sampling_json(self.sampling_baseline),
                             "candidate": _sampling_json(self.sampling_candidate)},
                "geomean": {RATIO_NAMES[m]: v for m, v in self.geomean.items()},
                "unpaired_groups": list(self.unpaired_groups),
                "interval": INTERVAL, "ratio_meaning": RATIO_MEANING}


def _sampling_json(s: Sampling | None) -> JsonObject | None:
    return s.to_json() if s is not None else None


def speed_compare(base_records: list[JsonValue], cand_records: list[JsonValue],
                  base_times: dict[str, list[float]] | None = None,
                  cand_times: dict[str, list[float]] | None = None, n_boot: int = 2000) -> JsonObject:
    """compare.json["speed"] of two sides' stored records (JSON as read from each items.jsonl)."""
    return speed_section(read_records(base_records, "baseline items.jsonl"),
                         read_records(cand_records, "candidate items.jsonl"),
                         base_times, cand_times, n_boot).to_json()


def speed_section(base_records: list[StoredRequest], cand_records: list[StoredRequest],
                  base_times: dict[str, list[float]] | None = None,
                  cand_times: dict[str, list[float]] | None = None, n_boot: int = 2000) -> SpeedSection:
    """Per prompt length and client count, both sides' percentiles and the candidate/baseline ratio of
    the medians with its 95% bootstrap interval (each side resampled on its own: the runs timed
    different requests).

    ttft/tpot/itl/e2e ratios < 1 and prefill/decode ratios > 1 mean the candidate is faster.
    """
    base_recs, cand_recs = _speed_records(base_records), _speed_records(cand_records)
    base, cand = speed_summary(base_recs, base_times), speed_summary(cand_recs, cand_times)
    bgroups, cgroups = _groups(base_recs), _groups(cand_recs)
    metrics = METRICS + (("itl_s",) if base_times and cand_times else ())
    rows = []
    for key in sorted(set(base) & set(cand)):
        b, c = base[key], cand[key]
        figures = {}
        for m in metrics:
            bm, cm = b.median(m), c.median(m)
            ratio = _ratio(bm, cm)
            if m == "itl_s":
                bv = [g for r in bgroups[key] for g in _gaps((base_times or {}).get(r.item_id))]
                cv = [g for r in cgroups[key] for g in _gaps((cand_times or {}).get(r.item_id))]
            else:
                bv = [r.times.metric(m) for r in bgroups[key]]
                cv = [r.times.metric(m) for r in cgroups[key]]
            ci = bootstrap_ratio_ci(bv, cv, n_boot=n_boot) if ratio is not None else None
            figures[m] = RatioFigure(bm, cm, ratio, ci)
        bt, ct = b.metrics["ttft_s"], c.metrics["ttft_s"]
        rows.append(SpeedRow(
            key[0], key[1], figures,
            acceptance_baseline=b.draft.acceptance_rate if b.draft else None,
            acceptance_candidate=c.draft.acceptance_rate if c.draft else None,
            n_baseline=bt.n if bt else 0, n_candidate=ct.n if ct else 0,
            baseline_stats={m: b.metrics.get(m) for m in metrics},
            candidate_stats={m: c.metrics.get(m) for m in metrics}))

    def geomean(m: str) -> float | None:
        vals = [v for r in rows if (v := r.figures[m].ratio) and v > 0]
        return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None

    only = sorted({f"{l}/{c}" for l, c in base} ^ {f"{l}/{c}" for l, c in cand})
    return SpeedSection(rows, load_section(base_records, cand_records), _sampling(base_recs), _sampling(cand_recs),
                        {m: geomean(m) for m in metrics}, only)
