"""compare.json's per-task entries as their readers see them (tasks.<task>, a per_subject entry, "overall").

The builder writes these entries from `compare.pairs` (TaskPairing, OverallPairing); the readers (the
gate, the matrix row) also take hand-written and older files, where a figure may be missing or not a
number. `TaskEntry.from_json` therefore reads leniently: a figure that is absent or of the wrong type
becomes None, and each reader says what it lacked where it needs it (the gate's rule reports it as
missing), instead of one bad key refusing the whole file.
"""
from __future__ import annotations

from dataclasses import dataclass

from moebench.json_fields import as_integer
from moebench.json_types import JsonObject, JsonValue
from moebench.store.sections import number


def _ids(v: JsonValue) -> list[str] | None:
    """An id list (wins, losses, excluded) as written; None where the key holds no list."""
    return [str(i) for i in v] if isinstance(v, list) else None


@dataclass(frozen=True)
class TaskEntry:
    """One task's paired figures read from compare.json; None where the file lacks a figure."""

    n_paired: float | None
    baseline_correct: float | None
    candidate_correct: float | None
    baseline_accuracy: float | None
    candidate_accuracy: float | None
    flip_rate: float | None
    mcnemar_p: float | None
    wins: list[str] | None
    losses: list[str] | None
    excluded: list[str] | None
    delta_ci95: list[float | None] | None
    """[low, high] as written (each None where not a number); None where the key holds no list."""
    n_wins: int | None = None
    """The overall block counts flips instead of listing them."""
    n_losses: int | None = None
    n_excluded: int | None = None
    unpaired_reason: str | None = None

    @classmethod
    def from_json(cls, t: JsonObject) -> "TaskEntry":
        ci = t.get("delta_ci95")
        why = t.get("unpaired_reason")
        return cls(n_paired=number(t.get("n_paired")), baseline_correct=number(t.get("baseline_correct")),
                   candidate_correct=number(t.get("candidate_correct")),
                   baseline_accuracy=number(t.get("baseline_accuracy")),
                   candidate_accuracy=number(t.get("candidate_accuracy")),
                   flip_rate=number(t.get("flip_rate")), mcnemar_p=number(t.get("mcnemar_p")),
                   wins=_ids(t.get("wins")), losses=_ids(t.get("losses")), excluded=_ids(t.get("excluded")),
                   delta_ci95=[number(x) for x in ci] if isinstance(ci, list) else None,
                   n_wins=as_integer(t.get("n_wins")), n_losses=as_integer(t.get("n_losses")),
                   n_excluded=as_integer(t.get("n_excluded")), unpaired_reason=str(why) if why else None)
