"""Evaluating a rules file's tables against a compare.json: a RuleResult per rule.

A rule PASSES or FAILS on its figure; it is INCONCLUSIVE where the evidence is there but cannot carry
a verdict: too few paired items (`min_paired`, else DEFAULT_MIN_PAIRED), a KLD measured against
another baseline run, data no SHA256SUMS vouched for, or (interval rules) a ratio's interval that
straddles the limit or rests on fewer than `min_samples` requests. A rule whose task or section is
absent FAILS. `fail_on_significant_loss` over several tasks is Holm-corrected as one family.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from moebench.compare.provenance import unverified_files
from moebench.compare.records import TaskEntry
from moebench.compare.figures import KldFigures, SectionFigures, read_section
from moebench.gate.rules import (DEFAULT_MIN_PAIRED, DEFAULT_MIN_SAMPLES, Correction, Estimate, Limit, Missing,
                                 Rule, RuleTable, fmt, id_count)
from moebench.json_fields import as_object
from moebench.json_types import JsonValue
from moebench.scoring.stats import holm_adjust
from moebench.store.records import CompareDoc

RuleVerdict = Literal["pass", "fail", "inconclusive"]


def _section_data(compare: CompareDoc, section: str) -> JsonValue:
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



@dataclass
class RuleResult:
    """One rule's verdict over one task or section, as the summary, junit.xml and gate.json show it."""

    section: str          # "gsm8k", "kld", ...
    rule: str
    value: str
    limit: str
    passed: bool
    message: str
    verdict: RuleVerdict | Literal[""] = ""     # "" until __post_init__ sets pass or fail
    cause: str = ""       # set when the verdict comes from the section as a whole (absent, too few
                          # pairs): the summary then gives one line per section and cause, not per rule

    def __post_init__(self) -> None:
        if not self.verdict:
            self.verdict = "pass" if self.passed else "fail"


def _holm(compare: CompareDoc, rules: list[RuleTable],
          correction: Correction) -> dict[str, tuple[float, int]]:
    """task -> (Holm-adjusted McNemar p, family size) over the tasks whose significant-loss rule is on."""
    if correction != "holm":
        return {}
    tasks = compare.tasks
    family: dict[str, float] = {}
    for section, is_task, settings in rules:
        t = tasks.get(section)
        entry = TaskEntry.from_json(t) if is_task and isinstance(t, dict) else None
        if entry is not None and settings.get("fail_on_significant_loss") \
                and not _too_few_paired(section, entry, settings):
            if entry.mcnemar_p is not None:
                family[section] = entry.mcnemar_p
    if len(family) < 2:
        return {}
    adjusted = holm_adjust(list(family.values()))
    return {name: (adj, len(family)) for name, adj in zip(family, adjusted)}


def _too_few_paired(task: str, t: TaskEntry, settings: dict[str, Limit]) -> str | None:
    """Why a task's rules cannot be judged: fewer paired items than the floor (`min_paired`, else
    DEFAULT_MIN_PAIRED), with compare's reason where it gave one; None when there is enough."""
    n = t.n_paired
    floor = settings.get("min_paired", DEFAULT_MIN_PAIRED)
    if n is None or n >= floor:
        return None                   # a missing n_paired is reported by the rules themselves
    why = t.unpaired_reason
    return (f"{task}: {int(n)} paired item{'s' if n != 1 else ''}, fewer than the floor of {floor} "
            f"({'min_paired' if 'min_paired' in settings else 'default; set min_paired to raise it'})"
            + (f": {why}" if why else ""))


def _kld_not_comparable(kld: KldFigures) -> str | None:
    """Why a kld section's figures do not describe this compare's pair (the candidate measured against
    another baseline run), else None."""
    if kld.baseline_mismatch and kld.measured_against:
        return f"kld: the candidate's KLD was measured against {kld.measured_against}, not this compare's baseline"
    warning = kld.warning     # a compare.json written before measured_against existed
    if warning is not None and warning.startswith("the candidate was measured against"):
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


