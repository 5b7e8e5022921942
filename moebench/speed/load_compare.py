"""Serving-load statistics from stored open-loop speed records (a request `rate`): per prompt length and
rate, goodput under the SLOs, the share of requests meeting them, latency percentiles with the number
of samples a tail needs, and the server's state; and the candidate/baseline goodput ratio with its
interval for compare.json["speed"]["load"]. Reads the store only.

Goodput is the number of requests that finished and met every SLO the suite set, divided by the
group's wall time (first send to last reply); without SLOs it is the completed-request throughput.
An errored request never meets an SLO.

Tail percentiles: a p90 or p99 over few requests is mostly the largest one or two. MLPerf Inference's
early-stopping rule (mlcommons/inference loadgen/early_stopping.cc, "Early Stopping Criterion" in the
LoadGen docs) asks for the smallest n at which, with no request over the latency bound, the
percentile's bound holds at 99% confidence: q**n <= 1 - 0.99, so n = ceil(ln 0.01 / ln q): 44 for p90
and 459 for p99 (LoadGen's h_min(t=0, p99) = 459). A percentile over fewer samples is marked
indicative.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypedDict

from moebench.json_types import JsonObject, JsonValue
from moebench.runners.metrics import ServingSummary
from moebench.speed.latency import Percentiles
from moebench.json_fields import Fields
from moebench.speed.records import RateGroup, SweepStep, server_from_json, server_json
from moebench.speed.stored import StoredRequest

TAIL_CONFIDENCE = 0.99
LOAD_METRICS = ("ttft_s", "tpot_s", "e2e_s")
GOODPUT_INTERVAL = ("95% Katz log interval of the ratio of the shares meeting every SLO (binomial; half a "
                    "request added where a side met none or all, and 0 as its lower end where the candidate met none), times the ratio of requests sent per "
                    "second of wall time, which is taken as measured")
RATIO_MEANING = ("candidate goodput / baseline goodput; > 1 means the candidate served more "
                 "requests within the SLOs per second")


def tail_samples_needed(q: float, confidence: float = TAIL_CONFIDENCE) -> int:
    """Fewest samples for the q-quantile (0.9, 0.99) to be more than indicative (MLPerf early stopping, t=0)."""
    return math.ceil(math.log(1.0 - confidence) / math.log(q))


TAIL_NEEDED = {"p90": tail_samples_needed(0.90), "p99": tail_samples_needed(0.99)}

LoadKey = tuple[int, float]              # (prompt length, rate)


def _key(r: StoredRequest) -> LoadKey | None:
    """(prompt length, rate) of an open-loop record from its item id ("speed/<length>/r<rate>/<i>"),
    which error records carry too."""
    parts = r.item_id.split("/")
    if len(parts) != 4 or parts[0] != "speed" or not parts[2].startswith("r"):
        return None
    try:
        return int(parts[1]), float(parts[2][1:])
    except ValueError:
        return None


@dataclass(frozen=True)
class TailStats:
    """A latency's spread over a group, with whether its p90 and p99 rest on enough samples."""

    stats: Percentiles

    def to_json(self) -> JsonObject:
        out = self.stats.to_json()
        for p, needed in TAIL_NEEDED.items():
            out[f"{p}_needs_n"] = needed
            out[f"{p}_indicative"] = self.indicative(p)
        return out

    def indicative(self, p: str) -> bool:
        return self.stats.n < TAIL_NEEDED[p]

    @staticmethod
    def of(values: list[float | None]) -> TailStats | None:
        st = Percentiles.of(values)
        return TailStats(st) if st is not None else None

    @staticmethod
    def from_json(f: Fields) -> TailStats:
        """The flags are not read: they follow from n."""
        return TailStats(Percentiles.from_json(f))


def _met(r: StoredRequest) -> int:
    if not r.measured:
        return 0
    return 0 if r.slo_met is False else 1


def load_groups(records: list[StoredRequest]) -> dict[LoadKey, list[StoredRequest]]:
    groups: dict[LoadKey, list[StoredRequest]] = {}
    for r in records:
        k = _key(r)
        if k is not None:
            groups.setdefault(k, []).append(r)
    return groups


