"""The regression gate: check a compare directory against rules, for CI.

`run_gate(compare_dir, rules_path) -> int`: 0 when every rule holds, 1 when any fails, 2 on a usage
or input error (no compare.json, malformed rules: the message names the file and key), 3 when no rule
fails but at least one is INCONCLUSIVE (see below; `[gate] on_inconclusive` changes that). It writes
`summary.md` (a markdown table for `$GITHUB_STEP_SUMMARY`), `junit.xml` (one testcase per rule; an
inconclusive rule is a skipped testcase with its reason) and `gate.json` (the verdicts, which the
report shows first) into the compare directory and prints the summary.

Rules file (TOML); a table per task named as in compare.json's "tasks", plus the optional sections:

    [gsm8k]
    min_paired = 100                 # the task really ran on enough items; below it the other rules
                                     # are INCONCLUSIVE (default floor 1: 0 paired items judge nothing)
    min_accuracy = 0.5               # candidate accuracy
    max_accuracy_drop = 0.02         # baseline minus candidate accuracy
    max_losses = 5                   # right in baseline, wrong in candidate
    max_flip_rate = 0.1              # (wins + losses) / n_paired
    fail_on_significant_loss = true  # fail when losses outnumber wins at McNemar p < alpha
    alpha = 0.05
    min_delta_ci_low = -0.05         # lower end of the paired bootstrap CI of the accuracy change
    max_excluded = 0                 # errored or missing items on either side
    [kld]
    max_mean = 0.05
    max_p99 = 1.0
    min_same_top_p = 0.9
    [speed]
    min_decode_ratio = 0.9           # candidate / baseline decode tok/s, every prompt length and client count
    max_ttft_ratio = 1.2             # also min_prefill_ratio, max_tpot_ratio, max_itl_ratio, max_e2e_ratio
    min_samples = 5                  # timed requests per side and group below which a group is inconclusive
    min_acceptance_rate = 0.6        # speculative decoding: the candidate's draft acceptance, every group
    min_goodput_ratio = 0.9          # serving load: candidate / baseline goodput, every prompt length and rate
    [speed_ab]                       # `moebench speed-ab` results (B is the candidate)
    min_rounds_won = 3               # B won at least 3 rounds ...
    min_rounds = 4                   # ... of at least 4
    min_decode_ratio = 1.0           # paired B/A decode ratio (interval verdict, as [speed])
    max_differing_outputs = 0        # A/B output identity, over every A pass against every B pass
    [needle]
    min_found = 10
    [memory]
    max_peak_used_gib = 80           # the run's headline: its one card, or the sum of its cards
    [memory.gpu1]                    # one card by NVML index (runs sampled with gpu_indices)
    max_peak_used_gib = 22
    [energy]
    max_whole_run_kj = 50            # candidate energy over the whole run (NVML counter), kJ
    max_idle_power_w = 400           # candidate idle draw, measured after load
    max_decode_net_j_per_token_ratio = 1.1
    [energy.sum]                     # the sum over cards (the headline with several cards)
    max_whole_run_kj = 150

    [gate]
    on_inconclusive = "exit3"        # exit3 (default) | fail (exit 1) | pass (exit 0, still listed)
    correction = "holm"              # holm (default) | none: fail_on_significant_loss over several tasks

A task whose name collides with a section (e.g. a scored "needle" task) goes under [tasks.NAME].
A rule whose task or section is absent from compare.json FAILS: a gate never passes on missing data.
A task with fewer paired items than its floor (`min_paired`, else DEFAULT_MIN_PAIRED = 1) has every
other rule INCONCLUSIVE, with compare's reason (prompts or data differ, errors); `min_paired` itself
fails. KLD rules are INCONCLUSIVE when the candidate measured its KLD against another baseline run.
The rules of a task or section whose data no SHA256SUMS vouched for on either side (compare.json
`data_unverified`) are INCONCLUSIVE: a verdict on data nobody checked is no evidence.
A several-candidate compare's matrix.json may only name directories inside the compare directory.

Speed ratio rules judge intervals, not single numbers: per prompt length and client count, the 95%
bootstrap interval of the candidate/baseline ratio. A group FAILS when its whole interval is on the
wrong side of the limit, PASSES when its whole interval is on the right side, and is INCONCLUSIVE when
the interval straddles the limit, is missing, either side timed fewer than `min_samples` requests, or
the sample counts are unknown (a compare.json older than schema 2); the summary says which. The rule fails when any group fails, else is inconclusive when any group is.

`fail_on_significant_loss` on several tasks is one family of tests: the McNemar p-values are
Holm-adjusted over those tasks before they are compared with each task's alpha.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from moebench import jsonout
from moebench.compare.provenance import unverified_files
from moebench.config import Field, ProfileError, load_toml, non_negative, positive, validate
from moebench.store.records import CompareDoc, RecordError
from moebench.store.sections import memory_value, needle_cells, needle_counts, number, side_value, speed_rows
from moebench.scoring.stats import holm_adjust

SUMMARY_FILE = "summary.md"
JUNIT_FILE = "junit.xml"
GATE_FILE = "gate.json"
DEFAULT_MIN_SAMPLES = 5
DEFAULT_MIN_PAIRED = 1      # below it a task's rules are INCONCLUSIVE: 0 paired items are no evidence
EXIT_INCONCLUSIVE = 3
INCONCLUSIVE_CHOICES = ("exit3", "fail", "pass")


def _fraction(v: Any) -> str | None:
    return None if 0 <= v <= 1 else "must be between 0 and 1"


class Missing(Exception):
    """The value a rule needs is absent from compare.json."""


@dataclass
class Rule:
    """A limit on one figure: `get` reads the figure from the section, `kind` says which side passes."""

    field: Field
    kind: str                                   # "max" | "min" | "flag" | "interval_max" | "interval_min"
    get: Callable[[dict[str, Any]], Any]        # a number; for interval rules a list of Estimate
    what: str                                   # the figure, for messages


@dataclass
class Estimate:
    """One group's ratio with its interval and sample counts, for an interval rule."""

    where: str                                  # "512 tokens, 1 client"
    value: float | None                         # None: no ratio here (`note` says why): inconclusive
    ci: tuple[float, float] | None
    n: int | None                               # the smaller side's sample count
    note: str = ""


