"""Typed, versioned forms of the store's three documents (docs/design.md sections 4 and 5, docs/schema.md):
one items.jsonl record (`ItemRecord`), manifest.json (`Manifest`) and compare.json (`CompareDoc`).

`from_dict` checks the top-level structure and names the file, the key and the expected type on bad
input (`RecordError`); `to_dict` gives back the JSON object the contract specifies: every key that was
read, none renamed or dropped (keys a class has no field for travel in `extra`). Nested sections (the
suite and runner profiles, per-task summaries, per-task compare figures, the kld/speed/needle/memory/
energy sections) stay JSON objects, typed as `Section`; docs/schema.md describes their keys and
`store.sections` reads the optional compare sections.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from moebench.store import ITEMS, MANIFEST, STATUSES, StoreError, load_run
from moebench.store import SCHEMA_VERSION as MANIFEST_SCHEMA_VERSION

# A nested JSON object whose keys docs/schema.md documents.
Section = dict[str, Any]

# compare.json's schema: 2 adds per-group sample counts to the speed section.
COMPARE_SCHEMA_VERSION = 2
ITEM_STATUSES = ("ok", "error")


class RecordError(StoreError):
    """A store document whose structure is not the contract's; the message names file, key and type."""


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "true or false", dict: "an object",
               list: "a list", type(None): "null"}


def _take(data: dict[str, Any], key: str, types: tuple[type, ...], source: str, required: bool = False,
          choices: tuple[Any, ...] | None = None) -> Any:
    """data[key], checked against `types` (and `choices`); None where absent and not required."""
    if key not in data:
        if required:
            raise RecordError(f"{source}: missing key {key!r} (expected {_expected(types)})")
        return None
    v = data[key]
    ok = isinstance(v, types) and not (isinstance(v, bool) and bool not in types)
    if not ok:
        raise RecordError(f"{source}: key {key!r} is {_json_type(v)}, expected {_expected(types)}")
    if choices is not None and v not in choices:
        raise RecordError(f"{source}: key {key!r} is {v!r}, expected one of {', '.join(map(repr, choices))}")
    return v


def _expected(types: tuple[type, ...]) -> str:
    return " or ".join(_TYPE_NAMES.get(t, t.__name__) for t in types)


def _json_type(v: Any) -> str:
    return next((name for t, name in _TYPE_NAMES.items() if type(v) is t), type(v).__name__)


