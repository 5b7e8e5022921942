"""The run loop's bookkeeping, shared by every entry point that writes or measures runs (`api.run`,
`moebench lm-eval`, the speed A/B passes): the manifest's common identity, the item record built
from a task's answer or its failure, the runner's identity once it is up, and the closing status with
the runner's events. Each entry point keeps only what is its own (which items, how they are asked).
"""
from __future__ import annotations

import errno
import os
import time
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable

from moebench.json_types import JsonObject

from moebench.identity import host_identity, moebench_identity
from moebench.secrets import env_secret_values
from moebench.store import RunLock, RunStore
from moebench.store.records import ErrorCause, ItemRecord, Manifest, RunEvent, TaskSummary, summaries

# OS errors that mean the run cannot go on (a full disk, a read-only or failing filesystem): they end
# the run instead of becoming one error record per remaining item.
FATAL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO}


def new_manifest(label: str, suite: JsonObject, runner: JsonObject, data_dir: str | os.PathLike[str],
                 **fields: Any) -> Manifest:
    """The identity every run's manifest starts with (docs/design.md section 4), plus the entry point's
    own `fields` (JSON values: its extra keys); `suite` and `runner` are the profiles' JSON echoes,
    already redacted."""
    return Manifest.begin({"run_id": uuid.uuid4().hex[:12], "label": label, "suite": suite, "runner": runner,
                           "moebench": dict(moebench_identity()), "host": dict(host_identity()),
                           "data_dir": str(data_dir), **fields})


def open_store(run_dir: str | os.PathLike[str], manifest: Manifest, runner_settings: JsonObject | None,
               lock: RunLock | None = None) -> RunStore:
    """Create (or resume) the run directory; secrets named by the runner's settings never reach it."""
    secrets = frozenset(env_secret_values(runner_settings)) if runner_settings is not None else frozenset()
    return RunStore.create_or_resume(Path(run_dir), manifest, lock=lock, secrets=secrets)


async def ask_record(task: str, item_id: str, evaluate: Callable[[], Awaitable[ItemRecord | JsonObject]],
                     describe: Callable[[BaseException], str],
                     passthrough: tuple[type[BaseException], ...] = ()) -> ItemRecord:
    """One item's record: the task's on success (an ItemRecord, or its fields as a JSON object), an
    error record on any failure but `passthrough` exceptions and fatal OS errors (both re-raised).
    `wall_s` is the time it took."""
    t0 = time.perf_counter()
    try:
        got = await evaluate()
        rec = got if isinstance(got, ItemRecord) else ItemRecord.from_fields(task, item_id, got)
    except passthrough:
        raise
    except OSError as e:
        if e.errno in FATAL_ERRNOS:
            raise
        rec = ItemRecord.failed(task, item_id, describe(e), type(e).__name__)
    except Exception as e:
        rec = ItemRecord.failed(task, item_id, describe(e), type(e).__name__)
    rec.task, rec.item_id = task, item_id
    rec.extra["wall_s"] = round(time.perf_counter() - t0, 4)
    return rec


async def ask_item(task: str, item_id: str, evaluate: Callable[[], Awaitable[ItemRecord | JsonObject]],
                   describe: Callable[[BaseException], str],
                   passthrough: tuple[type[BaseException], ...] = ()) -> JsonObject:
    """`ask_record` as the JSON object items.jsonl holds, for callers that keep records as JSON (the
    speed A/B pass writes them into its own file)."""
    return (await ask_record(task, item_id, evaluate, describe, passthrough)).to_dict()


COMMON_ERRORS = 3            # the error causes a run's manifest and printout name, most frequent first
ERROR_CAUSE_CHARS = 300      # a cause is the error message, cut to this length


def common_errors(records: list[ItemRecord], top: int = COMMON_ERRORS) -> list[ErrorCause]:
    """The most common error messages among the (latest) records, most frequent first; ties keep the
    order of first appearance."""
    counts: dict[str, int] = {}
    for rec in records:
        if rec.status == "error":
            cause = str(rec.error or "no message")[:ERROR_CAUSE_CHARS]
            counts[cause] = counts.get(cause, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])
    return [ErrorCause(cause, n) for cause, n in ranked[:top]]


def record_runner_identity(store: RunStore, runner: Any) -> None:
    """After the runner started: its model and build identity into the manifest."""
    ident = runner.identity()
    store.update_manifest(model=ident.get("model"), build=ident.get("build"))


def finish_run(store: RunStore, status: str, runner: Any, summary: dict[str, TaskSummary] | dict[str, JsonObject],
               **fields: object) -> None:
    """The closing manifest: status, end time, the tasks' summaries (TaskSummary, or the JSON object a
    task's `summarize` gives), the run's events followed by the runner's (`runners.base.RunnerEvent`),
    and the entry point's `fields` (typed where the manifest has a class for them: `counts` a
    RunCounts, `error_causes` ErrorCauses)."""
    runner_events = [RunEvent.from_json(dict(e), f"the runner's events[{i}]")
                     for i, e in enumerate(getattr(runner, "events", []))]
    store.finish(status, summary=summaries(summary), events=[*(store.manifest.events or []), *runner_events], **fields)
