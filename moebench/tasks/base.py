"""The task contract: a dataset turned into items, each asked of a runner and scored into a record.

A task kind is a `Task` subclass with:
- `kind`: the name suites use (`task = "gsm8k"`);
- `options`: its own suite keys (a schema of `config.Field`s);
- `needs(runner)`: the runner capabilities it requires, checked before any work starts;
- `check(runner)`: optional further checks of the runner's set-up, also before any work;
- `items()`: the items in the dataset's own order (already cut to `limit`), ids stable across runs;
- `evaluate(item, runner)`: ask and score one item, return its record (`store.records.ItemRecord`;
  the kld and speed tasks hand the record's fields as a JSON object);
- `summary(records)`: optional task-level figures for the manifest and compare, typed
  (`tasks.records.AccuracySummary` or a task's subclass); `summarize(lines)` is its JSON, from the
  items.jsonl lines (the kld and speed tasks override `summarize` itself).

A record has: task, item_id, status ("ok" | "error"), correct (bool or None), answer, reference,
output (docs/design.md section 4), and what the task adds. `evaluate` raising any exception yields an
`error` record carrying the message; errors are retried on resume and never counted as wrong.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypedDict, TypeVar

from moebench.config import Field, RunnerProfile, TaskOptions
from moebench.json_types import JsonObject
from moebench.runners.base import Capability, GenerateResult, Runner
from moebench.store.records import ItemRecord
from moebench.tasks.records import AccuracySummary

D = TypeVar("D")


@dataclass
class Item(Generic[D]):
    """One item of a task: its stable id and what the task needs to ask it (the task's own class)."""

    item_id: str
    data: D


class PhaseProbe(Protocol):
    """The background probe as tasks see it (moebench.probes.nvml.NvmlProbe): told which phase the work
    is in, now or at a past perf_counter instant."""

    def mark(self, phase: str, at: float | None = None) -> None: ...


@dataclass
class TaskContext:
    """What a task may use besides its options."""

    data_dir: Path                       # the dataset mirror
    run_dir: Path | None = None          # where bulk side files go (KLD arrays, timings)
    baseline_run: Path | None = None     # `--baseline RUN` for tasks that need a reference
    data_files: dict[str, str] = field(default_factory=dict)   # path -> sha256, filled by tasks
    probe: PhaseProbe | None = None      # the probe while NVML sampling runs, else None
    runner_profile: RunnerProfile | None = None   # the resolved profile (A/B speed runs spawn fresh ones)

    def mark(self, phase: str) -> None:
        """Tell the background probe which phase the work is in (load, prefill, decode, idle)."""
        if self.probe is not None:
            self.probe.mark(phase)


class Task:
    kind: str = "base"
    options: dict[str, Field] = {}
    # The probe phase the run marks while this task's items run ("generate": text generation,
    # "score": log-probs only). None: the task marks its own phases per item (speed, needle).
    phase: str | None = "generate"

    def __init__(self, opts: TaskOptions, ctx: TaskContext):
        self.opts = opts
        self.ctx = ctx
        self.name: str = opts.get("name") or self.kind
        self.limit: int | None = opts.get("limit")

    def needs(self, runner: Runner) -> set[str]:
        return {Capability.GENERATE}

    def check(self, runner: Runner) -> None:
        """Refuse a runner set-up this task cannot measure (raise ProfileError), before any work."""

    def items(self) -> list[Item]:
        raise NotImplementedError

    async def evaluate(self, item: Item[Any], runner: Runner) -> ItemRecord | JsonObject:
        raise NotImplementedError

    def record(self, item: Item[Any], correct: bool | None, answer: str | None, reference: str | None,
               output: str | None, extra: JsonObject) -> ItemRecord:
        """An answered item's record; `extra` holds the keys the task adds to its items.jsonl line
        (docs/schema.md, per task)."""
        return ItemRecord(task=self.name, item_id=item.item_id, status="ok", correct=correct, answer=answer,
                          reference=reference, output=output, extra=extra)

    def summary(self, records: list[ItemRecord]) -> AccuracySummary:
        """The task's figures over its records (accuracy; a task with more figures overrides this)."""
        return AccuracySummary.of(records)

    def summarize(self, records: list[JsonObject]) -> JsonObject:
        """summary(...) as the manifest's summary.<task>, from the task's items.jsonl lines."""
        return self.summary([ItemRecord.from_dict(r, f"items.jsonl ({self.name})") for r in records]).to_json()

    async def prepare(self, runner: Runner) -> None:
        """Optional set-up with the runner up (e.g. tokenizing a haystack); runs before the items."""

    def _cut(self, items: list[Item]) -> list[Item]:
        return items[: self.limit] if self.limit else items


# A fitted prompt whose length the server counts more than this far off is flagged (issue: tokenizers
# that differ from the server's make "a 32k prompt" mean something else).
PROMPT_TOKENS_TOLERANCE = 0.005


def runner_fields(result: GenerateResult) -> JsonObject:
    """What the runner reported for a record's `extra` (token ids and counts, finish reason, timings):
    `to_record_fields` without the output text, which is the record's own field."""
    fields = result.to_record_fields()
    del fields["output"]
    return fields


class PromptTokensCheck(TypedDict, total=False):
    """Both keys, or neither where there was nothing to compare (spread into a record's keys)."""

    prompt_tokens_disagreement: float
    prompt_tokens_flagged: bool


def prompt_tokens_check(fitted: int | None, reported: int | None) -> PromptTokensCheck:
    """The server-reported prompt length beside the fitted one: relative disagreement and a flag."""
    if not fitted or reported is None:
        return {}
    rel = (reported - fitted) / fitted
    return {"prompt_tokens_disagreement": rel, "prompt_tokens_flagged": abs(rel) > PROMPT_TOKENS_TOLERANCE}


def count_flagged(records: list[JsonObject]) -> int:
    """Ok items.jsonl lines whose prompt length the server counted off the fitted one (prompt_tokens_check)."""
    return sum(1 for r in records if r.get("status") == "ok" and r.get("prompt_tokens_flagged"))


def prompt_hash(prompt: str | list[int]) -> str:
    """Stable hash of what was asked: compare excludes a pair whose prompts differ."""
    if isinstance(prompt, str):
        data = prompt.encode("utf-8")
    else:
        data = (",".join(map(str, prompt))).encode("ascii")
    return hashlib.sha256(data).hexdigest()[:16]


class PrefixHash:
    """`prompt_hash` of text prompts that all start with one `prefix` (a few-shot block): the prefix is
    hashed once, and each prompt costs only its own tail (`of_tail(tail) == prompt_hash(prefix + tail)`)."""

    def __init__(self, prefix: str):
        self._prefix = hashlib.sha256(prefix.encode("utf-8"))

    def of_tail(self, tail: str) -> str:
        h = self._prefix.copy()
        h.update(tail.encode("utf-8"))
        return h.hexdigest()[:16]