class ShareCounts(TypedDict):
    """What the goodput interval needs of one side's row."""

    duration_s: float | None
    n_sent: int
    slo_met_share: float | None


@dataclass(frozen=True)
class SkippedRow:
    """A (prompt length, rate) whose sweep step was never sent: an earlier step met the stop rule."""

    prompt_length: int
    rate: float
    stopped_at: str | None

    n_sent = 0

    def to_json(self) -> JsonObject:
        return {"prompt_length": self.prompt_length, "rate": self.rate, "sweep_skipped": True,
                "sweep_stopped_at": self.stopped_at, "n_sent": 0}

    @staticmethod
    def from_json(f: Fields) -> SkippedRow:
        return SkippedRow(f.need_int("prompt_length"), f.need_num("rate"), f.text("sweep_stopped_at"))


@dataclass(frozen=True)
class LoadRow:
    """One side's (prompt length, rate): requests sent and served, goodput under the SLOs, the load it
    met (from the group's stored summary; None where no record carries one), the server's state, the
    sweep step, and the tail statistics of each latency."""

    prompt_length: int
    rate: float
    arrival: str | None
    burstiness: float | None
    n_sent: int
    n_ok: int
    n_errors: int
    duration_s: float | None
    slos: dict[str, float]
    achieved_rate: float | None
    slo_met_share: float | None
    goodput: float | None
    max_in_flight: int | None
    client_concurrency: int | None
    server: ServingSummary | None
    sweep: SweepStep | None
    tails: dict[str, TailStats | None]   # LOAD_METRICS -> spread

    @property
    def client_limited(self) -> bool:
        # the http runner opens at most concurrency + 4 connections: beyond that requests wait in the client
        cc, mf = self.client_concurrency, self.max_in_flight
        return cc is not None and mf is not None and mf > cc + 4

    def counts(self) -> ShareCounts:
        return {"duration_s": self.duration_s, "n_sent": self.n_sent, "slo_met_share": self.slo_met_share}

    def to_json(self) -> JsonObject:
        out: JsonObject = {
            "prompt_length": self.prompt_length, "rate": self.rate, "arrival": self.arrival,
            "burstiness": self.burstiness, "n_sent": self.n_sent, "n_ok": self.n_ok, "n_errors": self.n_errors,
            "duration_s": self.duration_s, "slos": dict(self.slos), "achieved_rate": self.achieved_rate,
            "slo_met_share": self.slo_met_share, "goodput": self.goodput, "max_in_flight": self.max_in_flight,
            "client_concurrency": self.client_concurrency, "server": server_json(self.server),
            "sweep": self.sweep.to_json() if self.sweep else None, "client_limited": self.client_limited}
        for m, t in self.tails.items():
            out[m] = t.to_json() if t is not None else None
        return out

    @staticmethod
    def from_json(f: Fields) -> LoadRow:
        sweep = f.at("sweep")
        tails = {m: (TailStats.from_json(t) if (t := f.at(m)) is not None else None) for m in LOAD_METRICS}
        return LoadRow(f.need_int("prompt_length"), f.need_num("rate"), f.text("arrival"), f.num("burstiness"),
                       f.need_int("n_sent"), f.integer("n_ok") or 0, f.integer("n_errors") or 0, f.num("duration_s"),
                       f.numbers("slos") or {}, f.num("achieved_rate"), f.num("slo_met_share"), f.num("goodput"),
                       f.integer("max_in_flight"), f.integer("client_concurrency"), server_from_json(f),
                       SweepStep.from_json(sweep) if sweep is not None else None, tails)


def row_from_json(f: Fields) -> LoadRow | SkippedRow:
    """One side's stored row: a step not sent, or a measured one."""
    return SkippedRow.from_json(f) if f.flag("sweep_skipped") else LoadRow.from_json(f)