def _object(data: Any, source: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise RecordError(f"{source}: expected a JSON object, got {_json_type(data)}")
    return data


def _extra(data: dict[str, Any], cls: type) -> dict[str, Any]:
    known = {f.name for f in fields(cls)} - {"extra"}
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
    answer: Any = None
    """The extracted answer (a string), or None."""
    reference: Any = None
    """The expected answer (a string), or None."""
    output: str | None = None
    """The raw model output text."""
    extra: dict[str, Any] = field(default_factory=dict)
    """What the task adds (prompt hash, token counts, timings, choice log-probs, the error message)."""

    @classmethod
    def from_dict(cls, data: Any, source: str = "items.jsonl") -> "ItemRecord":
        d = _object(data, source)
        return cls(task=_take(d, "task", (str,), source, required=True),
                   item_id=_take(d, "item_id", (str,), source, required=True),
                   status=_take(d, "status", (str,), source, required=True, choices=ITEM_STATUSES),
                   correct=_take(d, "correct", (bool, type(None)), source),
                   answer=d.get("answer"), reference=d.get("reference"),
                   output=_take(d, "output", _OPT_STR, source), extra=_extra(d, cls))

    @classmethod
    def from_fields(cls, task: str, item_id: str, fields: Section) -> "ItemRecord":
        """The record of a task that hands its fields as a JSON object (the contract's keys and its own,
        in its order); `status` is "ok" unless the fields say otherwise."""
        return cls(task=task, item_id=item_id, status=fields.get("status", "ok"), correct=fields.get("correct"),
                   answer=fields.get("answer"), reference=fields.get("reference"), output=fields.get("output"),
                   extra={k: v for k, v in fields.items() if k not in _RECORD_KEYS})

    @classmethod
    def failed(cls, task: str, item_id: str, message: str, error_type: str | None = None) -> "ItemRecord":
        """An errored item: retried on resume, never counted as a wrong answer. `error_type` is the
        exception's class name (`Unreachable`: the server never answered)."""
        extra: dict[str, Any] = {"error": message}
        if error_type is not None:
            extra["error_type"] = error_type
        return cls(task=task, item_id=item_id, status="error", extra=extra)

    def to_dict(self) -> dict[str, Any]:
        """The line of items.jsonl, keys in the order the run writes them (the contract's, then the task's)."""
        return {"task": self.task, "item_id": self.item_id, "correct": self.correct, "answer": self.answer,
                "reference": self.reference, "output": self.output, "status": self.status, **self.extra}

    @property
    def error(self) -> str | None:
        """An errored record's `Type: message`; None for an ok one."""
        return self.extra.get("error")

    @property
    def key(self) -> tuple[str, str]:
        return (self.task, self.item_id)


@dataclass
class Manifest:
    """manifest.json: a run's identity and status (docs/design.md section 4)."""

    schema_version: int
    """The run directory's format version (`store.SCHEMA_VERSION` when written by this moebench)."""
    run_id: str | None
    """A random id of the run (12 hex digits); None in hand-made or imported runs."""
    status: str
    """"running", "complete", "failed" or "interrupted"."""
    label: str | None = None
    """The run's name (`--label`, default the runner profile's name)."""
    suite: Section | None = None
    """The resolved suite profile (name, tasks with their options, probes), secrets redacted."""
    runner: Section | None = None
    """The resolved runner profile (name, kind, settings), secrets redacted."""
    model: Section | None = None
    """Model identity: path, content hash, GGUF metadata where present."""
    build: Section | None = None
    """Build identity: llama.cpp build number or commit, the engine's decode configuration."""
    moebench: Section | None = None
    """moebench's version and git revision with a dirty flag."""
    host: Section | None = None
    """CPU, RAM, GPU names, driver."""
    started_at: str | None = None
    """ISO 8601 UTC start time."""
    ended_at: str | None = None
    """ISO 8601 UTC end time; None while running."""
    summary: dict[str, Section] | None = None
    """Per task name: n, n_scored, n_correct, accuracy, n_errors and what the task adds; None until
    the run ends."""
    counts: Section | None = None
    """Items asked, errored and skipped as finished (a resume) in the last session."""
    events: list[Section] | None = None
    """What happened to the run: resumes, failures, server restarts, each with its time."""
    probes: Section | None = None
    """The probes' availability and summaries (NVML memory, power, energy)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Every other key (data_dir, data_files, baseline_run, limit, engine, lm_eval, ...), as written."""

    @classmethod
    def from_dict(cls, data: Any, source: str = "manifest.json") -> "Manifest":
        d = _object(data, source)
        sv = _take(d, "schema_version", (int,), source, required=True)
        if sv > MANIFEST_SCHEMA_VERSION:
            raise RecordError(f"{source}: schema_version {sv} is newer than this moebench reads "
                              f"({MANIFEST_SCHEMA_VERSION}); upgrade moebench")
        return cls(schema_version=sv, run_id=_take(d, "run_id", _OPT_STR, source),
                   status=_take(d, "status", (str,), source, required=True, choices=STATUSES),
                   label=_take(d, "label", _OPT_STR, source), suite=_take(d, "suite", _OPT_OBJ, source),
                   runner=_take(d, "runner", _OPT_OBJ, source), model=_take(d, "model", _OPT_OBJ, source),
                   build=_take(d, "build", _OPT_OBJ, source), moebench=_take(d, "moebench", _OPT_OBJ, source),
                   host=_take(d, "host", _OPT_OBJ, source), started_at=_take(d, "started_at", _OPT_STR, source),
                   ended_at=_take(d, "ended_at", _OPT_STR, source),
                   summary=_take(d, "summary", _OPT_OBJ, source), counts=_take(d, "counts", _OPT_OBJ, source),
                   events=_take(d, "events", (list, type(None)), source),
                   probes=_take(d, "probes", _OPT_OBJ, source), extra=_extra(d, cls))

    def to_dict(self) -> dict[str, Any]:
        """The manifest as written; a field that is None is left out (a running run has no ended_at)."""
        out: dict[str, Any] = {"schema_version": self.schema_version, "status": self.status}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name not in out and f.name != "extra" and v is not None:
                out[f.name] = v
        return {**out, **self.extra}

    @property
    def runner_name(self) -> str | None:
        return (self.runner or {}).get("name")

    @property
    def suite_name(self) -> str | None:
        return (self.suite or {}).get("name")


def typed_run(run_dir: str | os.PathLike[str], manifest: Section,
              records: list[Section]) -> tuple[Manifest, list[ItemRecord]]:
    """A run's manifest and latest records, as `store.load_run` read them, in their typed forms; a
    document off the contract is a RecordError naming the file (and the item)."""
    return Manifest.from_dict(manifest, str(Path(run_dir) / MANIFEST)), typed_records(run_dir, records)


def typed_records(run_dir: str | os.PathLike[str], records: list[Section]) -> list[ItemRecord]:
    """A run's records, as `store.load_run` read them, typed; one off the contract is a RecordError
    naming items.jsonl and the item."""
    items = Path(run_dir) / ITEMS
    return [ItemRecord.from_dict(r, f"{items} (item {r.get('item_id')!r})" if isinstance(r, dict) else str(items))
            for r in records]


def load_typed_run(run_dir: str | os.PathLike[str]) -> tuple[Manifest, list[ItemRecord]]:
    """`store.load_run`, typed: (manifest, latest record per item in file order)."""
    return typed_run(run_dir, *load_run(run_dir))


@dataclass
class CompareSide:
    """compare.json's "baseline" or "candidate": which run it is."""

    run: str | None
    """The run directory as given to `moebench compare` (None for a speed-ab side, which has no run)."""
    label: str | None
    """The run's label."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Every other key (status, runner, started_at, model, profile), as written."""

    @classmethod
    def from_dict(cls, data: Any, source: str) -> "CompareSide":
        d = _object(data, source)
        return cls(run=_take(d, "run", _OPT_STR, source), label=_take(d, "label", _OPT_STR, source),
                   extra=_extra(d, cls))

    def to_dict(self) -> dict[str, Any]:
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
    tasks: dict[str, Section]
    """Per task: n_paired, baseline_correct, candidate_correct, wins, losses, excluded, mcnemar_p,
    delta_ci95 and what the builder adds (accuracies, flip_rate, per_subject, unpaired_reason).
    An entry that is not an object is kept as read; readers skip it with a warning."""
    sections: dict[str, Any] = field(default_factory=dict)
    """The optional sections present (COMPARE_SECTIONS: overall, warnings, kld, needle, speed,
    memory, energy, engine, speed_ab), as written; `store.sections` reads their nested figures."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Every other top-level key, as written."""

    @classmethod
    def from_dict(cls, data: Any, source: str = "compare.json") -> "CompareDoc":
        d = _object(data, source)
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

    def section(self, name: str) -> Any:
        """An optional section as written, or None where absent."""
        return self.sections.get(name)

    @property
    def warnings(self) -> list[Any]:
        w = self.sections.get("warnings")
        return list(w) if isinstance(w, list) else []

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.schema_version is not None:
            out["schema_version"] = self.schema_version
        out.update(baseline=self.baseline.to_dict(), candidate=self.candidate.to_dict(), tasks=self.tasks)
        rest = {**self.sections, **self.extra}
        out.update((k, rest.pop(k)) for k in COMPARE_KEY_ORDER if k in rest)
        return {**out, **rest}