def _req(section: dict[str, Any], key: str, label: str = "") -> float:
    v = number(section.get(key))
    if v is None:
        raise Missing(f"no numeric {label or key!s}")
    return v


def _ids(section: dict[str, Any], key: str) -> int:
    v = section.get(key)
    if not isinstance(v, list):
        raise Missing(f"no list {key!r}")
    return len(v)


def _candidate_accuracy(t: dict[str, Any]) -> float:
    v = number(t.get("candidate_accuracy"))
    if v is None:
        v = _req(t, "candidate_correct") / _nonzero(_req(t, "n_paired"))
    return v


def _accuracy_drop(t: dict[str, Any]) -> float:
    base = number(t.get("baseline_accuracy"))
    if base is None:
        base = _req(t, "baseline_correct") / _nonzero(_req(t, "n_paired"))
    return base - _candidate_accuracy(t)


def _flip_rate(t: dict[str, Any]) -> float:
    v = number(t.get("flip_rate"))
    if v is None:
        v = (_ids(t, "wins") + _ids(t, "losses")) / _nonzero(_req(t, "n_paired"))
    return v


def _delta_ci_low(t: dict[str, Any]) -> float:
    ci = t.get("delta_ci95")
    if not (isinstance(ci, list) and len(ci) == 2 and number(ci[0]) is not None):
        raise Missing("no delta_ci95 [lo, hi]")
    return number(ci[0])  # type: ignore[return-value]


def _mcnemar_p(t: dict[str, Any]) -> float:
    _ids(t, "wins"), _ids(t, "losses")      # the verdict also needs who flipped which way
    return _req(t, "mcnemar_p")


def _nonzero(n: float) -> float:
    if n <= 0:
        raise Missing("n_paired is 0: nothing was compared")
    return n


def _speed(metric: str) -> Callable[[dict[str, Any]], list[Estimate]]:
    def get(speed: dict[str, Any]) -> list[Estimate]:
        out = []
        for r in speed_rows(speed):
            if r[f"{metric}_ratio"] is None:
                continue
            ns = [r.get("n_baseline"), r.get("n_candidate")]
            n = min(ns) if all(isinstance(x, int) for x in ns) else None
            ci = r.get(f"{metric}_ratio_ci95")
            where = f"{r['prompt_length']} tokens" + (f", {r['clients']} client{'s' if r['clients'] != 1 else ''}"
                                                        if r.get("clients") is not None else "")
            out.append(Estimate(where, r[f"{metric}_ratio"], tuple(ci) if ci else None, n))
        if not out:
            raise Missing(f"no {metric} ratio at any prompt length")
        return out
    return get


def _goodput(speed: dict[str, Any]) -> list[Estimate]:
    """Candidate/baseline goodput per prompt length and rate (compare.json speed.load.rows)."""
    load = speed.get("load") if isinstance(speed.get("load"), dict) else {}
    out = []
    for r in load.get("rows") or []:
        if not isinstance(r, dict) or (r.get("baseline") or {}).get("sweep_skipped") \
                or (r.get("candidate") or {}).get("sweep_skipped"):
            continue                 # a sweep step not sent (past the stop rule) has nothing to judge
        where = f"{r.get('prompt_length')} tokens, {fmt(r.get('rate'))} req/s"
        if number(r.get("goodput_ratio")) is None:
            out.append(Estimate(where, None, None, None, "no goodput ratio: the baseline met no SLO at this rate"))
            continue
        ns = [r.get("n_baseline"), r.get("n_candidate")]
        ci = r.get("goodput_ratio_ci95")
        ci_t = (number(ci[0]), number(ci[1])) if isinstance(ci, list) and len(ci) == 2 else None
        out.append(Estimate(where, number(r["goodput_ratio"]),
                            ci_t if ci_t and None not in ci_t else None,
                            min(ns) if all(isinstance(x, int) for x in ns) else None))
    if not out:
        raise Missing("no open-loop speed group measured on both sides (speed.load.rows)")
    return out


def _min_acceptance(speed: dict[str, Any]) -> float:
    """The candidate's lowest draft acceptance rate over prompt lengths and client counts."""
    vals = [r["acceptance_candidate"] for r in speed_rows(speed) if r.get("acceptance_candidate") is not None]
    if not vals:
        raise Missing("no draft acceptance rate (the candidate's backend reported no draft counters)")
    return min(vals)


