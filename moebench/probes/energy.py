"""Memory and energy figures from NVML samples and phase marks (pure functions, no NVML needed).

Energy per phase comes from the total-energy counter (differences between consecutive samples,
clipped to the phase windows; negative differences, i.e. counter resets, are rejected), and is
cross-checked against the trapezoid integral of the power samples over the same windows. Idle power
is measured in the probe's "baseline_idle" window (else any "idle" window) and subtracted: both
gross and net figures are reported.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, TypedDict

from moebench.config import ProbeKeys
from moebench.json_types import JsonObject
from moebench.probes.records import (WORK_PHASES, CardBrief, CardEnergy, CardsSummary, Cost, EnergyFigures,
                                     EnergySummary, GrossNet, MemorySummary, PhaseEnergy, PhaseTokens, TokenEnergy,
                                     WholeRun)

JOULES_PER_KWH = 3.6e6
POWER_COLUMNS = ("power_instant_w", "power_usage_w", "power_w", "power_avg_w")   # preference order

# One sample row: t (seconds), gpu (the card's NVML index; "sum" in a per-tick sum) and the counters
# (moebench.probes.nvml.SAMPLE_COLUMNS), None or NaN where the card did not answer.
Sample = dict[str, float | str | None]
# A phase mark {"phase": name, "t": start_s} (moebench.probes.nvml.PhaseMark.to_json, nvml_phases.json).
PhaseRow = Mapping[str, str | float]


def _rows(samples: Any) -> list[Sample]:
    """Samples as a list of dicts sorted by t (accepts a DataFrame, a list of dicts, or a dict of columns)."""
    if hasattr(samples, "to_dict"):
        rows = samples.to_dict("records")
    elif isinstance(samples, dict):
        keys = list(samples)
        n = len(samples[keys[0]]) if keys else 0
        rows = [{k: samples[k][i] for k in keys} for i in range(n)]
    else:
        rows = list(samples)
    for i, r in enumerate(rows):
        if "t" not in r or not _num(r["t"]):
            raise ValueError(f"energy_summary: sample {i} has no numeric 't' (seconds): {r!r}")
    return sorted(rows, key=lambda r: float(r["t"]))


def _num(v: Any) -> bool:
    return v is not None and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))


def _series(rows: list[Sample], col: str) -> tuple[list[float], list[float]]:
    ts, ys = [], []
    for r in rows:
        v = r.get(col)
        if _num(v):
            ts.append(float(r["t"]))
            ys.append(float(v))
    return ts, ys


def phase_windows(phases: Iterable[PhaseRow], t_end: float) -> list[tuple[str, float, float]]:
    """[(phase, start, end)]: each mark lasts until the next; "end" closes the last one."""
    marks = sorted(({"phase": str(p["phase"]), "t": float(p["t"])} for p in phases), key=lambda p: p["t"])
    out = []
    for i, m in enumerate(marks):
        if m["phase"] == "end":
            continue
        stop = marks[i + 1]["t"] if i + 1 < len(marks) else t_end
        if stop > m["t"]:
            out.append((m["phase"], m["t"], stop))
    return out


def counter_energy_j(ts: list[float], mj: list[float], a: float, b: float) -> tuple[float, int]:
    """Joules from the energy counter over [a, b]: consecutive differences, pro rata to the overlap.

    Returns (joules, rejected): a negative difference (counter reset on driver reload) is dropped.
    """
    total, rejected = 0.0, 0
    for i in range(len(ts) - 1):
        t0, t1 = ts[i], ts[i + 1]
        lo, hi = max(a, t0), min(b, t1)
        if hi <= lo or t1 <= t0:
            continue
        d = mj[i + 1] - mj[i]
        if d < 0:
            rejected += 1
            continue
        total += d * (hi - lo) / (t1 - t0)
    return total / 1000.0, rejected


def integrated_energy_j(ts: list[float], watts: list[float], a: float, b: float) -> float:
    """Trapezoid integral of power (W) over [a, b], the power linear between samples."""
    total = 0.0
    for i in range(len(ts) - 1):
        t0, t1 = ts[i], ts[i + 1]
        lo, hi = max(a, t0), min(b, t1)
        if hi <= lo or t1 <= t0:
            continue
        p = lambda t: watts[i] + (watts[i + 1] - watts[i]) * (t - t0) / (t1 - t0)   # noqa: E731
        total += (p(lo) + p(hi)) / 2.0 * (hi - lo)
    return total


def _rel(a: float | None, b: float | None) -> float | None:
    return (a - b) / b if a is not None and b else None


def memory_summary(samples: Any) -> MemorySummary:
    rows = _rows(samples)
    used = [float(r["mem_used_bytes"]) for r in rows if _num(r.get("mem_used_bytes"))]
    free = [float(r["mem_free_bytes"]) for r in rows if _num(r.get("mem_free_bytes"))]
    reserved = [float(r["mem_reserved_bytes"]) for r in rows if _num(r.get("mem_reserved_bytes"))]
    total = [float(r["mem_total_bytes"]) for r in rows if _num(r.get("mem_total_bytes"))]
    ts = [float(r["t"]) for r in rows]
    gaps = sorted(b - a for a, b in zip(ts, ts[1:]))
    return MemorySummary(
        source="NVML nvmlDeviceGetMemoryInfo v2 (used excludes driver-reserved memory)",
        n_samples=len(rows),
        interval_s_median=gaps[len(gaps) // 2] if gaps else None,
        peak_used_bytes=int(max(used)) if used else None,
        min_free_bytes=int(min(free)) if free else None,
        reserved_bytes=int(max(reserved)) if reserved else None,
        total_bytes=int(max(total)) if total else None,
    )


class TariffTable(TypedDict, total=False):
    """Tariffs written as a table (tests, benchmarks): prices per kWh and their currency."""

    day: float | None
    night: float | None
    currency: str


@dataclass(frozen=True)
class Tariffs:
    """Electricity prices per kWh by day and by night (either may be unset) and their currency: what
    the cost per million tokens is priced with."""

    day: float | None = None
    night: float | None = None
    currency: str = "EUR"

    @classmethod
    def of(cls, value: "Tariffs | TariffTable | None") -> "Tariffs | None":
        """Tariffs from a table {"day", "night", "currency"} (tests, benchmarks); None for none or an
        empty table."""
        if value is None or isinstance(value, Tariffs):
            return value
        if not value:
            return None
        return cls(day=value.get("day"), night=value.get("night"), currency=value.get("currency", "EUR"))


def energy_summary(samples: Any, phases: Iterable[PhaseRow],
                   tokens: PhaseTokens | None = None,
                   tariffs: Tariffs | TariffTable | None = None) -> JsonObject:
    """summarize(...) as the JSON the manifest's probe summary holds."""
    return summarize(samples, phases, tokens=tokens, tariffs=tariffs).to_json()


