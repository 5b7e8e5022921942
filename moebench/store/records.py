"""Typed, versioned forms of the store's three documents (docs/design.md sections 4 and 5, docs/schema.md):
one items.jsonl record (`ItemRecord`), manifest.json (`Manifest`, with its `RunEvent`s, `RunCounts`
and `ErrorCause`s) and compare.json (`CompareDoc`).

`from_dict` checks the structure and names the file, the key and the expected type on bad input
(`RecordError`); `to_dict` gives back the JSON object the contract specifies: every key that was read,
none renamed or dropped (keys a class has no field for travel in `extra`), in the order they were
written. The sections other packages own stay JSON objects here (`JsonObject`): the suite and runner
profile echoes (config), the model/build/moebench/host identities (runners, identity), per-task
summaries (tasks), the probes' block (probes), compare.json's per-task figures and optional sections
(compare); docs/schema.md describes their keys and `store.sections` reads the optional compare sections.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, TypeVar

from moebench.identity import HostIdentity, MoebenchIdentity
from moebench.json_fields import Wording
from moebench.json_types import JsonObject, JsonValue
from moebench.store.files import ITEMS, MANIFEST, STATUSES, StoreError, now_iso
from moebench.store.files import SCHEMA_VERSION as MANIFEST_SCHEMA_VERSION

_T = TypeVar("_T")

# compare.json's schema: 2 adds per-group sample counts to the speed section.
COMPARE_SCHEMA_VERSION = 2
ITEM_STATUSES = ("ok", "error")


class RecordError(StoreError):
    """A store document whose structure is not the contract's; the message names file, key and type."""


# The store's wording of a refusal (tests and users read these messages).
_WORDING = Wording(RecordError)


def _take(data: JsonObject, key: str, types: tuple[type, ...], source: str, required: bool = False,
          choices: tuple[str, ...] | None = None) -> Any:
    """data[key], checked against `types` (and `choices`); None where absent and not required."""
    return _WORDING.value(data, key, source, types, required=required, choices=choices)


def _extra(data: JsonObject, cls: type) -> JsonObject:
    known = {f.name for f in fields(cls)} - {"extra", "key_order"}
    return {k: v for k, v in data.items() if k not in known}


_OPT_STR = (str, type(None))
_OPT_OBJ = (dict, type(None))
_NUM = (int, float)


# The keys ItemRecord holds as fields; every other key of a line travels in `extra`.
_RECORD_KEYS = ("task", "item_id", "status", "correct", "answer", "reference", "output")


