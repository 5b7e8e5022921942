"""lm-eval per-sample logs -> moebench records (and whole runs).

lm-eval writes one row per (doc, filter) with `--log_samples` (`samples_<task>_<date>.jsonl`), or
returns the same rows in memory from `simple_evaluate(..., log_samples=True)["samples"]`. Both go
through `records_from_samples`, so a run made with `moebench lm-eval` and an imported one look alike
and `moebench compare` pairs them item by item.

Names follow moebench's own tasks where one exists, so a native run and an imported one pair item by
item: lm-eval's `gsm8k` under its `strict-match` filter (the "#### N" answer, as moebench scores it)
becomes task `gsm8k` with item ids `gsm8k/test/<doc_id>` (the doc id is the line in test.jsonl); its
other filters keep their name (`gsm8k:flexible-extract`). Other tasks are `<task>` or, with several
filters, `<task>:<filter>`, with item ids `<task>/<doc_id>`.

Record fields (besides docs/design.md section 4's): `prompt_hash` is lm-eval's own (sha256 of the first
request's context; moebench's native hash is its first 16 hex digits, so compare checks the two), `lm_eval_filter`, `lm_eval_metrics` (every metric of the row), `doc_hash`,
`target_hash`, and for multiple choice `choice_logprobs`.
"""
from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any, Iterable

from moebench.datasets import sha256_file
from moebench.store import RunStore
from moebench.store.records import summaries

# Metrics whose value 1 means "right", in order of preference for the record's `correct`.
MAIN_METRICS = ("exact_match", "acc", "pass@1", "pass_at_1", "em", "acc_norm")

# lm-eval task -> (moebench task, the filter that scores as moebench does, item id pattern).
NATIVE_NAMES = {"gsm8k": ("gsm8k", "strict-match", "gsm8k/test/{doc_id}")}

SAMPLES_NAME = re.compile(r"^samples_(?P<task>.+)_(?P<date>\d{4}-\d{2}-\d{2}T[0-9.\-]+)\.jsonl$")


class SamplesError(ValueError):
    """A samples file is malformed; the message names the file, line and key."""


