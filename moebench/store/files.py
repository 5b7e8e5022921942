"""The run directory's files on disk: their names and format version, the store's error, and the safe
ways to write them (never through a symbolic link; whole files replaced atomically, fsynced).

The run store (`moebench.store`), its lock (`store.lock`) and the documents' classes (`store.records`)
build on these; the probes and the wings write their side files into a run directory through them too.
"""
from __future__ import annotations

import datetime as _dt
import errno
import os
from pathlib import Path
from typing import BinaryIO

from moebench.jsonout import document_text
from moebench.json_types import JsonValue

# The run directory's format version (manifest.json `schema_version`), covering items.jsonl too.
SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
ITEMS = "items.jsonl"
LOCK = ".lock"
# manifest.json `status`.
STATUSES = ("running", "complete", "failed", "interrupted")


class StoreError(ValueError):
    """A run directory is missing or malformed; the message names the file."""


def _link_refused(path: Path | str) -> StoreError:
    return StoreError(f"{path}: is a symbolic link; refusing to write a run file through it "
                      "(the files of a run directory must be its own regular files)")


def open_fd(path: Path | str, flags: int, mode: int = 0o644) -> int:
    """os.open that never follows a symbolic link at `path`: a link there is refused (StoreError naming
    it) instead of writing through to its target."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _link_refused(path) from None
        raise


def open_append(path: Path | str) -> BinaryIO:
    """`path` opened for appending bytes (created if missing), never through a link."""
    return os.fdopen(open_fd(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab")


def refuse_links(run_dir: Path) -> None:
    """StoreError naming the first symbolic link anywhere inside `run_dir` (files and folders): the
    probes and tasks write side files there too, and none of them may land in a link's target."""
    for root, dirs, files in os.walk(run_dir, followlinks=False):
        for name in sorted(dirs + files):
            if os.path.islink(os.path.join(root, name)):
                raise _link_refused(Path(root) / name)


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def name_path(e: OSError, path: Path) -> OSError:
    """An OSError from writing a file object carries no file name: give it the one we were writing."""
    if e.filename is None:
        e.filename = str(path)
    return e


def write_json_atomic(path: Path, data: JsonValue) -> None:
    """Replace `path` with `data` all at once: the old file stays whole if anything fails, and the
    temporary file never outlives a failure (a full disk leaves no debris). Standard JSON: non-finite
    numbers are written as null and named under `non_finite` (moebench.jsonout.document)."""
    write_bytes_atomic(path, (document_text(data, indent=2, ensure_ascii=False, default=str) + "\n").encode("utf-8"))


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` all at once, as write_json_atomic. Neither the temporary file nor
    `path` is written through a link: a link under the temporary name is removed, and the rename
    replaces a link at `path` itself, never its target."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        try:
            os.unlink(tmp)          # debris of a writer that died with our PID, or a planted link
        except FileNotFoundError:
            pass
        with os.fdopen(open_fd(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise name_path(e, path) from None
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    _fsync_dir(path.parent)