@dataclass
class ItemRecord:
    """One line of items.jsonl: a scored item (docs/design.md section 4).

    Items carry no version of their own: the run's manifest `schema_version` covers them.
    """

    task: str
    """The task's name in the suite ("gsm8k", "cmmlu", "humaneval", "kld", "needle", "speed", ...)."""
    item_id: str
    """Stable across runs and machines, e.g. "gsm8k/test/17", "cmmlu/anatomy/3", "needle/131072/0.45"."""
    status: str
    """"ok", or "error" (retried on resume, never counted as a wrong answer)."""
    correct: bool | None = None
    """Whether the answer was right; None when not scored or errored."""
    answer: JsonValue = None
    """The extracted answer (a string), or None."""
    reference: JsonValue = None
    """The expected answer (a string), or None."""
    output: str | None = None
    """The raw model output text."""
    extra: JsonObject = field(default_factory=dict)
    """What the task adds (prompt hash, token counts, timings, choice log-probs, the error message)."""

    @classmethod
    def from_dict(cls, data: JsonValue, source: str = "items.jsonl") -> "ItemRecord":
        d = _WORDING.object(data, source)
        return cls(task=_take(d, "task", (str,), source, required=True),
                   item_id=_take(d, "item_id", (str,), source, required=True),
                   status=_take(d, "status", (str,), source, required=True, choices=ITEM_STATUSES),
                   correct=_take(d, "correct", (bool, type(None)), source),
                   answer=d.get("answer"), reference=d.get("reference"),
                   output=_take(d, "output", _OPT_STR, source), extra=_extra(d, cls))

    @classmethod
    def from_fields(cls, task: str, item_id: str, fields: JsonObject) -> "ItemRecord":
        """The record of a task that hands its fields as a JSON object (the contract's keys and its own,
        in its order); `status` is "ok" unless the fields say otherwise."""
        return cls(task=task, item_id=item_id, status=fields.get("status", "ok"), correct=fields.get("correct"),
                   answer=fields.get("answer"), reference=fields.get("reference"), output=fields.get("output"),
                   extra={k: v for k, v in fields.items() if k not in _RECORD_KEYS})

    @classmethod
    def failed(cls, task: str, item_id: str, message: str, error_type: str | None = None) -> "ItemRecord":
        """An errored item: retried on resume, never counted as a wrong answer. `error_type` is the
        exception's class name (`Unreachable`: the server never answered)."""
        extra: JsonObject = {"error": message}
        if error_type is not None:
            extra["error_type"] = error_type
        return cls(task=task, item_id=item_id, status="error", extra=extra)

    def to_dict(self) -> JsonObject:
        """The line of items.jsonl, keys in the order the run writes them (the contract's, then the task's)."""
        return {"task": self.task, "item_id": self.item_id, "correct": self.correct, "answer": self.answer,
                "reference": self.reference, "output": self.output, "status": self.status, **self.extra}

    @property
    def error(self) -> str | None:
        """An errored record's `Type: message`; None for an ok one."""
        error = self.extra.get("error")
        return None if error is None else str(error)

    @property
    def key(self) -> tuple[str, str]:
        return (self.task, self.item_id)


@dataclass
class RunEvent:
    """manifest.json `events[]`: something that happened to the run (resumed, failed, a stale lock taken
    over) or to its backend (a runner's restart or fallback), with its time where the writer gave one."""

    event: str
    time: str | None = None
    details: JsonObject = field(default_factory=dict)
    """What the event says beyond its name (message, previous_status, previous_pid, reason, ...);
    each writer of an event names its own keys (docs/schema.md)."""
    key_order: list[str] = field(default_factory=list, repr=False, compare=False)
    """The keys as read (a runner writes `time` after its own keys); empty: time, event, details."""

    @classmethod
    def now(cls, event: str, **details: JsonValue) -> "RunEvent":
        return cls(event=event, time=now_iso(), details=dict(details))

    @classmethod
    def from_json(cls, obj: JsonValue, source: str) -> "RunEvent":
        d = _WORDING.object(obj, source)
        return cls(event=_take(d, "event", (str,), source, required=True), time=_take(d, "time", _OPT_STR, source),
                   details={k: v for k, v in d.items() if k not in ("event", "time")}, key_order=list(d))

    def to_json(self) -> JsonObject:
        out: JsonObject = {} if self.time is None else {"time": self.time}
        out["event"] = self.event
        out.update(self.details)
        return _in_order(out, self.key_order)


@dataclass
class RunCounts:
    """manifest.json `counts`: the items the last session asked, how many errored, and how many it
    skipped as already finished (a resume). A count is None where the session never got to it (a run
    that failed before its first item writes `{}`), and is then left out."""

    asked: int | None = None
    errors: int | None = None
    skipped_finished: int | None = None

    @classmethod
    def from_json(cls, obj: JsonValue, source: str) -> "RunCounts":
        d = _WORDING.object(obj, source)
        return cls(**{k: _take(d, k, (int, type(None)), source) for k in ("asked", "errors", "skipped_finished")})

    def to_json(self) -> JsonObject:
        return {k: v for k, v in (("asked", self.asked), ("errors", self.errors),
                                  ("skipped_finished", self.skipped_finished)) if v is not None}