def summarize(samples: Any, phases: Iterable[PhaseRow],
              tokens: PhaseTokens | None = None,
              tariffs: Tariffs | TariffTable | None = None) -> EnergySummary:
    """Memory and energy figures of one sampled run.

    samples: rows with t (s) and any of mem_*_bytes, energy_mj, power_instant_w / power_usage_w / power_w.
    phases: [{"phase": name, "t": start_s}], each lasting until the next mark ("end" closes the last).
    tokens: {"prefill": n, "decode": m} processed inside those phases (for J/token).
    tariffs: the prices per kWh, or a table {"day": price, "night": price, "currency": "EUR"}.
    """
    prices = Tariffs.of(tariffs)
    rows = _rows(samples)
    memory = memory_summary(rows)
    if not rows:
        return EnergySummary(memory, None)
    t_end = float(rows[-1]["t"])
    windows = phase_windows(phases, t_end)
    et, emj = _series(rows, "energy_mj")
    power_col = next((c for c in POWER_COLUMNS if len(_series(rows, c)[0]) >= 2), None)
    pt, pw = _series(rows, power_col) if power_col else ([], [])
    has_counter, has_power = len(et) >= 2, len(pt) >= 2

    per_phase: dict[str, PhaseEnergy] = {}
    rejected = 0
    for name, a, b in windows:
        e = per_phase.setdefault(name, PhaseEnergy())
        e.windows += 1
        e.duration_s += b - a
        if has_counter:
            j, rej = counter_energy_j(et, emj, a, b)
            e.counter_j = (e.counter_j or 0.0) + j
            rejected += rej
        if has_power:
            e.integral_j = (e.integral_j or 0.0) + integrated_energy_j(pt, pw, a, b)
    for e in per_phase.values():
        if not has_counter:
            e.counter_j = None
        if not has_power:
            e.integral_j = None
        e.energy_j = e.counter_j if e.counter_j is not None else e.integral_j
        e.rel_diff_integral_vs_counter = _rel(e.integral_j, e.counter_j)
        e.mean_power_w = e.energy_j / e.duration_s if e.energy_j is not None and e.duration_s else None

    idle_name = "baseline_idle" if "baseline_idle" in per_phase else ("idle" if "idle" in per_phase else None)
    idle_w = per_phase[idle_name].mean_power_w if idle_name else None
    for e in per_phase.values():
        e.idle_j = idle_w * e.duration_s if idle_w is not None else None
        e.net_j = e.energy_j - e.idle_j if e.energy_j is not None and e.idle_j is not None else None

    t0 = float(rows[0]["t"])
    counter_whole = counter_energy_j(et, emj, t0, t_end)[0] if has_counter else None
    integral_whole = integrated_energy_j(pt, pw, t0, t_end) if has_power else None
    whole = WholeRun(duration_s=t_end - t0, counter_j=counter_whole, integral_j=integral_whole,
                     rel_diff_integral_vs_counter=_rel(integral_whole, counter_whole))

    energy = EnergyFigures(
        source="NVML total-energy counter (mJ), cross-checked by the trapezoid integral of " + str(power_col),
        energy_source="counter" if has_counter else ("integral" if has_power else None),
        power_column=power_col, idle_power_w=idle_w, idle_phase=idle_name,
        negative_deltas_rejected=rejected, phases=per_phase, whole_run=whole)
    counted = {k: int(v) for k, v in (tokens or {}).items()}
    work_gross = work_net = 0.0
    work_tokens = 0
    net_ok = True
    for ph in WORK_PHASES:
        n = counted.get(ph, 0)
        pe = per_phase.get(ph)
        if not n or pe is None or pe.energy_j is None:
            continue
        gross, net = pe.energy_j, pe.net_j
        energy.per_token[ph] = TokenEnergy(tokens=n, gross_j_per_token=gross / n,
                                           net_j_per_token=net / n if net is not None else None)
        energy.kwh_per_million_tokens[ph] = GrossNet(gross=gross / n * 1e6 / JOULES_PER_KWH,
                                                     net=net / n * 1e6 / JOULES_PER_KWH if net is not None else None)
        work_gross += gross
        work_tokens += n
        if net is None:
            net_ok = False
        else:
            work_net += net
    kwh_pm = energy.kwh_per_million_tokens
    if work_tokens:
        kwh_pm["all"] = GrossNet(gross=work_gross / work_tokens * 1e6 / JOULES_PER_KWH,
                                 net=work_net / work_tokens * 1e6 / JOULES_PER_KWH if net_ok else None)
    if prices is not None and kwh_pm:
        def priced(price: float | None) -> dict[str, GrossNet] | None:
            if price is None:
                return None
            return {ph: GrossNet(g.gross * float(price), g.net * float(price) if g.net is not None else None)
                    for ph, g in kwh_pm.items()}
        energy.cost_per_million_tokens = Cost(prices.currency, priced(prices.day), priced(prices.night))
    return EnergySummary(memory, energy)