def _ab_ratio(metric: str) -> Callable[[dict[str, Any]], list[Estimate]]:
    """The paired B/A ratio of speed-ab (median over every prompt measured in both, all rounds)."""
    def get(ab: dict[str, Any]) -> list[Estimate]:
        paired = ab.get("paired") if isinstance(ab.get("paired"), dict) else {}
        m = paired.get(metric) if isinstance(paired.get(metric), dict) else None
        if not m or number(m.get("median_ratio")) is None:
            raise Missing(f"no paired.{metric}.median_ratio")
        ci = m.get("ratio_ci95")
        ci_t = (number(ci[0]), number(ci[1])) if isinstance(ci, list) and len(ci) == 2 else None
        n = m.get("n_pairs")
        return [Estimate("all rounds", number(m["median_ratio"]),  # type: ignore[arg-type]
                         ci_t if ci_t and None not in ci_t else None, int(n) if isinstance(n, int) else None)]
    return get


def _ab_rounds(key: str) -> Callable[[dict[str, Any]], float]:
    def get(ab: dict[str, Any]) -> float:
        rounds = ab.get("rounds")
        if not isinstance(rounds, list) or not rounds:
            raise Missing("no rounds")
        if key == "rounds":
            return len(rounds)
        return sum(1 for r in rounds if isinstance(r, dict) and r.get("winner") == "B")
    return get


def _ab_differing(ab: dict[str, Any]) -> float:
    ident = ab.get("identity") if isinstance(ab.get("identity"), dict) else {}
    v = number(ident.get("n_differ_any"))
    if v is None:
        raise Missing("no identity.n_differ_any")
    return v


def _needle(key: str) -> Callable[[dict[str, Any]], float]:
    def get(needle: dict[str, Any]) -> float:
        cells = needle_cells(needle)
        if not cells:
            raise Missing("no needle cells")
        counts = needle_counts(cells)
        return counts["found_candidate"] / counts["cells"] if key == "found_share" else counts[key]
    return get


def _min_router_agreement(kld: dict[str, Any]) -> float:
    layers = kld.get("per_layer") if isinstance(kld.get("per_layer"), dict) else {}
    vals = [number(v) for v in layers.get("router_agreement") or []]
    vals = [v for v in vals if v is not None]
    if not vals:
        raise Missing("no per_layer.router_agreement")
    return min(vals)


def _rms_delta_p(kld: dict[str, Any]) -> float:
    dp = kld.get("delta_p") if isinstance(kld.get("delta_p"), dict) else {}
    return _req(dp, "rms", "delta_p.rms")


def _peak_gib(memory: dict[str, Any]) -> float:
    v = memory_value(memory, "peak_used_bytes", "candidate")
    if v is None:
        raise Missing("no candidate peak_used_bytes")
    return v / 2**30


def _peak_ratio(memory: dict[str, Any]) -> float:
    cand = memory_value(memory, "peak_used_bytes", "candidate")
    base = memory_value(memory, "peak_used_bytes", "baseline")
    if cand is None or not base:
        raise Missing("peak_used_bytes of both runs needed")
    return cand / base


def _cand(key: str, label: str, scale: float = 1.0) -> Callable[[dict[str, Any]], float]:
    """The candidate's `key` in a per-card energy entry ({"baseline": {...}, "candidate": {...}})."""
    def get(section: dict[str, Any]) -> float:
        v = side_value(section, "candidate", key)
        if v is None:
            raise Missing(f"no candidate {label}")
        return v * scale
    return get


def _decode_j_ratio(energy: dict[str, Any]) -> float:
    dec = (energy.get("per_token") or {}).get("decode") if isinstance(energy.get("per_token"), dict) else None
    v = number((dec or {}).get("net_ratio"))
    if v is None:
        raise Missing("no per_token.decode.net_ratio (decode J/token of both runs, net of idle)")
    return v


CARD_KEY = re.compile(r"^(gpu\d+|sum)$")


def _kld_key(key: str) -> Callable[[dict[str, Any]], float]:
    return lambda kld: _req(kld, key)


TASK_RULES: dict[str, Rule] = {
    "min_paired": Rule(Field(int, check=positive), "min", lambda t: _req(t, "n_paired"), "paired items"),
    "min_accuracy": Rule(Field(float, check=_fraction), "min", _candidate_accuracy, "candidate accuracy"),
    "max_accuracy_drop": Rule(Field(float), "max", _accuracy_drop, "accuracy drop (baseline - candidate)"),
    "max_losses": Rule(Field(int, check=non_negative), "max", lambda t: _ids(t, "losses"), "losses"),
    "max_flip_rate": Rule(Field(float, check=_fraction), "max", _flip_rate, "flip rate"),
    "fail_on_significant_loss": Rule(Field(bool), "flag", lambda t: _mcnemar_p(t), "McNemar p"),
    "min_delta_ci_low": Rule(Field(float), "min", _delta_ci_low, "delta CI95 low"),
    "max_excluded": Rule(Field(int, check=non_negative), "max", lambda t: _ids(t, "excluded"), "excluded items"),
}
TASK_OPTIONS: dict[str, Field] = {"alpha": Field(float, default=0.05, check=lambda v: None if 0 < v < 1
                                                  else "must be between 0 and 1 (exclusive)")}

