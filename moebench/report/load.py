"""The report's serving-load part (compare.json speed.load): goodput against the offered rate for both
builds, the goodput ratio with its interval, SLO shares, latency tails marked indicative where they rest
on fewer samples than MLPerf's early-stopping rule asks, the server's own state per group, and where a
sweep stopped."""
from __future__ import annotations

from markupsafe import Markup

from moebench.json_fields import as_object
from moebench.json_types import JsonValue
from moebench.report import plots
from moebench.report.views import LoadRow, LoadSide, LoadView, SweepLine, Tail
from moebench.store.sections import number

SERVER_FIGURES = (("kv_cache_usage", "KV-cache usage mean / max"), ("queue_length", "queue length mean / max"),
                  ("running", "running mean / max"), ("prefix_cache_hit_rate", "prefix-cache hit rate"),
                  ("preemptions", "preemptions"))


def _pair(v: JsonValue) -> str:
    if isinstance(v, dict):
        mean, mx = number(v.get("mean")), number(v.get("max"))
        return "-" if mean is None else f"{mean:.3g} / {mx:.3g}"
    n = number(v)
    return "-" if n is None else f"{n:.3g}"


def _tail(st: JsonValue, p: str) -> Tail:
    """A percentile with its sample count and whether it is only indicative (fewer than the rule's n)."""
    if not isinstance(st, dict):
        return Tail(value=None, indicative=False, n=None, needs=None)
    return Tail(value=number(st.get(p)), indicative=bool(st.get(f"{p}_indicative")), n=st.get("n"),
                needs=st.get(f"{p}_needs_n"))


def goodput_plot(rows: list[LoadRow]) -> Markup:
    """Goodput (requests/s within every SLO) against the offered rate, baseline and candidate, a pair of
    lines per prompt length."""
    lengths = sorted({r.prompt_length for r in rows})
    series, colours = [], []
    for length in lengths:
        group = sorted((r for r in rows if r.prompt_length == length and not r.skipped), key=lambda r: r.rate)
        suffix = f", {length} tokens" if len(lengths) > 1 else ""
        for role, colour in (("baseline", plots.BASELINE), ("candidate", plots.CANDIDATE)):
            series.append((role + suffix, [r.rate for r in group], [getattr(r, role).goodput for r in group]))
            colours.append(colour if len(lengths) == 1 else plots.SERIES_COLOURS[len(colours) % len(plots.SERIES_COLOURS)])
    log_x = len({r.rate for r in rows}) > 2
    return Markup(plots.line_plot(series, "offered rate (requests/s)", "goodput (requests/s)",
                                  log_x=log_x, colours=colours))


def _load_side(side: JsonValue) -> LoadSide:
    """One side of a compare.json speed.load row, as the table shows it."""
    side = as_object(side)
    server = side.get("server") if isinstance(side.get("server"), dict) else None
    slos = side.get("slos") or {}
    return LoadSide(goodput=number(side.get("goodput")), share=number(side.get("slo_met_share")),
                    n=side.get("n_sent"), errors=side.get("n_errors"), achieved=number(side.get("achieved_rate")),
                    client_limited=bool(side.get("client_limited")),
                    ttft_p90=_tail(side.get("ttft_s"), "p90"), ttft_p99=_tail(side.get("ttft_s"), "p99"),
                    tpot_p99=_tail(side.get("tpot_s"), "p99"),
                    server=[(label, _pair(server.get(k))) for k, label in SERVER_FIGURES] if server else None,
                    server_source=server.get("source") if server else None,
                    server_samples=server.get("n_samples") if server else None,
                    slos=sorted(slos.items()) if isinstance(slos, dict) else [])


def load_context(speed: JsonValue) -> LoadView | None:
    load = as_object(as_object(speed).get("load"))
    rows_raw = load.get("rows")
    if not load or not isinstance(rows_raw, list) or not rows_raw:
        return None
    rows = []
    for r in rows_raw:
        if not isinstance(r, dict):
            continue
        b, c = as_object(r.get("baseline")), as_object(r.get("candidate"))
        ci = r.get("goodput_ratio_ci95")
        rows.append(LoadRow(prompt_length=r.get("prompt_length"), rate=number(r.get("rate")),
                            skipped=bool(b.get("sweep_skipped") or c.get("sweep_skipped")),
                            ratio=number(r.get("goodput_ratio")),
                            ci=ci if isinstance(ci, list) and len(ci) == 2 else None,
                            baseline=_load_side(b), candidate=_load_side(c)))
    rows = [r for r in rows if r.rate is not None]
    slos = next((r.baseline.slos for r in rows if r.baseline.slos), [])
    sweeps = []
    for role in ("baseline", "candidate"):
        for length, s in as_object(as_object(load.get("sweeps") or {}).get(role) or {}).items():
            if isinstance(s, dict):
                rates = s.get("rates_run")
                sweeps.append(SweepLine(role=role, prompt_length=length,
                                        rates_run=rates if isinstance(rates, list) else [],
                                        stop_reason=s.get("stop_reason"), stopped_at_rate=s.get("stopped_at_rate"),
                                        saturation_rate=s.get("saturation_rate")))
    needs = as_object(load.get("tail_samples_needed") or {})
    return LoadView(rows=rows, plot=goodput_plot(rows), slos=slos, sweeps=sweeps, needs_p90=needs.get("p90"),
                    needs_p99=needs.get("p99"), interval=load.get("interval"),
                    server=any(r.baseline.server or r.candidate.server for r in rows),
                    server_labels=[label for _, label in SERVER_FIGURES])
