"""compare.json's memory and energy sections from two runs' manifests: both sides' probe figures and
candidate/baseline ratios, per card and for the headline ("sum").

The manifests are read at the boundary (`ProbeSide.from_manifest`: the probe's summary parsed into
probes.records classes, the engine's torch counters beside it); everything after works on those
classes, and `MemoryEnergyCompare.to_json()` is the two sections as compare.json holds them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moebench.json_fields import is_of
from moebench.json_types import JsonObject, JsonValue
from moebench.probes.records import (WORK_PHASES, CardEnergy, CardsSummary, Cost, EnergyFigures, GrossNet,
                                     MemorySummary, SummaryError, WholeRun, json_object)

SIDES = ("baseline", "candidate")
MEMORY_KEYS = ("peak_used_bytes", "min_free_bytes", "reserved_bytes", "total_bytes", "n_samples")
DELTA_KEYS = ("peak_used_bytes", "min_free_bytes", "reserved_bytes")


def _ratio(x: float | None, y: float | None) -> float | None:
    """Candidate over baseline; None where the baseline is missing or zero, or the candidate missing."""
    return (y / x) if x and y is not None else None


def _part(d: JsonObject, key: str, where: str) -> JsonObject:
    """d[key] as an object; an absent or null part reads as empty (a run without that part)."""
    v = d.get(key)
    return {} if v is None else json_object(v, f"{where}.{key}")


@dataclass(frozen=True)
class ProbeSide:
    """What one run's manifest gives the sections: the probe summary (None with why), and the engine's
    own torch memory counters, reported beside NVML's and never mixed with them."""

    summary: CardsSummary | None
    reason: str | None
    torch_peak_allocated_bytes: int | None
    torch_memory: JsonObject | None          # the engine's telemetry, passed on as written

    @classmethod
    def from_manifest(cls, manifest: JsonValue, where: str) -> ProbeSide:
        """From manifest.json's probes.nvml and engine (`where` names the manifest in errors)."""
        m = {} if manifest is None else json_object(manifest, where)
        nv = _part(_part(m, "probes", where), "nvml", f"{where}.probes")
        summary, reason = None, None
        if nv.get("available") and nv.get("summary") is not None:
            summary = CardsSummary.from_json(nv["summary"], f"{where}.probes.nvml.summary")
        else:
            reason = str(nv.get("reason") or "no NVML summary in the manifest")
        engine = _part(m, "engine", where)
        torch_peak = engine.get("torch_peak_allocated_bytes") or m.get("torch_peak_allocated_bytes")
        if torch_peak is not None and not is_of(torch_peak, (int,)):
            raise SummaryError(f"{where}: key 'torch_peak_allocated_bytes' is {torch_peak!r}, expected an integer")
        torch_memory = engine.get("torch_memory")
        return cls(summary=summary, reason=reason,
                   torch_peak_allocated_bytes=torch_peak,
                   torch_memory=json_object(torch_memory, f"{where}.engine.torch_memory") if torch_memory else None)


@dataclass(frozen=True)
class Unavailable:
    """A section neither side can fill: why, per side that had no summary."""

    reason: dict[str, str]

    def to_json(self) -> JsonObject:
        return {"available": False, "reason": dict(self.reason)}


@dataclass(frozen=True)
class CardMemory:
    """One card's (or the headline's) memory figures in the per-card table (MEMORY_KEYS)."""

    peak_used_bytes: int | None
    min_free_bytes: int | None
    reserved_bytes: int | None
    total_bytes: int | None
    n_samples: int | None

    @classmethod
    def of(cls, m: MemorySummary | None) -> CardMemory:
        return cls(*(getattr(m, k) if m is not None else None for k in MEMORY_KEYS))

    def to_json(self) -> JsonObject:
        return {k: getattr(self, k) for k in MEMORY_KEYS}


@dataclass(frozen=True)
class CardEnergyRow:
    """One card's (or the headline's) energy figures in the per-card table."""

    idle_power_w: float | None
    whole_run: WholeRun | None
    phases_j: dict[str, float | None]

    @classmethod
    def of(cls, e: EnergyFigures | CardEnergy | None) -> CardEnergyRow:
        if e is None:
            return cls(None, None, {})
        return cls(e.idle_power_w, e.whole_run, {n: ph.energy_j for n, ph in e.phases.items()})

    def to_json(self) -> JsonObject:
        w = self.whole_run
        return {"idle_power_w": self.idle_power_w, "whole_run_counter_j": w.counter_j if w else None,
                "whole_run_integral_j": w.integral_j if w else None,
                "rel_diff_integral_vs_counter": w.rel_diff_integral_vs_counter if w else None,
                "phases_j": dict(self.phases_j)}