@dataclass
class ErrorCause:
    """manifest.json `error_causes[]`: one error message and how many of the latest records carry it."""

    error: str
    count: int

    @classmethod
    def from_json(cls, obj: JsonValue, source: str) -> "ErrorCause":
        d = _WORDING.object(obj, source)
        return cls(error=_take(d, "error", (str,), source, required=True),
                   count=_take(d, "count", (int,), source, required=True))

    def to_json(self) -> JsonObject:
        return {"error": self.error, "count": self.count}


def _in_order(out: JsonObject, key_order: list[str]) -> JsonObject:
    """`out` with the keys of `key_order` first, in that order (the order a document was read in)."""
    return {**{k: out[k] for k in key_order if k in out}, **out} if key_order else out


@dataclass
class TaskSummary:
    """manifest.json `summary[task]`: a task's figures over its latest records. The common ones are
    fields (None where the task does not give one); what the task adds (by_length, n_reruns, the KLD
    figures, ...) is in `extra`."""

    n: int | None = None
    """Records of the task."""
    n_scored: int | None = None
    n_correct: int | None = None
    n_errors: int | None = None
    accuracy: float | None = None
    """n_correct / n_scored; None when nothing was scored."""
    extra: JsonObject = field(default_factory=dict)
    key_order: list[str] = field(default_factory=list, repr=False, compare=False)

    _COMMON = ("n", "n_scored", "n_correct", "n_errors", "accuracy")

    @classmethod
    def from_json(cls, obj: JsonValue, source: str) -> "TaskSummary":
        d = _WORDING.object(obj, source)
        counts = {k: _take(d, k, (int, type(None)), source) for k in cls._COMMON[:4]}
        return cls(**counts, accuracy=_take(d, "accuracy", (int, float, type(None)), source),
                   extra={k: v for k, v in d.items() if k not in cls._COMMON}, key_order=list(d))

    def to_json(self) -> JsonObject:
        """The summary as the task gave it: its keys in their order; a common figure left out where the
        task gave none."""
        common: JsonObject = {k: getattr(self, k) for k in self._COMMON
                              if k in self.key_order or getattr(self, k) is not None}
        return _in_order({**common, **self.extra}, self.key_order)


def summaries(by_task: dict[str, TaskSummary] | dict[str, JsonObject]) -> dict[str, TaskSummary]:
    """Per task its TaskSummary; a task that hands its summary as a JSON object has it parsed (an error
    names the task and the key)."""
    return {task: s if isinstance(s, TaskSummary) else TaskSummary.from_json(s, f"task {task!r} summary")
            for task, s in by_task.items()}


def _list_of(d: JsonObject, key: str, parse: Callable[[JsonValue, str], _T], source: str) -> list[_T] | None:
    """d[key] as a list of parsed entries (None where absent or null); each entry's errors name its index."""
    raw = _take(d, key, (list, type(None)), source)
    return None if raw is None else [parse(v, f"{source}: {key}[{i}]") for i, v in enumerate(raw)]


# The manifest's keys that hold a class of their own (a list of them for events and error_causes, one
# per task for summary).
_MANIFEST_CLASSES: dict[str, type] = {"counts": RunCounts, "events": RunEvent, "error_causes": ErrorCause,
                                      "summary": TaskSummary}
# The manifest's keys ordered as a fresh `Manifest` writes them when nothing recorded another order.
_MANIFEST_FIRST = ("schema_version", "status")


