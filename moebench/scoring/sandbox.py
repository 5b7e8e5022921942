"""Run untrusted (model-written) Python in a contained child process (docs/design.md section 8).

Layers, each applied where this machine allows it and named in `SandboxResult.isolation`
(what could not be applied, and why, is in `SandboxResult.missing`):

- `unshare` namespaces: a new network namespace (no network: even 127.0.0.1 is unreachable), a new
  PID namespace (the check's launcher is PID 1 there; when it ends the kernel kills every process
  left in it, so a fork bomb cannot leave stragglers), a new mount namespace with fresh,
  size-limited tmpfs over /tmp, /var/tmp and /dev/shm (the check's work dir lives there; nothing it
  writes in those places reaches the host) and its own /proc.
- a private root (in the mount namespace, through `pivot_root`): the check sees the Python runtime
  (the interpreter's installation, standard library only: site-packages is covered) and the system
  libraries it loads, all read-only, plus /dev/null, /dev/zero, /dev/(u)random, its own /proc and its
  private tmpfs /tmp; nothing else of the host (no project, no home, no other folders). Where the
  root cannot be built the check runs with the host's view and `missing` says why.
- cgroups (v1 or v2, created under this process's own cgroup, removed afterwards): `pids.max`
  bounds the whole check's process count, `memory` bounds its total memory.
- an unprivileged uid (`nobody`) when the harness runs as root, so the check cannot write to files
  owned by the harness, signal its processes, or lift its limits; RLIMIT_NPROC then applies too.
- rlimits: CPU time, address space, file size, open files, processes, no core dumps.
- its own process group and session, killed as a whole (SIGKILL) at the wall timeout, when output
  passes its cap, and at the end; a scrubbed environment; `python -I -S -B`.

Output is read through pipes with a byte cap (only the tails are kept), so a check printing
gigabytes costs neither memory nor disk. `run_untrusted` never raises for anything the program does;
a sandbox that could not be started comes back with status "error" (an infrastructure failure,
never a wrong answer).

This file is also the launcher: `python -I -S sandbox.py --launch CONFIG_JSON` runs inside the
namespaces, joins the cgroups, mounts, forks the check, drops privileges and execs the interpreter.
It therefore imports only the standard library.
"""
from __future__ import annotations

import functools
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TypedDict

TAIL_BYTES = 4096
NOBODY_UID = 65534
NOBODY_GID = 65534
# The work dir inside the mount namespace (on its private tmpfs); the run id makes it unique so a
# leftover process could be found by its command line.
INNER_TMP = "/tmp"
# At most this many checks run at once in this process, whatever the runner's concurrency: each may
# take a CPU and gigabytes of memory. Waiting for a slot does not count against a check's timeout.
_SLOTS = threading.BoundedSemaphore(max(1, os.cpu_count() or 1))


class SandboxError(RuntimeError):
    """The sandbox itself failed (could not start, could not set up); never the program's fault."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one check."""

    cpu_s: int | None = None                 # CPU seconds; None = wall timeout rounded up + 1
    address_space_bytes: int = 2 << 30       # per process (RLIMIT_AS)
    memory_bytes: int = 3 << 30              # the whole check (memory cgroup), where available
    file_size_bytes: int = 10 << 20          # largest file it may write (RLIMIT_FSIZE)
    open_files: int = 64                     # RLIMIT_NOFILE
    max_processes: int = 64                  # pids cgroup, else RLIMIT_NPROC
    tmpfs_bytes: int = 64 << 20              # size of each private tmpfs (/tmp, /var/tmp, /dev/shm)
    max_output_bytes: int = 1 << 20          # stdout + stderr together; more gets the check killed
    python_flags: tuple[str, ...] = ("-I", "-S", "-B")


