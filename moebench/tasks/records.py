"""The task-level figures a run's manifest keeps under summary.<task> (docs/schema.md), typed.

`AccuracySummary` holds what every scored task reports; a task that adds figures subclasses it with
its own fields. `to_json()` is the manifest's JSON: the base figures, then the task's, in field order.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from moebench.json_types import JsonObject
from moebench.store.records import ItemRecord


def scored(records: list[ItemRecord]) -> list[ItemRecord]:
    """The ok records that were scored (correct is true or false; an abstention or an error is not)."""
    return [r for r in records if r.status == "ok" and r.correct is not None]


@dataclass(frozen=True)
class AccuracySummary:
    """How many items, scored, correct and errored, and the accuracy over the scored ones."""

    n: int
    n_scored: int
    n_correct: int
    n_errors: int
    accuracy: float | None

    @staticmethod
    def counts(records: list[ItemRecord]) -> tuple[int, int, int, int, float | None]:
        """(n, n_scored, n_correct, n_errors, accuracy): the base fields, for a subclass to extend."""
        ok = scored(records)
        n_correct = sum(1 for r in ok if r.correct)
        errors = sum(1 for r in records if r.status == "error")
        return len(records), len(ok), n_correct, errors, (n_correct / len(ok)) if ok else None

    @classmethod
    def of(cls, records: list[ItemRecord]) -> AccuracySummary:
        return cls(*cls.counts(records))

    def to_json(self) -> JsonObject:
        return asdict(self)
