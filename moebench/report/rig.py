"""The report's rig sections, from compare.json: GPUs card by card and summed (NVML memory and
energy), torch's own memory per engine phase beside NVML's, energy by phase, and the engine's
decode choices and tier telemetry (per-layer bars; host hit rate against decode speed)."""
from __future__ import annotations

from markupsafe import Markup

from moebench.json_fields import as_object
from moebench.json_types import JsonObject, JsonValue
from moebench.report import plots
from moebench.report.views import (CardRow, EngineSide, EngineView, Figure, RigPhaseRow, RigView, TierTotals,
                                   TorchRow)
from moebench.store.records import ItemRecord, Manifest
from moebench.store.sections import number

SIDES = ("baseline", "candidate")


def _get(d: JsonValue, *keys: str) -> JsonValue:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def cards_rows(memory: JsonValue, energy: JsonValue) -> list[CardRow]:
    """One row per card and side, the sum last: peak used, min free, reserved, idle W, whole-run J
    by counter and by integrated power, their relative difference."""
    rows = []
    keys = sorted((k for k in as_object(_get(memory, "gpus")) if k != "sum"), key=lambda k: (len(k), k))
    for key in keys + ["sum"]:
        for side in SIDES:
            m = _get(memory, "gpus", key, side)
            e = _get(energy, "gpus", key, side)
            if not m and not e:
                continue
            m, e = as_object(m), as_object(e)
            rows.append(CardRow(card="sum" if key == "sum" else key.replace("gpu", "GPU "), side=side,
                                peak_used_bytes=m.get("peak_used_bytes"), min_free_bytes=m.get("min_free_bytes"),
                                reserved_bytes=m.get("reserved_bytes"), idle_power_w=e.get("idle_power_w"),
                                counter_j=e.get("whole_run_counter_j"), integral_j=e.get("whole_run_integral_j"),
                                rel_diff=e.get("rel_diff_integral_vs_counter")))
    return rows


def torch_rows(memory: JsonValue) -> list[TorchRow]:
    """torch's peak allocated / reserved per engine phase and side, with NVML's peak used beside."""
    rows = []
    for side in SIDES:
        tm = _get(memory, "torch", side)
        if not isinstance(tm, dict) or not tm.get("available"):
            continue
        nvml_peak = _get(memory, side, "peak_used_bytes")
        for phase, v in as_object(tm.get("phases") or {}).items():
            v = as_object(v)
            rows.append(TorchRow(side=side, phase=phase, allocated=v.get("peak_allocated_bytes"),
                                 reserved=v.get("peak_reserved_bytes"), nvml_peak_used=nvml_peak))
    return rows


def phase_rows(energy: JsonValue) -> list[RigPhaseRow]:
    rows = []
    for phase, sides in as_object(_get(energy, "phases") or {}).items():
        row = RigPhaseRow(phase=phase)
        for side in SIDES:
            p = as_object(as_object(sides).get(side) or {})
            setattr(row, f"{side}_s", p.get("duration_s"))
            setattr(row, f"{side}_j", p.get("energy_j"))
            setattr(row, f"{side}_net_j", p.get("net_j"))
            setattr(row, f"{side}_w", p.get("mean_power_w"))
        rows.append(row)
    return rows


def _tier_plots(side: str, tiers: JsonObject) -> list[Figure]:
    raw_layers = tiers.get("layers")
    layers = [as_object(layer) for layer in raw_layers] if isinstance(raw_layers, list) else []
    labels = [str(layer.get("layer")) for layer in layers]
    out = []
    picks = [("GPU tier", [number(layer.get("picks_gpu")) for layer in layers]),
             ("host: cache hits", [number(layer.get("host_hits")) for layer in layers]),
             ("host: prefetch hits", [number(layer.get("prefetch_hits")) for layer in layers]),
             ("host: copied (misses)", [number(layer.get("host_misses")) for layer in layers]),
             ("host: read over PCIe", [number(layer.get("host_direct")) for layer in layers]),
             ("host: tail-skipped", [number(layer.get("route_tail_skips")) for layer in layers])]
    for name, values in picks:
        if any(v for v in values):
            out.append(Figure(f"{side}: expert picks per layer, {name}",
                              Markup(plots.bar_plot(labels, values, "expert picks", xlabel="MoE layer"))))
    rate = [number(layer.get("host_hit_rate")) for layer in layers]
    if any(v is not None for v in rate):
        out.append(Figure(f"{side}: host-tier picks served from GPU memory, per layer",
                          Markup(plots.bar_plot(labels, rate, "host hit rate (%)", y_max=1.0, xlabel="MoE layer",
                                                yfmt=plots.fmt_percent_tick))))
    moved = [number(layer.get("bytes_h2d")) for layer in layers]
    if any(v for v in moved):
        out.append(Figure(f"{side}: bytes copied host to device, per layer",
                          Markup(plots.bar_plot(labels, [m / 2**20 if m is not None else None for m in moved],
                                                "MiB copied", xlabel="MoE layer"))))
    return out