@dataclass
class SandboxResult:
    """What happened to one check.

    status: "passed" (exit 0) | "failed" (non-zero exit: assertion, exception, syntax error) |
    "timeout" (wall or CPU limit) | "killed" (a signal, output cap, out of memory) |
    "error" (the sandbox could not run it: infrastructure, not the program).
    """

    passed: bool
    status: str
    reason: str
    exit_code: int | None = None
    signal: int | None = None
    stdout_tail: str = ""
    stderr_tail: str = ""
    wall_s: float = 0.0
    cpu_s: float | None = None
    output_bytes: int = 0
    isolation: list[str] = field(default_factory=list)   # protections that were active
    missing: list[str] = field(default_factory=list)     # protections not applied here, with why
    interpreter: str | None = None
    run_id: str = ""

    def summary(self) -> CheckSummary:
        """The short form tasks put into a record."""
        return {"status": self.status, "reason": self.reason, "wall_s": round(self.wall_s, 3),
                "isolation": list(self.isolation)}


class CheckSummary(TypedDict):
    """A check's short form, as tasks put it into a record."""

    status: str
    reason: str
    wall_s: float
    isolation: list[str]


@dataclass(frozen=True)
class LauncherReport:
    """One line the launcher writes on its status pipe: the `stage` ("fs", "setup_failed", "running",
    "exited") and what that stage tells (a field another stage does not write stays None)."""

    stage: str
    view: str | None = None           # fs: "private-root" or "host"
    how: str | None = None            # fs: "pivot_root" or "chroot"
    reason: str | None = None         # fs: why the private root was not built
    error: str | None = None          # setup_failed
    interpreter: str | None = None    # running
    exit_code: int | None = None      # exited
    signal: int | None = None
    cpu_s: float | None = None

    @staticmethod
    def from_line(line: str) -> LauncherReport | None:
        """The line read back; None for one that is not a JSON object naming its stage (the pipe is
        ours, so such a line is noise, e.g. cut off at the size limit)."""
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            return None
        if not isinstance(doc, dict) or not isinstance(doc.get("stage"), str):
            return None
        known = {f.name for f in fields(LauncherReport)}
        return LauncherReport(**{k: v for k, v in doc.items() if k in known})


@dataclass(frozen=True)
class LaunchConfig:
    """What the harness hands the launcher (as JSON on its command line): the program, where it runs,
    the namespaces' set-up, the uid/gid to drop to, the interpreters to try, resource limits by
    RLIMIT_ name, and the environment of the check."""

    program: str
    inner_dir: str
    mount: bool
    tmpfs_bytes: int
    status_fd: int
    cgroup_procs: list[str]
    drop_to: tuple[int, int] | None
    interpreters: list[str]
    flags: list[str]
    expose_prefix: str
    root_view: RootView
    rlimits: dict[str, int]
    env: dict[str, str]

    def to_argv(self) -> str:
        return json.dumps(asdict(self), allow_nan=False)

    @staticmethod
    def from_argv(text: str) -> LaunchConfig:
        doc = json.loads(text)
        drop = doc["drop_to"]
        return LaunchConfig(**{**doc, "drop_to": (int(drop[0]), int(drop[1])) if drop else None})


# --- what this machine allows ------------------------------------------------------------------

@dataclass
class _Plan:
    unshare_prefix: list[str]
    namespaces: list[str]          # "net", "pid", "mount"
    drop_to: tuple[int, int] | None
    cgroup_kind: str | None        # "v1" | "v2" | None
    cgroup_parents: dict[str, Path]  # controller -> parent dir for our child cgroups
    missing: list[str]


def _try(cmd: list[str]) -> tuple[bool, str]:
    try:
        p = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=10,
                           env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)
    return p.returncode == 0, p.stderr.decode(errors="replace").strip()[-200:]


