"""The run directory's `.lock`: an OS file lock (flock) the writing process holds for the run's life,
so two writers never interleave in one directory. The file names its holder (`LockHolder`) for the
refusal message; the kernel drops the lock when its holder dies, so a stale file is simply taken over
and the dead holder is recorded in the manifest.
"""
from __future__ import annotations

import errno
import json
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from moebench.json_fields import Wording, as_object
from moebench.json_types import JsonObject
from moebench.jsonout import dumps
from moebench.store.files import LOCK, StoreError, now_iso, open_fd

COMMAND_CHARS = 500          # the holder's command line, cut to this length


class RunLocked(StoreError):
    """Another live process is writing into this run directory."""


# A lock file's wording of a refusal: the type found by its Python name.
_WORDING = Wording(StoreError, wrong="{where}: key {key!r} is {type}, expected {expected}")


@dataclass
class LockHolder:
    """What `.lock` says about the process that holds (or held) it."""

    pid: int | None
    host: str | None
    started_at: str | None
    command: str | None = None
    released_at: str | None = None
    """Set when the holder let go on purpose; a holder without it died holding the lock."""

    @classmethod
    def this_process(cls) -> "LockHolder":
        return cls(pid=os.getpid(), host=socket.gethostname(), started_at=now_iso(),
                   command=" ".join(sys.argv)[:COMMAND_CHARS])

    @classmethod
    def from_json(cls, obj: JsonObject, source: str) -> "LockHolder":
        """The holder a lock file names; a key of the wrong type is a StoreError naming file and key."""
        def take(key: str, kind: type, what: str) -> object:
            return _WORDING.value(obj, key, source, (kind,), what, null_is_absent=True)
        pid = take("pid", int, "an integer")
        host, started, command, released = (take(k, str, "a string")
                                            for k in ("host", "started_at", "command", "released_at"))
        return cls(pid=pid, host=host, started_at=started, command=command,  # type: ignore[arg-type]
                   released_at=released)  # type: ignore[arg-type]

    def to_json(self) -> JsonObject:
        out: JsonObject = {"pid": self.pid, "host": self.host, "started_at": self.started_at}
        if self.command is not None:
            out["command"] = self.command
        if self.released_at is not None:
            out["released_at"] = self.released_at
        return out

    def describe(self) -> str:
        return f"PID {self.pid or '?'} on {self.host or '?'}, started {self.started_at or '?'}"


class RunLock:
    """An exclusive OS lock on a run directory, held from `acquire` until `release` (or process death).

    `previous` is what the lock file said before we took it (a dead holder's PID and start time),
    so a takeover can be recorded.
    """

    def __init__(self, run_dir: str | os.PathLike[str]):
        self.path = Path(run_dir) / LOCK
        self._fd: int | None = None
        self.previous: LockHolder | None = None

    def _read_holder(self) -> LockHolder | None:
        """The holder the file names; None for an empty, unreadable or foreign file (a lock file is
        advisory: whatever it holds, the flock decides)."""
        try:
            text = self.path.read_text(encoding="utf-8")
            holder = json.loads(text) if text.strip() else None
            return LockHolder.from_json(holder, str(self.path)) if isinstance(holder, dict) else None
        except (OSError, ValueError):
            return None

    def acquire(self) -> "RunLock":
        import fcntl
        fd = open_fd(self.path, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            holder = self._read_holder()
            who = holder.describe() if holder else "a process that is still starting"
            raise RunLocked(f"{self.path.parent}: another moebench process is writing this run ({who}); "
                            f"wait for it to finish or choose another --out") from None
        self._fd = fd
        self.previous = self._read_holder()
        os.ftruncate(fd, 0)
        os.pwrite(fd, (dumps(LockHolder.this_process().to_json()) + "\n").encode(), 0)
        os.fsync(fd)
        return self

    def took_over(self) -> LockHolder | None:
        """The previous holder when it died holding the lock (a stale lock we took over), else None."""
        prev = self.previous
        return prev if prev and prev.released_at is None else None

    def release(self) -> None:
        """Mark the file released (so the next holder knows this was no crash) and drop the lock."""
        if self._fd is None:
            return
        import fcntl
        fd, self._fd = self._fd, None
        try:
            raw = json.loads(os.pread(fd, 4096, 0) or b"{}")
            holder = LockHolder.from_json(as_object(raw), str(self.path))
            holder.released_at = now_iso()
            os.ftruncate(fd, 0)
            os.pwrite(fd, (dumps(holder.to_json()) + "\n").encode(), 0)
        except (OSError, ValueError):
            pass            # a full disk must not stop the release; the lock itself goes with the fd
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