def main_metric(sample: dict[str, Any]) -> str | None:
    """The metric that decides `correct`: exact_match / acc first, else the first 0-or-1 metric."""
    names = [m for m in sample.get("metrics", []) if m in sample]
    for m in MAIN_METRICS:
        if m in names:
            return m
    for m in names:
        v = _number(sample[m])
        if v in (0.0, 1.0):
            return m
    return None


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _arguments(sample: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Request arguments as tuples; log files store them as {"gen_args_0": {"arg_0": .., ..}, ..}."""
    args = sample.get("arguments", [])
    if isinstance(args, dict):
        out = []
        for key in sorted(args, key=lambda k: int(k.rsplit("_", 1)[-1])):
            inner = args[key]
            out.append(tuple(inner[k] for k in sorted(inner, key=lambda k: int(k.rsplit("_", 1)[-1]))))
        return out
    return [tuple(a) if isinstance(a, (list, tuple)) else (a,) for a in args]


def _loglikelihood_pair(resp: Any) -> tuple[float, bool] | None:
    """(logprob, is_greedy) from an in-memory tuple or a sanitized ["-1.2", "False"] list."""
    if isinstance(resp, (list, tuple)) and len(resp) == 2:
        lp = _number(resp[0])
        if lp is not None:
            greedy = resp[1] if isinstance(resp[1], bool) else str(resp[1]) == "True"
            return lp, greedy
    return None


def native_names(task_name: str, filt: str, doc_id: Any, with_filter: bool) -> tuple[str, str]:
    """(task, item_id) of one sample: moebench's own names where the task has a native twin."""
    native = NATIVE_NAMES.get(task_name)
    if native is None:
        return (f"{task_name}:{filt}" if with_filter else task_name), f"{task_name}/{doc_id}"
    name, primary, pattern = native
    task = name if (filt == primary or not with_filter) else f"{name}:{filt}"
    return task, pattern.format(doc_id=doc_id)


def record_from_sample(task_name: str, sample: dict[str, Any], with_filter: bool) -> dict[str, Any]:
    """One moebench record from one lm-eval sample row (one doc under one filter)."""
    for key in ("doc_id", "filter", "filtered_resps"):
        if key not in sample:
            raise SamplesError(f"sample of task {task_name!r} lacks key {key!r}")
    filt = str(sample["filter"])
    args = _arguments(sample)
    filtered = sample["filtered_resps"]
    resps = sample.get("resps", [])
    target = sample.get("target")
    metric = main_metric(sample)
    value = _number(sample.get(metric)) if metric else None
    task, item_id = native_names(task_name, filt, sample["doc_id"], with_filter)
    record: dict[str, Any] = {
        "task": task,
        "item_id": item_id,
        "status": "ok",
        "correct": (value == 1.0) if value is not None else None,
        "prompt_hash": sample.get("prompt_hash"),
        "lm_eval_task": task_name,
        "lm_eval_filter": filt,
        "lm_eval_doc_id": sample["doc_id"],
        "lm_eval_main_metric": metric,
        "lm_eval_metrics": {m: sample.get(m) for m in sample.get("metrics", []) if m in sample},
        "doc_hash": sample.get("doc_hash"),
        "target_hash": sample.get("target_hash"),
    }
    pairs = [_loglikelihood_pair(r) for r in filtered] if isinstance(filtered, list) else []
    if pairs and all(p is not None for p in pairs) and all(len(a) >= 2 for a in args):
        # Multiple choice: one loglikelihood request per choice; the answer is the best-scoring one.
        choices = [str(a[1]).strip() for a in args]
        lps = [p[0] for p in pairs]
        best = max(range(len(lps)), key=lambda i: lps[i])
        record["answer"] = choices[best]
        record["output"] = choices[best]
        record["choice_logprobs"] = lps
        t = _number(target)
        record["reference"] = (choices[int(t)] if t is not None and t == int(t) and 0 <= t < len(choices)
                               else (None if target is None else str(target)))
    else:
        answer = filtered[0] if isinstance(filtered, list) and filtered else filtered
        raw = resps[0] if isinstance(resps, list) and resps else resps
        while isinstance(raw, list) and raw:          # resps are nested: [[text], ...]
            raw = raw[0]
        record["answer"] = None if answer is None else str(answer)
        record["output"] = "" if raw is None or raw == [] else str(raw)
        record["reference"] = None if target is None else str(target)
    return record


def records_from_samples(task_name: str, samples: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records for every row of one task; the filter joins the task name when the task has several."""
    rows = list(samples)
    filters = {str(r.get("filter")) for r in rows}
    with_filter = len(filters) > 1
    out, seen = [], set()
    for r in rows:
        rec = record_from_sample(task_name, r, with_filter)
        key = (rec["task"], rec["item_id"])
        if key in seen:
            raise SamplesError(f"task {task_name!r}: doc_id {r.get('doc_id')} appears twice under filter "
                               f"{r.get('filter')!r}")
        seen.add(key)
        out.append(rec)
    return out


def task_of_samples_file(path: Path) -> str:
    m = SAMPLES_NAME.match(path.name)
    if not m:
        raise SamplesError(f"{path}: not an lm-eval samples file name; expected "
                           f"samples_<task>_<YYYY-MM-DDTHH-MM-SS.ffffff>.jsonl")
    return m.group("task")


def read_samples_file(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise SamplesError(f"{path}: file not found")
    rows = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SamplesError(f"{path}: line {n} is not valid JSON ({e})") from None
            if not isinstance(row, dict) or "doc_id" not in row or "filtered_resps" not in row:
                raise SamplesError(f"{path}: line {n} is not an lm-eval sample (needs doc_id, filtered_resps)")
            rows.append(row)
    return rows


def import_lm_eval(paths: list[Path], out_dir: Path, label: str | None = None) -> Path:
    """Turn lm-eval `--log_samples` files into a moebench run in `out_dir`; returns `out_dir`.

    Several files of the same task (e.g. a run split in parts) are joined; a (task, filter, doc_id)
    seen twice is an error.
    """
    paths = [Path(p) for p in paths]
    if not paths:
        raise SamplesError("import-lm-eval: no samples files given")
    by_task: dict[str, list[dict[str, Any]]] = {}
    sources = {}
    for p in paths:
        task = task_of_samples_file(p)
        rows = read_samples_file(p)
        if not rows:
            raise SamplesError(f"{p}: holds no samples")
        by_task.setdefault(task, []).extend(rows)
        sources[str(p)] = sha256_file(p)
    records = []
    for task, rows in by_task.items():
        records.extend(records_from_samples(task, rows))
    out_dir = Path(out_dir)
    manifest = {
        "run_id": uuid.uuid4().hex[:12],
        "label": label or out_dir.name,
        "source": "lm-eval import",
        "lm_eval_samples_files": sources,
        "suite": {"name": "lm-eval", "tasks": [{"task": t} for t in by_task]},
    }
    store = RunStore.create_or_resume(out_dir, manifest)
    try:
        store.append_many(records)
        store.finish("complete", summary=summaries(summarize(records)))
    finally:
        store.close()
    return out_dir


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per record task: n, scored, correct, errors, accuracy."""
    out: dict[str, Any] = {}
    for r in records:
        s = out.setdefault(r["task"], {"n": 0, "n_scored": 0, "n_correct": 0, "n_errors": 0})
        s["n"] += 1
        if r.get("status") == "error":
            s["n_errors"] += 1
        elif r.get("correct") is not None:
            s["n_scored"] += 1
            s["n_correct"] += int(bool(r["correct"]))
    for s in out.values():
        s["accuracy"] = s["n_correct"] / s["n_scored"] if s["n_scored"] else None
    return out
