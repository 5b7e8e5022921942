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
from typing import Any

from moebench.speed.latency import Percentiles, tpot

TAIL_CONFIDENCE = 0.99
LOAD_METRICS = ("ttft_s", "tpot_s", "e2e_s")
GOODPUT_INTERVAL = ("95% Katz log interval of the ratio of the shares meeting every SLO (binomial; half a "
                    "request added where a side met none or all, and 0 as its lower end where the candidate met none), times the ratio of requests sent per "
                    "second of wall time, which is taken as measured")


def tail_samples_needed(q: float, confidence: float = TAIL_CONFIDENCE) -> int:
    """Fewest samples for the q-quantile (0.9, 0.99) to be more than indicative (MLPerf early stopping, t=0)."""
    return math.ceil(math.log(1.0 - confidence) / math.log(q))


TAIL_NEEDED = {"p90": tail_samples_needed(0.90), "p99": tail_samples_needed(0.99)}


def _key(r: dict[str, Any]) -> tuple[int, float] | None:
    """(prompt length, rate) of an open-loop record from its item id ("speed/<length>/r<rate>/<i>"),
    which error records carry too."""
    parts = str(r.get("item_id", "")).split("/")
    if len(parts) != 4 or parts[0] != "speed" or not parts[2].startswith("r"):
        return None
    try:
        return int(parts[1]), float(parts[2][1:])
    except ValueError:
        return None


def _tail_stats(values: list[float | None]) -> dict[str, Any] | None:
    st = Percentiles.of(values)
    if st is None:
        return None
    out: dict[str, Any] = st.to_json()
    for p, needed in TAIL_NEEDED.items():
        out[f"{p}_needs_n"] = needed
        out[f"{p}_indicative"] = st.n < needed
    return out


def _met(r: dict[str, Any]) -> int:
    if r.get("status", "ok") != "ok" or r.get("ttft_s") is None:
        return 0
    return 0 if r.get("slo_met") is False else 1


def load_groups(records: list[dict[str, Any]]) -> dict[tuple[int, float], list[dict[str, Any]]]:
    groups: dict[tuple[int, float], list[dict[str, Any]]] = {}
    for r in records:
        k = _key(r)
        if k is not None:
            groups.setdefault(k, []).append(r)
    return groups


def _group_info(recs: list[dict[str, Any]]) -> dict[str, Any]:
    return next((r["group"] for r in recs if isinstance(r.get("group"), dict)), {})


def _row(length: int, rate: float, recs: list[dict[str, Any]]) -> dict[str, Any]:
    skipped = [r for r in recs if r.get("sweep_skipped")]
    if skipped and len(skipped) == len(recs):
        return {"prompt_length": length, "rate": rate, "sweep_skipped": True,
                "sweep_stopped_at": skipped[0].get("sweep_stopped_at"), "n_sent": 0}
    g = _group_info(recs)
    ok = [r for r in recs if r.get("status", "ok") == "ok" and r.get("ttft_s") is not None]
    n_sent = int(g.get("n_sent") or len(recs))
    duration = g.get("duration_s")
    met = sum(_met(r) for r in recs)
    slos = g.get("slos") or {}
    row: dict[str, Any] = {
        "prompt_length": length, "rate": rate, "arrival": g.get("arrival"), "burstiness": g.get("burstiness"),
        "n_sent": n_sent, "n_ok": len(ok), "n_errors": sum(1 for r in recs if r.get("status") == "error"),
        "duration_s": duration, "slos": slos,
        "achieved_rate": len(ok) / duration if duration else None,
        "slo_met_share": met / n_sent if n_sent else None,
        "goodput": met / duration if duration else (0.0 if not ok else None),
        "max_in_flight": g.get("max_in_flight"), "client_concurrency": g.get("client_concurrency"),
        "server": g.get("server"), "sweep": g.get("sweep"),
    }
    cc, mf = row["client_concurrency"], row["max_in_flight"]
    # the http runner opens at most concurrency + 4 connections: beyond that requests wait in the client
    row["client_limited"] = bool(isinstance(cc, int) and isinstance(mf, int) and mf > cc + 4)
    for m in LOAD_METRICS:
        row[m] = _tail_stats([tpot(r) if m == "tpot_s" else r.get(m) for r in ok])
    return row


