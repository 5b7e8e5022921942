"""The gate's rules: the rule types, the readers of the figure each rule limits, and the rules file.

`TASK_RULES` limit a task's paired figures, `SECTION_RULES` those of compare.json's optional sections
(kld, speed, speed_ab, needle, memory, energy); each `Rule` names its value's type and check (a
`config.Field`), which side of the limit passes, and how to read its figure from the task's
`compare.records.TaskEntry` or the section's `compare.figures` class (raising `Missing` where compare.json
lacks it). `load_rules` parses and checks a rules file into `RuleTable`s,
`load_gate_options` its [gate] table; the package docstring (`moebench/gate/__init__.py`) is the
rules file's reference.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generic, Literal, NamedTuple, TypeVar

from moebench.compare.records import TaskEntry
from moebench.config import Field, ProfileError, load_toml, non_negative, positive, validate
from moebench.compare.figures import (EnergyFigures, KldFigures, MemoryFigures, NeedleFigures, SpeedAbFigures,
                                   SpeedFigures)

DEFAULT_MIN_SAMPLES = 5
DEFAULT_MIN_PAIRED = 1      # below it a task's rules are INCONCLUSIVE: 0 paired items are no evidence
OnInconclusive = Literal["exit3", "fail", "pass"]
Correction = Literal["holm", "none"]
INCONCLUSIVE_CHOICES: tuple[OnInconclusive, ...] = ("exit3", "fail", "pass")


def _fraction(v: float) -> str | None:
    return None if 0 <= v <= 1 else "must be between 0 and 1"


def fmt(v: object) -> str:
    """A figure as the gate's messages and tables show it: integers plain, others to 4 digits."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if v.is_integer() and abs(v) < 1e9:
            return str(int(v))
        return f"{v:.4g}"
    return str(v)


class Missing(Exception):
    """The value a rule needs is absent from compare.json."""


RuleKind = Literal["max", "min", "flag", "interval_max", "interval_min"]
F = TypeVar("F", TaskEntry, KldFigures, SpeedFigures, SpeedAbFigures, NeedleFigures, MemoryFigures, EnergyFigures)


@dataclass(frozen=True)
class Estimate:
    """One group's ratio with its interval and sample counts, for an interval rule."""

    where: str                                  # "512 tokens, 1 client"
    value: float | None                         # None: no ratio here (`note` says why): inconclusive
    ci: tuple[float, float] | None
    n: int | None                               # the smaller side's sample count
    note: str = ""


@dataclass(frozen=True)
class Rule(Generic[F]):
    """A limit on one figure: `get` reads the figure from the task's or section's figures, `kind` says
    which side passes."""

    field: Field
    kind: RuleKind
    get: Callable[[F], float | list[Estimate]]  # a number; for interval rules a list of Estimate
    what: str                                   # the figure, for messages


def _need(v: float | None, label: str) -> float:
    if v is None:
        raise Missing(f"no numeric {label}")
    return v


def id_count(ids: list[str] | None, key: str) -> int:
    """How many item ids a task's list `key` holds (wins, losses, excluded)."""
    if ids is None:
        raise Missing(f"no list {key!r}")
    return len(ids)


def _n_paired(t: TaskEntry) -> float:
    return _need(t.n_paired, "n_paired")


def _candidate_accuracy(t: TaskEntry) -> float:
    v = t.candidate_accuracy
    if v is None:
        v = _need(t.candidate_correct, "candidate_correct") / _nonzero(_n_paired(t))
    return v


def _accuracy_drop(t: TaskEntry) -> float:
    base = t.baseline_accuracy
    if base is None:
        base = _need(t.baseline_correct, "baseline_correct") / _nonzero(_n_paired(t))
    return base - _candidate_accuracy(t)


def _flip_rate(t: TaskEntry) -> float:
    v = t.flip_rate
    if v is None:
        v = (id_count(t.wins, "wins") + id_count(t.losses, "losses")) / _nonzero(_n_paired(t))
    return v