def _row(length: int, rate: float, recs: list[StoredRequest]) -> LoadRow | SkippedRow:
    skipped = [r for r in recs if r.sweep_skipped]
    if skipped and len(skipped) == len(recs):
        return SkippedRow(length, rate, skipped[0].sweep_stopped_at)
    g = next((r.group for r in recs if isinstance(r.group, RateGroup)), None)
    ok = [r for r in recs if r.measured]
    n_sent = (g.n_sent if g else 0) or len(recs)
    duration = g.duration_s if g else None
    met = sum(_met(r) for r in recs)
    return LoadRow(
        length, rate, g.arrival if g else None, g.burstiness if g else None, n_sent=n_sent, n_ok=len(ok),
        n_errors=sum(1 for r in recs if r.status == "error"), duration_s=duration,
        slos=dict(g.slos) if g else {},
        achieved_rate=len(ok) / duration if duration else None,
        slo_met_share=met / n_sent if n_sent else None,
        goodput=met / duration if duration else (0.0 if not ok else None),
        max_in_flight=g.max_in_flight if g else None, client_concurrency=g.client_concurrency if g else None,
        server=g.server if g else None, sweep=g.sweep if g else None,
        tails={m: TailStats.of([r.times.metric(m) for r in ok]) for m in LOAD_METRICS})


@dataclass(frozen=True)
class SweepSummary:
    """One prompt length of a sweep: the rates run, where and why it stopped, the saturation rate (the
    highest rate before the step that met the stop rule; None where no step met it)."""

    rates_run: list[float]
    stopped_at_rate: float | None
    stop_reason: str | None
    saturation_rate: float | None
    rule: dict[str, float] | None     # the stop rule as the first step's records carry it

    def to_json(self) -> JsonObject:
        return {"rates_run": list(self.rates_run), "stopped_at_rate": self.stopped_at_rate,
                "stop_reason": self.stop_reason, "saturation_rate": self.saturation_rate,
                "rule": dict(self.rule) if self.rule is not None else None}

    @staticmethod
    def from_json(f: Fields) -> SweepSummary:
        return SweepSummary(f.number_list("rates_run") or [], f.num("stopped_at_rate"),
                            f.text("stop_reason"), f.num("saturation_rate"), f.numbers("rule"))


def _sweeps_from_json(f: Fields | None) -> dict[str, SweepSummary]:
    """A side's sweeps (prompt length -> summary) as compare.json holds them."""
    if f is None:
        return {}
    return {length: SweepSummary.from_json(sub) for length in f.obj if (sub := f.at(length)) is not None}


def _sweeps(rows: list[LoadRow | SkippedRow]) -> dict[str, SweepSummary]:
    """Per prompt length (as a string) of a sweep: its summary."""
    out: dict[str, SweepSummary] = {}
    for length in sorted({r.prompt_length for r in rows if isinstance(r, SkippedRow) or r.sweep}):
        steps = sorted(((r, r.sweep) for r in rows if isinstance(r, LoadRow) and r.prompt_length == length
                        and r.sweep), key=lambda rs: rs[0].rate)
        stop = next(((r, sw) for r, sw in steps if sw.stop), None)
        before = [r.rate for r, _ in steps if stop is None or r.rate < stop[0].rate]
        out[str(length)] = SweepSummary(rates_run=[r.rate for r, _ in steps],
                                        stopped_at_rate=stop[0].rate if stop else None,
                                        stop_reason=stop[1].stop if stop else None,
                                        saturation_rate=(before[-1] if before else None) if stop else None,
                                        rule=steps[0][1].rule if steps else None)
    return out


@dataclass(frozen=True)
class LoadSummary:
    """One run's serving load (the speed task's summary `load`): a row per (prompt length, rate) and
    each sweep's summary."""

    rows: list[LoadRow | SkippedRow]
    sweeps: dict[str, SweepSummary]      # prompt length -> its sweep

    def to_json(self) -> JsonObject:
        return {"rows": [r.to_json() for r in self.rows],
                "sweeps": {length: sw.to_json() for length, sw in self.sweeps.items()},
                "tail_samples_needed": dict(TAIL_NEEDED)}


def summarize_load(records: list[StoredRequest]) -> LoadSummary:
    rows = [_row(length, rate, recs) for (length, rate), recs in sorted(load_groups(records).items())]
    return LoadSummary(rows, _sweeps(rows))