# card key ("gpuN" or "sum") -> side -> figures; a card only one run sampled has one side
CardTable = dict[str, dict[str, CardMemory]]
CardEnergyTable = dict[str, dict[str, CardEnergyRow]]


def cards_tables(sides: dict[str, CardsSummary]) -> tuple[CardTable, CardEnergyTable]:
    """Per-card memory and energy of both runs, keyed "gpuN", plus "sum": the headline figures (the
    sum over cards, or the one card)."""
    memory: CardTable = {}
    energy: CardEnergyTable = {}
    for side, s in sides.items():
        cards: list[tuple[str, MemorySummary, EnergyFigures | CardEnergy | None]] = [
            (f"gpu{g.index}", g.memory, g.energy) for g in s.gpus]
        cards.append(("sum", s.memory, s.energy))
        for key, mem, e in cards:
            memory.setdefault(key, {})[side] = CardMemory.of(mem)
            energy.setdefault(key, {})[side] = CardEnergyRow.of(e)
    return memory, energy


@dataclass(frozen=True)
class CardsCount:
    cards: int
    headline: str | None


@dataclass
class MemoryCompare:
    """The memory section: both sides' summaries, deltas (candidate - baseline), the peak ratio, the
    engine's torch counters where a side has them, per card, and how many cards each side had."""

    source: str
    baseline: MemorySummary
    candidate: MemorySummary
    deltas: dict[str, int | None]                      # "<key>_delta" for DELTA_KEYS
    peak_used_ratio: float | None
    torch_peak_allocated_bytes: dict[str, int] = field(default_factory=dict)     # side -> bytes
    torch: dict[str, JsonObject] = field(default_factory=dict)                   # side -> engine telemetry
    gpus: CardTable = field(default_factory=dict)
    cards: dict[str, CardsCount] = field(default_factory=dict)

    def to_json(self) -> JsonObject:
        out: JsonObject = {"available": True, "source": self.source, "baseline": self.baseline.to_json(),
                           "candidate": self.candidate.to_json(), **self.deltas,
                           "peak_used_ratio": self.peak_used_ratio}
        for side, n in self.torch_peak_allocated_bytes.items():
            out[f"torch_peak_allocated_bytes_{side}"] = n
        if self.torch:
            out["torch"] = dict(self.torch)
        out["gpus"] = {k: {side: m.to_json() for side, m in by.items()} for k, by in self.gpus.items()}
        out["cards"] = {side: {"cards": c.cards, "headline": c.headline} for side, c in self.cards.items()}
        return out


@dataclass(frozen=True)
class TokenCompare:
    """Joules per token of one work phase on both sides, net and gross, with candidate/baseline ratios."""

    baseline_net_j_per_token: float | None
    candidate_net_j_per_token: float | None
    net_ratio: float | None
    baseline_gross_j_per_token: float
    candidate_gross_j_per_token: float
    gross_ratio: float | None


@dataclass(frozen=True)
class KwhCompare:
    """kWh per million tokens over all work phases, both sides, and the net ratio."""

    baseline: GrossNet
    candidate: GrossNet
    net_ratio: float | None

    def to_json(self) -> JsonObject:
        return {"baseline": self.baseline.to_json(), "candidate": self.candidate.to_json(),
                "net_ratio": self.net_ratio}


@dataclass(frozen=True)
class PhaseBrief:
    duration_s: float
    energy_j: float | None
    net_j: float | None
    mean_power_w: float | None


@dataclass
class EnergyCompare:
    """The energy section: idle power, J/token and kWh per million tokens with ratios, cost, energy by
    phase and whole run, per side, and per card."""

    available: bool
    baseline_idle_power_w: float | None
    candidate_idle_power_w: float | None
    per_token: dict[str, TokenCompare] = field(default_factory=dict)
    kwh_per_million_tokens: KwhCompare | None = None
    cost_per_million_tokens: dict[str, Cost] = field(default_factory=dict)      # side -> cost
    phases: dict[str, dict[str, PhaseBrief]] = field(default_factory=dict)      # phase -> side -> figures
    whole_run: dict[str, WholeRun | None] = field(default_factory=dict)
    gpus: CardEnergyTable = field(default_factory=dict)

    def to_json(self) -> JsonObject:
        out: JsonObject = {"available": self.available, "baseline_idle_power_w": self.baseline_idle_power_w,
                           "candidate_idle_power_w": self.candidate_idle_power_w,
                           "per_token": {ph: vars(t).copy() for ph, t in self.per_token.items()}}
        if self.kwh_per_million_tokens is not None:
            out["kwh_per_million_tokens"] = self.kwh_per_million_tokens.to_json()
        for side, cost in self.cost_per_million_tokens.items():
            out[f"cost_per_million_tokens_{side}"] = cost.to_json()
        out["phases"] = {name: {side: vars(p).copy() for side, p in by.items()} for name, by in self.phases.items()}
        out["whole_run"] = {side: w.to_json() if w is not None else None for side, w in self.whole_run.items()}
        out["gpus"] = {k: {side: e.to_json() for side, e in by.items()} for k, by in self.gpus.items()}
        return out