def _unshare_plan(missing: list[str]) -> tuple[list[str], list[str]]:
    exe = shutil.which("unshare")
    if not exe:
        missing.append("namespaces: no `unshare` (util-linux) on PATH")
        return [], []
    as_user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    full = [exe, *as_user, "--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc",
            "--propagation", "private"]
    ok, err = _try([*full, "--", "true"])
    if ok:
        return full, ["net", "pid", "mount"]
    missing.append(f"pid+mount namespaces: unshare refused ({err}); without a mount namespace the "
                   f"check sees the host's files")
    net_only = [exe, *as_user, "--net"]
    ok, err = _try([*net_only, "--", "true"])
    if ok:
        return net_only, ["net"]
    missing.append(f"net namespace: unshare refused ({err})")
    return [], []


def _own_cgroup_dirs() -> tuple[str | None, dict[str, Path]]:
    """Writable parent dirs (this process's own cgroups) per controller, for v1 or v2."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None, {}
    root = Path("/sys/fs/cgroup")
    v1: dict[str, Path] = {}
    v2: Path | None = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        for c in controllers.split(","):
            if c in ("pids", "memory") and (root / c).is_dir():
                v1[c] = root / c / rel.lstrip("/")
        if controllers == "" and (root / "cgroup.controllers").is_file():
            v2 = root / rel.lstrip("/")
    if v1:
        return "v1", {c: d for c, d in v1.items() if os.access(d, os.W_OK)}
    if v2 is not None and os.access(v2, os.W_OK):
        try:
            enabled = (v2 / "cgroup.subtree_control").read_text().split()
        except OSError:
            enabled = []
        return "v2", {c: v2 for c in ("pids", "memory") if c in enabled}
    return None, {}


@functools.cache
def plan() -> _Plan:
    """Probe once which protections this machine allows (cached for the process)."""
    missing: list[str] = []
    prefix, namespaces = _unshare_plan(missing)
    drop_to = None
    if os.geteuid() == 0:
        drop_to = (NOBODY_UID, NOBODY_GID)
    else:
        missing.append("uid drop: harness is not root, the check runs as the harness's own user")
    kind, parents = _own_cgroup_dirs()
    if os.geteuid() != 0 or not parents:
        kind, parents = None, {}
        missing.append("cgroups: no writable pids/memory cgroup; process count from RLIMIT_NPROC only")
    else:
        for c in ("pids", "memory"):
            if c not in parents:
                missing.append(f"cgroup {c}: controller not writable here")
    return _Plan(prefix, namespaces, drop_to, kind, parents, missing)


# System library folders the interpreter and its extension modules load from; symlinks (merged /usr)
# are recreated as symlinks.
LIBRARY_DIRS = ("/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32", "/lib", "/lib64", "/lib32", "/libx32")
RUNTIME_FILES = ("/etc/ld.so.cache",)
DEVICES = ("null", "zero", "random", "urandom")


class RootView(TypedDict):
    """What the private root shows: read-only `binds`, `links` (path -> target) recreated as symlinks,
    single `files` bound read-only, and folders inside the binds hidden under an empty tmpfs (`hide`).
    A TypedDict: it travels to the launcher as JSON inside LaunchConfig."""

    binds: list[str]
    links: dict[str, str]
    files: list[str]
    hide: list[str]


def _root_view() -> RootView:
    """What the private root shows: read-only binds, symlinks, and the folders hidden inside them."""
    prefix = os.path.realpath(sys.base_prefix)
    binds = [prefix]
    interp_dir = os.path.dirname(os.path.realpath(sys.executable))
    if not interp_dir.startswith(prefix + os.sep):
        binds.append(interp_dir)
    links: dict[str, str] = {}
    for d in LIBRARY_DIRS:
        if os.path.islink(d):
            links[d] = os.readlink(d)
        elif os.path.isdir(d) and not any(d == b or d.startswith(b + os.sep) for b in binds):
            binds.append(d)
    files = [f for f in RUNTIME_FILES if os.path.isfile(f)]
    # Third-party packages are not the standard library: covered, whichever binds contain them.
    import sysconfig
    hide = sorted({os.path.realpath(sysconfig.get_paths(vars={"base": prefix, "platbase": prefix})[k])
                   for k in ("purelib", "platlib")})
    return {"binds": binds, "links": links, "files": files, "hide": hide}


def _interpreters(dropping: bool) -> list[str]:
    """Interpreters to try in order. As `nobody`, one under /root (pyenv) is not reachable, so a
    system python3 follows; the launcher reports which one ran."""
    cands = [os.path.realpath(sys.executable), sys.executable]
    if dropping:
        cands += ["/usr/bin/python3", "/usr/local/bin/python3", shutil.which("python3") or ""]
    out: list[str] = []
    for c in cands:
        if c and c not in out:
            out.append(c)
    return out


# --- cgroups -----------------------------------------------------------------------------------

def _make_cgroups(p: _Plan, run_id: str, limits: SandboxLimits) -> tuple[list[Path], list[str]]:
    """Create this check's cgroups; return their dirs and isolation labels."""
    made: list[Path] = []
    labels: list[str] = []
    settings = {
        "pids": [("pids.max", str(limits.max_processes))],
        "memory": ([("memory.limit_in_bytes", str(limits.memory_bytes))] if p.cgroup_kind == "v1"
                   else [("memory.max", str(limits.memory_bytes)), ("memory.swap.max", "0")]),
    }
    dirs: dict[Path, list[str]] = {}
    for controller, parent in p.cgroup_parents.items():
        dirs.setdefault(parent / f"moebench-sbx-{run_id}", []).append(controller)
    try:
        for d, controllers in dirs.items():
            try:
                d.mkdir()
            except OSError as e:
                raise SandboxError(f"cannot create cgroup {d}: {e}") from None
            made.append(d)
            for c in controllers:
                for name, value in settings[c]:
                    try:
                        (d / name).write_text(value)
                    except OSError as e:
                        if name == "memory.swap.max":
                            continue       # no swap accounting: the memory limit still holds
                        raise SandboxError(f"cannot set {d / name} = {value}: {e}") from None
                labels.append(f"cgroup-{p.cgroup_kind} {c} limit")
    except SandboxError:
        _remove_cgroups(made)              # none half-made left behind
        raise
    return made, labels


