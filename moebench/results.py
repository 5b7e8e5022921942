"""Load runs and compares into pandas DataFrames (the fields are documented in docs/schema.md).

    from moebench.results import load_items, load_compare, load_matrix
    items = load_items("results/my-run")          # a row per item: the last record of each item wins
    tasks = load_compare("results/cmp")           # a row per (candidate, task) of a compare directory
    matrix = load_matrix("results/cmp")           # a row per candidate: matrix.csv's columns

Unlike `pandas.read_json(items.jsonl, lines=True)`, answers and references stay the strings the run
wrote ("18" is not 18.0, "007" keeps its zeros), and an item retried on resume appears once.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from moebench import jsonout
from moebench import store

# Columns that hold text in items.jsonl (docs/design.md section 4): kept as str (or None), never parsed.
TEXT_COLUMNS = ("task", "item_id", "status", "answer", "reference", "output", "error", "prompt_hash")
FIRST_COLUMNS = ("task", "item_id", "status", "correct", "answer", "reference", "output")


def load_items(run: str | Path) -> pd.DataFrame:
    """A run's items.jsonl as a DataFrame: one row per (task, item_id), the last record of each winning
    (retries on resume append a new record), a torn last line ignored. Text columns stay strings."""
    _, records = store.load_run(run)         # StoreError names the file and line when malformed
    if not records:
        return pd.DataFrame(columns=list(FIRST_COLUMNS))
    rows = []
    for r in records:
        row = dict(r)
        for k in TEXT_COLUMNS:
            v = row.get(k)
            if v is not None and not isinstance(v, str):
                row[k] = jsonout.document_text(v) if isinstance(v, (list, dict)) else str(v)
        rows.append(row)
    df = pd.DataFrame.from_records(rows)
    for k in TEXT_COLUMNS:
        if k in df.columns:
            df[k] = df[k].astype(object).where(df[k].notna(), None)
    if "correct" in df.columns:        # True / False / None stay as such (object), not 1.0 / 0.0 / NaN
        df["correct"] = df["correct"].astype(object).where(df["correct"].notna(), None)
    order = [c for c in FIRST_COLUMNS if c in df.columns]
    return df[order + [c for c in df.columns if c not in order]]


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _compare_files(directory: Path) -> list[Path]:
    """compare.json of a one-candidate compare, or each candidate's of a several-candidate one."""
    if (directory / "compare.json").is_file():
        return [directory / "compare.json"]
    matrix = _read_json(directory / "matrix.json")
    try:
        return [directory / c["compare_dir"] / "compare.json" for c in matrix["candidates"]]
    except (KeyError, TypeError):
        raise ValueError(f"{directory / 'matrix.json'}: expected 'candidates' with 'compare_dir'") from None


def load_compare(directory: str | Path) -> pd.DataFrame:
    """A row per (candidate, task) of a compare directory: accuracies, delta and its 95% interval, wins,
    losses, flip rate, McNemar p, excluded count; CMMLU subjects as rows "cmmlu/<subject>" too."""
    from moebench.compare.tables import task_figures
    rows = []
    for path in _compare_files(Path(directory)):
        cmp = _read_json(path)
        cand = (cmp.get("candidate") or {}).get("label")
        base = (cmp.get("baseline") or {}).get("label")
        for name, t in (cmp.get("tasks") or {}).items():
            rows.append({"baseline": base, "candidate": cand, "task": name, **task_figures(t).to_json()})
            for subject, st in (t.get("per_subject") or {}).items():
                rows.append({"baseline": base, "candidate": cand, "task": f"{name}/{subject}",
                             **task_figures(st).to_json()})
        if isinstance(cmp.get("overall"), dict):
            rows.append({"baseline": base, "candidate": cand, "task": "overall",
                         **task_figures(cmp["overall"]).to_json()})
    return pd.DataFrame.from_records(rows)


def load_matrix(directory: str | Path) -> pd.DataFrame:
    """A row per candidate (the columns of matrix.csv), from matrix.json."""
    data = _read_json(Path(directory) / "matrix.json")
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError(f"{Path(directory) / 'matrix.json'}: expected an object with 'rows'")
    return pd.DataFrame.from_records(data["rows"])