def goodput_ratio_ci(base_row: ShareCounts, cand_row: ShareCounts, z: float = 1.959964) -> tuple[float, float] | None:
    """95% interval of the goodput ratio: the Katz log interval of the ratio of the two shares meeting
    every SLO (met / sent per side, binomial), times the ratio of requests sent per second of wall time.

    Katz: ln(RR) +- z * sqrt(1/a - 1/n1 + 1/b - 1/n0); a side that met none, or all, gets half a request
    either way (Haldane's correction) so the interval stays finite and honest about the small count."""
    base_s, cand_s = base_row["duration_s"], cand_row["duration_s"]
    if not base_s or not cand_s:
        return None
    n0, n1 = base_row["n_sent"], cand_row["n_sent"]
    b = round((base_row["slo_met_share"] or 0.0) * n0)
    a = round((cand_row["slo_met_share"] or 0.0) * n1)
    if n0 <= 0 or n1 <= 0:
        return None
    scale = (n1 / cand_s) / (n0 / base_s)
    point = (a / n1) / (b / n0) * scale if b else None
    met_none = a == 0
    if a in (0, n1) or b in (0, n0):
        a, b, n0, n1 = a + 0.5, b + 0.5, n0 + 1, n1 + 1
    ratio = (a / n1) / (b / n0)
    half = z * math.sqrt(1 / a - 1 / n1 + 1 / b - 1 / n0)
    lo, hi = ratio * math.exp(-half) * scale, ratio * math.exp(half) * scale
    # The corrected counts move the centre: a candidate that met no SLO has goodput ratio 0, which the
    # interval must hold (its lower end is 0), and the interval always holds the measured ratio.
    if met_none:
        lo = 0.0
    if point is not None:
        lo, hi = min(lo, point), max(hi, point)
    return lo, hi


@dataclass(frozen=True)
class LoadPair:
    """One (prompt length, rate) of both sides: each side's row and the goodput ratio with its interval."""

    prompt_length: int
    rate: float
    baseline: LoadRow | SkippedRow
    candidate: LoadRow | SkippedRow
    goodput_ratio: float | None       # candidate / baseline
    goodput_ratio_ci95: tuple[float, float] | None

    def to_json(self) -> JsonObject:
        return {"prompt_length": self.prompt_length, "rate": self.rate, "baseline": self.baseline.to_json(),
                "candidate": self.candidate.to_json(), "goodput_ratio": self.goodput_ratio,
                "goodput_ratio_ci95": list(self.goodput_ratio_ci95) if self.goodput_ratio_ci95 else None,
                "n_baseline": self.baseline.n_sent, "n_candidate": self.candidate.n_sent}

    @staticmethod
    def from_json(f: Fields) -> LoadPair:
        base, cand = f.at("baseline"), f.at("candidate")
        if base is None or cand is None:
            raise ValueError(f"{f.source}: keys 'baseline' and 'candidate' must both be rows (JSON objects)")
        return LoadPair(f.need_int("prompt_length"), f.need_num("rate"), row_from_json(base),
                        row_from_json(cand), f.num("goodput_ratio"), f.interval("goodput_ratio_ci95"))


@dataclass(frozen=True)
class LoadSection:
    """compare.json["speed"]["load"]: the paired rows, each side's sweeps, the groups one side ran."""

    rows: list[LoadPair]
    sweeps_baseline: dict[str, SweepSummary]
    sweeps_candidate: dict[str, SweepSummary]
    unpaired_groups: list[str]            # "<length>/r<rate>"

    def to_json(self) -> JsonObject:
        return {"rows": [r.to_json() for r in self.rows],
                "sweeps": {"baseline": {k: s.to_json() for k, s in self.sweeps_baseline.items()},
                           "candidate": {k: s.to_json() for k, s in self.sweeps_candidate.items()}},
                "unpaired_groups": list(self.unpaired_groups), "tail_samples_needed": dict(TAIL_NEEDED),
                "interval": GOODPUT_INTERVAL, "ratio_meaning": RATIO_MEANING}

    @staticmethod
    def from_json(obj: JsonValue, source: str) -> LoadSection:
        """compare.json speed.load read back; `source` names the file. Refused naming file and key."""
        f = Fields(obj, source)
        sweeps = f.at("sweeps")
        return LoadSection([LoadPair.from_json(r) for r in f.objects("rows")],
                           _sweeps_from_json(sweeps.at("baseline") if sweeps else None),
                           _sweeps_from_json(sweeps.at("candidate") if sweeps else None),
                           f.strings("unpaired_groups") or [])


