"""compare.json["needle"]: per cell (length, depth) whether each run found the code. Reads records only."""
from __future__ import annotations

from typing import Any


def needle_compare(base_records: list[dict[str, Any]], cand_records: list[dict[str, Any]]) -> dict[str, Any]:
    """compare.json["needle"]: per cell found in baseline / candidate, plus counts and the cells lost.

    Cells pair by item_id; a cell errored or missing on either side goes to `excluded`.
    """
    def ok(records):
        return {r["item_id"]: r for r in records
                if r.get("task") in (None, "needle") and str(r.get("item_id", "")).startswith("needle/")
                and r.get("status") == "ok"}
    base, cand = ok(base_records), ok(cand_records)
    all_ids = {r.get("item_id") for r in [*base_records, *cand_records]
               if str(r.get("item_id", "")).startswith("needle/")}
    cells, lost, gained = [], [], []
    for item_id in sorted(set(base) & set(cand), key=_cell_sort_key):
        b, c = base[item_id], cand[item_id]
        cells.append({"item_id": item_id, "length": b.get("length"), "depth": b.get("depth"),
                      "prompt_tokens": c.get("prompt_tokens"), "prompt_tokens_baseline": b.get("prompt_tokens"),
                      "found_baseline": bool(b.get("correct")), "found_candidate": bool(c.get("correct"))})
        if b.get("correct") and not c.get("correct"):
            lost.append(item_id)
        if c.get("correct") and not b.get("correct"):
            gained.append(item_id)
    return {
        "cells": cells,
        "n_paired": len(cells),
        "found_baseline": sum(x["found_baseline"] for x in cells),
        "found_candidate": sum(x["found_candidate"] for x in cells),
        "lost": lost, "gained": gained,
        "excluded": sorted(all_ids - (set(base) & set(cand)), key=_cell_sort_key),
        # cells whose server-reported prompt length differs from the fitted one by more than 0.5%
        "prompt_tokens_flagged": {side: sorted((i for i, r in recs.items() if r.get("prompt_tokens_flagged")),
                                               key=_cell_sort_key)
                                  for side, recs in (("baseline", base), ("candidate", cand))},
    }


def _cell_sort_key(item_id: str) -> tuple[int, float]:
    try:
        _, length, depth = item_id.split("/")
        return int(length), float(depth)
    except ValueError:
        return (0, 0.0)