@dataclass(frozen=True)
class SweepSummary:
    """One prompt length of a sweep: the rates run, where and why it stopped, the saturation rate (the
    highest rate before the step that met the stop rule; None where no step met it)."""

    rates_run: list[float]
    stopped_at_rate: float | None
    stop_reason: str | None
    saturation_rate: float | None
    rule: dict[str, float] | None     # the stop rule as the first step's records carry it

    def to_json(self) -> dict[str, Any]:
        return {"rates_run": list(self.rates_run), "stopped_at_rate": self.stopped_at_rate,
                "stop_reason": self.stop_reason, "saturation_rate": self.saturation_rate, "rule": self.rule}


def _sweeps(rows: list[dict[str, Any]]) -> dict[str, SweepSummary]:
    """Per prompt length (as a string) of a sweep: its summary."""
    out: dict[str, SweepSummary] = {}
    for length in sorted({r["prompt_length"] for r in rows if r.get("sweep") or r.get("sweep_skipped")}):
        steps = sorted((r for r in rows if r["prompt_length"] == length and r.get("sweep")), key=lambda r: r["rate"])
        stop = next((r for r in steps if r["sweep"].get("stop")), None)
        before = [r["rate"] for r in steps if stop is None or r["rate"] < stop["rate"]]
        out[str(length)] = SweepSummary(rates_run=[r["rate"] for r in steps],
                                        stopped_at_rate=stop["rate"] if stop else None,
                                        stop_reason=stop["sweep"]["stop"] if stop else None,
                                        saturation_rate=(before[-1] if before else None) if stop else None,
                                        rule=steps[0]["sweep"].get("rule") if steps else None)
    return out



def summarize_load(records: list[dict[str, Any]]) -> dict[str, Any]:
    rows = [_row(length, rate, recs) for (length, rate), recs in sorted(load_groups(records).items())]
    return {"rows": rows, "sweeps": {length: sw.to_json() for length, sw in _sweeps(rows).items()}, "tail_samples_needed": dict(TAIL_NEEDED)}


def goodput_ratio_ci(base_row: dict[str, Any], cand_row: dict[str, Any], z: float = 1.959964) -> tuple[float, float] | None:
    """95% interval of the goodput ratio: the Katz log interval of the ratio of the two shares meeting
    every SLO (met / sent per side, binomial), times the ratio of requests sent per second of wall time.

    Katz: ln(RR) +- z * sqrt(1/a - 1/n1 + 1/b - 1/n0); a side that met none, or all, gets half a request
    either way (Haldane's correction) so the interval stays finite and honest about the small count."""
    if not base_row.get("duration_s") or not cand_row.get("duration_s"):
        return None
    n0, n1 = base_row["n_sent"], cand_row["n_sent"]
    b = round((base_row.get("slo_met_share") or 0.0) * n0)
    a = round((cand_row.get("slo_met_share") or 0.0) * n1)
    if n0 <= 0 or n1 <= 0:
        return None
    scale = (cand_row["n_sent"] / cand_row["duration_s"]) / (base_row["n_sent"] / base_row["duration_s"])
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
    baseline: dict[str, Any]          # _row of each side, as summarize_load writes it
    candidate: dict[str, Any]
    goodput_ratio: float | None       # candidate / baseline
    goodput_ratio_ci95: tuple[float, float] | None

    def to_json(self) -> dict[str, Any]:
        return {"prompt_length": self.prompt_length, "rate": self.rate, "baseline": self.baseline,
                "candidate": self.candidate, "goodput_ratio": self.goodput_ratio,
                "goodput_ratio_ci95": list(self.goodput_ratio_ci95) if self.goodput_ratio_ci95 else None,
                "n_baseline": self.baseline["n_sent"], "n_candidate": self.candidate["n_sent"]}