SECTION_RULES: dict[str, dict[str, Rule]] = {
    "kld": {
        **{f"max_{k}": Rule(Field(float, check=non_negative), "max", _kld_key(k), f"KLD {k}")
           for k in ("mean", "median", "p90", "p95", "p99", "p999", "max")},
        "min_same_top_p": Rule(Field(float, check=_fraction), "min", _kld_key("same_top_p"), "same top p"),
        "max_ppl_ratio": Rule(Field(float, check=positive), "max", _kld_key("ppl_ratio"), "PPL ratio"),
        "max_rms_delta_p": Rule(Field(float, check=non_negative), "max", _rms_delta_p, "RMS delta p"),
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
        "min_rounds_won": Rule(Field(int, check=non_negative), "min", _ab_rounds("won"), "rounds won by B"),
        "min_rounds": Rule(Field(int, check=positive), "min", _ab_rounds("rounds"), "A/B rounds"),
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
                                 _cand("whole_run_counter_j", "whole-run energy (NVML counter)", 1e-3),
                                 "candidate whole-run energy kJ"),
        "max_idle_power_w": Rule(Field(float, check=positive), "max", _cand("idle_power_w", "idle power"),
                                 "candidate idle power W"),
        "max_decode_net_j_per_token_ratio": Rule(Field(float, check=positive), "max", _decode_j_ratio,
                                                 "decode net J/token ratio"),
    },
}


def _section_data(compare: CompareDoc, section: str) -> Any:
    """compare.json's part a rules section reads: "memory", "energy", or one card of them
    ("memory.gpu1", "energy.sum": compare[...]["gpus"][card]). Plain [energy] reads the sum's
    per-card figures beside the section's own."""
    name, _, card = section.partition(".")
    data = compare.section(name)
    if not isinstance(data, dict):
        return None
    if card:
        gpus = data.get("gpus") if isinstance(data.get("gpus"), dict) else {}
        return gpus.get(card)
    if name == "energy" and isinstance(data.get("gpus"), dict) and isinstance(data["gpus"].get("sum"), dict):
        return {**data, **data["gpus"]["sum"]}
    return data


# keys of a section table that tune its rules instead of being rules
SECTION_OPTIONS: dict[str, dict[str, Field]] = {
    "speed": {"min_samples": Field(int, default=DEFAULT_MIN_SAMPLES, check=positive)},
    "speed_ab": {"min_samples": Field(int, default=DEFAULT_MIN_SAMPLES, check=positive)},
}
GATE_OPTIONS: dict[str, Field] = {
    "on_inconclusive": Field(str, default="exit3", choices=INCONCLUSIVE_CHOICES),
    "correction": Field(str, default="holm", choices=("holm", "none")),
}


@dataclass
class Check:
    section: str          # "gsm8k", "kld", ...
    rule: str
    value: str
    limit: str
    passed: bool
    message: str
    verdict: str = ""     # "pass" | "fail" | "inconclusive"
    cause: str = ""       # set when the verdict comes from the section as a whole (absent, too few
                          # pairs): the summary then gives one line per section and cause, not per rule

    def __post_init__(self) -> None:
        if not self.verdict:
            self.verdict = "pass" if self.passed else "fail"


class GateInputError(Exception):
    """Usage or input error (exit 2)."""


# --- rules ------------------------------------------------------------------------------------

