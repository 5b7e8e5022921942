"""compare.json["needle"]: per cell (length, depth) whether each run found the code. Reads records only."""
from __future__ import annotations

from dataclasses import dataclass

from moebench.json_types import JsonObject
from moebench.store.records import ItemRecord


@dataclass
class NeedleCell:
    """One (length, depth) cell asked of both runs."""

    item_id: str
    length: int | None
    depth: float | None
    prompt_tokens: int | None
    """The candidate's prompt length (the baseline's is prompt_tokens_baseline)."""
    prompt_tokens_baseline: int | None
    found_baseline: bool
    found_candidate: bool

    def to_json(self) -> JsonObject:
        return {"item_id": self.item_id, "length": self.length, "depth": self.depth,
                "prompt_tokens": self.prompt_tokens, "prompt_tokens_baseline": self.prompt_tokens_baseline,
                "found_baseline": self.found_baseline, "found_candidate": self.found_candidate}


@dataclass
class NeedleCompare:
    """compare.json["needle"] (docs/schema.md)."""

    cells: list[NeedleCell]
    lost: list[str]
    gained: list[str]
    excluded: list[str]
    """Cells errored or missing on either side."""
    prompt_tokens_flagged: dict[str, list[str]]
    """Per side: cells whose server-reported prompt length differs from the fitted one by more than 0.5%."""

    @property
    def n_paired(self) -> int:
        return len(self.cells)

    @property
    def found_baseline(self) -> int:
        return sum(c.found_baseline for c in self.cells)

    @property
    def found_candidate(self) -> int:
        return sum(c.found_candidate for c in self.cells)

    def to_json(self) -> JsonObject:
        return {"cells": [c.to_json() for c in self.cells], "n_paired": self.n_paired,
                "found_baseline": self.found_baseline, "found_candidate": self.found_candidate,
                "lost": self.lost, "gained": self.gained, "excluded": self.excluded,
                "prompt_tokens_flagged": self.prompt_tokens_flagged}


def _is_needle(r: ItemRecord) -> bool:
    return r.item_id.startswith("needle/")


def needle_compare(base_records: list[ItemRecord], cand_records: list[ItemRecord]) -> NeedleCompare:
    """Per cell found in baseline / candidate, plus counts and the cells lost.

    Cells pair by item_id; a cell errored or missing on either side goes to `excluded`.
    """
    def ok(records: list[ItemRecord]) -> dict[str, ItemRecord]:
        return {r.item_id: r for r in records if r.task == "needle" and _is_needle(r) and r.status == "ok"}
    base, cand = ok(base_records), ok(cand_records)
    all_ids = {r.item_id for r in [*base_records, *cand_records] if _is_needle(r)}
    cells, lost, gained = [], [], []
    for item_id in sorted(set(base) & set(cand), key=_cell_sort_key):
        b, c = base[item_id], cand[item_id]
        cells.append(NeedleCell(item_id=item_id, length=b.extra.get("length"), depth=b.extra.get("depth"),
                                prompt_tokens=c.extra.get("prompt_tokens"),
                                prompt_tokens_baseline=b.extra.get("prompt_tokens"),
                                found_baseline=bool(b.correct), found_candidate=bool(c.correct)))
        if b.correct and not c.correct:
            lost.append(item_id)
        if c.correct and not b.correct:
            gained.append(item_id)
    return NeedleCompare(
        cells=cells, lost=lost, gained=gained,
        excluded=sorted(all_ids - (set(base) & set(cand)), key=_cell_sort_key),
        prompt_tokens_flagged={side: sorted((i for i, r in recs.items() if r.extra.get("prompt_tokens_flagged")),
                                            key=_cell_sort_key)
                               for side, recs in (("baseline", base), ("candidate", cand))})


def _cell_sort_key(item_id: str) -> tuple[int, float]:
    try:
        _, length, depth = item_id.split("/")
        return int(length), float(depth)
    except ValueError:
        return (0, 0.0)