def _delta_ci_low(t: TaskEntry) -> float:
    ci = t.delta_ci95
    if not (ci is not None and len(ci) == 2 and ci[0] is not None):
        raise Missing("no delta_ci95 [lo, hi]")
    return ci[0]


def _mcnemar_p(t: TaskEntry) -> float:
    id_count(t.wins, "wins"), id_count(t.losses, "losses")      # the verdict also needs who flipped which way
    return _need(t.mcnemar_p, "mcnemar_p")


def _nonzero(n: float) -> float:
    if n <= 0:
        raise Missing("n_paired is 0: nothing was compared")
    return n


def _speed(metric: str) -> Callable[[SpeedFigures], list[Estimate]]:
    def get(speed: SpeedFigures) -> list[Estimate]:
        out = []
        for g in speed.groups:
            if g.ratio[metric] is None:
                continue
            ns = [g.n_baseline, g.n_candidate]
            n = min(x for x in ns if x is not None) if None not in ns else None
            out.append(Estimate(g.where, g.ratio[metric], g.ratio_ci95[metric], n))
        if not out:
            raise Missing(f"no {metric} ratio at any prompt length")
        return out
    return get


def _goodput(speed: SpeedFigures) -> list[Estimate]:
    """Candidate/baseline goodput per prompt length and rate (compare.json speed.load.rows)."""
    out = []
    for g in speed.load:
        if g.skipped:
            continue                 # a sweep step not sent (past the stop rule) has nothing to judge
        where = f"{g.prompt_length} tokens, {fmt(g.rate)} req/s"
        if g.goodput_ratio is None:
            out.append(Estimate(where, None, None, None, "no goodput ratio: the baseline met no SLO at this rate"))
            continue
        n = min(g.n_baseline, g.n_candidate) if g.n_baseline is not None and g.n_candidate is not None else None
        out.append(Estimate(where, g.goodput_ratio, g.goodput_ratio_ci95, n))
    if not out:
        raise Missing("no open-loop speed group measured on both sides (speed.load.rows)")
    return out


def _min_acceptance(speed: SpeedFigures) -> float:
    """The candidate's lowest draft acceptance rate over prompt lengths and client counts."""
    vals = [g.acceptance_candidate for g in speed.groups if g.acceptance_candidate is not None]
    if not vals:
        raise Missing("no draft acceptance rate (the candidate's backend reported no draft counters)")
    return min(vals)


def _ab_ratio(metric: str) -> Callable[[SpeedAbFigures], list[Estimate]]:
    """The paired B/A ratio of speed-ab (median over every prompt measured in both, all rounds)."""
    def get(ab: SpeedAbFigures) -> list[Estimate]:
        m = ab.paired.get(metric)
        if m is None or m.median_ratio is None:
            raise Missing(f"no paired.{metric}.median_ratio")
        return [Estimate("all rounds", m.median_ratio, m.ratio_ci95, m.n_pairs)]
    return get


def _ab_rounds(won: bool) -> Callable[[SpeedAbFigures], float]:
    """How many A/B rounds ran, or (won) how many B won."""
    def get(ab: SpeedAbFigures) -> float:
        if not ab.round_winners:
            raise Missing("no rounds")
        return sum(w == "B" for w in ab.round_winners) if won else len(ab.round_winners)
    return get


def _ab_differing(ab: SpeedAbFigures) -> float:
    if ab.n_differ_any is None:
        raise Missing("no identity.n_differ_any")
    return ab.n_differ_any


def _needle(key: str) -> Callable[[NeedleFigures], float]:
    def get(needle: NeedleFigures) -> float:
        if not needle.found:
            raise Missing("no needle cells")
        return {"found_candidate": needle.found_candidate, "lost": needle.lost,
                "found_share": needle.found_candidate / len(needle.found)}[key]
    return get