@dataclass
class Manifest:
    """manifest.json: a run's identity and status (docs/design.md section 4).

    The writer sets keys as the run goes (`set`); `to_dict` writes them in the order they were first
    set (or read), so a manifest reads the same on disk as it always has.
    """

    schema_version: int
    """The run directory's format version (`store.SCHEMA_VERSION` when written by this moebench)."""
    run_id: str | None
    """A random id of the run (12 hex digits); None in hand-made or imported runs."""
    status: str
    """"running", "complete", "failed" or "interrupted"."""
    label: str | None = None
    """The run's name (`--label`, default the runner profile's name)."""
    suite: JsonObject | None = None
    """The resolved suite profile (name, tasks with their options, probes), secrets redacted: config's
    profile, echoed as written."""
    runner: JsonObject | None = None
    """The resolved runner profile (name, kind, settings), secrets redacted: config's profile, echoed."""
    model: JsonObject | None = None
    """Model identity (the runner's): path, content hash, GGUF metadata where present."""
    build: JsonObject | None = None
    """Build identity (the runner's): llama.cpp build number or commit, the engine's decode configuration."""
    moebench: MoebenchIdentity | None = None
    """moebench's version and git revision with a dirty flag (identity.MoebenchIdentity)."""
    host: HostIdentity | None = None
    """CPU, RAM, GPU names, driver (identity.HostIdentity)."""
    started_at: str | None = None
    """ISO 8601 UTC start time."""
    ended_at: str | None = None
    """ISO 8601 UTC end time; None while running."""
    summary: dict[str, TaskSummary] | None = None
    """Per task name, the task's summary: n, n_scored, n_correct, accuracy, n_errors and what the task
    adds; None until the run ends."""
    counts: RunCounts | None = None
    """Items asked, errored and skipped as finished (a resume) in the last session."""
    events: list[RunEvent] | None = None
    """What happened to the run: resumes, failures, server restarts."""
    resumes: int | None = None
    """How many times the run was resumed."""
    error_causes: list[ErrorCause] | None = None
    """The most common error messages among the latest records, most frequent first."""
    probes: JsonObject | None = None
    """The probes' availability and summaries (NVML memory, power, energy): the probes' block."""
    extra: JsonObject = field(default_factory=dict)
    """Every other key (data_dir, data_files, baseline_run, limit, engine, lm_eval, ...), as written."""
    key_order: list[str] = field(default_factory=list, repr=False, compare=False)
    """The keys in the order they were first read or set; `to_dict` writes them so."""

    @classmethod
    def from_dict(cls, data: JsonValue, source: str = "manifest.json") -> "Manifest":
        d = _WORDING.object(data, source)
        sv = _take(d, "schema_version", (int,), source, required=True)
        if sv > MANIFEST_SCHEMA_VERSION:
            raise RecordError(f"{source}: schema_version {sv} is newer than this moebench reads "
                              f"({MANIFEST_SCHEMA_VERSION}); upgrade moebench")
        summary = _take(d, "summary", _OPT_OBJ, source)
        if summary is not None:
            summary = {task: TaskSummary.from_json(v, f"{source}: summary[{task!r}]") for task, v in summary.items()}
        counts = _take(d, "counts", _OPT_OBJ, source)
        return cls(schema_version=sv, run_id=_take(d, "run_id", _OPT_STR, source),
                   status=_take(d, "status", (str,), source, required=True, choices=STATUSES),
                   label=_take(d, "label", _OPT_STR, source), suite=_take(d, "suite", _OPT_OBJ, source),
                   runner=_take(d, "runner", _OPT_OBJ, source), model=_take(d, "model", _OPT_OBJ, source),
                   build=_take(d, "build", _OPT_OBJ, source), moebench=_take(d, "moebench", _OPT_OBJ, source),
                   host=_take(d, "host", _OPT_OBJ, source), started_at=_take(d, "started_at", _OPT_STR, source),
                   ended_at=_take(d, "ended_at", _OPT_STR, source), summary=summary,
                   counts=None if counts is None else RunCounts.from_json(counts, f"{source}: counts"),
                   events=_list_of(d, "events", RunEvent.from_json, source),
                   resumes=_take(d, "resumes", (int, type(None)), source),
                   error_causes=_list_of(d, "error_causes", ErrorCause.from_json, source),
                   probes=_take(d, "probes", _OPT_OBJ, source), extra=_extra(d, cls), key_order=list(d))

    @classmethod
    def begin(cls, data: JsonObject, source: str = "the new manifest") -> "Manifest":
        """The manifest a writer starts a run with (its identity; no status yet): `data`'s keys after
        `schema_version`, and the status ("running") is set when the store opens the run."""
        m = cls.from_dict({"schema_version": MANIFEST_SCHEMA_VERSION, **data,
                           "status": data.get("status", "running")}, source)
        if "status" not in data:
            m.key_order.remove("status")
        return m

    def _fields(self) -> list[str]:
        return [f.name for f in fields(self) if f.name not in ("extra", "key_order")]

    def set(self, **values: object) -> None:
        """Set fields (by their names, with their types) or extra keys; a new key goes last on disk."""
        names = self._fields()
        for key, value in values.items():
            kind = _MANIFEST_CLASSES.get(key)
            members = value.values() if isinstance(value, dict) else value if isinstance(value, list) else [value]
            if kind is not None and value is not None and not all(isinstance(v, kind) for v in members):
                raise TypeError(f"manifest key {key!r} takes {kind.__name__} (not {type(value).__name__})")
            if key in names:
                setattr(self, key, value)
            else:
                self.extra[key] = value  # type: ignore[assignment]
            if key not in self.key_order:
                self.key_order.append(key)

    def drop(self, key: str) -> None:
        """Remove a key (a resumed run's ended_at)."""
        if key in self._fields():
            setattr(self, key, None)
        else:
            self.extra.pop(key, None)
        if key in self.key_order:
            self.key_order.remove(key)

    def add_event(self, event: RunEvent) -> None:
        self.set(events=[*(self.events or []), event])

    def _json_of(self, key: str) -> JsonValue:
        if key not in self._fields():
            return self.extra[key]
        v = getattr(self, key)
        if isinstance(v, RunCounts):
            return v.to_json()
        if isinstance(v, list):
            return [x.to_json() if isinstance(x, (RunEvent, ErrorCause)) else x for x in v]
        if key == "summary" and isinstance(v, dict):
            return {task: s.to_json() if isinstance(s, TaskSummary) else s for task, s in v.items()}
        return v

    def to_dict(self) -> JsonObject:
        """The manifest as written: its keys in the order they were read or set (a key set to None is
        written as null), then any other field that is not None, then the other keys."""
        names = self._fields()
        order = [k for k in self.key_order if k in names or k in self.extra]
        order += [k for k in (*_MANIFEST_FIRST, *names) if k not in order and getattr(self, k) is not None]
        order += [k for k in self.extra if k not in order]
        return {k: self._json_of(k) for k in order}

    @property
    def runner_name(self) -> str | None:
        name = (self.runner or {}).get("name")
        return name if isinstance(name, str) else None

    @property
    def suite_name(self) -> str | None:
        name = (self.suite or {}).get("name")
        return name if isinstance(name, str) else None