@dataclass(frozen=True)
class MemoryEnergyCompare:
    memory: MemoryCompare | Unavailable
    energy: EnergyCompare | Unavailable

    def to_json(self) -> JsonObject:
        return {"memory": self.memory.to_json(), "energy": self.energy.to_json()}


def _memory(b: CardsSummary, c: CardsSummary, sides: dict[str, ProbeSide]) -> MemoryCompare:
    bm, cm = b.memory, c.memory
    deltas: dict[str, int | None] = {}
    for k in DELTA_KEYS:
        x, y = getattr(bm, k), getattr(cm, k)
        deltas[f"{k}_delta"] = y - x if x is not None and y is not None else None
    return MemoryCompare(
        source=bm.source, baseline=bm, candidate=cm, deltas=deltas,
        peak_used_ratio=_ratio(bm.peak_used_bytes, cm.peak_used_bytes),
        torch_peak_allocated_bytes={side: p.torch_peak_allocated_bytes for side, p in sides.items()
                                    if p.torch_peak_allocated_bytes is not None},
        torch={side: p.torch_memory for side, p in sides.items() if p.torch_memory},
        cards={side: CardsCount(s.cards, s.headline) for side, s in (("baseline", b), ("candidate", c))})


def _energy(be: EnergyFigures | None, ce: EnergyFigures | None) -> EnergyCompare:
    out = EnergyCompare(available=be is not None and ce is not None,
                        baseline_idle_power_w=be.idle_power_w if be else None,
                        candidate_idle_power_w=ce.idle_power_w if ce else None)
    if be is not None and ce is not None:
        for ph in WORK_PHASES:
            bp, cp = be.per_token.get(ph), ce.per_token.get(ph)
            if bp and cp:
                out.per_token[ph] = TokenCompare(
                    bp.net_j_per_token, cp.net_j_per_token, _ratio(bp.net_j_per_token, cp.net_j_per_token),
                    bp.gross_j_per_token, cp.gross_j_per_token, _ratio(bp.gross_j_per_token, cp.gross_j_per_token))
        bk, ck = be.kwh_per_million_tokens.get("all"), ce.kwh_per_million_tokens.get("all")
        if bk and ck:
            out.kwh_per_million_tokens = KwhCompare(bk, ck, _ratio(bk.net, ck.net))
    for side, e in (("baseline", be), ("candidate", ce)):
        if e is not None and e.cost_per_million_tokens is not None:
            out.cost_per_million_tokens[side] = e.cost_per_million_tokens
    for side, e in (("baseline", be), ("candidate", ce)):
        for name, ph in (e.phases if e is not None else {}).items():
            out.phases.setdefault(name, {})[side] = PhaseBrief(ph.duration_s, ph.energy_j, ph.net_j, ph.mean_power_w)
    out.whole_run = {side: e.whole_run if e is not None else None for side, e in (("baseline", be), ("candidate", ce))}
    return out


def compare_probes(base: ProbeSide, cand: ProbeSide) -> MemoryEnergyCompare:
    """The memory and energy sections of two runs (both Unavailable, with why, where a side has no summary)."""
    sides = {"baseline": base, "candidate": cand}
    why = {side: p.reason for side, p in sides.items() if p.summary is None}
    if why:
        return MemoryEnergyCompare(Unavailable(why), Unavailable(why))
    b, c = base.summary, cand.summary
    memory = _memory(b, c, sides)
    energy = _energy(b.energy, c.energy)
    memory.gpus, energy.gpus = cards_tables({"baseline": b, "candidate": c})
    return MemoryEnergyCompare(memory, energy)


def memory_energy_compare(base_manifest: JsonObject, cand_manifest: JsonObject) -> JsonObject:
    """{"memory": ..., "energy": ...} for compare.json from two manifest.json documents."""
    return compare_probes(ProbeSide.from_manifest(base_manifest, "baseline manifest.json"),
                          ProbeSide.from_manifest(cand_manifest, "candidate manifest.json")).to_json()
