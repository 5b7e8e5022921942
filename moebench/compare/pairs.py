"""Per-item pairing of two runs (docs/design.md section 5): wins, losses, exclusions, McNemar, bootstrap."""
from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass

from moebench.scoring.stats import mcnemar_exact_p, paired_bootstrap_ci, wilson_ci
from moebench.json_types import JsonObject
from moebench.store.records import ItemRecord

# One task's records by item id; the runs' records by task, in first-seen order.
ById = dict[str, ItemRecord]
ByTask = dict[str, ById]


def natural_key(item_id: str) -> list:
    """Sort "gsm8k/test/10" after "gsm8k/test/9": item ids follow the dataset's own order."""
    return [(0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", item_id)]


@dataclass
class SubjectPairing:
    """compare.json tasks.<cmmlu>.per_subject.<subject>: one subject's paired figures."""

    n_paired: int
    baseline_correct: int
    candidate_correct: int
    baseline_accuracy: float
    candidate_accuracy: float
    wins: list[str]
    losses: list[str]
    mcnemar_p: float
    delta_ci95: list[float]

    def to_json(self) -> JsonObject:
        return {"n_paired": self.n_paired, "baseline_correct": self.baseline_correct,
                "candidate_correct": self.candidate_correct, "baseline_accuracy": self.baseline_accuracy,
                "candidate_accuracy": self.candidate_accuracy, "wins": self.wins, "losses": self.losses,
                "mcnemar_p": self.mcnemar_p, "delta_ci95": self.delta_ci95}


@dataclass
class PairedAccuracy:
    """What a task's pairing and the overall block both open with: pairs, correct answers per side,
    accuracies (None with nothing paired) and their Wilson 95% intervals."""

    n_paired: int
    baseline_correct: int
    candidate_correct: int
    baseline_accuracy: float | None
    candidate_accuracy: float | None
    baseline_ci95: list[float]
    candidate_ci95: list[float]

    def _accuracy_json(self) -> JsonObject:
        return {"n_paired": self.n_paired, "baseline_correct": self.baseline_correct,
                "candidate_correct": self.candidate_correct, "baseline_accuracy": self.baseline_accuracy,
                "candidate_accuracy": self.candidate_accuracy, "baseline_ci95": self.baseline_ci95,
                "candidate_ci95": self.candidate_ci95}


@dataclass
class TaskPairing(PairedAccuracy):
    """compare.json tasks.<task>: one task's records paired by item id (docs/schema.md)."""

    wins: list[str]
    losses: list[str]
    excluded: list[str]
    excluded_reasons: dict[str, str]
    flip_rate: float
    mcnemar_p: float
    delta_ci95: list[float]
    unpaired_reason: str | None = None
    """Why nothing paired (said so nobody reads '0 paired' as 'no difference'); absent when something did."""
    per_subject: dict[str, SubjectPairing] | None = None
    """CMMLU tasks only: per subject, sorted by name."""
    data_mismatch: dict[str, dict[str, str]] | None = None
    """The files both runs read under one path with different contents: path -> side -> sha256."""

    def to_json(self) -> JsonObject:
        out = {**self._accuracy_json(), "wins": self.wins, "losses": self.losses, "excluded": self.excluded,
               "excluded_reasons": self.excluded_reasons, "flip_rate": self.flip_rate, "mcnemar_p": self.mcnemar_p,
               "delta_ci95": self.delta_ci95}
        if self.unpaired_reason is not None:
            out["unpaired_reason"] = self.unpaired_reason
        if self.per_subject is not None:
            out["per_subject"] = {s: v.to_json() for s, v in self.per_subject.items()}
        if self.data_mismatch is not None:
            out["data_mismatch"] = self.data_mismatch
        return out


@dataclass
class OverallPairing(PairedAccuracy):
    """compare.json "overall": every scored item of every task paired at once; counts, not id lists."""

    flip_rate: float
    mcnemar_p: float
    delta_ci95: list[float]
    n_wins: int
    n_losses: int
    n_excluded: int

    @classmethod
    def of(cls, t: TaskPairing) -> "OverallPairing":
        return cls(n_paired=t.n_paired, baseline_correct=t.baseline_correct, candidate_correct=t.candidate_correct,
                   baseline_accuracy=t.baseline_accuracy, candidate_accuracy=t.candidate_accuracy,
                   baseline_ci95=t.baseline_ci95, candidate_ci95=t.candidate_ci95, flip_rate=t.flip_rate,
                   mcnemar_p=t.mcnemar_p, delta_ci95=t.delta_ci95, n_wins=len(t.wins), n_losses=len(t.losses),
                   n_excluded=len(t.excluded))

    def to_json(self) -> JsonObject:
        return {**self._accuracy_json(), "flip_rate": self.flip_rate, "mcnemar_p": self.mcnemar_p,
                "delta_ci95": self.delta_ci95, "n_wins": self.n_wins, "n_losses": self.n_losses,
                "n_excluded": self.n_excluded}


@dataclass
class Pairing:
    """Every scored task paired, and the overall block (None when no task carries correctness)."""

    tasks: dict[str, TaskPairing]
    overall: OverallPairing | None

    def to_json(self) -> JsonObject:
        return {"tasks": {t: p.to_json() for t, p in self.tasks.items()},
                "overall": self.overall.to_json() if self.overall is not None else None}


def _by_task(records: list[ItemRecord]) -> ByTask:
    out: OrderedDict[str, ById] = OrderedDict()
    for r in records:
        out.setdefault(r.task, {})[r.item_id] = r
    return out


def _scored_tasks(by_task: ByTask) -> set[str]:
    """Tasks whose records carry a correctness verdict (speed and kld records do not)."""
    return {t for t, recs in by_task.items() if any(r.correct is not None for r in recs.values())}


def same_prompt(a: object, b: object) -> bool:
    """Both hashes are sha256 hex of the prompt, whole (lm-eval) or its first 16 digits (moebench):
    compared over the shorter one. A side without a hash cannot be checked and counts as the same."""
    if not a or not b:
        return True
    a, b = str(a), str(b)
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def pair_task(base: ById, cand: ById, n_boot: int = 2000, refused: dict[str, str] | None = None) -> TaskPairing:
    """Pair one task's records by item id.

    A pair is excluded (and listed with its reason) when either side is missing, errored or unscored,
    when the prompt hashes differ (the suites asked different questions), or when its id is in
    `refused` (id -> reason: the runs read different data).
    """
    refused = refused or {}
    wins, losses, excluded = [], [], []
    reasons: dict[str, str] = {}
    base_ok, cand_ok = [], []
    # Records land in completion order (concurrent requests); report in the dataset's order.
    order = sorted(set(base) | set(cand), key=natural_key)
    for item_id in order:
        b, c = base.get(item_id), cand.get(item_id)
        reason = None
        if item_id in refused:
            reason = refused[item_id]
        elif b is None or c is None:
            reason = "missing in " + ("baseline" if b is None else "candidate")
        elif b.status != "ok" or c.status != "ok":
            side = "baseline" if b.status != "ok" else "candidate"
            reason = f"error in {side}: {(b if side == 'baseline' else c).extra.get('error', '')}"[:200]
        elif b.correct is None or c.correct is None:
            reason = "not scored"
        elif not same_prompt(b.extra.get("prompt_hash"), c.extra.get("prompt_hash")):
            reason = "prompt hash differs (the suites differ)"
        if reason:
            excluded.append(item_id)
            reasons[item_id] = reason
            continue
        bc, cc = bool(b.correct), bool(c.correct)
        base_ok.append(bc)
        cand_ok.append(cc)
        if bc and not cc:
            losses.append(item_id)
        elif cc and not bc:
            wins.append(item_id)
    n = len(base_ok)
    nb, nc = sum(base_ok), sum(cand_ok)
    return TaskPairing(
        n_paired=n, baseline_correct=nb, candidate_correct=nc,
        baseline_accuracy=nb / n if n else None, candidate_accuracy=nc / n if n else None,
        baseline_ci95=list(wilson_ci(nb, n)), candidate_ci95=list(wilson_ci(nc, n)),
        wins=wins, losses=losses, excluded=excluded, excluded_reasons=reasons,
        flip_rate=(len(wins) + len(losses)) / n if n else 0.0,
        mcnemar_p=mcnemar_exact_p(len(wins), len(losses)),
        delta_ci95=list(paired_bootstrap_ci(base_ok, cand_ok, n_boot=n_boot)))


def per_subject(t: TaskPairing, base: ById, cand: ById, n_boot: int = 1000) -> dict[str, SubjectPairing]:
    """Per CMMLU subject (the middle part of "cmmlu/<subject>/<row>"): paired accuracy and flips.

    Pairs the same way as the task (excluded items stay out), one entry per subject, sorted by name.
    """
    excluded = set(t.excluded)
    subjects: dict[str, list[str]] = {}
    for item_id in sorted(set(base) & set(cand), key=natural_key):
        if item_id in excluded:
            continue
        parts = item_id.split("/")
        if len(parts) == 3:
            subjects.setdefault(parts[1], []).append(item_id)
    wins, losses = set(t.wins), set(t.losses)
    out = {}
    for subject, ids in sorted(subjects.items()):
        b = [bool(base[i].correct) for i in ids]
        c = [bool(cand[i].correct) for i in ids]
        n_w, n_l = sum(i in wins for i in ids), sum(i in losses for i in ids)
        out[subject] = SubjectPairing(
            n_paired=len(ids), baseline_correct=sum(b), candidate_correct=sum(c),
            baseline_accuracy=sum(b) / len(ids), candidate_accuracy=sum(c) / len(ids),
            wins=[i for i in ids if i in wins], losses=[i for i in ids if i in losses],
            mcnemar_p=mcnemar_exact_p(n_w, n_l), delta_ci95=list(paired_bootstrap_ci(b, c, n_boot=n_boot)))
    return out


def _near_names(task: str, others: list[str]) -> list[str]:
    """Task names that look like the same task spelled another way ("gsm8k" and "gsm8k:strict-match")."""
    stem = task.split(":", 1)[0]
    return [o for o in others if o != task and o.split(":", 1)[0] == stem]


def why_unpaired(task: str, bt: ByTask, ct: ByTask, result: TaskPairing) -> str:
    """One sentence on why a task has no pair at all (so nobody reads '0 paired' as 'no difference')."""
    for side, here, there in (("baseline", bt, ct), ("candidate", ct, bt)):
        if task not in there or not there[task]:
            other = "candidate" if side == "baseline" else "baseline"
            near = _near_names(task, list(there))
            hint = (f"; the {other} has {', '.join(map(repr, near))}: the same task under another name "
                    f"(an lm-eval filter name? re-import with `moebench import-lm-eval` to use moebench's names)"
                    if near else f"; the {other} has tasks {', '.join(map(repr, list(there)[:8])) or 'none'}")
            return f"task {task!r} is only in the {side} run{hint}"
    b_ids, c_ids = set(bt[task]), set(ct[task])
    if not b_ids & c_ids:
        return (f"no item ids in common: the baseline has e.g. {min(b_ids, key=natural_key)!r}, the candidate "
                f"e.g. {min(c_ids, key=natural_key)!r} (different datasets, splits or id schemes)")
    counts: dict[str, int] = {}
    for item_id in b_ids & c_ids:
        reason = result.excluded_reasons.get(item_id, "excluded")
        kind = reason.split(":", 1)[0]
        counts[kind] = counts.get(kind, 0) + 1
    parts = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    return f"all {len(b_ids & c_ids)} items in both runs were excluded: {parts}"


def pair_runs(base_records: list[ItemRecord], cand_records: list[ItemRecord],
              refuse: dict[str, str] | None = None) -> Pairing:
    """Per-task pairing for every task with correctness in either run, plus an overall block.
    `refuse` (task -> reason) names tasks not to pair at all: every item is excluded with the reason."""
    refuse = refuse or {}
    bt, ct = _by_task(base_records), _by_task(cand_records)
    tasks = [t for t in list(bt) + [t for t in ct if t not in bt] if t in _scored_tasks(bt) | _scored_tasks(ct)]

    def refused(t: str, prefix: str = "") -> dict[str, str]:
        ids = set(bt.get(t, {})) | set(ct.get(t, {}))
        return {f"{prefix}{i}": refuse[t] for i in ids} if t in refuse else {}

    per_task = {t: pair_task(bt.get(t, {}), ct.get(t, {}), refused=refused(t)) for t in tasks}
    for t, result in per_task.items():
        if t in refuse:
            result.unpaired_reason = refuse[t]
        elif result.n_paired == 0:
            result.unpaired_reason = why_unpaired(t, bt, ct, result)
    for t in tasks:
        if t == "cmmlu" or t.startswith("cmmlu"):
            per_task[t].per_subject = per_subject(per_task[t], bt.get(t, {}), ct.get(t, {}))
    overall = None
    if per_task:
        # Overall pairs every scored item of every task; ids are prefixed by task to stay unique.
        base_all = {f"{t}::{i}": r for t in tasks for i, r in bt.get(t, {}).items()}
        cand_all = {f"{t}::{i}": r for t in tasks for i, r in ct.get(t, {}).items()}
        overall = OverallPairing.of(pair_task(base_all, cand_all, refused={
            k: v for t in tasks for k, v in refused(t, f"{t}::").items()}))
    return Pairing(tasks=per_task, overall=overall)