def load_section(base_records: list[StoredRequest], cand_records: list[StoredRequest]) -> LoadSection | None:
    """compare.json["speed"]["load"]; None where neither side has open-loop records."""
    bg, cg = load_groups(base_records), load_groups(cand_records)
    if not bg and not cg:
        return None
    rows = []
    for key in sorted(set(bg) & set(cg)):
        b, c = _row(*key, bg[key]), _row(*key, cg[key])
        ratio, ci = None, None
        if isinstance(b, LoadRow) and isinstance(c, LoadRow):     # a step not sent has no ratio
            bgp, cgp = b.goodput, c.goodput
            ratio = cgp / bgp if bgp and cgp is not None else None
            ci = goodput_ratio_ci(b.counts(), c.counts()) if ratio is not None else None
        rows.append(LoadPair(key[0], key[1], b, c, ratio, ci))
    only = sorted({f"{l}/r{r:g}" for l, r in bg} ^ {f"{l}/r{r:g}" for l, r in cg})
    return LoadSection(rows, summarize_load(base_records).sweeps, summarize_load(cand_records).sweeps, only)


def _f(v: float | None, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}g}"


def format_load(load: JsonValue, source: str = "compare.json speed.load") -> list[str]:
    """compare.json speed.load (as read; parsed here) as text lines: `format_load_section`."""
    return format_load_section(LoadSection.from_json(load, source))


def _server_figure(server: ServingSummary | None, key: str) -> str:
    if server is None:
        return _f(None)
    if key in ("queue_length", "kv_cache_usage"):
        gauge = server["queue_length"] if key == "queue_length" else server["kv_cache_usage"]
        return _f(gauge["max"] if gauge else None)
    return _f(server["prefix_cache_hit_rate"] if key == "prefix_cache_hit_rate" else server["preemptions"])


def format_load_section(load: LoadSection) -> list[str]:
    """Goodput per rate, the ratio and interval, the SLO shares, the server's queue and KV-cache usage,
    and where a p99 is only indicative."""
    lines = ["serving load (goodput = requests/s within every SLO; candidate / baseline):"]
    for r in load.rows:
        b, c = r.baseline, r.candidate
        where = f"  {r.prompt_length} tokens @ {_f(r.rate)} req/s:"
        if not isinstance(b, LoadRow) or not isinstance(c, LoadRow):
            lines.append(f"{where} not sent (the sweep had stopped)")
            continue
        ci = r.goodput_ratio_ci95
        text = (f"{where} goodput {_f(b.goodput)} -> {_f(c.goodput)}, ratio {_f(r.goodput_ratio)}"
                + (f" [{_f(ci[0])}, {_f(ci[1])}]" if ci else "")
                + f", within SLOs {_pct(b.slo_met_share)} -> {_pct(c.slo_met_share)}")
        servers = (b.server, c.server)
        if any(s is not None for s in servers):
            text += ("; server " + "/".join(str(s["source"] if s else None) for s in servers)
                     + "".join(f"{sep}{label} {_server_figure(servers[0], key)} -> {_server_figure(servers[1], key)}"
                               for sep, label, key in ((": ", "queue max", "queue_length"),
                                                       (", ", "KV-cache max", "kv_cache_usage"),
                                                       (", ", "prefix hits", "prefix_cache_hit_rate"),
                                                       (", ", "preemptions", "preemptions"))))
        short = [f"{side} n {t.stats.n}" for side, t in (("baseline", b.tails.get("ttft_s")),
                                                          ("candidate", c.tails.get("ttft_s")))
                 if t is not None and t.indicative("p99")]
        if short:
            text += f"; TTFT p99 indicative ({', '.join(short)} < {TAIL_NEEDED['p99']})"
        lines.append(text)
    for side, sweeps in (("baseline", load.sweeps_baseline), ("candidate", load.sweeps_candidate)):
        for length, s in sweeps.items():
            lines.append(f"  sweep {side}, {length} tokens: rates {s.rates_run}, "
                         + (f"stopped at {_f(s.stopped_at_rate)} ({s.stop_reason}), saturation "
                            f"{_f(s.saturation_rate)} req/s" if s.stop_reason else "saturation not reached"))
    return lines


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"
