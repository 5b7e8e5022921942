"""The probe's summary as typed records: device memory, energy by phase, per token, priced, per card.

Each class's `to_json()` is its part of the manifest's probes.nvml.summary (docs/schema.md), keys in
the order the probe writes them; `from_json(obj, where)` reads that part back from a manifest and
refuses a shape the probe never writes with the place (`where`: the file and the key path) and the
type it expected. Numbers are kept as written (an int stays an int), so a summary read back gives the
same JSON again.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, TypedDict, TypeVar

from moebench.json_fields import Wording, is_of
from moebench.json_types import JsonObject, JsonValue
from moebench.store import StoreError

T = TypeVar("T")

WORK_PHASES = ("prefill", "decode")
# The figures a card's brief keeps of each of its phases (CardPhase's fields, in written order).
CARD_PHASE_KEYS = ("duration_s", "energy_j", "counter_j", "integral_j", "net_j", "mean_power_w")


class PhaseTokens(TypedDict, total=False):
    """Tokens processed inside the marked work phases (for J/token); a phase left out had none."""

    prefill: int
    decode: int


class SummaryError(StoreError):
    """A probe summary (in a run's manifest) whose structure is not the one the probe writes; the
    message names the file, the key path and the expected type."""


# The probe summary's wording of a refusal (tests and users read these messages).
_WORDING = Wording(SummaryError, not_object="{where}: expected an object, got {kind}",
                   missing="{where}: missing key {key!r}")
_NULL = (type(None),)


def json_object(v: JsonValue, where: str) -> JsonObject:
    """`v` if it is a JSON object, else a SummaryError naming `where`."""
    return _WORDING.object(v, where)


def _get(d: JsonObject, key: str, where: str) -> JsonValue:
    if key not in d:
        raise _WORDING.refuse_missing(where, key, "")
    return d[key]


def _bad(where: str, key: str, v: JsonValue, expected: str, optional: bool) -> SummaryError:
    return _WORDING.refuse(where, key, v, f"{expected}{' or null' if optional else ''}")


def _typed(d: JsonObject, key: str, where: str, types: tuple[type, ...], expected: str, optional: bool) -> Any:
    """d[key], which the probe always writes (else a missing-key refusal): of `types`, or null where optional."""
    return _WORDING.value(d, key, where, types + _NULL if optional else types,
                          f"{expected}{' or null' if optional else ''}", required=True)


def _number(d: JsonObject, key: str, where: str, optional: bool = True) -> float | None:
    return _typed(d, key, where, (float,), "a number", optional)


def _integer(d: JsonObject, key: str, where: str, optional: bool = False) -> int | None:
    return _typed(d, key, where, (int,), "an integer", optional)


def _text(d: JsonObject, key: str, where: str, optional: bool = True) -> str | None:
    return _typed(d, key, where, (str,), "a string", optional)


def _table(d: JsonObject, key: str, where: str, parse: Callable[[JsonValue, str], T]) -> dict[str, T]:
    """d[key]: an object of name -> part, each part parsed."""
    table = json_object(_get(d, key, where), f"{where}.{key}")
    return {name: parse(v, f"{where}.{key}.{name}") for name, v in table.items()}


@dataclass
class MemorySummary:
    """Device memory over a sampled run (bytes; None where no sample had the figure)."""

    source: str
    n_samples: int
    interval_s_median: float | None
    peak_used_bytes: int | None
    min_free_bytes: int | None
    reserved_bytes: int | None
    total_bytes: int | None

    def to_json(self) -> JsonObject:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: JsonValue, where: str) -> MemorySummary:
        d = json_object(obj, where)
        return cls(source=_text(d, "source", where, optional=False), n_samples=_integer(d, "n_samples", where),
                   interval_s_median=_number(d, "interval_s_median", where),
                   **{k: _integer(d, k, where, optional=True)
                      for k in ("peak_used_bytes", "min_free_bytes", "reserved_bytes", "total_bytes")})


@dataclass
class PhaseEnergy:
    """One phase's energy, summed over its windows (joules; None where the run had no such series):
    the counter's, the power integral's, the one used (`energy_j`: the counter's where present),
    and net of the idle draw."""

    windows: int = 0
    duration_s: float = 0.0
    counter_j: float | None = 0.0
    integral_j: float | None = 0.0
    energy_j: float | None = None
    rel_diff_integral_vs_counter: float | None = None
    mean_power_w: float | None = None
    idle_j: float | None = None
    net_j: float | None = None

    @classmethod
    def from_json(cls, obj: JsonValue, where: str) -> PhaseEnergy:
        d = json_object(obj, where)
        return cls(windows=_integer(d, "windows", where), duration_s=_number(d, "duration_s", where, optional=False),
                   **{k: _number(d, k, where) for k in ("counter_j", "integral_j", "energy_j",
                                                        "rel_diff_integral_vs_counter", "mean_power_w", "idle_j",
                                                        "net_j")})


@dataclass(frozen=True)
class WholeRun:
    """Energy from the first sample to the last."""

    duration_s: float
    counter_j: float | None
    integral_j: float | None
    rel_diff_integral_vs_counter: float | None

    def to_json(self) -> JsonObject:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: JsonValue, where: str) -> WholeRun:
        d = json_object(obj, where)
        return cls(duration_s=_number(d, "duration_s", where, optional=False),
                   counter_j=_number(d, "counter_j", where), integral_j=_number(d, "integral_j", where),
                   rel_diff_integral_vs_counter=_number(d, "rel_diff_integral_vs_counter", where))


@dataclass(frozen=True)
class TokenEnergy:
    """Joules per token of one work phase."""

    tokens: int
    gross_j_per_token: float
    net_j_per_token: float | None

    @classmethod
    def from_json(cls, obj: JsonValue, where: str) -> TokenEnergy:
        d = json_object(obj, where)
        return cls(tokens=_integer(d, "tokens", where),
                   gross_j_per_token=_number(d, "gross_j_per_token", where, optional=False),
                   net_j_per_token=_number(d, "net_j_per_token", where))


@dataclass(frozen=True)
class GrossNet:
    """A figure gross and net of the idle draw (kWh or money per million tokens)."""

    gross: float
    net: float | None

    def to_json(self) -> JsonObject:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: JsonValue, where: str) -> GrossNet:
        d = json_object(obj, where)
        return cls(gross=_number(d, "gross", where, optional=False), net=_number(d, "net", where))


@dataclass(frozen=True)
class Cost:
    """Money per million tokens at the day and the night tariff (each None where unset), by phase."""

    currency: str
    day: dict[str, GrossNet] | None
    night: dict[str, GrossNet] | None

    def to_json(self) -> JsonObject:
        out: JsonObject = {"currency": self.currency}
        for when, figs in (("day", self.day), ("night", self.night)):
            if figs is not None:
                out[when] = {ph: g.to_json() for ph, g in figs.items()}
        return out

    @classmethod
    def from_json(cls, obj: JsonValue, where: str) -> Cost:
        d = json_object(obj, where)
        day, night = (_table(d, when, where, GrossNet.from_json) if when in d else None for when in ("day", "night"))
        return cls(currency=_text(d, "currency", where, optional=False), day=day, night=night)


@dataclass
class EnergyFigures:
    """The energy of a sampled run: per phase, whole run, per token and priced."""

    source: str
    energy_source: str | None               # "counter", "integral" or None (neither series)
    power_column: str | None
    idle_power_w: float | None
    idle_phase: str | None
    negative_deltas_rejected: int
    phases: dict[str, PhaseEnergy]
    whole_run: WholeRun
    per_token: dict[str, TokenEnergy] = field(default_factory=dict)
    kwh_per_million_tokens: dict[str, GrossNet] = field(default_factory=dict)
    cost_per_million_tokens: Cost | None = None

    def to_json(self) -> JsonObject:
        out: JsonObject = {
            "source": self.source, "energy_source": self.energy_source, "power_column": self.power_column,
            "idle_power_w": self.idle_power_w, "idle_phase": self.idle_phase,
            "negative_deltas_rejected": self.negative_deltas_rejected}
        out["phases"] = {name: asdict(e) for name, e in self.phases.items()}
        out["whole_run"] = self.whole_run.to_json()
        out["per_token"] = {ph: asdict(t) for ph, t in self.per_token.items()}
        out["kwh_per_million_tokens"] = {ph: g.to_json() for ph, g in self.kwh_per_million_tokens.items()}
        if self.cost_per_million_tokens is not None:
            out["cost_per_million_tokens"] = self.cost_per_million_tokens.to_json()
        return out

    @classmethod
    def from_json(cls, obj: JsonValue, where: str) -> EnergyFigures:
        d = json_object(obj, where)
        cost = d.get("cost_per_million_tokens")
        return cls(source=_text(d, "source", where, optional=False),
                   energy_source=_text(d, "energy_source", where), power_column=_text(d, "power_column", where),
                   idle_power_w=_number(d, "idle_power_w", where), idle_phase=_text(d, "idle_phase", where),
                   negative_deltas_rejected=_integer(d, "negative_deltas_rejected", where),
                   phases=_table(d, "phases", where, PhaseEnergy.from_json),
                   whole_run=WholeRun.from_json(_get(d, "whole_run", where), f"{where}.whole_run"),
                   per_token=_table(d, "per_token", where, TokenEnergy.from_json),
                   kwh_per_million_tokens=_table(d, "kwh_per_million_tokens", where, GrossNet.from_json),
                   cost_per_million_tokens=Cost.from_json(cost, f"{where}.cost_per_million_tokens")
                   if cost is not None else None)


@dataclass(frozen=True)
class CardPhase:
    """The figures a card's brief keeps of one phase (CARD_PHASE_KEYS)."""

    duration_s: float
    energy_j: float | None
    counter_j: float | None
    integral_j: float | None
    net_j: float | None
    mean_power_w: float | None

    @classmethod
    def of(cls, e: PhaseEnergy) -> CardPhase:
        return cls(**{k: getattr(e, k) for k in CARD_PHASE_KEYS})

    @classmethod
    def from_json(cls, obj: JsonValue, where: str) -> CardPhase:
        d = json_object(obj, where)
        return cls(duration_s=_number(d, "duration_s", where, optional=False),
                   **{k: _number(d, k, where) for k in CARD_PHASE_KEYS[1:]})


@dataclass(frozen=True)
class CardEnergy:
    """A card's energy as its brief keeps it: idle power, the power series used, whole run, phases."""

    idle_power_w: float | None
    power_column: str | None
    whole_run: WholeRun
    phases: dict[str, CardPhase]

    @classmethod
    def of(cls, e: EnergyFigures) -> CardEnergy:
        return cls(e.idle_power_w, e.power_column, e.whole_run,
                   {name: CardPhase.of(ph) for name, ph in e.phases.items()})

    def to_json(self) -> JsonObject:
        return {"idle_power_w": self.idle_power_w, "power_column": self.power_column,
                "whole_run": self.whole_run.to_json(), "phases": {n: asdict(p) for n, p in self.phases.items()}}

    @classmethod
    def from_json(cls, obj: JsonValue, where: str) -> CardEnergy:
        d = json_object(obj, where)
        return cls(idle_power_w=_number(d, "idle_power_w", where), power_column=_text(d, "power_column", where),
                   whole_run=WholeRun.from_json(_get(d, "whole_run", where), f"{where}.whole_run"),
                   phases=_table(d, "phases", where, CardPhase.from_json))


@dataclass(frozen=True)
class CardBrief:
    """A card's figures for the manifest: its memory, idle power, whole run and per-phase energy."""

    index: int | str | None
    memory: MemorySummary
    energy: CardEnergy | None

    def to_json(self) -> JsonObject:
        return {"index": self.index, "memory": self.memory.to_json(),
                "energy": self.energy.to_json() if self.energy is not None else None}

    @classmethod
    def from_json(cls, obj: JsonValue, where: str) -> CardBrief:
        d = json_object(obj, where)
        index = _get(d, "index", where)
        if not is_of(index, (int, str, type(None))):
            raise _bad(where, "index", index, "a GPU index (integer or string)", True)
        energy = _get(d, "energy", where)
        return cls(index=index, memory=MemorySummary.from_json(_get(d, "memory", where), f"{where}.memory"),
                   energy=CardEnergy.from_json(energy, f"{where}.energy") if energy is not None else None)


@dataclass
class EnergySummary:
    """Memory and energy figures of one sampled run (energy None where there were no samples)."""

    memory: MemorySummary
    energy: EnergyFigures | None

    def to_json(self) -> JsonObject:
        return {"memory": self.memory.to_json(), "energy": self.energy.to_json() if self.energy else None}


@dataclass
class CardsSummary(EnergySummary):
    """EnergySummary of the headline (the one card, or the per-tick sum of several), how many cards,
    what the headline is (None in a summary written before cards were counted), and each card's brief."""

    cards: int = 1
    headline: str | None = "GPU"
    gpus: list[CardBrief] = field(default_factory=list)

    def to_json(self) -> JsonObject:
        return {**super().to_json(), "cards": self.cards, "headline": self.headline,
                "gpus": [g.to_json() for g in self.gpus]}

    @classmethod
    def from_json(cls, obj: JsonValue, where: str) -> CardsSummary:
        """The manifest's probes.nvml.summary; one written before cards were counted (no "cards",
        "headline", "gpus") reads as one card with no headline and no briefs."""
        d = json_object(obj, where)
        energy = _get(d, "energy", where)
        gpus = d.get("gpus", [])
        if not isinstance(gpus, list):
            raise _bad(where, "gpus", gpus, "a list", False)
        return cls(memory=MemorySummary.from_json(_get(d, "memory", where), f"{where}.memory"),
                   energy=EnergyFigures.from_json(energy, f"{where}.energy") if energy is not None else None,
                   cards=_integer(d, "cards", where) if "cards" in d else 1,
                   headline=_text(d, "headline", where) if "headline" in d else None,
                   gpus=[CardBrief.from_json(g, f"{where}.gpus[{i}]") for i, g in enumerate(gpus)])