def load_compare(base_records: list[dict[str, Any]], cand_records: list[dict[str, Any]],
                 ) -> dict[str, Any] | None:
    """compare.json["speed"]["load"]; None where neither side has open-loop records."""
    bg, cg = load_groups(base_records), load_groups(cand_records)
    if not bg and not cg:
        return None
    rows = []
    for key in sorted(set(bg) & set(cg)):
        b, c = _row(*key, bg[key]), _row(*key, cg[key])
        ratio, ci = None, None
        if not (b.get("sweep_skipped") or c.get("sweep_skipped")):     # a step not sent has no ratio
            bgp, cgp = b["goodput"], c["goodput"]
            ratio = cgp / bgp if bgp and cgp is not None else None
            ci = goodput_ratio_ci(b, c) if ratio is not None else None
        rows.append(LoadPair(key[0], key[1], b, c, ratio, ci).to_json())
    base_sum, cand_sum = summarize_load(base_records), summarize_load(cand_records)
    only = sorted({f"{l}/r{r:g}" for l, r in bg} ^ {f"{l}/r{r:g}" for l, r in cg})
    return {"rows": rows, "sweeps": {"baseline": base_sum["sweeps"], "candidate": cand_sum["sweeps"]},
            "unpaired_groups": only, "tail_samples_needed": dict(TAIL_NEEDED),
            "interval": GOODPUT_INTERVAL,
            "ratio_meaning": "candidate goodput / baseline goodput; > 1 means the candidate served more "
                             "requests within the SLOs per second"}


def _f(v: Any, digits: int = 3) -> str:
    return "-" if v is None else f"{v:.{digits}g}"


def format_load(load: dict[str, Any]) -> list[str]:
    """compare.json speed.load as text lines: goodput per rate, the ratio and interval, the SLO shares,
    the server's queue and KV-cache usage, and where a p99 is only indicative."""
    lines = ["serving load (goodput = requests/s within every SLO; candidate / baseline):"]
    for r in load.get("rows") or []:
        b, c = r.get("baseline") or {}, r.get("candidate") or {}
        where = f"  {r.get('prompt_length')} tokens @ {_f(r.get('rate'))} req/s:"
        if b.get("sweep_skipped") or c.get("sweep_skipped"):
            lines.append(f"{where} not sent (the sweep had stopped)")
            continue
        ci = r.get("goodput_ratio_ci95")
        text = (f"{where} goodput {_f(b.get('goodput'))} -> {_f(c.get('goodput'))}, ratio {_f(r.get('goodput_ratio'))}"
                + (f" [{_f(ci[0])}, {_f(ci[1])}]" if ci else "")
                + f", within SLOs {_pct(b.get('slo_met_share'))} -> {_pct(c.get('slo_met_share'))}")
        servers = [s.get("server") for s in (b, c)]
        if any(isinstance(s, dict) for s in servers):
            def fig(s: Any, key: str) -> str:
                v = s.get(key) if isinstance(s, dict) else None
                return _f(v.get("max")) if isinstance(v, dict) else _f(v)
            text += ("; server " + "/".join(str((s or {}).get("source")) for s in servers)
                     + f": queue max {fig(servers[0], 'queue_length')} -> {fig(servers[1], 'queue_length')}"
                     + f", KV-cache max {fig(servers[0], 'kv_cache_usage')} -> {fig(servers[1], 'kv_cache_usage')}"
                     + f", prefix hits {fig(servers[0], 'prefix_cache_hit_rate')} -> {fig(servers[1], 'prefix_cache_hit_rate')}"
                     + f", preemptions {fig(servers[0], 'preemptions')} -> {fig(servers[1], 'preemptions')}")
        tails = [(side, s.get("ttft_s")) for side, s in (("baseline", b), ("candidate", c))]
        short = [f"{side} n {t['n']}" for side, t in tails if isinstance(t, dict) and t.get("p99_indicative")]
        if short:
            text += f"; TTFT p99 indicative ({', '.join(short)} < {TAIL_NEEDED['p99']})"
        lines.append(text)
    for side, sweeps in (load.get("sweeps") or {}).items():
        for length, s in (sweeps or {}).items():
            lines.append(f"  sweep {side}, {length} tokens: rates {s.get('rates_run')}, "
                         + (f"stopped at {_f(s.get('stopped_at_rate'))} ({s.get('stop_reason')}), saturation "
                            f"{_f(s.get('saturation_rate'))} req/s" if s.get("stop_reason") else "saturation not reached"))
    return lines


def _pct(v: Any) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"
