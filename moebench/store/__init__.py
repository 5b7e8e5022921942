"""The run store (docs/design.md section 4): a run is a directory.

- `manifest.json`: identity and status, replaced atomically (write a temp file, fsync, rename).
- `items.jsonl`: one record per finished item, appended by one writer thread per open store with
  group commit: the records that arrive while an fsync runs are written together and made durable by
  the next fsync, which starts as soon as the previous one ends (no timer: a record waits at most for
  the fsync in progress and its own). `append_async` hands the records of one pass of the event loop
  to the writer together at the end of that pass: one lock and at most one wake-up of the writer per
  pass, not per record. A record is acknowledged (`append` returns, `append_async`'s
  future resolves) only once its fsync has returned, so a crash loses only records not yet
  acknowledged. Lines are only ever appended whole, in one write per batch: a torn last line (a
  crash mid-write) is ignored on read and cut off on resume; nothing else is ever rewritten, and a
  record is written once. After a failed write (a full disk) the store writes nothing more: every
  later append fails with the same error, so nothing lands after a torn line. When an item appears
  more than once (an error retried on resume), the last record wins.
- `.lock`: an OS file lock (flock) that the writing process holds for the run's life, so two writers
  never interleave in one directory; the file names the holder (PID, host, start time) for the refusal
  message. The kernel drops the lock when its holder dies, so a stale file is simply taken over
  (`store.lock`).
- No file of a run directory is written through a symbolic link: the store opens its files with
  O_NOFOLLOW, replaces whole files by renaming a fresh temporary file over them, and refuses (StoreError,
  exit 2, naming the link) a run directory holding any link before it writes anything. A directory with
  items.jsonl but no manifest.json is refused too: its records are of unknown origin.
The writer holds the manifest as a `Manifest` and takes `ItemRecord`s; `records()` and
`load_typed_run` give them back typed (`store.records`); `load_run` gives the files' JSON as it is.
The safe file primitives and the names of a run's files live in `store.files`.
Everything downstream (compare, report, gate) reads only this.
"""
from __future__ import annotations

import json
import os
import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence

from moebench.json_types import JsonObject
from moebench.jsonout import NonFiniteValue, document, dumper, dumps, non_finite_values, standard
from moebench.secrets import scrub
from moebench.store.files import (ITEMS, LOCK, MANIFEST, SCHEMA_VERSION, STATUSES, StoreError, name_path, now_iso,
                                  open_append, open_fd, refuse_links, write_bytes_atomic, write_json_atomic)
from moebench.store.lock import LockHolder, RunLock, RunLocked
from moebench.store.records import ItemRecord, Manifest, RunEvent, typed_records, typed_run

__all__ = ["ITEMS", "LOCK", "MANIFEST", "SCHEMA_VERSION", "STATUSES", "LockHolder", "RunLock", "RunLocked",
           "RunStore", "StoreError", "finite_record", "iter_records", "latest_records", "load_run", "load_typed_run",
           "now_iso", "open_append", "open_fd", "record_key", "refuse_links", "write_bytes_atomic",
           "write_json_atomic"]

# An item record's line (standard JSON; `default=str` for anything else a task puts in a record)
_record_text = dumper(ensure_ascii=False, default=str)