def evaluate(compare: CompareDoc, rules: list[RuleTable],
             correction: Correction = "holm") -> list[RuleResult]:
    """A RuleResult for every rule of every table, in the rules file's order."""
    checks: list[RuleResult] = []
    tasks = compare.tasks
    holm = _holm(compare, rules, correction)
    why_absent = compare.extra.get("missing_sections")
    why_absent = as_object(why_absent)
    for rule_table in rules:
        section, is_task, settings = rule_table
        table = rule_table.rules()
        unjudgeable = None            # the evidence is there but cannot carry a verdict: INCONCLUSIVE
        figures: TaskEntry | SectionFigures | None = None      # None: the task or section is absent
        if is_task:
            data = tasks.get(section)
            absent = (f"task {section!r} is not in compare.json (tasks there: "
                      f"{', '.join(sorted(tasks)) or 'none'})")
            if isinstance(data, dict) and data:
                figures = TaskEntry.from_json(data)
                unjudgeable = _too_few_paired(section, figures, settings)
        else:
            data = _section_data(compare, section)
            absent = f"section {section!r} is not in compare.json"
            reason = why_absent.get(section.partition(".")[0])
            if reason:
                absent += f": {reason}"
            if isinstance(data, dict) and data:
                figures = read_section(section, data)
                if isinstance(figures, KldFigures):
                    unjudgeable = _kld_not_comparable(figures)
        if figures is not None and not unjudgeable:
            unjudgeable = _unverified_data(compare, section)
        for name, limit in settings.items():
            if name not in table:
                continue              # options such as alpha
            rule = table[name]
            shown_limit = _limit_text(rule, limit)
            if figures is None:
                checks.append(RuleResult(section, name, "missing", shown_limit, False, absent, cause=absent))
                continue
            if unjudgeable and not (is_task and name == "min_paired"):
                value = ("unverified data" if unjudgeable.startswith(f"{section}: unverified data") else
                         f"n_paired={fmt(figures.n_paired)}" if isinstance(figures, TaskEntry) else "other baseline")
                checks.append(RuleResult(section, name, value, shown_limit, False,
                                    f"{unjudgeable}; cannot check {rule.what}", "inconclusive", cause=unjudgeable))
                continue
            try:
                value = rule.get(figures)
            except Missing as e:
                checks.append(RuleResult(section, name, "missing", shown_limit, False,
                                    f"{section}: {e} in compare.json; cannot check {rule.what}"))
                continue
            if isinstance(value, list):
                checks.append(_judge_interval(section, name, rule, value, limit, settings))
            elif rule.kind == "flag" and isinstance(figures, TaskEntry):
                checks.append(_judge_loss(section, name, value, limit, figures, settings, holm.get(section)))
            else:
                checks.append(_judge(section, name, rule, value, limit))
    return checks


def _limit_text(rule: Rule, limit: Limit) -> str:
    if rule.kind == "flag":
        return "not (losses > wins and p < alpha)" if limit else "off"
    return f"{'<=' if rule.kind.endswith('max') else '>='} {fmt(limit)}"


def _judge_interval(section: str, name: str, rule: Rule, estimates: list[Estimate], limit: float,
                    settings: dict[str, Limit]) -> RuleResult:
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
        return RuleResult(section, name, value, shown_limit, False, msg, "fail")
    if unsure:
        msg = f"{section}: {rule.what} INCONCLUSIVE against {_limit_text(rule, limit)}: " + "; ".join(unsure)
        return RuleResult(section, name, value, shown_limit, False, msg, "inconclusive")
    msg = f"{section}: {rule.what} within the limit {_limit_text(rule, limit)} at every group " \
          f"({len(passed)}), interval included"
    return RuleResult(section, name, value, shown_limit, True, msg, "pass")


def _judge_loss(section: str, name: str, p: float, on: Limit, t: TaskEntry, settings: dict[str, Limit],
                holm: tuple[float, int] | None = None) -> RuleResult:
    """fail_on_significant_loss: fails when losses outnumber wins with McNemar p (Holm-adjusted over
    the family of such tasks) below alpha."""
    alpha = settings.get("alpha", 0.05)
    wins, losses = id_count(t.wins, "wins"), id_count(t.losses, "losses")
    shown = f"p={p:.3g} ({losses} loss{'es' if losses != 1 else ''}, {wins} win{'s' if wins != 1 else ''})"
    if holm is not None:
        shown += f", Holm {holm[0]:.3g}"
    if not on:
        return RuleResult(section, name, shown, "off", True, "rule switched off")
    p_used = holm[0] if holm is not None else p
    significant = losses > wins and p_used < alpha
    if significant:
        msg = f"{section}: losses ({losses}) outnumber wins ({wins}) with McNemar p = {p:.3g} < {alpha}"
        if holm is not None:
            msg += f" and, Holm-adjusted over {holm[1]} tasks, {holm[0]:.3g} < {alpha}"
    else:
        msg = f"{section}: no significant loss (p = {p:.3g}" + \
              (f", Holm-adjusted over {holm[1]} tasks {holm[0]:.3g}" if holm is not None else "") + \
              f", alpha {alpha})"
    limit_text = f"not (losses > wins and p{' (Holm)' if holm is not None else ''} < {alpha})"
    return RuleResult(section, name, shown, limit_text, not significant, msg)


def _judge(section: str, name: str, rule: Rule, value: float, limit: Limit) -> RuleResult:
    ok = value <= limit if rule.kind.endswith("max") else value >= limit
    if not math.isfinite(value):
        ok = False
    msg = f"{section}: {rule.what} = {fmt(value)}, {'within' if ok else 'breaks'} the limit {_limit_text(rule, limit)}"
    return RuleResult(section, name, fmt(value), _limit_text(rule, limit), ok, msg)