def _min_router_agreement(kld: KldFigures) -> float:
    if not kld.router_agreement:
        raise Missing("no per_layer.router_agreement")
    return min(kld.router_agreement)


def _peak_gib(memory: MemoryFigures) -> float:
    if memory.peak_used_candidate is None:
        raise Missing("no candidate peak_used_bytes")
    return memory.peak_used_candidate / 2**30


def _peak_ratio(memory: MemoryFigures) -> float:
    cand, base = memory.peak_used_candidate, memory.peak_used_baseline
    if cand is None or not base:
        raise Missing("peak_used_bytes of both runs needed")
    return cand / base


def _candidate_energy(label: str, get: Callable[[EnergyFigures], float | None],
                      scale: float = 1.0) -> Callable[[EnergyFigures], float]:
    """The candidate's figure in an energy section or one card of it."""
    def read(energy: EnergyFigures) -> float:
        v = get(energy)
        if v is None:
            raise Missing(f"no candidate {label}")
        return v * scale
    return read


def _decode_j_ratio(energy: EnergyFigures) -> float:
    if energy.decode_net_ratio is None:
        raise Missing("no per_token.decode.net_ratio (decode J/token of both runs, net of idle)")
    return energy.decode_net_ratio


CARD_KEY = re.compile(r"^(gpu\d+|sum)$")


def _kld(label: str, get: Callable[[KldFigures], float | None]) -> Callable[[KldFigures], float]:
    return lambda kld: _need(get(kld), label)


TASK_RULES: dict[str, Rule[TaskEntry]] = {
    "min_paired": Rule(Field(int, check=positive), "min", _n_paired, "paired items"),
    "min_accuracy": Rule(Field(float, check=_fraction), "min", _candidate_accuracy, "candidate accuracy"),
    "max_accuracy_drop": Rule(Field(float), "max", _accuracy_drop, "accuracy drop (baseline - candidate)"),
    "max_losses": Rule(Field(int, check=non_negative), "max", lambda t: id_count(t.losses, "losses"), "losses"),
    "max_flip_rate": Rule(Field(float, check=_fraction), "max", _flip_rate, "flip rate"),
    "fail_on_significant_loss": Rule(Field(bool), "flag", _mcnemar_p, "McNemar p"),
    "min_delta_ci_low": Rule(Field(float), "min", _delta_ci_low, "delta CI95 low"),
    "max_excluded": Rule(Field(int, check=non_negative), "max", lambda t: id_count(t.excluded, "excluded"),
                         "excluded items"),
}
TASK_OPTIONS: dict[str, Field] = {"alpha": Field(float, default=0.05, check=lambda v: None if 0 < v < 1
                                                  else "must be between 0 and 1 (exclusive)")}

