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
from dataclasses import dataclass, field
from typing import Iterable, Protocol

from moebench.datasets import sha256_file
from moebench.json_types import JsonObject, JsonValue
from moebench.store import RunStore
from moebench.store.records import summaries

# Metrics whose value 1 means "right", in order of preference for the record's `correct`.
MAIN_METRICS = ("exact_match", "acc", "pass@1", "pass_at_1", "em", "acc_norm")

# lm-eval task -> (moebench task, the filter that scores as moebench does, item id pattern).
NATIVE_NAMES = {"gsm8k": ("gsm8k", "strict-match", "gsm8k/test/{doc_id}")}

SAMPLES_NAME = re.compile(r"^samples_(?P<task>.+)_(?P<date>\d{4}-\d{2}-\d{2}T[0-9.\-]+)\.jsonl$")


class SamplesError(ValueError):
    """A samples file is malformed; the message names the file, line and key."""


@dataclass(frozen=True)
class LmEvalSample:
    """One lm-eval sample row (one doc under one filter), from a `--log_samples` file or from
    `simple_evaluate`'s in-memory samples (there the responses may be tuples, not lists)."""

    doc_id: JsonValue
    filter: str
    filtered_resps: JsonValue
    resps: JsonValue = None
    target: JsonValue = None
    arguments: JsonValue = None
    metrics: dict[str, JsonValue] = field(default_factory=dict)   # every metric the row lists and holds, in order
    prompt_hash: JsonValue = None
    doc_hash: JsonValue = None
    target_hash: JsonValue = None

    @staticmethod
    def from_json(row: JsonObject, task_name: str) -> LmEvalSample:
        """A row as lm-eval gives it; one without doc_id, filter or filtered_resps is refused naming
        the task and key."""
        for key in ("doc_id", "filter", "filtered_resps"):
            if key not in row:
                raise SamplesError(f"sample of task {task_name!r} lacks key {key!r}")
        listed = row.get("metrics", [])
        if not isinstance(listed, (list, tuple)):
            raise SamplesError(f"sample of task {task_name!r} doc_id {row['doc_id']}: key 'metrics' is "
                               f"{type(listed).__name__}, expected a list of metric names")
        return LmEvalSample(doc_id=row["doc_id"], filter=str(row["filter"]), filtered_resps=row["filtered_resps"],
                            resps=row.get("resps", []), target=row.get("target"), arguments=row.get("arguments", []),
                            metrics={str(m): row.get(str(m)) for m in listed if m in row},
                            prompt_hash=row.get("prompt_hash"), doc_hash=row.get("doc_hash"),
                            target_hash=row.get("target_hash"))

    def main_metric(self) -> str | None:
        """The metric that decides `correct`: exact_match / acc first, else the first 0-or-1 metric."""
        for m in MAIN_METRICS:
            if m in self.metrics:
                return m
        for m, v in self.metrics.items():
            if _number(v) in (0.0, 1.0):
                return m
        return None

    def argument_tuples(self) -> list[tuple[JsonValue, ...]]:
        """Request arguments as tuples; log files store them as {"gen_args_0": {"arg_0": .., ..}, ..}."""
        args = self.arguments or []
        if isinstance(args, dict):
            out = []
            for key in sorted(args, key=lambda k: int(k.rsplit("_", 1)[-1])):
                inner = args[key]
                if not isinstance(inner, dict):
                    raise SamplesError(f"sample doc_id {self.doc_id}: arguments[{key!r}] is "
                                       f"{type(inner).__name__}, expected an object of arg_N keys")
                out.append(tuple(inner[k] for k in sorted(inner, key=lambda k: int(k.rsplit("_", 1)[-1]))))
            return out
        if not isinstance(args, (list, tuple)):
            return [(args,)]
        return [tuple(a) if isinstance(a, (list, tuple)) else (a,) for a in args]


def _number(value: JsonValue) -> float | None:
    if isinstance(value, bool):
        return float(value)
    try:
        return float(value)  # type: ignore[arg-type]   # lm-eval writes numbers, and numbers as strings
    except (TypeError, ValueError):
        return None


def _loglikelihood_pair(resp: JsonValue) -> tuple[float, bool] | None:
    """(logprob, is_greedy) from an in-memory tuple or a sanitized ["-1.2", "False"] list."""
    if isinstance(resp, (list, tuple)) and len(resp) == 2:
        lp = _number(resp[0])
        if lp is not None:
            greedy = resp[1] if isinstance(resp[1], bool) else str(resp[1]) == "True"
            return lp, greedy
    return None


def native_names(task_name: str, filt: str, doc_id: JsonValue, with_filter: bool) -> tuple[str, str]:
    """(task, item_id) of one sample: moebench's own names where the task has a native twin."""
    native = NATIVE_NAMES.get(task_name)
    if native is None:
        return (f"{task_name}:{filt}" if with_filter else task_name), f"{task_name}/{doc_id}"
    name, primary, pattern = native
    task = name if (filt == primary or not with_filter) else f"{name}:{filt}"
    return task, pattern.format(doc_id=doc_id)