def _remove_cgroups(dirs: list[Path]) -> None:
    """Kill anything still in our cgroups (stragglers) and remove them."""
    deadline = time.monotonic() + 5.0
    for d in dirs:
        while True:
            try:
                for pid in (d / "cgroup.procs").read_text().split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                d.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    break              # left behind, empty soon; harmless, and never fatal
                time.sleep(0.02)


def _oom_killed(dirs: list[Path]) -> bool:
    for d in dirs:
        for name, key in (("memory.oom_control", "oom_kill"), ("memory.events", "oom_kill")):
            try:
                for line in (d / name).read_text().splitlines():
                    k, _, v = line.partition(" ")
                    if k == key and int(v) > 0:
                        return True
            except (OSError, ValueError):
                continue
    return False


# --- the harness side --------------------------------------------------------------------------

def _tail(buf: bytearray) -> str:
    return bytes(buf[-TAIL_BYTES:]).decode("utf-8", errors="replace")


def _killpg(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_untrusted(program: str, timeout_s: float = 10.0,
                  limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `program` (Python source) in the sandbox; pass = exit status 0 within the limits."""
    with _SLOTS:
        return _run_untrusted(program, timeout_s, limits or SandboxLimits())


def _run_untrusted(program: str, timeout_s: float, limits: SandboxLimits) -> SandboxResult:
    p = plan()
    run_id = uuid.uuid4().hex[:12]
    isolation = ["process-group", "scrubbed-env", "rlimits", "python-isolated(" + " ".join(limits.python_flags) + ")"]
    isolation += [f"{ns}-namespace" for ns in p.namespaces]
    if "mount" in p.namespaces:
        isolation.append("private-tmpfs(/tmp,/var/tmp,/dev/shm)")
    if p.drop_to:
        isolation.append(f"uid-{p.drop_to[0]}")
    missing = list(p.missing)
    workdir = Path(tempfile.mkdtemp(prefix=f"moebench-sbx-{run_id}-"))
    cgroups: list[Path] = []
    t0 = time.monotonic()
    try:
        try:
            cgroups, labels = _make_cgroups(p, run_id, limits)
        except SandboxError as e:
            return SandboxResult(False, "error", str(e), isolation=isolation, missing=missing, run_id=run_id)
        isolation += labels
        prog_path = workdir / "prog.py"
        prog_path.write_text(program, encoding="utf-8")
        if p.drop_to:
            # Without a mount namespace the check works in this dir as `nobody`.
            os.chown(workdir, *p.drop_to)
            os.chown(prog_path, *p.drop_to)
        cpu_s = limits.cpu_s or int(timeout_s) + 2
        status_r, status_w = os.pipe()
        inner_dir = f"{INNER_TMP}/moebench-sbx-{run_id}" if "mount" in p.namespaces else str(workdir)
        cfg = LaunchConfig(
            program=str(prog_path), inner_dir=inner_dir, mount="mount" in p.namespaces,
            tmpfs_bytes=limits.tmpfs_bytes, status_fd=status_w,
            cgroup_procs=[str(d / "cgroup.procs") for d in cgroups], drop_to=p.drop_to,
            interpreters=_interpreters(p.drop_to is not None), flags=list(limits.python_flags),
            expose_prefix=os.path.realpath(sys.base_prefix), root_view=_root_view(),
            rlimits={"CPU": cpu_s, "AS": limits.address_space_bytes, "FSIZE": limits.file_size_bytes,
                     "NOFILE": limits.open_files, "CORE": 0,
                     # with a pids cgroup, NPROC (per uid, shared by parallel checks) is a backstop
                     "NPROC": limits.max_processes * (8 if any("pids" in x for x in labels) else 1)},
            env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": inner_dir, "TMPDIR": inner_dir,
                 "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
                 "PYTHONHASHSEED": "0", "PYTHONIOENCODING": "utf-8"})
        cmd = [*p.unshare_prefix, *(["--"] if p.unshare_prefix else []),
               sys.executable, "-I", "-S", "-B", os.path.abspath(__file__), "--launch", cfg.to_argv()]
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, pass_fds=(status_w,), start_new_session=True,
                                    env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"},
                                    cwd=str(workdir))
        except OSError as e:
            os.close(status_r)
            os.close(status_w)
            return SandboxResult(False, "error", f"could not start the sandbox: {e}",
                                 isolation=isolation, missing=missing, run_id=run_id)
        os.close(status_w)
        out = _collect(proc, status_r, timeout_s, limits.max_output_bytes)
        oom = _oom_killed(cgroups)
    finally:
        _remove_cgroups(cgroups)
        shutil.rmtree(workdir, ignore_errors=True)
    wall = time.monotonic() - t0
    return _classify(out, oom, timeout_s, cpu_s, limits, isolation, missing, run_id, wall)


@dataclass
class _Collected:
    stdout: bytearray
    stderr: bytearray
    total: int
    messages: list[LauncherReport]
    timed_out: bool
    over_output: bool
    launcher_rc: int | None


def _collect(proc: subprocess.Popen, status_r: int, timeout_s: float, max_output: int) -> _Collected:
    """Read stdout/stderr (tails only) and the launcher's status pipe until the end or a limit."""
    pgid = proc.pid                      # start_new_session: the group id is the leader's pid
    bufs = {"stdout": bytearray(), "stderr": bytearray()}
    status_buf = bytearray()
    total = 0
    timed_out = over_output = False
    deadline = time.monotonic() + timeout_s
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "stdout")
    sel.register(proc.stderr, selectors.EVENT_READ, "stderr")
    sel.register(status_r, selectors.EVENT_READ, "status")
    exited_at: float | None = None
    try:
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                timed_out = True
                break
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > 1.0:
                break                    # launcher gone but something holds a pipe: stop waiting
            for key, _ in sel.select(timeout=min(0.2, deadline - now)):
                fd = key.fileobj if isinstance(key.fileobj, int) else key.fileobj.fileno()
                chunk = os.read(fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                if key.data == "status":
                    status_buf += chunk[: 65536 - len(status_buf)]
                    continue
                total += len(chunk)
                buf = bufs[key.data]
                buf += chunk
                del buf[:-TAIL_BYTES]     # keep only the tail: bounded memory whatever it prints
                if total > max_output:
                    over_output = True
                    break
            if over_output:
                break
    finally:
        sel.close()
        _killpg(pgid)                    # whatever is left of the group, in every case
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for f in (proc.stdout, proc.stderr):
            f.close()
        # the launcher may have written its last message just before the kill
        try:
            os.set_blocking(status_r, False)
            while len(status_buf) < 65536:
                chunk = os.read(status_r, 65536)
                if not chunk:
                    break
                status_buf += chunk
        except BlockingIOError:
            pass
        os.close(status_r)
    messages = [m for line in bytes(status_buf).decode("utf-8", errors="replace").splitlines()
                if (m := LauncherReport.from_line(line)) is not None]
    return _Collected(bufs["stdout"], bufs["stderr"], total, messages, timed_out, over_output,
                      proc.returncode)


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def _classify(c: _Collected, oom: bool, timeout_s: float, cpu_s: int, limits: SandboxLimits,
              isolation: list[str], missing: list[str], run_id: str, wall: float) -> SandboxResult:
    msgs = {m.stage: m for m in c.messages}
    fs = msgs.get("fs")
    if fs is not None and fs.view == "private-root":
        isolation = [*isolation, f"private-root({fs.how}: python runtime read-only, private tmp)"]
    elif fs is not None:
        missing = [*missing, f"filesystem view: the check sees the host's files ({fs.reason})"]
    running = msgs.get("running")
    exited = msgs.get("exited")
    base = dict(stdout_tail=_tail(c.stdout), stderr_tail=_tail(c.stderr), wall_s=wall,
                output_bytes=c.total, isolation=isolation, missing=missing, run_id=run_id,
                interpreter=running.interpreter if running else None)
    if c.over_output:
        return SandboxResult(False, "killed", f"output exceeded {limits.max_output_bytes} bytes", **base)
    if c.timed_out:
        return SandboxResult(False, "timeout", f"wall timeout after {timeout_s:g} s", **base)
    if running is None:
        setup = msgs.get("setup_failed")
        why = (setup.error if setup else None) or _last_line(_tail(c.stderr)) \
            or f"launcher exit status {c.launcher_rc}"
        return SandboxResult(False, "error", f"sandbox could not start the check: {why}", **base)
    if exited is None:
        return SandboxResult(False, "killed", f"launcher ended without a result (exit status {c.launcher_rc})",
                             **base)
    code, sig, used = exited.exit_code, exited.signal, exited.cpu_s
    base["cpu_s"] = used
    if sig is not None:
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
        # The kernel's SIGKILL at the hard CPU limit can come with rusage a tick or two short of it.
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and used is not None and used >= 0.9 * cpu_s):
            return SandboxResult(False, "timeout", f"CPU time limit ({cpu_s} s)", signal=sig, **base)
        if oom:
            return SandboxResult(False, "killed", f"out of memory (cgroup limit {limits.memory_bytes} bytes)",
                                 signal=sig, **base)
        return SandboxResult(False, "killed", f"killed by {name}", signal=sig, **base)
    if code == 0:
        return SandboxResult(True, "passed", "passed", exit_code=0, **base)
    reason = _last_line(base["stderr_tail"]) or f"exit code {code}"
    if reason.startswith("MemoryError"):
        reason += f" (address space limit {limits.address_space_bytes} bytes)"
    return SandboxResult(False, "failed", reason, exit_code=code, **base)


# --- the launcher (inside the namespaces) ------------------------------------------------------

def _mount(source: str, target: str, fstype: str | None, flags: int, opts: str | None = None) -> None:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                  opts.encode() if opts else None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC = 0x1, 0x2, 0x4, 0x20, 0x1000, 0x2000, 0x4000


def _mount_tmpfs(target: str, size: int, mode: str = "1777") -> None:
    _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode={mode}")


def _expose_prefix(prefix: str) -> str | None:
    """Make the harness's Python installation (e.g. pyenv under /root, mode 700) usable by `nobody`
    at its own path, read-only, while hiding everything else in the blocking directory.

    Inside our mount namespace only: the installation is bind-mounted aside, a tmpfs covers the
    first directory others cannot enter, and the installation is moved back to its path on it.
    Returns the blocking directory, or None when nothing was blocked.
    """
    parts = Path(prefix).parts
    blocked = None
    for i in range(2, len(parts)):            # from /a downwards, the installation dir excluded
        d = os.path.join(*parts[:i])
        if not os.stat(d).st_mode & 0o001:
            blocked = d
            break
    if blocked is None:
        return None
    stage = "/tmp/.moebench-python"            # on our private /tmp
    os.mkdir(stage, 0o755)
    _mount(prefix, stage, None, MS_BIND)
    _mount_tmpfs(blocked, 1 << 20, mode="0755")
    os.makedirs(prefix, mode=0o755)
    _mount(stage, prefix, None, MS_MOVE)
    _mount("none", prefix, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.rmdir(stage)
    return blocked


MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}


def _bind_ro(src: str, dst: str) -> None:
    _mount(src, dst, None, MS_BIND | MS_REC)
    _mount("none", dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _private_root(view: RootView, tmpfs_bytes: int) -> str:
    """Build a root holding only the Python runtime (read-only), devices, /proc and private tmpfs, and
    switch to it (pivot_root, the old root detached). Returns how the switch was made."""
    import ctypes
    root = "/tmp/.moebench-root"               # on the namespace's private /tmp
    os.mkdir(root, 0o755)
    _mount_tmpfs(root, 1 << 20, mode="0755")
    for src in view["binds"]:
        dst = root + src
        os.makedirs(dst, 0o755, exist_ok=True)
        _bind_ro(src, dst)
    for link, target in view["links"].items():
        os.makedirs(os.path.dirname(root + link), 0o755, exist_ok=True)
        os.symlink(target, root + link)
    for f in view["files"]:
        os.makedirs(os.path.dirname(root + f), 0o755, exist_ok=True)
        open(root + f, "w").close()
        _bind_ro(f, root + f)
    for d in view["hide"]:
        if os.path.isdir(root + d):
            _mount("tmpfs", root + d, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=0555")
    os.makedirs(root + "/dev", 0o755)
    for dev in DEVICES:
        if os.path.exists("/dev/" + dev):
            open(root + "/dev/" + dev, "w").close()
            _mount("/dev/" + dev, root + "/dev/" + dev, None, MS_BIND)
    for d in ("/tmp", "/var/tmp", "/dev/shm"):
        os.makedirs(root + d, 0o755, exist_ok=True)
        _mount_tmpfs(root + d, tmpfs_bytes)
    os.makedirs(root + "/proc", 0o555)
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | 0x8)     # 0x8: MS_NOEXEC
    os.chdir(root)
    os.mkdir(".old")
    libc = ctypes.CDLL(None, use_errno=True)
    number = SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is not None and libc.syscall(number, b".", b".old") == 0:
        os.chdir("/")
        if libc.umount2(b"/.old", MNT_DETACH) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"umount of the old root: {os.strerror(err)}")
        os.rmdir("/.old")
        how = "pivot_root"
    else:
        os.rmdir(".old")
        os.chroot(".")                         # no pivot_root here: chroot (the check runs as nobody)
        os.chdir("/")
        how = "chroot"
    _mount("none", "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    return how


def _launch(cfg: LaunchConfig) -> int:
    import resource
    status_fd = cfg.status_fd

    def report(stage: str, **kw: Any) -> None:
        os.write(status_fd, (json.dumps({"stage": stage, **kw}) + "\n").encode())

    try:
        for procs in cfg.cgroup_procs:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))     # pid as seen in our namespace; the kernel translates
        source = Path(cfg.program).read_bytes()
        inner = cfg.inner_dir
        if cfg.mount:
            for target in ("/tmp", "/var/tmp", "/dev/shm"):
                if os.path.isdir(target):
                    _mount_tmpfs(target, cfg.tmpfs_bytes)
            try:
                how = _private_root(cfg.root_view, cfg.tmpfs_bytes)
                report("fs", view="private-root", how=how)
            except OSError as e:
                report("fs", view="host", reason=f"private root not built: {type(e).__name__}: {e}")
                if cfg.drop_to and cfg.expose_prefix:
                    try:
                        _expose_prefix(cfg.expose_prefix)
                    except OSError:
                        pass                   # the next interpreter candidate (system python3) runs
            os.mkdir(inner, 0o700)
            Path(inner, "prog.py").write_bytes(source)
        drop = cfg.drop_to
        if drop:
            os.chown(inner, *drop)
            os.chown(os.path.join(inner, "prog.py"), *drop)
    except Exception as e:                      # noqa: BLE001 - reported, then the harness decides
        report("setup_failed", error=f"{type(e).__name__}: {e}")
        return 125
    err_r, err_w = os.pipe()                    # close-on-exec: EOF without data = exec worked
    pid = os.fork()
    if pid == 0:
        try:
            os.close(status_fd)
            os.close(err_r)
            for name, value in cfg.rlimits.items():
                resource.setrlimit(getattr(resource, f"RLIMIT_{name}"), (value, value))
            if drop:
                os.setgroups([])
                os.setgid(drop[1])
                os.setuid(drop[0])
            os.chdir(inner)
            for interp in cfg.interpreters:
                try:
                    os.execve(interp, [interp, *cfg.flags, os.path.join(inner, "prog.py")], cfg.env)
                except OSError as e:
                    os.write(err_w, f"{interp}: {e}\n".encode())
            os.write(err_w, b"END\n")
        except BaseException as e:             # noqa: BLE001
            os.write(err_w, f"setup: {type(e).__name__}: {e}\nEND\n".encode())
        os._exit(127)
    os.close(err_w)
    failures = b""
    while True:
        chunk = os.read(err_r, 4096)
        if not chunk:
            break
        failures += chunk
    os.close(err_r)
    lines = failures.decode(errors="replace").splitlines()
    if lines and lines[-1] == "END":
        report("setup_failed", error="; ".join(lines[:-1]))
        os.waitpid(pid, 0)
        return 126
    report("running", interpreter=cfg.interpreters[len(lines)])
    # As PID 1 of the namespace we also reap orphans; stop when the check itself has ended.
    while True:
        try:
            got, status, usage = os.wait4(-1, 0)
        except ChildProcessError:
            report("exited", exit_code=None, signal=None, cpu_s=None)
            return 0
        if got == pid:
            break
    cpu = usage.ru_utime + usage.ru_stime
    if os.WIFSIGNALED(status):
        report("exited", exit_code=None, signal=os.WTERMSIG(status), cpu_s=round(cpu, 3))
    else:
        report("exited", exit_code=os.WEXITSTATUS(status), signal=None, cpu_s=round(cpu, 3))
    return 0


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--launch":
    sys.exit(_launch(LaunchConfig.from_argv(sys.argv[2])))