SECTION_RULES: dict[str, dict[str, Rule]] = {
    "kld": {
        **{f"max_{k}": Rule(Field(float, check=non_negative), "max", _kld(k, get), f"KLD {k}")
           for k, get in (("mean", lambda f: f.mean), ("median", lambda f: f.median), ("p90", lambda f: f.p90),
                          ("p95", lambda f: f.p95), ("p99", lambda f: f.p99), ("p999", lambda f: f.p999),
                          ("max", lambda f: f.max))},
        "min_same_top_p": Rule(Field(float, check=_fraction), "min", _kld("same_top_p", lambda f: f.same_top_p),
                               "same top p"),
        "max_ppl_ratio": Rule(Field(float, check=positive), "max", _kld("ppl_ratio", lambda f: f.ppl_ratio),
                              "PPL ratio"),
        "max_rms_delta_p": Rule(Field(float, check=non_negative), "max",
                                _kld("delta_p.rms", lambda f: f.rms_delta_p), "RMS delta p"),
        "min_router_agreement": Rule(Field(float, check=_fraction), "min", _min_router_agreement,
                                     "router agreement (worst layer)"),
    },
    "speed": {
        "min_decode_ratio": Rule(Field(float, check=positive), "interval_min", _speed("decode_tok_s"),
                                 "decode tok/s ratio"),
        "min_prefill_ratio": Rule(Field(float, check=positive), "interval_min", _speed("prefill_tok_s"),
                                  "prefill tok/s ratio"),
        "max_ttft_ratio": Rule(Field(float, check=positive), "interval_max", _speed("ttft_s"), "TTFT ratio"),
        "max_tpot_ratio": Rule(Field(float, check=positive), "interval_max", _speed("tpot_s"),
                               "time per output token ratio"),
        "max_itl_ratio": Rule(Field(float, check=positive), "interval_max", _speed("itl_s"),
                              "inter-token latency ratio"),
        "max_e2e_ratio": Rule(Field(float, check=positive), "interval_max", _speed("e2e_s"),
                              "end-to-end latency ratio"),
        "min_goodput_ratio": Rule(Field(float, check=positive), "interval_min", _goodput,
                                  "goodput ratio (requests per second meeting every SLO)"),
        "min_acceptance_rate": Rule(Field(float, check=_fraction), "min", _min_acceptance,
                                    "candidate draft acceptance rate (lowest group)"),
    },
    "speed_ab": {
        "min_rounds_won": Rule(Field(int, check=non_negative), "min", _ab_rounds(won=True), "rounds won by B"),
        "min_rounds": Rule(Field(int, check=positive), "min", _ab_rounds(won=False), "A/B rounds"),
        "min_decode_ratio": Rule(Field(float, check=positive), "interval_min", _ab_ratio("decode_tok_s"),
                                 "paired B/A decode tok/s ratio"),
        "min_prefill_ratio": Rule(Field(float, check=positive), "interval_min", _ab_ratio("prefill_tok_s"),
                                  "paired B/A prefill tok/s ratio"),
        "max_ttft_ratio": Rule(Field(float, check=positive), "interval_max", _ab_ratio("ttft_s"),
                               "paired B/A TTFT ratio"),
        "max_differing_outputs": Rule(Field(int, check=non_negative), "max", _ab_differing,
                                      "prompts whose outputs differ between an A and a B pass"),
    },
    "needle": {
        "min_found": Rule(Field(int, check=non_negative), "min", _needle("found_candidate"), "cells found"),
        "max_lost": Rule(Field(int, check=non_negative), "max", _needle("lost"), "cells lost"),
        "min_found_share": Rule(Field(float, check=_fraction), "min", _needle("found_share"),
                                "share of cells found"),
    },
    "memory": {
        "max_peak_used_gib": Rule(Field(float, check=positive), "max", _peak_gib, "candidate peak used GiB"),
        "max_peak_used_ratio": Rule(Field(float, check=positive), "max", _peak_ratio, "peak used ratio"),
    },
    "energy": {
        "max_whole_run_kj": Rule(Field(float, check=positive), "max",
                                 _candidate_energy("whole-run energy (NVML counter)",
                                                   lambda e: e.whole_run_counter_j, 1e-3),
                                 "candidate whole-run energy kJ"),
        "max_idle_power_w": Rule(Field(float, check=positive), "max",
                                 _candidate_energy("idle power", lambda e: e.idle_power_w), "candidate idle power W"),
        "max_decode_net_j_per_token_ratio": Rule(Field(float, check=positive), "max", _decode_j_ratio,
                                                 "decode net J/token ratio"),
    },
}



# keys of a section table that tune its rules instead of being rules
SECTION_OPTIONS: dict[str, dict[str, Field]] = {
    "speed": {"min_samples": Field(int, default=DEFAULT_MIN_SAMPLES, check=positive)},
    "speed_ab": {"min_samples": Field(int, default=DEFAULT_MIN_SAMPLES, check=positive)},
}
GATE_OPTIONS: dict[str, Field] = {
    "on_inconclusive": Field(str, default="exit3", choices=INCONCLUSIVE_CHOICES),
    "correction": Field(str, default="holm", choices=("holm", "none")),
}