@dataclass
class ImportedRecord:
    """The items.jsonl record of one lm-eval sample (docs/design.md section 4's fields and the lm_eval_*
    ones of this module's docstring). `to_dict` writes the keys in the order imports always have;
    `floored_tokens` and `error` are what `moebench lm-eval` adds for its own runner."""

    task: str
    item_id: str
    status: str
    correct: bool | None
    prompt_hash: JsonValue
    lm_eval_task: str
    lm_eval_filter: str
    lm_eval_doc_id: JsonValue
    lm_eval_main_metric: str | None
    lm_eval_metrics: dict[str, JsonValue]
    doc_hash: JsonValue
    target_hash: JsonValue
    answer: str | None
    output: str
    reference: str | None
    choice_logprobs: list[float] | None = None     # multiple choice: one log-prob per choice
    floored_tokens: int | None = None               # tokens whose log-prob was floored: the score is a bound
    error: str | None = None

    def fail(self, message: str) -> None:
        """An item the runner failed on: retried on resume, never counted as a wrong answer."""
        self.status, self.correct, self.error = "error", None, message

    def to_dict(self) -> JsonObject:
        out: JsonObject = {"task": self.task, "item_id": self.item_id, "status": self.status, "correct": self.correct,
                           "prompt_hash": self.prompt_hash, "lm_eval_task": self.lm_eval_task,
                           "lm_eval_filter": self.lm_eval_filter, "lm_eval_doc_id": self.lm_eval_doc_id,
                           "lm_eval_main_metric": self.lm_eval_main_metric, "lm_eval_metrics": self.lm_eval_metrics,
                           "doc_hash": self.doc_hash, "target_hash": self.target_hash, "answer": self.answer,
                           "output": self.output}
        if self.choice_logprobs is not None:
            out["choice_logprobs"] = self.choice_logprobs
        out["reference"] = self.reference
        if self.floored_tokens is not None:
            out["floored_tokens"] = self.floored_tokens
        if self.error is not None:
            out["error"] = self.error
        return out


def record_from_sample(task_name: str, sample: LmEvalSample, with_filter: bool) -> ImportedRecord:
    """One moebench record from one lm-eval sample row (one doc under one filter)."""
    args = sample.argument_tuples()
    filtered = sample.filtered_resps
    resps = sample.resps
    target = sample.target
    metric = sample.main_metric()
    value = _number(sample.metrics.get(metric)) if metric else None
    task, item_id = native_names(task_name, sample.filter, sample.doc_id, with_filter)
    pairs = [_loglikelihood_pair(r) for r in filtered] if isinstance(filtered, list) else []
    choice_logprobs = None
    if pairs and all(p is not None for p in pairs) and all(len(a) >= 2 for a in args):
        # Multiple choice: one loglikelihood request per choice; the answer is the best-scoring one.
        choices = [str(a[1]).strip() for a in args]
        choice_logprobs = [p[0] for p in pairs if p is not None]
        best = max(range(len(choice_logprobs)), key=lambda i: choice_logprobs[i])
        answer: str | None = choices[best]
        output = choices[best]
        t = _number(target)
        reference = (choices[int(t)] if t is not None and t == int(t) and 0 <= t < len(choices)
                     else (None if target is None else str(target)))
    else:
        picked = filtered[0] if isinstance(filtered, list) and filtered else filtered
        raw = resps[0] if isinstance(resps, list) and resps else resps
        while isinstance(raw, list) and raw:          # resps are nested: [[text], ...]
            raw = raw[0]
        answer = None if picked is None else str(picked)
        output = "" if raw is None or raw == [] else str(raw)
        reference = None if target is None else str(target)
    return ImportedRecord(
        task=task, item_id=item_id, status="ok", correct=(value == 1.0) if value is not None else None,
        prompt_hash=sample.prompt_hash, lm_eval_task=task_name, lm_eval_filter=sample.filter,
        lm_eval_doc_id=sample.doc_id, lm_eval_main_metric=metric, lm_eval_metrics=dict(sample.metrics),
        doc_hash=sample.doc_hash, target_hash=sample.target_hash, answer=answer, output=output,
        reference=reference, choice_logprobs=choice_logprobs)


def records_from_samples(task_name: str, rows: Iterable[JsonObject]) -> list[ImportedRecord]:
    """Records for every row of one task (rows as lm-eval gives them); the filter joins the task name
    when the task has several."""
    samples = [LmEvalSample.from_json(r, task_name) for r in rows]
    with_filter = len({s.filter for s in samples}) > 1
    out, seen = [], set()
    for s in samples:
        rec = record_from_sample(task_name, s, with_filter)
        key = (rec.task, rec.item_id)
        if key in seen:
            raise SamplesError(f"task {task_name!r}: doc_id {s.doc_id} appears twice under filter {s.filter!r}")
        seen.add(key)
        out.append(rec)
    return out


def task_of_samples_file(path: Path) -> str:
    m = SAMPLES_NAME.match(path.name)
    if not m:
        raise SamplesError(f"{path}: not an lm-eval samples file name; expected "
                           f"samples_<task>_<YYYY-MM-DDTHH-MM-SS.ffffff>.jsonl")
    return m.group("task")


def read_samples_file(path: Path) -> list[JsonObject]:
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
    by_task: dict[str, list[JsonObject]] = {}
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


class Scored(Protocol):
    """What a run's summary counts of a record: its task, status and whether it was right."""

    task: str
    status: str
    correct: bool | None


@dataclass
class TaskCounts:
    """One task's line of the run summary."""

    n: int = 0
    n_scored: int = 0
    n_correct: int = 0
    n_errors: int = 0

    def to_json(self) -> JsonObject:
        return {"n": self.n, "n_scored": self.n_scored, "n_correct": self.n_correct, "n_errors": self.n_errors,
                "accuracy": self.n_correct / self.n_scored if self.n_scored else None}


def summarize(records: Iterable[Scored]) -> JsonObject:
    """The manifest's summary: per record task, n, scored, correct, errors, accuracy."""
    counts: dict[str, TaskCounts] = {}
    for r in records:
        c = counts.setdefault(r.task, TaskCounts())
        c.n += 1
        if r.status == "error":
            c.n_errors += 1
        elif r.correct is not None:
            c.n_scored += 1
            c.n_correct += int(bool(r.correct))
    return {task: c.to_json() for task, c in counts.items()}