SUMMED_COLUMNS = ("mem_total_bytes", "mem_used_bytes", "mem_free_bytes", "mem_reserved_bytes",
                  "energy_mj") + POWER_COLUMNS


def summed_rows(rows: list[Sample], cards: list[int | str]) -> list[Sample]:
    """One row per tick holding the sum over `cards` of each counter; a counter is summed only at
    ticks where every card answered it (else that tick leaves it out, never a partial sum)."""
    by_t: dict[float, dict[float | str | None, Sample]] = {}
    for r in rows:
        by_t.setdefault(float(r["t"]), {})[r.get("gpu")] = r
    out = []
    for t in sorted(by_t):
        tick = by_t[t]
        s: Sample = {"t": t, "gpu": "sum"}
        for col in SUMMED_COLUMNS:
            vals = [tick[c].get(col) for c in cards if c in tick]
            if len(vals) == len(cards) and all(_num(v) for v in vals):
                s[col] = float(sum(vals))
        out.append(s)
    return out


def cards_summary(samples: Any, phases: Iterable[PhaseRow], tokens: PhaseTokens | None = None,
                  tariffs: Tariffs | TariffTable | None = None) -> JsonObject:
    """summarize_cards(...) as the JSON the manifest's probe summary holds."""
    return summarize_cards(samples, phases, tokens=tokens, tariffs=tariffs).to_json()