# A rule's limit or a table's option, as the rules file gives it (checked by its Field)
Limit = float | int | bool | str


class RuleTable(NamedTuple):
    """One table of a rules file: the task or section it judges, and its limits and options by key.

    A tuple so that `for section, is_task, settings in load_rules(p)` reads as before."""

    section: str                    # "gsm8k", "kld", "memory.gpu1", ...
    is_task: bool                   # a task's table (TASK_RULES) or a section's (SECTION_RULES)
    settings: dict[str, Limit]      # rule name -> limit, option name -> value (defaults filled in)

    def rules(self) -> dict[str, Rule]:
        """The rule types this table's keys are looked up in."""
        return TASK_RULES if self.is_task else SECTION_RULES[self.section.partition(".")[0]]


@dataclass(frozen=True)
class GateOptions:
    """The rules file's [gate] table."""

    on_inconclusive: OnInconclusive = "exit3"    # exit 3, count as a failure, or pass
    correction: Correction = "holm"              # the significant-loss rules over several tasks, or none


def load_gate_options(path: str | os.PathLike[str]) -> GateOptions:
    """The rules file's [gate] table (how inconclusive rules exit, the multiple-testing correction)."""
    p = Path(path)
    raw = load_toml(p)
    return GateOptions(**validate(raw.get("gate", {}), GATE_OPTIONS, f"{p} [gate]"))


def load_rules(path: str | os.PathLike[str]) -> list[RuleTable]:
    """Parse and validate the rules file, a RuleTable per table; errors name file and key."""
    p = Path(path)
    raw = load_toml(p)
    out: list[RuleTable] = []
    task_schema = {**{k: r.field for k, r in TASK_RULES.items()}, **TASK_OPTIONS}

    def add_task(name: str, table: Any, where: str) -> None:
        settings = validate(table, task_schema, where)
        if "alpha" in table and "fail_on_significant_loss" not in table:
            raise ProfileError(f"{where}: key 'alpha' is only used with 'fail_on_significant_loss'")
        out.append(RuleTable(name, True, settings))

    for name, table in raw.items():
        where = f"{p} [{name}]"
        if not isinstance(table, dict):
            raise ProfileError(f"{p}: key {name!r} must be a table ([{name}]) of rules, got {table!r}")
        if name == "gate":
            validate(table, GATE_OPTIONS, where)
            continue
        if name == "tasks":
            for tname, ttable in table.items():
                if not isinstance(ttable, dict):
                    raise ProfileError(f"{p}: key 'tasks.{tname}' must be a table of rules, got {ttable!r}")
                add_task(tname, ttable, f"{p} [tasks.{tname}]")
        elif name in SECTION_RULES:
            schema = {**{k: r.field for k, r in SECTION_RULES[name].items()}, **SECTION_OPTIONS.get(name, {})}
            cards = {k: v for k, v in table.items() if isinstance(v, dict)} if name in ("memory", "energy") else {}
            for card, sub in cards.items():
                if not CARD_KEY.match(card):
                    raise ProfileError(f"{where}: sub-table [{name}.{card}]: expected a card as gpuN "
                                       f"(its NVML index) or 'sum'")
                out.append(RuleTable(f"{name}.{card}", False, validate(sub, schema, f"{p} [{name}.{card}]")))
            plain = {k: v for k, v in table.items() if k not in cards}
            if plain or not cards:
                settings = validate(plain, schema, where)
                if not any(k in SECTION_RULES[name] for k in plain):
                    raise ProfileError(f"{where}: no rules, only options ({', '.join(sorted(plain))})")
                out.append(RuleTable(name, False, settings))
        else:
            add_task(name, table, where)
    if not any(any(k in TASK_RULES or k in SECTION_RULES.get(sec.partition(".")[0], {}) for k in s)
               for sec, _, s in out):
        raise ProfileError(f"{p}: no rules; a gate with nothing to check would always pass")
    return out