def iter_records(path: Path) -> Iterator[JsonObject]:
    """Yield the records of an items.jsonl, as JSON; a torn (unterminated, unparsable) last line is skipped.

    A malformed line anywhere else is an error naming the file and line: it means the file was
    edited or corrupted, and silently dropping it would lose data.
    """
    if not path.exists():
        return
    with path.open("rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    torn_tail = not data.endswith(b"\n")
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        is_last = n == len(lines)
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError as e:
            if is_last and torn_tail:
                return            # a crash mid-write: ignored on read, cut on resume
            raise StoreError(f"{path}: line {n} is not valid JSON ({e})") from None
        if is_last and torn_tail:
            return                # complete JSON but no newline: treat as torn too (fsync never finished)
        if not isinstance(rec, dict):
            raise StoreError(f"{path}: line {n} is not a JSON object")
        yield rec


def finite_record(record: JsonObject) -> JsonObject:
    """`record` unchanged when every number in it is finite; else an error record (retried on resume,
    never a wrong answer) whose `error` names the fields, with the numbers as null and their spellings
    under `non_finite`."""
    found = non_finite_values(record)
    if not found:
        return record
    clean, _ = standard(record)
    where = f"non-finite value{'s' if len(found) > 1 else ''} at {', '.join(found)}"
    clean["non_finite"] = found
    if clean.get("status") == "error":              # already failed: keep its own message first
        clean["error"] = f"{clean.get('error')}; {where}"
    else:
        clean.update(status="error", correct=None, error=where, error_type="NonFiniteValue")
    return clean


class TypedRecord(Protocol):
    """A typed item record the writer takes besides its JSON object: `records.ItemRecord`, or a
    record class of its own (lm-eval's ImportedRecord) whose `to_dict` fixes its key order."""

    def to_dict(self) -> JsonObject: ...


def record_key(rec: JsonObject) -> tuple[str, str]:
    return (str(rec.get("task")), str(rec.get("item_id")))


def latest_records(path: Path) -> dict[tuple[str, str], JsonObject]:
    """The last record of each (task, item_id), in file order of first appearance, as JSON."""
    out: dict[tuple[str, str], JsonObject] = {}
    for rec in iter_records(path):
        out[record_key(rec)] = rec
    return out


class _Pending:
    """A record waiting for its group commit: its line and who to tell once it is durable (a
    concurrent Future, or an asyncio future on `loop`)."""
    __slots__ = ("line", "record", "future", "loop")

    def __init__(self, line: bytes, record: JsonObject, future: Any, loop: Any = None):
        self.line, self.record, self.future, self.loop = line, record, future, loop


def _settle(batch: list[_Pending], error: BaseException | None) -> None:
    """On the event loop's thread: resolve the asyncio futures of a written (or failed) batch."""
    for p in batch:
        if p.future.done():
            continue
        if error is None:
            p.future.set_result(p.record)
        else:
            p.future.set_exception(error)


class RunStore:
    """An open run directory. Appends are thread-safe and durable once acknowledged: when `append`
    returns, or when the future of `append_async` resolves."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.items_path = self.path / ITEMS
        self.manifest_path = self.path / MANIFEST
        self._lock = threading.Lock()
        self._items_file = None
        # group commit (see the module docstring): the queue, the writer thread, and a failed write
        self._cond = threading.Condition()
        self._queue: list[_Pending] = []
        self._writer: threading.Thread | None = None
        self._stopping = False
        self._failed: BaseException | None = None
        # append_async's records not yet handed to the writer, per event loop: only that loop's thread
        # touches its list, and hands it over at the end of the loop's pass (_hand_over)
        self._held: dict[Any, list[_Pending]] = {}
        self.lock: RunLock | None = None
        # Values of the environment variables the profile names (API keys): never written, wherever
        # they turn up (a server echoing the key in an error message).
        self.secrets: frozenset[str] = frozenset()
        self.previous_status: str | None = None     # a resumed run's status before this writer

    # -- creation / opening ---------------------------------------------------------------------
    @classmethod
    def create_or_resume(cls, path: str | os.PathLike[str], manifest: Manifest | JsonObject,
                         lock: RunLock | None = None, secrets: frozenset[str] = frozenset()) -> "RunStore":
        """Open `path` for writing. An existing unfinished run is resumed; a fresh one is created.

        `manifest` is the run's identity (`Manifest.begin`, or its JSON object). Returns the store;
        `store.resumed` tells which. The manifest's fixed identity fields of a resumed run are kept,
        and `resumes` counts the resumptions. The run's lock (`lock`, or one taken here) is held until
        `close`; RunLocked when another process holds it.
        """
        store = cls(path)
        store.secrets = frozenset(secrets)
        store.path.mkdir(parents=True, exist_ok=True)
        store.lock = lock if lock is not None else RunLock(store.path).acquire()
        try:
            store._open_for_writing(manifest if isinstance(manifest, Manifest) else Manifest.begin(manifest))
        except BaseException:
            store.close()
            raise
        return store

    def _open_for_writing(self, manifest: Manifest) -> None:
        refuse_links(self.path)
        self.resumed = self.manifest_path.exists()
        if not self.resumed and self.items_path.exists() and self.items_path.stat().st_size > 0:
            raise StoreError(f"{self.items_path}: item records but no manifest.json beside them; refusing to "
                             "adopt records of unknown origin (move them away, or choose another --out)")
        self.previous_status = None
        if self.resumed:
            old = self.read_manifest()
            self.previous_status = old.status
            manifest.set(**{k: getattr(old, k) for k in ("run_id", "started_at") if k in old.key_order})
            manifest.set(resumes=(old.resumes or 0) + 1,
                         events=[*(old.events or []), RunEvent.now("resumed", previous_status=old.status)])
            self._cut_torn_tail()
        manifest.schema_version = SCHEMA_VERSION
        manifest.key_order[:] = ["schema_version", *(k for k in manifest.key_order if k != "schema_version")]
        manifest.set(status="running")
        if "started_at" not in manifest.key_order:
            manifest.set(started_at=now_iso())
        manifest.drop("ended_at")
        stale = self.lock.took_over() if self.lock is not None else None
        if stale:
            manifest.add_event(RunEvent.now("stale_lock_taken_over", previous_pid=stale.pid,
                                            previous_host=stale.host, previous_started_at=stale.started_at))
        self.manifest = manifest
        # The items file opens before the manifest says "running": a resume that cannot write leaves
        # the manifest exactly as it found it.
        self._items_file = open_append(self.items_path)
        self.write_manifest()

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> "RunStore":
        """Open an existing run for reading."""
        store = cls(path)
        if not store.manifest_path.is_file():
            raise StoreError(f"{store.manifest_path}: not a moebench run (no manifest.json)")
        store.manifest = store.read_manifest()
        return store

    def _cut_torn_tail(self) -> None:
        if not self.items_path.exists():
            return
        with os.fdopen(open_fd(self.items_path, os.O_RDWR), "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                cut = data.rfind(b"\n") + 1
                f.truncate(cut)
                f.flush()
                os.fsync(f.fileno())

    # -- manifest -------------------------------------------------------------------------------
    def read_manifest(self) -> Manifest:
        """manifest.json, parsed; a file off the contract is a RecordError naming it and the key."""
        return Manifest.from_dict(_read_manifest_json(self.manifest_path), str(self.manifest_path))

    def write_manifest(self) -> None:
        data = document(self.manifest.to_dict())
        if self.secrets:
            data = json.loads(scrub(dumps(data, ensure_ascii=False, default=str), self.secrets))
        with self._lock:
            write_json_atomic(self.manifest_path, data)

    def update_manifest(self, **fields: object) -> None:
        """Set manifest fields (`Manifest.set`: by name, typed) or extra keys, and write it."""
        self.manifest.set(**fields)
        self.write_manifest()

    def add_event(self, event: str, **details: Any) -> None:
        self.manifest.add_event(RunEvent.now(event, **details))
        self.write_manifest()

    def finish(self, status: str, **fields: object) -> None:
        assert status in STATUSES, status
        self.update_manifest(status=status, ended_at=now_iso(), **fields)

    # -- items ----------------------------------------------------------------------------------
    def append(self, record: TypedRecord | JsonObject) -> JsonObject:
        """Append one finished item (an `ItemRecord`, or the JSON object of one an importer read); durable
        on return. Returns the record as written (its JSON line): one holding a
        non-finite number (NaN, Infinity) is written as an error record naming the field, the number
        as null and its spelling under `non_finite`, so the file stays standard JSON and nothing is lost.
        An OSError (naming items.jsonl) when the write or its fsync failed."""
        record, line = self._line(record)
        future: Future = Future()
        self._hand_over_running_loop()
        self._submit(_Pending(line, record, future))
        return future.result()

    def append_many(self, records: Sequence[TypedRecord] | Sequence[JsonObject]) -> list[JsonObject]:
        """`append` for records that are all at hand (an import): handed to the writer together, so
        they share a few fsyncs; durable on return. Returns the records as written."""
        futures = []
        self._hand_over_running_loop()
        for record in records:
            record, line = self._line(record)
            future: Future = Future()
            self._submit(_Pending(line, record, future))
            futures.append(future)
        return [f.result() for f in futures]

    def append_async(self, record: TypedRecord | JsonObject) -> "Any":
        """`append` for a caller on a running event loop: returns an asyncio future that resolves to
        the record as written once it is durable (or fails with the OSError of its write). The record
        is checked and serialised here; the write and the fsync happen on the writer thread, batched
        with the records of other items. The records appended during one pass of the loop reach the
        writer together, when that pass ends (`_hand_over`). A store that is not open for writing, or
        whose writes failed, raises here."""
        import asyncio
        loop = asyncio.get_running_loop()
        record, line = self._line(record)
        self._check_writable()
        future = loop.create_future()
        pending = _Pending(line, record, future, loop)
        held = self._held.get(loop)
        if held is None:
            self._held[loop] = [pending]
            loop.call_soon(self._hand_over, loop)
        else:
            held.append(pending)
        return future

    def _hand_over(self, loop: Any) -> None:
        """On `loop`'s thread: the records that loop's append_async calls hold, to the writer in one
        go; a store that can no longer write fails their futures instead."""
        batch = self._held.pop(loop, None)
        if not batch:
            return
        try:
            self._submit(*batch)
        except BaseException as e:
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(e)

    def _hand_over_running_loop(self) -> None:
        """Called on an event loop's thread (a blocking append, a close): what that loop holds goes to
        the writer first, so records keep the order in which they were appended."""
        asyncio = sys.modules.get("asyncio")       # not imported: no loop holds anything
        if self._held and asyncio is not None:
            loop = asyncio._get_running_loop()
            if loop is not None:
                self._hand_over(loop)

    def _check_writable(self) -> None:
        assert self._items_file is not None and not self._stopping, "store not opened for writing"
        if self._failed is not None:
            raise self._failed

    def _line(self, given: TypedRecord | JsonObject) -> tuple[JsonObject, bytes]:
        """The record as it will be written and its line (standard JSON, secrets scrubbed)."""
        record = given if isinstance(given, dict) else given.to_dict()
        for key in ("task", "item_id", "status"):
            if key not in record:
                raise ValueError(f"record lacks {key!r}: {record!r}")
        try:
            text = _record_text(record)
        except NonFiniteValue:              # rare: the walk over every field runs only then
            record = finite_record(record)
            text = _record_text(record)
        line = (scrub(text, self.secrets) if self.secrets else text).encode("utf-8") + b"\n"
        return record, line

    def _submit(self, *pending: _Pending) -> None:
        with self._cond:
            self._check_writable()
            self._queue.extend(pending)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="moebench-items-writer", daemon=True)
                self._writer.start()
            self._cond.notify()

    def _write_loop(self) -> None:
        """The writer thread: take every queued record, write them in one write, fsync once,
        acknowledge them all; until the store closes and the queue is empty."""
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                batch, self._queue = self._queue, []
            error: BaseException | None = self._failed
            if error is None:
                try:
                    f = self._items_file
                    assert f is not None
                    f.write(b"".join(p.line for p in batch))
                    f.flush()
                    os.fsync(f.fileno())
                except OSError as e:
                    error = name_path(e, self.items_path)
                except BaseException as e:      # never leave a waiter hanging on a dead writer
                    error = e
                if error is not None:
                    with self._cond:
                        self._failed = error
            self._acknowledge(batch, error)

    @staticmethod
    def _acknowledge(batch: list[_Pending], error: BaseException | None) -> None:
        by_loop: dict[Any, list[_Pending]] = {}
        for p in batch:
            if p.loop is None:
                if error is None:
                    p.future.set_result(p.record)
                else:
                    p.future.set_exception(error)
            else:
                by_loop.setdefault(p.loop, []).append(p)
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_settle, items, error)
            except RuntimeError:
                pass            # the loop has closed: nobody is waiting for these any more

    def _stop_writer(self) -> None:
        """Wait until every record appended so far is written (or its write failed) and end the
        writer thread (on close: no append may run meanwhile)."""
        self._hand_over_running_loop()
        with self._cond:
            writer = self._writer
            self._stopping = True
            self._cond.notify()
        if writer is not None:
            writer.join()
        with self._cond:
            self._writer = None
            self._stopping = False

    def records(self) -> dict[tuple[str, str], ItemRecord]:
        """The latest record of each (task, item_id), in file order of first appearance; one off the
        contract is a RecordError naming items.jsonl and the item."""
        typed = typed_records(self.path, list(latest_records(self.items_path).values()))
        return {rec.key: rec for rec in typed}

    def finished_keys(self) -> set[tuple[str, str]]:
        """Items that need not run again: those whose last record is `ok`."""
        return {k for k, r in self.records().items() if r.status == "ok"}

    def close(self) -> None:
        self._stop_writer()
        with self._lock:
            try:
                if self._items_file is not None:
                    self._items_file.close()
            except OSError:
                pass        # a write already failed and was reported; a torn tail is cut on resume
            finally:
                self._items_file = None
                if self.lock is not None:
                    self.lock.release()
                    self.lock = None


def _read_manifest_json(path: Path) -> JsonObject:
    """manifest.json as JSON; a missing file says the directory is no run, bad JSON names the file."""
    if not path.is_file():
        raise StoreError(f"{path}: not a moebench run (no manifest.json)")
    try:
        with path.open(encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise StoreError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise StoreError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def load_run(path: str | os.PathLike[str]) -> tuple[JsonObject, list[JsonObject]]:
    """A run's files as JSON: (manifest, latest record per item in file order), for readers that pass
    them on as they are (an export, a test); `load_typed_run` parses them."""
    run = Path(path)
    return _read_manifest_json(run / MANIFEST), list(latest_records(run / ITEMS).values())


def load_typed_run(path: str | os.PathLike[str]) -> tuple[Manifest, list[ItemRecord]]:
    """A run, typed: (manifest, latest record per item in file order); a document off the contract is
    a RecordError naming the file, the key (and the item)."""
    return typed_run(path, *load_run(path))
