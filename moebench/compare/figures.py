"""The figures of compare.json's optional sections that the gate's rules limit and the matrix row shows.

One class per section (kld, speed, speed_ab, needle, memory, energy), built by `read_section` from the
section's JSON object (an absent section reads as one with no figures). Like
`compare.records.TaskEntry` they read leniently: a figure absent or not a
number is None (or an empty list), and the rule that needs it reports it missing, so one odd key in a
hand-written compare.json fails that rule and not the gate.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from moebench.json_fields import as_number, as_object
from moebench.json_types import JsonObject, JsonValue
from moebench.store.sections import SPEED_METRICS, memory_value, number, side_value, speed_rows


def _int(v: object) -> int | None:
    """A sample count as written; None where it is not an integer."""
    return v if isinstance(v, int) else None


def _interval(v: JsonValue) -> tuple[float, float] | None:
    """[low, high] with both ends numbers, else None."""
    if not (isinstance(v, list) and len(v) == 2):
        return None
    lo, hi = number(v[0]), number(v[1])
    return None if lo is None or hi is None else (lo, hi)


@dataclass(frozen=True)
class KldFigures:
    """compare.json "kld": the distribution of per-token KLD and what sits beside it."""

    mean: float | None
    median: float | None
    p90: float | None
    p95: float | None
    p99: float | None
    p999: float | None
    max: float | None
    same_top_p: float | None
    ppl_ratio: float | None
    rms_delta_p: float | None
    """delta_p.rms"""
    router_agreement: list[float]
    """per_layer.router_agreement, the numeric entries."""
    measured_against: str | None
    """The baseline run the candidate's KLD was measured against, where it is not this compare's."""
    baseline_mismatch: bool
    warning: str | None
    n_tokens: int | float | None
    method: str | None
    """"sampled" for a sampled KLD (its figures are in `sampled`), else the teacher-forced one."""

    @classmethod
    def from_json(cls, kld: JsonObject) -> "KldFigures":
        agreement = as_object(kld.get("per_layer")).get("router_agreement")
        other, warning, method = kld.get("measured_against"), kld.get("warning"), kld.get("method")
        return cls(**{k: number(kld.get(k)) for k in ("mean", "median", "p90", "p95", "p99", "p999", "max",
                                                      "same_top_p", "ppl_ratio")},
                   rms_delta_p=number(as_object(kld.get("delta_p")).get("rms")),
                   router_agreement=[v for v in map(number, agreement) if v is not None]
                   if isinstance(agreement, list) else [],
                   measured_against=str(other) if other else None, baseline_mismatch=bool(kld.get("baseline_mismatch")),
                   warning=warning if isinstance(warning, str) else None, n_tokens=as_number(kld.get("n_tokens")),
                   method=method if isinstance(method, str) else None)


@dataclass(frozen=True)
class SpeedGroup:
    """One closed-loop speed group (a prompt length at a client count) with its ratios per metric."""

    prompt_length: int | None
    clients: int | None
    ratio: dict[str, float | None]
    """SPEED_METRICS -> candidate/baseline."""
    ratio_ci95: dict[str, tuple[float, float] | None]
    n_baseline: int | None
    n_candidate: int | None
    acceptance_candidate: float | None
    """The candidate's draft acceptance rate (speculative decoding)."""

    @property
    def where(self) -> str:
        return f"{self.prompt_length} tokens" + (
            f", {self.clients} client{'s' if self.clients != 1 else ''}" if self.clients is not None else "")


@dataclass(frozen=True)
class LoadGroup:
    """One open-loop step of the serving load (speed.load.rows): a prompt length at a request rate."""

    prompt_length: int | float | None
    rate: float | None
    skipped: bool
    """A sweep step not sent on either side (past the stop rule)."""
    goodput_ratio: float | None
    goodput_ratio_ci95: tuple[float, float] | None
    n_baseline: int | None
    n_candidate: int | None


@dataclass(frozen=True)
class SpeedFigures:
    """compare.json "speed": the closed-loop groups (every layout `store.sections.speed_rows` reads)
    and the open-loop load steps."""

    groups: list[SpeedGroup]
    load: list[LoadGroup]
    geomean: dict[str, float | None]
    """decode, prefill, ttft: the candidate/baseline ratio's geometric mean over the groups."""
    decode_candidate: list[float | None]
    """The candidate's decode tok/s per row of speed.rows (as the speed wing writes them)."""

    @classmethod
    def from_json(cls, speed: JsonObject) -> "SpeedFigures":
        groups = [SpeedGroup(prompt_length=r["prompt_length"], clients=r["clients"],
                             ratio={m: r[f"{m}_ratio"] for m in SPEED_METRICS},
                             ratio_ci95={m: _interval(r[f"{m}_ratio_ci95"]) for m in SPEED_METRICS},
                             n_baseline=r["n_baseline"], n_candidate=r["n_candidate"],
                             acceptance_candidate=r["acceptance_candidate"])
                  for r in speed_rows(speed)]
        load = []
        for r in as_object(speed.get("load")).get("rows") or []:
            if not isinstance(r, dict):
                continue
            length = r.get("prompt_length")
            load.append(LoadGroup(
                prompt_length=as_number(length),
                rate=number(r.get("rate")),
                skipped=bool(as_object(r.get("baseline")).get("sweep_skipped")
                             or as_object(r.get("candidate")).get("sweep_skipped")),
                goodput_ratio=number(r.get("goodput_ratio")), goodput_ratio_ci95=_interval(r.get("goodput_ratio_ci95")),
                n_baseline=_int(r.get("n_baseline")), n_candidate=_int(r.get("n_candidate"))))
        geomean = as_object(speed.get("geomean"))
        rows = speed.get("rows")
        return cls(groups=groups, load=load, geomean={k: number(geomean.get(k)) for k in ("decode", "prefill", "ttft")},
                   decode_candidate=[number(r.get("decode_candidate")) for r in rows if isinstance(r, dict)]
                   if isinstance(rows, list) else [])