def summarize_cards(samples: Any, phases: Iterable[PhaseRow], tokens: PhaseTokens | None = None,
                    tariffs: Tariffs | TariffTable | None = None) -> CardsSummary:
    """summarize over one or several cards (samples with a `gpu` column, one row per card and tick).

    The headline memory and energy are the one card's, or with several cards those of their per-tick
    sum (peak memory used by all cards at once; energy, idle power and J/token of the whole rig).
    `gpus`: each card's memory and energy by phase; `cards`: how many."""
    phases = list(phases)
    rows = _rows(samples)
    cards = sorted({r.get("gpu") for r in rows if r.get("gpu") is not None}, key=str)
    if len(cards) <= 1:
        one = summarize(rows, phases, tokens=tokens, tariffs=tariffs)
        return CardsSummary(one.memory, one.energy, cards=1, headline=f"GPU {cards[0]}" if cards else "GPU",
                            gpus=[CardBrief(cards[0] if cards else None, one.memory, _card_energy(one.energy))])
    rig = summarize(summed_rows(rows, cards), phases, tokens=tokens, tariffs=tariffs)
    rig.memory.source += f"; summed over GPUs {', '.join(map(str, cards))} at each tick"
    gpus = []
    for c in cards:
        card = summarize([r for r in rows if r.get("gpu") == c], phases)
        gpus.append(CardBrief(c, card.memory, _card_energy(card.energy)))
    return CardsSummary(rig.memory, rig.energy, cards=len(cards), headline=f"sum of GPUs {', '.join(map(str, cards))}",
                        gpus=gpus)


def _card_energy(e: EnergyFigures | None) -> CardEnergy | None:
    return CardEnergy.of(e) if e is not None else None


def tokens_from_records(records: Iterable[JsonObject], tasks: tuple[str, ...] = ("speed", "needle")) -> PhaseTokens:
    """Prefill and decode token totals of ok records (prompt_tokens, output_tokens) of the given tasks."""
    pre = dec = 0
    for r in records:
        if r.get("status") == "ok" and r.get("task") in tasks:
            pre += int(r.get("prompt_tokens") or 0)
            dec += int(r.get("output_tokens") or 0)
    return {"prefill": pre, "decode": dec}


def tariffs_from_probes(probes: ProbeKeys) -> Tariffs | None:
    """The suite's [probes] tariff keys as energy_summary's `tariffs` (None when none is set)."""
    day, night = probes.get("tariff_day_per_kwh"), probes.get("tariff_night_per_kwh")
    if day is None and night is None:
        return None
    return Tariffs(day=day, night=night, currency=probes.get("currency", "EUR"))