def load_gate_options(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The rules file's [gate] table (how inconclusive rules exit, the multiple-testing correction)."""
    p = Path(path)
    raw = load_toml(p)
    return validate(raw.get("gate", {}), GATE_OPTIONS, f"{p} [gate]")


def load_rules(path: str | os.PathLike[str]) -> list[tuple[str, bool, dict[str, Any]]]:
    """Parse and validate the rules file: [(section, is_task, settings)]; errors name file and key."""
    p = Path(path)
    raw = load_toml(p)
    out: list[tuple[str, bool, dict[str, Any]]] = []
    task_schema = {**{k: r.field for k, r in TASK_RULES.items()}, **TASK_OPTIONS}

    def add_task(name: str, table: Any, where: str) -> None:
        settings = validate(table, task_schema, where)
        if "alpha" in table and "fail_on_significant_loss" not in table:
            raise ProfileError(f"{where}: key 'alpha' is only used with 'fail_on_significant_loss'")
        out.append((name, True, settings))

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
                out.append((f"{name}.{card}", False, validate(sub, schema, f"{p} [{name}.{card}]")))
            plain = {k: v for k, v in table.items() if k not in cards}
            if plain or not cards:
                settings = validate(plain, schema, where)
                if not any(k in SECTION_RULES[name] for k in plain):
                    raise ProfileError(f"{where}: no rules, only options ({', '.join(sorted(plain))})")
                out.append((name, False, settings))
        else:
            add_task(name, table, where)
    if not any(any(k in TASK_RULES or k in SECTION_RULES.get(sec.partition(".")[0], {}) for k in s)
               for sec, _, s in out):
        raise ProfileError(f"{p}: no rules; a gate with nothing to check would always pass")
    return out


# --- evaluation -------------------------------------------------------------------------------

def fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if v.is_integer() and abs(v) < 1e9:
            return str(int(v))
        return f"{v:.4g}"
    return str(v)


def _holm(compare: CompareDoc, rules: list[tuple[str, bool, dict[str, Any]]],
          correction: str) -> dict[str, tuple[float, int]]:
    """task -> (Holm-adjusted McNemar p, family size) over the tasks whose significant-loss rule is on."""
    if correction != "holm":
        return {}
    tasks = compare.tasks
    family: dict[str, float] = {}
    for section, is_task, settings in rules:
        t = tasks.get(section)
        if is_task and settings.get("fail_on_significant_loss") and isinstance(t, dict) \
                and not _too_few_paired(section, t, settings):
            p = number(t.get("mcnemar_p"))
            if p is not None:
                family[section] = p
    if len(family) < 2:
        return {}
    adjusted = holm_adjust(list(family.values()))
    return {name: (adj, len(family)) for name, adj in zip(family, adjusted)}


def _too_few_paired(task: str, t: dict[str, Any], settings: dict[str, Any]) -> str | None:
    """Why a task's rules cannot be judged: fewer paired items than the floor (`min_paired`, else
    DEFAULT_MIN_PAIRED), with compare's reason where it gave one; None when there is enough."""
    n = number(t.get("n_paired"))
    floor = settings.get("min_paired", DEFAULT_MIN_PAIRED)
    if n is None or n >= floor:
        return None                   # a missing n_paired is reported by the rules themselves
    why = t.get("unpaired_reason")
    return (f"{task}: {int(n)} paired item{'s' if n != 1 else ''}, fewer than the floor of {floor} "
            f"({'min_paired' if 'min_paired' in settings else 'default; set min_paired to raise it'})"
            + (f": {why}" if why else ""))


def _kld_not_comparable(kld: dict[str, Any]) -> str | None:
    """Why a kld section's figures do not describe this compare's pair (the candidate measured against
    another baseline run), else None."""
    other = kld.get("measured_against")
    if kld.get("baseline_mismatch") and other:
        return f"kld: the candidate's KLD was measured against {other}, not this compare's baseline"
    warning = kld.get("warning")     # a compare.json written before measured_against existed
    if isinstance(warning, str) and warning.startswith("the candidate was measured against"):
        return f"kld: {warning}"
    return None


def _unverified_data(compare: CompareDoc, section: str) -> str | None:
    """Why a task's or section's figures rest on data no SHA256SUMS vouched for (compare.json's
    `data_unverified`: a run with --allow-modified-data, or files no list named), else None."""
    unvouched = compare.extra.get("data_unverified")
    sides = unvouched.get(section.partition(".")[0]) if isinstance(unvouched, dict) else None
    if not isinstance(sides, dict) or not sides:
        return None
    files = {side: f for side, f in sides.items() if isinstance(f, dict)}
    return f"{section}: unverified data ({unverified_files(files)})"


def evaluate(compare: CompareDoc, rules: list[tuple[str, bool, dict[str, Any]]],
             correction: str = "holm") -> list[Check]:
    checks: list[Check] = []
    tasks = compare.tasks
    holm = _holm(compare, rules, correction)
    why_absent = compare.extra.get("missing_sections")
    why_absent = why_absent if isinstance(why_absent, dict) else {}
    for section, is_task, settings in rules:
        table = TASK_RULES if is_task else SECTION_RULES[section.partition(".")[0]]
        unjudgeable = None            # the evidence is there but cannot carry a verdict: INCONCLUSIVE
        if is_task:
            data = tasks.get(section)
            absent = (f"task {section!r} is not in compare.json (tasks there: "
                      f"{', '.join(sorted(tasks)) or 'none'})")
            if isinstance(data, dict) and data:
                unjudgeable = _too_few_paired(section, data, settings)
        else:
            data = _section_data(compare, section)
            absent = f"section {section!r} is not in compare.json"
            reason = why_absent.get(section.partition(".")[0])
            if reason:
                absent += f": {reason}"
            if section == "kld" and isinstance(data, dict) and data:
                unjudgeable = _kld_not_comparable(data)
        if isinstance(data, dict) and data and not unjudgeable:
            unjudgeable = _unverified_data(compare, section)
        for name, limit in settings.items():
            if name not in table:
                continue              # options such as alpha
            rule = table[name]
            shown_limit = _limit_text(rule, limit)
            if not isinstance(data, dict) or not data:
                checks.append(Check(section, name, "missing", shown_limit, False, absent, cause=absent))
                continue
            if unjudgeable and not (is_task and name == "min_paired"):
                value = ("unverified data" if unjudgeable.startswith(f"{section}: unverified data") else
                         f"n_paired={fmt(data.get('n_paired'))}" if is_task else "other baseline")
                checks.append(Check(section, name, value, shown_limit, False,
                                    f"{unjudgeable}; cannot check {rule.what}", "inconclusive", cause=unjudgeable))
                continue
            try:
                value = rule.get(data)
            except Missing as e:
                checks.append(Check(section, name, "missing", shown_limit, False,
                                    f"{section}: {e} in compare.json; cannot check {rule.what}"))
                continue
            if rule.kind.startswith("interval_"):
                checks.append(_judge_interval(section, name, rule, value, limit, settings))
            else:
                checks.append(_judge(section, name, rule, value, limit, data, settings, holm.get(section)))
    return checks


def _limit_text(rule: Rule, limit: Any) -> str:
    if rule.kind == "flag":
        return "not (losses > wins and p < alpha)" if limit else "off"
    return f"{'<=' if rule.kind.endswith('max') else '>='} {fmt(limit)}"


def _judge_interval(section: str, name: str, rule: Rule, estimates: list[Estimate], limit: float,
                    settings: dict[str, Any]) -> Check:
    """Fail when a group's interval lies wholly beyond the limit; pass when every group's interval
    lies wholly within it; inconclusive otherwise, saying why (too few samples, no interval, straddles)."""
    min_n = int(settings.get("min_samples", DEFAULT_MIN_SAMPLES))
    upper = rule.kind == "interval_max"
    failed, unsure, passed = [], [], []
    for e in estimates:
        if e.value is None:
            unsure.append(f"{e.where}: {e.note or 'no ratio'}")
            continue
        shown = f"{fmt(e.value)}" + (f" [{fmt(e.ci[0])}, {fmt(e.ci[1])}]" if e.ci else "")
        # too few samples first: a bootstrap over two requests is no interval, whatever it says
        if e.n is None:
            unsure.append(f"{e.where}: sample count unknown")
        elif e.n < min_n:
            unsure.append(f"{e.where}: {e.n} sample{'s' if e.n != 1 else ''} per side, fewer than "
                          f"min_samples = {min_n} ({shown})")
        elif e.ci is not None and (e.ci[0] > limit if upper else e.ci[1] < limit):
            failed.append(f"{e.where}: {shown}")
        elif e.ci is None:
            unsure.append(f"{e.where}: no interval")
        elif (e.ci[1] <= limit) if upper else (e.ci[0] >= limit):
            passed.append(e)
        else:
            unsure.append(f"{e.where}: {shown} straddles {fmt(limit)}")
    valued = [e for e in estimates if e.value is not None]
    if valued:
        worst = max(valued, key=lambda e: e.value) if upper else min(valued, key=lambda e: e.value)  # type: ignore[arg-type, return-value]
        value = f"{fmt(worst.value)}" + (f" [{fmt(worst.ci[0])}, {fmt(worst.ci[1])}]" if worst.ci else "") + \
            f" at {worst.where}" + (f", n={worst.n}" if worst.n is not None else "")
    else:
        value = "no ratio"
    shown_limit = _limit_text(rule, limit) + " (95% interval)"
    if failed:
        msg = f"{section}: {rule.what} breaks the limit {_limit_text(rule, limit)}: the whole interval is beyond it at " \
              + "; ".join(failed)
        return Check(section, name, value, shown_limit, False, msg, "fail")
    if unsure:
        msg = f"{section}: {rule.what} INCONCLUSIVE against {_limit_text(rule, limit)}: " + "; ".join(unsure)
        return Check(section, name, value, shown_limit, False, msg, "inconclusive")
    msg = f"{section}: {rule.what} within the limit {_limit_text(rule, limit)} at every group " \
          f"({len(passed)}), interval included"
    return Check(section, name, value, shown_limit, True, msg, "pass")


def _judge(section: str, name: str, rule: Rule, value: float, limit: Any, data: dict[str, Any],
           settings: dict[str, Any], holm: tuple[float, int] | None = None) -> Check:
    if rule.kind == "flag":
        alpha = settings.get("alpha", 0.05)
        wins, losses = _ids(data, "wins"), _ids(data, "losses")
        shown = f"p={value:.3g} ({losses} loss{'es' if losses != 1 else ''}, {wins} win{'s' if wins != 1 else ''})"
        if holm is not None:
            shown += f", Holm {holm[0]:.3g}"
        if not limit:
            return Check(section, name, shown, "off", True, "rule switched off")
        p_used = holm[0] if holm is not None else value
        significant = losses > wins and p_used < alpha
        if significant:
            msg = f"{section}: losses ({losses}) outnumber wins ({wins}) with McNemar p = {value:.3g} < {alpha}"
            if holm is not None:
                msg += f" and, Holm-adjusted over {holm[1]} tasks, {holm[0]:.3g} < {alpha}"
        else:
            msg = f"{section}: no significant loss (p = {value:.3g}" + \
                  (f", Holm-adjusted over {holm[1]} tasks {holm[0]:.3g}" if holm is not None else "") + \
                  f", alpha {alpha})"
        limit_text = f"not (losses > wins and p{' (Holm)' if holm is not None else ''} < {alpha})"
        return Check(section, name, shown, limit_text, not significant, msg)
    ok = value <= limit if rule.kind.endswith("max") else value >= limit
    if not math.isfinite(value):
        ok = False
    msg = f"{section}: {rule.what} = {fmt(value)}, {'within' if ok else 'breaks'} the limit {_limit_text(rule, limit)}"
    return Check(section, name, fmt(value), _limit_text(rule, limit), ok, msg)


# --- outputs ----------------------------------------------------------------------------------

def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


RESULT_TEXT = {"pass": "PASS", "fail": "**FAIL**", "inconclusive": "*INCONCLUSIVE*"}


def overall_verdict(checks: list[Check]) -> str:
    if any(c.verdict == "fail" for c in checks):
        return "fail"
    return "inconclusive" if any(c.verdict == "inconclusive" for c in checks) else "pass"


def exit_code(checks: list[Check], on_inconclusive: str = "exit3") -> int:
    verdict = overall_verdict(checks)
    if verdict == "fail":
        return 1
    if verdict == "inconclusive":
        return {"exit3": EXIT_INCONCLUSIVE, "fail": 1, "pass": 0}[on_inconclusive]
    return 0


def summary_markdown(checks: list[Check], compare: CompareDoc, rules_path: Path,
                     on_inconclusive: str = "exit3") -> str:
    failed = [c for c in checks if c.verdict == "fail"]
    unsure = [c for c in checks if c.verdict == "inconclusive"]
    held = len(checks) - len(failed) - len(unsure)
    verdict = overall_verdict(checks).upper()
    counts = f"{held}/{len(checks)} rules hold" + (f", {len(unsure)} inconclusive" if unsure else "")
    base, cand = compare.baseline.label, compare.candidate.label
    lines = [f"## moebench gate: {verdict} ({counts})", ""]
    if base or cand:
        lines += [f"Candidate `{_md(str(cand or '?'))}` against baseline `{_md(str(base or '?'))}`; "
                  f"rules from `{_md(str(rules_path))}`.", ""]
    lines += ["| rule | value | limit | result |", "|---|---|---|---|"]
    for c in checks:
        lines.append(f"| {_md(c.section)}.{_md(c.rule)} | {_md(c.value)} | {_md(c.limit)} | "
                     f"{RESULT_TEXT[c.verdict]} |")
    if failed:
        lines += ["", "Failures:", ""] + [f"- {_md(m)}" for m in _reasons(failed)]
    if unsure:
        effect = {"exit3": f"exit code {EXIT_INCONCLUSIVE}", "fail": "counted as failures",
                  "pass": "not failing the gate"}[on_inconclusive]
        lines += ["", f"Inconclusive ({effect}; measure more samples or see the A/A noise floor):", ""]
        lines += [f"- {_md(m)}" for m in _reasons(unsure)]
    return "\n".join(lines) + "\n"


def _reasons(checks: list[Check]) -> list[str]:
    """One line per check, except that checks sharing a section-wide cause share one line naming
    their rules (a missing kld section is one line, not one per KLD rule)."""
    lines: list[str] = []
    line_of: dict[tuple[str, str], int] = {}        # (section, cause) -> its line
    rules: dict[int, list[str]] = {}                # line -> the rules sharing it
    for c in checks:
        if not c.cause:
            lines.append(c.message)
            continue
        i = line_of.setdefault((c.section, c.cause), len(lines))
        if i == len(lines):
            lines.append(c.cause)
        rules.setdefault(i, []).append(c.rule)
    return [f"{line} (rule{'s' if len(rules[i]) > 1 else ''} {', '.join(rules[i])})" if i in rules else line
            for i, line in enumerate(lines)]


def junit_xml(checks: list[Check]) -> bytes:
    failures = sum(1 for c in checks if c.verdict == "fail")
    skipped = sum(1 for c in checks if c.verdict == "inconclusive")
    suites = ET.Element("testsuites", name="moebench gate", tests=str(len(checks)), failures=str(failures))
    suite = ET.SubElement(suites, "testsuite", name="moebench gate", tests=str(len(checks)),
                          failures=str(failures), errors="0", skipped=str(skipped))
    for c in checks:
        case = ET.SubElement(suite, "testcase", classname=f"moebench.gate.{c.section}", name=c.rule)
        ET.SubElement(case, "system-out").text = f"value {c.value}; limit {c.limit}"
        if c.verdict == "fail":
            ET.SubElement(case, "failure", message=c.message, type="GateFailure").text = c.message
        elif c.verdict == "inconclusive":
            ET.SubElement(case, "skipped", message=c.message).text = c.message
    ET.indent(suites)
    return ET.tostring(suites, encoding="utf-8", xml_declaration=True)


def gate_json(checks: list[Check], rules_path: Path, code: int) -> dict[str, Any]:
    """gate.json: the verdict and every rule's, for the report's opening table."""
    return {"verdict": overall_verdict(checks), "exit_code": code, "rules_file": str(rules_path),
            "checks": [{"section": c.section, "rule": c.rule, "value": c.value, "limit": c.limit,
                        "verdict": c.verdict, "message": c.message} for c in checks]}


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# --- entry points -----------------------------------------------------------------------------

def _load_compare(compare_dir: Path) -> CompareDoc:
    path = compare_dir / "compare.json"
    if not compare_dir.is_dir():
        raise GateInputError(f"{compare_dir}: not a directory")
    if not path.is_file():
        raise GateInputError(f"{path}: not found (run `moebench compare` first)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise GateInputError(f"{path}: not valid JSON ({e})") from None
    try:
        return CompareDoc.from_dict(data, str(path))
    except RecordError as e:
        raise GateInputError(str(e)) from None


def _matrix_pairs(cdir: Path) -> list[Path] | None:
    """The per-candidate compare directories of a several-candidate compare (matrix.json), else None."""
    path = cdir / "matrix.json"
    if (cdir / "compare.json").is_file() or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        named = [c["compare_dir"] for c in data["candidates"]]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise GateInputError(f"{path}: not a moebench matrix ({type(e).__name__}: {e})") from None
    return [_inside(cdir, path, f"candidates[{i}].compare_dir", d) for i, d in enumerate(named)]


def _inside(cdir: Path, matrix: Path, key: str, named: Any) -> Path:
    """A candidate's compare directory, which must lie inside the compare directory: the gate writes
    summary.md, junit.xml, gate.json and report.html there, and an edited matrix.json must not point
    those writes elsewhere (an absolute path, `..`, or a symlink leading out are all refused)."""
    if not isinstance(named, str) or not named or named in (".", "./"):
        raise GateInputError(f"{matrix}: key {key!r} must name a sub-directory of {cdir}, got {named!r}")
    root = cdir.resolve()
    target = (cdir / named).resolve()
    if Path(named).is_absolute() or root not in target.parents:
        raise GateInputError(f"{matrix}: key {key!r} = {named!r} leads to {target}, outside the compare "
                             f"directory {root}; the gate writes only inside it")
    return cdir / named


def run_gate(compare_dir: str | os.PathLike[str], rules_path: str | os.PathLike[str], as_json: bool = False,
             quiet: bool = False) -> int:
    """Check `compare_dir/compare.json` against the rules; write summary.md, junit.xml, gate.json; exit code.

    A several-candidate compare directory (matrix.json) gates every candidate's directory with the same
    rules; its exit code is the worst (1 over 3 over 0) and its summary.md joins theirs.
    Prints the Markdown summary, or with `as_json` gate.json's content (for several candidates
    {"exit_code", "candidates": [...]}; on an input error {"exit_code": 2, "error"}).
    """
    cdir, rpath = Path(compare_dir), Path(rules_path)
    try:
        pairs = _matrix_pairs(cdir) if cdir.is_dir() else None
    except GateInputError as e:
        print(f"moebench gate: error: {e}", file=sys.stderr)
        if as_json:
            print(jsonout.dumps({"exit_code": 2, "error": str(e), "rules_file": str(rpath)}))
        return 2
    if pairs is not None:
        codes = [run_gate(p, rpath, quiet=as_json or quiet) for p in pairs]
        code = 2 if 2 in codes else 1 if 1 in codes else EXIT_INCONCLUSIVE if EXIT_INCONCLUSIVE in codes else 0
        parts = [(p / SUMMARY_FILE).read_text(encoding="utf-8") for p in pairs if (p / SUMMARY_FILE).is_file()]
        _write(cdir / SUMMARY_FILE, ("\n".join(parts)).encode("utf-8"))
        _rerender(cdir)
        if as_json:
            print(jsonout.dumps({"exit_code": code, "candidates": [
                {"compare_dir": str(p), **(json.loads((p / GATE_FILE).read_text()) if (p / GATE_FILE).is_file()
                                           else {"exit_code": c})} for p, c in zip(pairs, codes)]}))
        return code
    try:
        compare = _load_compare(cdir)
        rules = load_rules(rpath)
        options = load_gate_options(rpath)
    except (GateInputError, ProfileError) as e:
        print(f"moebench gate: error: {e}", file=sys.stderr)
        if cdir.is_dir():   # let CI show why, next to where the table would be
            _write(cdir / SUMMARY_FILE, f"## moebench gate: ERROR\n\n{_md(str(e))}\n".encode())
        if as_json:
            print(jsonout.dumps({"exit_code": 2, "error": str(e), "rules_file": str(rpath)}))
        return 2
    checks = evaluate(compare, rules, options["correction"])
    code = exit_code(checks, options["on_inconclusive"])
    summary = summary_markdown(checks, compare, rpath, options["on_inconclusive"])
    try:                 # the figures behind the verdict, as `moebench compare` summarised them
        from moebench.compare.tables import matrix_row, summary_markdown as results_markdown
        raw = compare.to_dict()
        details = results_markdown([raw], [matrix_row(raw)])
    except Exception as e:      # a hand-edited compare.json: the verdict still stands
        details = f"(results summary unavailable: {type(e).__name__}: {e})\n"
    _write(cdir / SUMMARY_FILE, (summary + "\n" + details.replace("## moebench compare", "### moebench compare", 1)
                                 ).encode("utf-8"))
    _write(cdir / JUNIT_FILE, junit_xml(checks))
    verdicts = gate_json(checks, rpath, code)
    _write(cdir / GATE_FILE, (jsonout.document_text(verdicts, indent=2) + "\n").encode("utf-8"))
    _rerender(cdir)
    if as_json:
        print(jsonout.document_text(verdicts))
    elif not quiet:
        print(summary, end="")
    return code


def _rerender(cdir: Path) -> None:
    """The report opens with the verdict: render an existing report.html again after a gate."""
    if not (cdir / "report.html").is_file():
        return
    try:
        from moebench.report.render import render
        render(cdir)
    except Exception as e:                # the verdict stands even if the report cannot be redrawn
        print(f"moebench gate: warning: report.html not updated ({type(e).__name__}: {e})", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moebench gate", description="Check a compare directory against rules.")
    parser.add_argument("compare_dir")
    parser.add_argument("--rules", required=True, help="rules TOML (see gates/example.toml)")
    args = parser.parse_args(argv)
    return run_gate(args.compare_dir, args.rules)


if __name__ == "__main__":
    sys.exit(main())