def engine_context(engine: JsonValue) -> EngineView | None:
    """Choices, tier totals and plots per side, and the hit-rate-vs-speed points."""
    if not isinstance(engine, dict):
        return None
    sides, figs = [], []
    for side in SIDES:
        s = engine.get(side)
        if not isinstance(s, dict):
            continue
        tiers = s.get("tiers") if isinstance(s.get("tiers"), dict) else None
        total = as_object(tiers).get("total") if tiers else None
        sides.append(EngineSide(side=side, choices=sorted(as_object(s.get("choices") or {}).items()),
                                decode_steps=s.get("decode_steps"), decode_tok_s=s.get("decode_tok_s_median"),
                                total=TierTotals.from_json(total) if isinstance(total, dict) and total else None))
        if tiers:
            figs += _tier_plots(side, tiers)
    points = [p for p in engine.get("hit_rate_vs_speed") or [] if isinstance(p, dict)]
    series = [(p["run"], [number(p.get("host_hit_rate"))], [number(p.get("decode_tok_s_median"))]) for p in points]
    if any(xs[0] is not None and ys[0] is not None for _, xs, ys in series):
        figs.append(Figure("host hit rate against decode speed (median over the speed task)",
                           Markup(plots.line_plot(series, "host hit rate (%)", "decode tok/s",
                                                  xfmt=plots.fmt_percent_tick))))
    if not sides:
        return None
    return EngineView(sides=sides, plots=figs)


def rig_context(memory: JsonValue, energy: JsonValue, engine: JsonValue) -> RigView | None:
    """Everything the rig sections show from compare.json's memory, energy and engine sections, or
    None when they hold none of it."""
    phases = phase_rows(energy)
    ctx = RigView(cards=cards_rows(memory, energy), torch=torch_rows(memory), phases=phases,
                  phase_sides=[s for s in SIDES if any(getattr(r, f"{s}_s") is not None for r in phases)],
                  headlines={side: _get(memory, "cards", side, "headline") for side in SIDES},
                  engine=engine_context(engine))
    if not (ctx.cards or ctx.torch or ctx.phases or ctx.engine):
        return None
    return ctx


def _one_side(d: JsonValue) -> JsonValue:
    """A compare-shaped part with only its "candidate" entries kept (a run is shown as that side)."""
    if isinstance(d, dict):
        if "baseline" in d or "candidate" in d:
            d = {k: v for k, v in d.items() if k != "baseline"}
        return {k: _one_side(v) for k, v in d.items()}
    return d


def run_rig_context(manifest: Manifest, records: list[ItemRecord]) -> RigView | None:
    """The rig sections for a single run: its probe summary and engine telemetry, laid out as the
    candidate side of a compare."""
    from moebench.compare.engine import engine_compare
    from moebench.probes.energy_compare import memory_energy_compare
    raw = manifest.to_dict()
    section = memory_energy_compare(raw, raw)
    compare = {k: _one_side(v) for k, v in section.items() if isinstance(v, dict) and v.get("available")}
    engine = engine_compare(None, manifest, [], records)
    if engine:
        compare["engine"] = _one_side(engine.to_json())
        compare["engine"]["hit_rate_vs_speed"] = engine.hit_rate_vs_speed()
    return rig_context(compare.get("memory"), compare.get("energy"), compare.get("engine"))