def typed_run(run_dir: str | os.PathLike[str], manifest: JsonObject,
              records: list[JsonObject]) -> tuple[Manifest, list[ItemRecord]]:
    """A run's manifest and latest records as `store.load_run` read them (JSON), parsed into their
    classes; a document off the contract is a RecordError naming the file (and the item)."""
    return Manifest.from_dict(manifest, str(Path(run_dir) / MANIFEST)), typed_records(run_dir, records)


def typed_records(run_dir: str | os.PathLike[str], records: list[JsonObject]) -> list[ItemRecord]:
    """A run's records as `store.load_run` read them (JSON), parsed; one off the contract is a
    RecordError naming items.jsonl and the item."""
    items = Path(run_dir) / ITEMS
    return [ItemRecord.from_dict(r, f"{items} (item {r.get('item_id')!r})" if isinstance(r, dict) else str(items))
            for r in records]


@dataclass
class CompareSide:
    """compare.json's "baseline" or "candidate": which run it is."""

    run: str | None
    """The run directory as given to `moebench compare` (None for a speed-ab side, which has no run)."""
    label: str | None
    """The run's label."""
    extra: JsonObject = field(default_factory=dict)
    """Every other key (status, runner, started_at, model, profile), as written."""

    @classmethod
    def from_dict(cls, data: JsonValue, source: str) -> "CompareSide":
        d = _WORDING.object(data, source)
        return cls(run=_take(d, "run", _OPT_STR, source), label=_take(d, "label", _OPT_STR, source),
                   extra=_extra(d, cls))

    def to_dict(self) -> JsonObject:
        return {"run": self.run, "label": self.label, **self.extra}