@dataclass(frozen=True)
class PairedRatio:
    """speed_ab.paired.<metric>: the median B/A ratio over every prompt measured in both."""

    median_ratio: float | None
    ratio_ci95: tuple[float, float] | None
    n_pairs: int | None


@dataclass(frozen=True)
class SpeedAbFigures:
    """compare.json "speed_ab": who won each round and the paired ratios."""

    round_winners: list[str | None] | None
    """Per round its winner ("A" or "B"); None where the section holds no rounds list."""
    paired: dict[str, PairedRatio]
    n_differ_any: float | None
    """identity.n_differ_any: prompts whose outputs differ between an A and a B pass."""
    rounds_won_b: int | float | None
    """rounds_won.B as the A/B tool counted it."""

    @classmethod
    def from_json(cls, ab: JsonObject) -> "SpeedAbFigures":
        rounds = ab.get("rounds")
        paired = {}
        for metric, m in as_object(ab.get("paired")).items():
            if isinstance(m, dict) and m:
                n = m.get("n_pairs")
                paired[metric] = PairedRatio(number(m.get("median_ratio")), _interval(m.get("ratio_ci95")),
                                             int(n) if isinstance(n, int) else None)
        return cls(round_winners=[str(r.get("winner")) if isinstance(r, dict) and r.get("winner") is not None
                                  else None for r in rounds] if isinstance(rounds, list) else None,
                   paired=paired, n_differ_any=number(as_object(ab.get("identity")).get("n_differ_any")),
                   rounds_won_b=as_number(as_object(ab.get("rounds_won")).get("B")))


@dataclass(frozen=True)
class NeedleFigures:
    """compare.json "needle": per cell whether each run found the code (True only where written true)."""

    found: list[tuple[bool, bool]]
    """Per cell (found by the baseline, found by the candidate)."""

    @classmethod
    def from_json(cls, needle: JsonObject) -> "NeedleFigures":
        cells = needle.get("cells")
        return cls(found=[(c.get("found_baseline") is True, c.get("found_candidate") is True)
                          for c in cells if isinstance(c, dict)] if isinstance(cells, list) else [])

    @property
    def found_candidate(self) -> int:
        return sum(c for _, c in self.found)

    @property
    def lost(self) -> int:
        return sum(1 for b, c in self.found if b and not c)


@dataclass(frozen=True)
class MemoryFigures:
    """compare.json "memory" (or one card of it): each run's peak used bytes."""

    peak_used_baseline: float | None
    peak_used_candidate: float | None
    peak_used_ratio: float | None

    @classmethod
    def from_json(cls, memory: JsonObject) -> "MemoryFigures":
        return cls(memory_value(memory, "peak_used_bytes", "baseline"),
                   memory_value(memory, "peak_used_bytes", "candidate"), number(memory.get("peak_used_ratio")))


@dataclass(frozen=True)
class EnergyFigures:
    """compare.json "energy" (or one card of it): the candidate's energy figures."""

    whole_run_counter_j: float | None
    """The candidate's whole-run energy by the NVML counter."""
    idle_power_w: float | None
    decode_net_ratio: float | None
    """per_token.decode.net_ratio: decode J/token of the candidate over the baseline's, net of idle."""
    decode_j_per_token: float | None
    """per_token.decode.candidate_net_j_per_token"""
    prefill_j_per_token: float | None

    @classmethod
    def from_json(cls, energy: JsonObject) -> "EnergyFigures":
        per_token = as_object(energy.get("per_token"))
        decode, prefill = as_object(per_token.get("decode")), as_object(per_token.get("prefill"))
        return cls(side_value(energy, "candidate", "whole_run_counter_j"),
                   side_value(energy, "candidate", "idle_power_w"), number(decode.get("net_ratio")),
                   number(decode.get("candidate_net_j_per_token")), number(prefill.get("candidate_net_j_per_token")))


SectionFigures = Union[KldFigures, SpeedFigures, SpeedAbFigures, NeedleFigures, MemoryFigures, EnergyFigures]
_READERS = {"kld": KldFigures.from_json, "speed": SpeedFigures.from_json, "speed_ab": SpeedAbFigures.from_json,
            "needle": NeedleFigures.from_json, "memory": MemoryFigures.from_json, "energy": EnergyFigures.from_json}


def read_section(name: str, data: JsonValue) -> SectionFigures:
    """The figures of section `name` ("kld", ..., or a card of memory/energy: "energy.gpu1"); a section
    that is absent or not an object reads as one without figures."""
    return _READERS[name.partition(".")[0]](as_object(data))