# The optional sections of compare.json.
COMPARE_SECTIONS = ("overall", "warnings", "kld", "needle", "speed", "memory", "energy", "engine", "speed_ab")
# compare.json's keys after "tasks" in the order the builder writes them (sections and the top-level
# keys kept in `extra`); `to_dict` follows it, so a built document reads the same as the files before it.
COMPARE_KEY_ORDER = ("overall", "setup_differences", "data_unverified", "kld", "missing_sections", "warnings",
                     "needle", "speed", "memory", "energy", "engine", "speed_ab")


@dataclass
class CompareDoc:
    """compare.json: one candidate paired with the baseline item by item (docs/design.md section 5)."""

    schema_version: int | None
    """COMPARE_SCHEMA_VERSION when written by this moebench; None in a hand-made file."""
    baseline: CompareSide
    """The baseline run."""
    candidate: CompareSide
    """The candidate run."""
    tasks: dict[str, JsonValue]
    """Per task: n_paired, baseline_correct, candidate_correct, wins, losses, excluded, mcnemar_p,
    delta_ci95 and what the builder adds (accuracies, flip_rate, per_subject, unpaired_reason).
    An entry that is not an object is kept as read; readers skip it with a warning."""
    sections: dict[str, JsonValue] = field(default_factory=dict)
    """The optional sections present (COMPARE_SECTIONS: overall, warnings, kld, needle, speed,
    memory, energy, engine, speed_ab), as written; `store.sections` reads their nested figures."""
    extra: JsonObject = field(default_factory=dict)
    """Every other top-level key, as written."""

    @classmethod
    def from_dict(cls, data: JsonValue, source: str = "compare.json") -> "CompareDoc":
        d = _WORDING.object(data, source)
        sv = _take(d, "schema_version", (int, type(None)), source)
        if sv is not None and sv > COMPARE_SCHEMA_VERSION:
            raise RecordError(f"{source}: schema_version {sv} is newer than this moebench reads "
                              f"({COMPARE_SCHEMA_VERSION}); upgrade moebench")
        sides = {}
        for role in ("baseline", "candidate"):
            raw = _take(d, role, (dict, type(None)), source)
            sides[role] = CompareSide.from_dict(raw or {}, f"{source}: {role}")
        tasks = _take(d, "tasks", (dict, type(None)), source) or {}
        warnings = _take(d, "warnings", (list, type(None)), source)
        sections = {k: d[k] for k in COMPARE_SECTIONS if k in d}
        if warnings is not None:
            sections["warnings"] = warnings
        known = {"schema_version", "baseline", "candidate", "tasks", *COMPARE_SECTIONS}
        return cls(schema_version=sv, baseline=sides["baseline"], candidate=sides["candidate"], tasks=tasks,
                   sections=sections, extra={k: v for k, v in d.items() if k not in known})

    def section(self, name: str) -> JsonValue:
        """An optional section as written, or None where absent."""
        return self.sections.get(name)

    @property
    def warnings(self) -> list[JsonValue]:
        w = self.sections.get("warnings")
        return list(w) if isinstance(w, list) else []

    def to_dict(self) -> JsonObject:
        out: JsonObject = {}
        if self.schema_version is not None:
            out["schema_version"] = self.schema_version
        out.update(baseline=self.baseline.to_dict(), candidate=self.candidate.to_dict(), tasks=self.tasks)
        rest = {**self.sections, **self.extra}
        out.update((k, rest.pop(k)) for k in COMPARE_KEY_ORDER if k in rest)
        return {**out, **rest}
