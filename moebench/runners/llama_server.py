"""The `llama-server` runner: spawns and manages a llama.cpp server process and asks it over HTTP.

- One server process per runner, in its own process group, log appended to `run_dir/llama-server.log`.
- Requests go to the native `/completion` endpoint (token-id prompts, `n_probs` top log-probs,
  output token ids, per-token streaming) through one aiohttp session.
- A server that dies mid-run is restarted (at most `max_restarts` times), the requests in flight are
  asked again, and each restart is recorded in `self.events`. A live server that drops a connection
  (it closed a pooled keep-alive one) is asked again at once: the request's result counts it
  (`resends`), and the runner counts and records it ("reconnect").
- No orphans: `close()` stops the whole process group (SIGTERM, then SIGKILL), and an `atexit` hook
  plus a chained SIGTERM/SIGHUP handler do the same when the Python process ends another way.
"""
from __future__ import annotations

import asyncio
import atexit
import hashlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

import contextlib

import aiohttp

from moebench import jsonout
from moebench.config import (MAX_CLIENTS, MAX_PROMPT_TOKENS, MAX_RESPONSE_BYTES, MAX_SECONDS, ProfileError,
                             RunnerSettings, non_negative, positive, setting)
from moebench.json_types import JsonObject, JsonValue
from moebench.gguf_header import FILE_TYPE_NAMES, GgufFormatError, read_gguf
from moebench.runners import reply_checks
from moebench.runners.base import (DEFAULT_REQUEST_DEADLINE_S, SERVERLESS, Capability, DeadlineExceeded,
                                   GenerateRequest, GenerateResult, Runner, RunnerError)
from moebench.runners.responses import (DEFAULT_MAX_RESPONSE_BYTES, ConnectTimeout, ReadTimeout, RemoteProtocolError,
                                        TransportError, bounded_lines, describe, read_bounded, response_limit,
                                        transport_error)
from moebench.runners.identity import (GgufModel, GgufSummary, GgufUnreadable, GreedySamplers, LlamaBuild,
                                       RunnerIdentity)
from moebench.runners.wire import (DetokenizeBody, LlamaChoiceBody, LlamaCompletionBody, LlamaTokenizeBody,
                                   WireBody, greedy_chain)
from moebench.store import now_iso, open_append
from moebench.tools import llama_args, llamacpp
from moebench.tools.binary_probe import PROBE, ProbeError
from moebench.tools.llama_args import PerplexityPlan

T = TypeVar("T")

LOG_NAME = "llama-server.log"
STOP_GRACE_S = 5.0
CONNECT_TIMEOUT_S = 10.0          # TCP connect to the managed server (on this host)
RECONNECT_EVENTS = 5              # dropped connections recorded one by one in the run's events (all counted)
# llama-server (cpp-httplib) closes a keep-alive connection idle for 5 s; the client drops its own
# sooner, so an idle pooled connection is never sent a request the server has already hung up on.
KEEPALIVE_S = 3.0
# Flags the runner sets itself; a profile's `args` must not set them too.
OWNED_FLAGS = {"--host", "--port", "-m", "--model", "-np", "--parallel"}


def _model_file_problem(value: Any) -> str | None:
    p = Path(value).expanduser()
    if not p.is_file():
        return "must name an existing GGUF file (not found)"
    return None


def _env_problem(value: Any) -> str | None:
    bad = [k for k, v in value.items() if not isinstance(v, str)]
    return f"values must be strings (bad: {', '.join(bad)})" if bad else None


@dataclass(frozen=True)
class LlamaServerSettings(RunnerSettings):
    """A `kind = "llama-server"` profile's keys (docs/profiles.md), each with its one default."""

    binary: str = setting(str, default="llama-server", path="llama-server binary",
                          doc="a path, or a name found in the moebench tool cache or on PATH")
    model: str = setting(str, required=True, check=_model_file_problem, path="GGUF file",
                         doc="the GGUF file to serve")
    args: list[str] = setting(list, default=list, item_type=str,
                              doc="extra llama-server arguments, e.g. ['-c', '8192']")
    host: str = setting(str, default="127.0.0.1")
    port: int = setting(int, default=0, check=non_negative, low=0, high=65_535, doc="0 picks a free port")
    startup_timeout_s: float = setting(float, default=300.0, check=positive, low=0, low_open=True, high=MAX_SECONDS)
    request_timeout_s: float = setting(float, default=600.0, check=positive, low=0, low_open=True, high=MAX_SECONDS,
                                       doc="read timeout: the longest wait for the next bytes of a reply")
    request_deadline_s: float = setting(float, default=DEFAULT_REQUEST_DEADLINE_S, check=positive, low=0,
                                        low_open=True, high=MAX_SECONDS,
                                        doc="longest one request may take from being sent to its whole reply")
    max_restarts: int = setting(int, default=3, check=non_negative, low=0, high=100)
    parallel: int | None = setting(int, check=positive, low=1, high=MAX_CLIENTS,
                                   doc="server slots (--parallel); defaults to concurrency")
    ctx_size: int | None = setting(int, check=positive, low=1, high=16 * MAX_PROMPT_TOKENS,
                                   doc="-c: total context, shared by the slots")
    env: dict[str, str] = setting(dict, default=dict, check=_env_problem, doc="extra environment for the server")
    max_response_bytes: int = setting(int, default=DEFAULT_MAX_RESPONSE_BYTES, check=positive, low=1,
                                      high=MAX_RESPONSE_BYTES,
                                      doc="hard cap on one response's size (the bound from max_tokens is "
                                          "usually lower)")
    greedy_argmax: bool = setting(bool, default=True,
                                  doc="greedy requests (temperature 0) name the argmax alone as their sampler "
                                      "chain (the same tokens without the default chain's cost per token); "
                                      "false sends the server's default chain")


SCHEMA = LlamaServerSettings.schema()


# --- process bookkeeping: no server outlives its Python process ----------------------------------

def _die_with_parent() -> list[str]:
    """A launcher prefix that makes the server receive SIGKILL when the thread that spawned it dies
    (Linux PR_SET_PDEATHSIG, set by util-linux's setpriv before it execs the server): the signal
    hooks below cover SIGINT/SIGTERM/SIGHUP and normal exits, but not a SIGKILL of moebench itself,
    which used to leave the server running. Empty where setpriv is missing (the hooks still apply)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv and sys.platform.startswith("linux") else []


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)                   # the server leads its own group (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass


class LiveServers:
    """Every server process this Python process started and has not stopped yet (all runners), and
    the exit hooks that stop them: atexit covers normal exits and Ctrl-C (KeyboardInterrupt unwinds,
    then atexit runs); SIGTERM/SIGHUP would otherwise end the process without running atexit."""

    def __init__(self) -> None:
        self._procs: dict[int, subprocess.Popen] = {}        # pid -> server process
        self._lock = threading.RLock()       # re-entrant: the signal handler may interrupt a holder
        self._hooks_installed = False

    def spawn(self, cmd: list[str], **popen: Any) -> subprocess.Popen:
        """Start `cmd` in its own session, listed before any signal can find it unlisted."""
        self.install_exit_hooks()
        with self._lock:
            proc = subprocess.Popen(_die_with_parent() + cmd, start_new_session=True, **popen)
            self._procs[proc.pid] = proc
        return proc

    def stop(self, proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM the group, wait up to `grace_s`, then SIGKILL it; return the exit code."""
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(proc, signal.SIGKILL)            # also reaps any helper the server forked
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        with self._lock:
            self._procs.pop(proc.pid, None)
        return proc.returncode

    def kill_all(self) -> None:
        with self._lock:
            procs = list(self._procs.values())
        for proc in procs:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + 3.0
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            self.stop(proc, grace_s=0.0)

    def _chain_signal(self, sig: int) -> None:
        """Stop the servers on `sig`, then do what the previous handler would have done."""
        previous = signal.getsignal(sig)

        def handler(signum: int, frame: Any) -> None:
            self.kill_all()
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_IGN:
                return
            else:                                      # SIG_DFL: die of the same signal, as before
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(sig, handler)

    def install_exit_hooks(self) -> None:
        if self._hooks_installed:
            return
        self._hooks_installed = True
        atexit.register(self.kill_all)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._chain_signal(sig)
            if signal.getsignal(signal.SIGINT) in (signal.SIG_DFL, None):
                self._chain_signal(signal.SIGINT)           # only where Python's KeyboardInterrupt is off


# The process's servers: one list, so the exit hooks stop every runner's server.
SERVERS = LiveServers()


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _lists_flag(binary: Path, flag: str) -> bool:
    """Whether `binary --help` lists `flag`; a binary that cannot say (binary_probe.ProbeError) lists
    nothing, and its start then fails with the server's own error."""
    try:
        text = PROBE.help_text(binary)
    except ProbeError:
        return False
    return re.search(re.escape(flag) + r"(?![-\w])", text) is not None


# --- model identity ------------------------------------------------------------------------------

def _hash_cache_path() -> Path:
    return llamacpp.cache_root() / "sha256-cache.json"


def file_sha256(path: Path) -> str:
    """sha256 of a (possibly huge) file, streamed; cached by path, size and mtime across processes."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    cache_file = _hash_cache_path()
    try:
        cache = json.loads(cache_file.read_text())
    except (OSError, ValueError):
        cache = {}
    if key in cache:
        return cache[key]
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(8 << 20), b""):
            h.update(block)
    digest = h.hexdigest()
    try:
        try:
            cache = json.loads(cache_file.read_text())   # re-read: another process may have added keys
        except (OSError, ValueError):
            cache = {}
        cache[key] = digest
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_name(f".{cache_file.name}.{os.getpid()}")
        tmp.write_text(jsonout.dumps(cache, indent=1))
        os.replace(tmp, cache_file)
    except OSError:
        pass                                           # a read-only cache only costs a re-hash
    return digest


def gguf_metadata(path: Path) -> GgufSummary | GgufUnreadable:
    """Architecture, name, file type and parameter count of a GGUF (an "error" key if unreadable)."""
    try:
        gguf = read_gguf(path, arrays="lengths")
    except GgufFormatError as e:                           # a corrupt file: say so, do not fail the run
        return {"error": f"cannot read the GGUF header of {path}: {e}"}
    meta = gguf.metadata
    arch = meta.get("general.architecture")
    file_type = meta.get("general.file_type")
    out: GgufSummary = {
        "architecture": arch,
        "name": meta.get("general.name"),
        "file_type": file_type,
        "file_type_name": FILE_TYPE_NAMES.get(file_type) if isinstance(file_type, int) else None,
        "parameter_count": sum(t.n_elements for t in gguf.tensors),
        "tensor_count": len(gguf.tensors),
        "gguf_version": gguf.version,
    }
    if arch:
        for key in ("expert_count", "expert_used_count", "block_count", "context_length", "embedding_length"):
            if f"{arch}.{key}" in meta:
                out[key] = meta[f"{arch}.{key}"]           # type: ignore[literal-required]  # a key of GgufSummary
    return out


def _json_object(raw: bytes, where: str) -> JsonObject:
    """A reply parsed, checked to be a JSON object (its fields are checked where they are read)."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RunnerError(f"{where}: reply is not JSON: {raw[:200].decode('utf-8', 'replace')!r}") from None
    if not isinstance(data, dict):
        raise RunnerError(f"{where}: reply is {type(data).__name__}, expected a JSON object")
    return data


# --- the runner ----------------------------------------------------------------------------------

class LlamaServerRunner(Runner):
    kind = "llama-server"
    capabilities = frozenset({Capability.GENERATE, Capability.STREAM, Capability.TOP_LOGPROBS,
                              Capability.CHOICE_LOGPROBS, Capability.SAMPLING, Capability.LLAMA_PERPLEXITY,
                              Capability.TOKENIZE, Capability.TOKEN_PROMPTS})

    settings_class = LlamaServerSettings
    settings: LlamaServerSettings

    def __init__(self, settings: LlamaServerSettings | JsonObject, profile_path: str | None = None,
                 name: str | None = None):
        super().__init__(settings, profile_path, name)
        # A profile that names its binary is a candidate build: its KLD uses that build's tools.
        self.binary_named = "binary" in self.settings.given
        where = profile_path or "llama-server runner profile"
        if self.settings.model is None:
            raise ProfileError(f"{where}: missing required key 'model' (a GGUF file path)")
        self.model_path = Path(self.settings.model).expanduser()
        if not self.model_path.is_file():
            raise ProfileError(f"{where}: key 'model': GGUF file not found: {self.model_path} "
                               f"(resolved from {Path.cwd()})")
        with self.model_path.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise ProfileError(f"{where}: key 'model': {self.model_path} is not a GGUF file "
                                   f"(no GGUF magic at its start)")
        args = self.settings.args
        clash = sorted(a.split("=", 1)[0] for a in args if a.split("=", 1)[0] in OWNED_FLAGS)
        if clash:
            raise ProfileError(f"{where}: key 'args' must not set {', '.join(clash)}: the runner sets "
                               f"host, port, model and parallel itself (use the keys of the same names)")
        self.slots = int(self.settings.parallel or self.concurrency)
        self.max_restarts = self.settings.max_restarts
        self.restarts = 0
        self.reconnects = 0       # requests sent again after a live server dropped their connection
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None
        self.base_url: str | None = None
        self.log_path: Path | None = None
        self.binary: Path | None = None
        self._client: aiohttp.ClientSession | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._old_clients: list[aiohttp.ClientSession] = []
        self._generation = 0              # bumped on every (re)start; requests note it when sent
        self._restart_lock: asyncio.Lock | None = None
        self._gave_up: str | None = None
        self._identity: RunnerIdentity | None = None
        self._plan: PerplexityPlan | None = None
        self.server_started = False
        # The server's default backend sampling (/props), read at each start; None: not known.
        self.backend_sampling: bool | None = None

    # -- life cycle -------------------------------------------------------------------------------
    def _resolve_binary(self) -> Path:
        if self.binary is None:
            try:
                self.binary = llamacpp.tool(self.settings.binary, True)
            except llamacpp.ToolError as e:
                raise RunnerError(str(e)) from None
        return self.binary

    def startup_note(self, run_dir: str | None) -> str:
        if self.needed is not None and set(self.needed) <= SERVERLESS:
            return f"no llama-server needed (KLD by llama-perplexity on {self.model_path})"
        log = Path(run_dir) / LOG_NAME if run_dir else "a temporary folder"
        return (f"starting llama-server ({self.settings.binary}; built first if missing) on {self.model_path}, "
                f"waiting for /health; its log: {log}")

    async def start(self, run_dir: str | None = None) -> None:
        if self.proc is not None and self.proc.poll() is None:
            return
        try:
            # Built on first use (minutes); in a thread so the event loop stays responsive.
            self.binary = await asyncio.to_thread(llamacpp.tool, self.settings.binary, True)
        except llamacpp.ToolError as e:
            raise RunnerError(str(e)) from None
        if self.needed is not None and set(self.needed) <= SERVERLESS:
            return                     # e.g. KLD only: llama-perplexity loads the model, not a server
        self.server_started = True
        log_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="moebench-llama-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / LOG_NAME
        await self._spawn_and_wait()

    def command(self, port: int) -> list[str]:
        """The server command line for `port` (the profile's args go last so they can add anything)."""
        assert self.binary is not None
        cmd = [str(self.binary), "--host", self.settings.host, "--port", str(port),
               "-m", str(self.model_path), "--parallel", str(self.slots)]
        if self.settings.ctx_size:
            cmd += ["-c", str(self.settings.ctx_size)]
        if _lists_flag(self.binary, "--no-webui"):
            cmd.append("--no-webui")
        return cmd + list(self.settings.args)

    async def _spawn_and_wait(self) -> None:
        """Spawn the server and wait until /health answers 200; on failure stop it and raise."""
        assert self.log_path is not None
        fixed_port = int(self.settings.port)
        for attempt in range(3):           # a picked free port can be taken before the server binds it
            port = fixed_port or _free_port(self.settings.host)
            cmd = self.command(port)
            with open_append(self.log_path) as log:     # never through a link planted in the run
                log_start = log.tell()
                log.write(f"\n=== moebench {now_iso()}: {' '.join(cmd)}\n".encode())
                log.flush()
                env = {**os.environ, **self.settings.env}
                proc = SERVERS.spawn(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
            self.proc, self.port = proc, port
            host = self.settings.host
            self.base_url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
            problem = await self._wait_healthy(proc)
            if problem is None:
                self._new_client()
                self._generation += 1
                self.backend_sampling = await self._read_backend_sampling()
                return
            await asyncio.to_thread(SERVERS.stop, proc)
            with self.log_path.open("rb") as f:
                f.seek(log_start)
                bind_failed = b"couldn't bind HTTP server socket" in f.read()
            if fixed_port or not bind_failed:
                break
        raise RunnerError(f"llama-server did not start: {problem}; command: {' '.join(cmd)}; "
                          f"log {self.log_path} ends with:\n{self._log_tail()}")

    async def _wait_healthy(self, proc: subprocess.Popen) -> str | None:
        """None once GET /health is 200; otherwise why not (exited, timed out)."""
        deadline = time.monotonic() + float(self.settings.startup_timeout_s)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as client:
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    return f"the process exited with code {proc.returncode} while loading"
                try:
                    async with client.get(f"{self.base_url}/health") as r:
                        if r.status == 200:
                            return None
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    pass                    # not listening yet
                await asyncio.sleep(0.1)
        return f"/health not 200 after {self.settings.startup_timeout_s} s"

    async def _read_backend_sampling(self) -> bool | None:
        """`default_generation_settings.params.backend_sampling` of GET /props (`-bs` or
        LLAMA_ARG_BACKEND_SAMPLING); None where the server does not say (an older build, a fork)."""
        try:
            async with self._open("GET", "/props", timeout_s=10.0) as r:
                raw = await read_bounded(r, int(self.settings.max_response_bytes), "llama-server /props")
            props = _json_object(raw, f"{self.base_url}/props") if r.status == 200 else {}
        except (RunnerError, TransportError, asyncio.TimeoutError):
            return None
        value: Any = props
        for key in ("default_generation_settings", "params", "backend_sampling"):
            value = value.get(key) if isinstance(value, dict) else None
        return value if isinstance(value, bool) else None

    def greedy_in_graph(self) -> bool | None:
        """What `LlamaCompletionBody.of` takes: None keeps every request's sampling as asked
        (`greedy_argmax` off); else whether the argmax can run in the server's graph."""
        return bool(self.backend_sampling) if self.settings.greedy_argmax else None

    def _new_client(self) -> None:
        if self._client is not None:
            self._old_clients.append(self._client)   # requests may still hold it; closed in close()
        # One session over a pool of slots + 4 connections; a request's read may stall at most
        # request_timeout_s between bytes (its whole length is bounded by request_deadline_s).
        connector = aiohttp.TCPConnector(limit=max(self.slots, self.concurrency) + 4, limit_per_host=0,
                                         keepalive_timeout=KEEPALIVE_S)
        self._client = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(
            total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=float(self.settings.request_timeout_s)))
        try:
            self._client_loop = asyncio.get_running_loop()
        except RuntimeError:
            self._client_loop = None

    def _client_for_loop(self) -> aiohttp.ClientSession:
        # A client is bound to the loop it first ran on; a caller on a new loop gets a fresh one.
        if self._client is None:
            raise RunnerError("llama-server runner used before start()")
        if self._client_loop is not asyncio.get_running_loop():
            self._new_client()
        return self._client

    def _log_tail(self, n_chars: int = 3000) -> str:
        try:
            with self.log_path.open("rb") as f:   # type: ignore[union-attr]
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - n_chars))
                return f.read().decode("utf-8", "replace")
        except (OSError, AttributeError):
            return "(no log)"

    async def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            await asyncio.to_thread(SERVERS.stop, proc)
        clients = self._old_clients + ([self._client] if self._client else [])
        self._client, self._old_clients = None, []
        for c in clients:
            try:
                await c.close()
            except RuntimeError:             # bound to a loop that has ended: nothing left to free
                pass

    # -- restarts ---------------------------------------------------------------------------------
    async def _recover(self, generation: int, reason: str) -> None:
        """A request lost its connection: restart the server unless someone already did."""
        if self._restart_lock is None:
            self._restart_lock = asyncio.Lock()
        async with self._restart_lock:
            if self._gave_up:
                raise RunnerError(self._gave_up)
            if generation != self._generation:
                return                       # another request restarted it meanwhile: just re-ask
            proc = self.proc
            if proc is None:
                raise RunnerError("llama-server runner is closed")
            # A live server that answers /health dropped one connection (a pooled keep-alive connection
            # it had closed): ask again at once. Only a server that does not answer is waited for
            # (a killed one may take a moment to be reaped) and restarted.
            if proc.poll() is None and await self._healthy():
                self._reconnected(reason)
                return
            for _ in range(10):
                if proc.poll() is not None:
                    break
                await asyncio.sleep(0.1)
            if proc.poll() is None and await self._healthy():
                self._reconnected(reason)
                return
            exit_code = await asyncio.to_thread(SERVERS.stop, proc)
            if self.restarts >= self.max_restarts:
                self._gave_up = (f"llama-server died ({reason}; exit code {exit_code}) and max_restarts="
                                 f"{self.max_restarts} restarts are used up; log {self.log_path} ends with:\n"
                                 f"{self._log_tail()}")
                self.events.append({"event": "gave_up", "reason": reason, "exit_code": exit_code,
                                    "time": now_iso(), "restarts": self.restarts})
                raise RunnerError(self._gave_up)
            self.restarts += 1
            old_pid = proc.pid
            try:
                await self._spawn_and_wait()
            except RunnerError as e:            # it will not come back: fail every request from now on
                self._gave_up = f"llama-server died ({reason}) and could not be restarted: {e}"
                self.events.append({"event": "restart_failed", "reason": reason, "exit_code": exit_code,
                                    "time": now_iso(), "restarts": self.restarts, "error": str(e)[:2000]})
                raise RunnerError(self._gave_up) from None
            self.events.append({"event": "restart", "reason": reason, "exit_code": exit_code,
                                "time": now_iso(), "restarts": self.restarts, "old_pid": old_pid,
                                "new_pid": self.proc.pid if self.proc else None})

    async def _healthy(self) -> bool:
        try:
            async with self._open("GET", "/health", timeout_s=5.0) as r:
                return r.status == 200
        except TransportError:
            return False

    def _reconnected(self, reason: str) -> None:
        """Count a dropped connection of a live server; the first RECONNECT_EVENTS are run events."""
        self.reconnects += 1
        if self.reconnects <= RECONNECT_EVENTS:
            self.events.append({"event": "reconnect", "reason": reason, "time": now_iso(),
                                "reconnects": self.reconnects})

    @contextlib.asynccontextmanager
    async def _open(self, method: str, path: str, body: WireBody | None = None,
                    timeout_s: float | None = None) -> AsyncIterator[aiohttp.ClientResponse]:
        """An open response to `method path` on the managed server; aiohttp's failures while asking or
        reading (inside the block too) come out as TransportError subclasses (ConnectError, ReadTimeout...)."""
        url = f"{self.base_url}{path}"
        timeout = aiohttp.ClientTimeout(total=timeout_s) if timeout_s is not None else None
        try:
            async with self._client_for_loop().request(method, url, json=body.to_json() if body is not None else None,
                                                       allow_redirects=False,
                                                       **({"timeout": timeout} if timeout else {})) as resp:
                yield resp
        except aiohttp.ClientError as e:
            raise transport_error(e, method, url, CONNECT_TIMEOUT_S, float(self.settings.request_timeout_s)) from None

    async def _post_json(self, path: str, body: WireBody) -> JsonObject:
        """POST a small request and read its JSON reply (bounded), after checking the status."""
        async with self._open("POST", path, body) as r:
            raw = await read_bounded(r, int(self.settings.max_response_bytes), f"llama-server {path}")
        self._check_status(r, raw)
        return _json_object(raw, f"{self.base_url}{path}")

    async def _with_restarts(self, call: Callable[[], Awaitable[T]], path: str = "/completion") -> T:
        """Run `call`, restarting the server and asking again when the connection is lost. Each attempt
        ends by `request_deadline_s` (a server that drips bytes inside the read timeout holds no item
        for hours); a restart's own wait is bounded by `startup_timeout_s` and `max_restarts`."""
        deadline_s = float(self.settings.request_deadline_s)
        for _ in range(self.max_restarts + 4):
            if self._gave_up:
                raise RunnerError(self._gave_up)
            generation = self._generation
            try:
                return await asyncio.wait_for(call(), deadline_s)
            except (ReadTimeout, ConnectTimeout) as e:
                if self.proc is not None and self.proc.poll() is None:
                    raise RunnerError(f"llama-server request timed out after "
                                      f"{self.settings.request_timeout_s} s ({type(e).__name__})") from None
                await self._recover(generation, f"timeout, process gone: {type(e).__name__}")
            except TransportError as e:     # refused, reset, disconnected mid-response
                await self._recover(generation, describe(e))
            except asyncio.TimeoutError:    # the builtin TimeoutError from 3.11; its own class on 3.10
                raise DeadlineExceeded(f"POST {self.base_url}{path}: no complete reply after {deadline_s:g} s "
                                       "(request_deadline_s)") from None
        raise RunnerError("llama-server request failed repeatedly although the server answers /health")

    @staticmethod
    def _check_status(r: aiohttp.ClientResponse, raw: bytes) -> None:
        if r.status == 200:
            return
        try:
            err = json.loads(raw)
            msg = err.get("error", {}).get("message") or err
        except (ValueError, AttributeError):
            msg = raw[:500].decode("utf-8", "replace")
        moved = (f" (redirect to {r.headers.get('location') or 'no Location header'}, not followed)"
                 if 300 <= r.status < 400 else "")
        raise RunnerError(f"llama-server {r.url} answered {r.status}{moved}: {msg}")

    # -- requests ---------------------------------------------------------------------------------
    @staticmethod
    def _top_logprobs(probs: Any, where: str) -> list[dict[str, float]]:
        if not isinstance(probs, list):
            raise RunnerError(f"{where}: field 'completion_probabilities' is {type(probs).__name__}, expected a list")
        out = []
        for i, position in enumerate(probs):
            alts = position.get("top_logprobs") if isinstance(position, dict) else None
            if not isinstance(alts, list):
                raise RunnerError(f"{where}: field 'completion_probabilities[{i}].top_logprobs' is not a list")
            d: dict[str, float] = {}
            for alt in alts:
                if not isinstance(alt, dict) or not isinstance(alt.get("token"), str):
                    raise RunnerError(f"{where}: an entry of 'completion_probabilities[{i}].top_logprobs' has no "
                                      f"token text: {str(alt)[:100]}")
                lp = reply_checks.logprob(alt.get("logprob"), f"completion_probabilities[{i}].top_logprobs", where)
                d.setdefault(alt["token"], lp)      # same text, two ids: keep the likelier
            out.append(d)
        return out

    def _result(self, final: JsonObject, request: GenerateRequest, *, text: Any, ids: Any, probs: Any,
                times: list[float] | None, wall: float, sent_at: float) -> GenerateResult:
        """The result of one /completion reply (`final`: the reply, or a stream's last event), every
        count, timing and log-prob checked (moebench.runners.reply_checks)."""
        where = f"{self.base_url}/completion"
        if not isinstance(text, str):
            raise RunnerError(f"{where}: field 'content' is {type(text).__name__}, expected text")
        if not isinstance(ids, list):
            raise RunnerError(f"{where}: field 'tokens' is {type(ids).__name__}, expected a list of token ids")
        ids = [reply_checks.count(t, f"tokens[{i}]", where) for i, t in enumerate(ids)]
        timings = reply_checks.timings(final.get("timings"), where)
        timings.update(wall_s=wall, tokens_cached=reply_checks.count(final.get("tokens_cached"), "tokens_cached", where),
                       stop_type=final.get("stop_type"))
        if times:
            timings["client_ttft_s"] = times[0]
        server = reply_checks.count(final.get("tokens_predicted"), "tokens_predicted", where)
        output_tokens, mismatch = reply_checks.reconcile(server, "tokens_predicted",
                                                         reply_checks.OutputCount(len(ids), "token-ids"), text,
                                                         request.max_tokens)
        return GenerateResult(
            text=text,
            token_ids=ids,
            prompt_tokens=reply_checks.count(final.get("tokens_evaluated"), "tokens_evaluated", where),
            output_tokens=output_tokens,
            output_tokens_source="server" if mismatch is None and server is not None else "token-ids",
            server_count_mismatch=mismatch,
            finish_reason=self._finish_reason(final.get("stop_type")),
            top_logprobs=self._top_logprobs(probs, where) if request.top_logprobs and probs is not None else None,
            token_times=times,
            timings=timings,
            endpoint=self.base_url,
            sent_at=sent_at,
        )

    @staticmethod
    def _finish_reason(stop_type: str | None) -> str | None:
        return {"eos": "stop", "word": "stop", "limit": "length"}.get(stop_type or "", stop_type)

    def _limit(self, request: GenerateRequest) -> int:
        return response_limit(request.max_tokens, request.top_logprobs, int(self.settings.max_response_bytes))

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if isinstance(request.prompt, list) and not all(isinstance(t, int) for t in request.prompt):
            raise RunnerError("a token prompt must be a list of ints")
        payload = LlamaCompletionBody.of(request, self.greedy_in_graph())
        sends = 0

        def send() -> Awaitable[GenerateResult]:
            nonlocal sends
            sends += 1
            return (self._generate_stream if request.stream else self._generate_once)(payload, request)
        result = await self._with_restarts(send)
        result.resends = sends - 1
        return result

    async def _generate_once(self, payload: LlamaCompletionBody, request: GenerateRequest) -> GenerateResult:
        t0 = time.perf_counter()
        async with self._open("POST", "/completion", payload) as r:
            raw = await read_bounded(r, self._limit(request), "llama-server /completion")
        wall = time.perf_counter() - t0
        self._check_status(r, raw)
        data = _json_object(raw, f"{self.base_url}/completion")
        if data.get("error"):
            err = data["error"]
            raise RunnerError(f"llama-server error: {err.get('message', err) if isinstance(err, dict) else err}")
        return self._result(data, request, text=data.get("content", ""), ids=data.get("tokens") or [],
                            probs=data.get("completion_probabilities"), times=None, wall=wall, sent_at=t0)

    async def _generate_stream(self, payload: LlamaCompletionBody, request: GenerateRequest) -> GenerateResult:
        """SSE: one `data:` event per generated token; record when each arrives."""
        t0 = time.perf_counter()
        text: list[str] = []
        ids: list[int] = []
        times: list[float] = []
        probs: list[JsonValue] = []             # as the server sent them: _result checks them
        final: JsonObject = {}
        async with self._open("POST", "/completion", payload) as r:
            if r.status != 200:
                self._check_status(r, await read_bounded(r, self._limit(request), "llama-server /completion"))
            async for line in bounded_lines(r, self._limit(request), "llama-server /completion"):
                if not line.startswith(("data:", "error:")):
                    continue
                body = line.split(":", 1)[1].strip()
                if not body or body == "[DONE]":
                    continue
                event = _json_object(body.encode(), f"{self.base_url}/completion (stream)")
                if line.startswith("error:") or "error" in event:
                    err = event.get("error", event)
                    raise RunnerError(f"llama-server stream error: {err.get('message', err)}")
                now = time.perf_counter() - t0
                if event.get("prompt_progress") is not None:
                    continue
                piece = event.get("content", "")
                if not isinstance(piece, str):
                    raise RunnerError(f"{self.base_url}/completion (stream): field 'content' is "
                                      f"{type(piece).__name__}, expected text")
                text.append(piece)
                if request.on_text and event.get("content"):
                    request.on_text(event["content"])
                # The final event may carry the last tokens (text held back until its UTF-8 was whole).
                event_ids = event.get("tokens") or []
                if not isinstance(event_ids, list):
                    raise RunnerError(f"{self.base_url}/completion (stream): field 'tokens' is "
                                      f"{type(event_ids).__name__}, expected a list of token ids")
                for tok in event_ids:
                    ids.append(tok)
                    times.append(now)
                event_probs = event.get("completion_probabilities") or []
                if not isinstance(event_probs, list):
                    raise RunnerError(f"{self.base_url}/completion (stream): field 'completion_probabilities' "
                                      f"is {type(event_probs).__name__}, expected a list")
                probs.extend(event_probs)
                if event.get("stop"):
                    final = event
                    break
        wall = time.perf_counter() - t0
        if not final:
            # The server closed the stream without its final event: it died mid-answer.
            raise RemoteProtocolError(f"POST {self.base_url}/completion: stream ended without a final event")
        return self._result(final, request, text="".join(text), ids=ids,
                            probs=probs if request.top_logprobs else None, times=times, wall=wall, sent_at=t0)

    async def choice_logprobs(self, prompt, choices):
        """Exact ranking of single-token choices whatever their rank in the vocabulary: a grammar allows
        only the choices, and the post-sampling probabilities (temperature 1, no truncation) are the
        model's probabilities renormalised over them (ratios kept; checked against n_probs = vocab)."""
        if not choices:
            return {}, "renormalized"
        payload = LlamaChoiceBody(prompt, tuple(choices))

        async def call() -> dict[str, float | None]:
            where = f"{self.base_url}/completion"
            positions = (await self._post_json("/completion", payload)).get("completion_probabilities") or [{}]
            probs = (positions[0].get("top_probs") if isinstance(positions, list) and isinstance(positions[0], dict)
                     else None) or []
            if not isinstance(probs, list):
                raise RunnerError(f"{where}: field 'completion_probabilities[0].top_probs' is not a list")
            best: dict[str, float] = {}
            for p in probs:
                tok = p.get("token") if isinstance(p, dict) else None
                if tok not in choices:
                    continue
                prob = reply_checks.probability(p.get("prob"), "completion_probabilities[0].top_probs", where)
                if prob > 0:
                    best[tok] = max(best.get(tok, 0.0), prob)
            return {c: (math.log(best[c]) if c in best else None) for c in choices}

        return await self._with_restarts(call), "renormalized"

    async def server_metrics(self) -> dict[str, float] | None:
        """llama-server's Prometheus page (served when `args` hold `--metrics`), its values summed per
        name; None without it (llama-server answers 501) or while the server is not up. A failed
        reading never restarts the server: it is no request."""
        if self._client is None:
            return None
        try:
            async with self._open("GET", "/metrics") as r:
                if r.status != 200:
                    return None
                raw = await read_bounded(r, 16 << 20, "llama-server /metrics")
        except (TransportError, RunnerError):
            return None
        from moebench.runners.metrics import parse_prometheus
        return parse_prometheus(raw.decode("utf-8", "replace"))

    async def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        """Token ids of `text` (no BOS unless `add_special`; special-token text is not parsed)."""
        async def call() -> list[int]:
            data = await self._post_json("/tokenize", LlamaTokenizeBody(text, add_special, parse_special=False))
            return [int(t) for t in data["tokens"]]
        return await self._with_restarts(call, "/tokenize")

    async def detokenize(self, token_ids: list[int]) -> str:
        async def call() -> str:
            return (await self._post_json("/detokenize", DetokenizeBody(tuple(token_ids))))["content"]
        return await self._with_restarts(call, "/detokenize")

    # -- KLD through llama-perplexity -----------------------------------------------------------
    def perplexity_plan(self) -> PerplexityPlan:
        """The llama-perplexity of this candidate's build with its placement and numerics flags.

        The binary sits beside the profile's `binary` (a candidate build folder); only a profile that
        names no binary falls back to moebench's built tools. Flags llama-perplexity does not know are
        refused here, before any work (moebench.tools.llama_args)."""
        if self._plan is not None:
            return self._plan
        where = self.profile_path or "llama-server runner profile"
        try:
            server = self._resolve_binary()
        except RunnerError as e:
            raise ProfileError(f"{where}: key 'binary': {e}") from None
        if self.binary_named:
            ppl = server.parent / ("llama-perplexity" + server.suffix)
            source = f"beside the profile's binary {server}"
            if not ppl.is_file():
                raise ProfileError(f"{where}: key 'binary' names {server}, but its folder has no llama-perplexity "
                                   f"({ppl} not found): KLD must run the candidate's own build; build "
                                   "llama-perplexity there (cmake --target llama-perplexity)")
        else:
            try:
                ppl = llamacpp.tool("llama-perplexity", True)
            except llamacpp.ToolError as e:
                raise ProfileError(f"{where}: no llama-perplexity for KLD: {e}") from None
            source = "moebench's built llama.cpp tools (the profile names no binary)"
        try:
            sorted_args = llama_args.perplexity_args(self.settings.args, ppl, where)
        except llama_args.ArgsError as e:
            raise ProfileError(str(e)) from None
        self._plan = PerplexityPlan(binary=str(ppl), version=llama_args.version_line(ppl), source=source,
                                    model=str(self.model_path), args=sorted_args.passed,
                                    dropped=sorted_args.dropped, server_binary=str(server))
        return self._plan

    # -- identity -------------------------------------------------------------------------------
    def _greedy_samplers_record(self) -> GreedySamplers | None:
        """What a greedy request asks for its sampler chain (None: the server's default chain, or no
        server ran)."""
        in_graph = self.greedy_in_graph()
        if in_graph is None or not self.server_started:
            return None
        names, top_k = greedy_chain(in_graph)
        return {"samplers": list(names), "top_k": top_k, "backend_sampling": self.backend_sampling}

    def identity(self) -> RunnerIdentity:
        if self._identity is None:
            p = self.model_path
            model: GgufModel = {"path": str(p.resolve()), "name": p.name,
                                "size_bytes": p.stat().st_size, "sha256": file_sha256(p)}
            meta = gguf_metadata(p)
            if meta is not None:
                model["gguf"] = meta
            try:
                binary = self.binary or llamacpp.tool(self.settings.binary)
                build: LlamaBuild = {"kind": "llama.cpp", **llamacpp.build_info(binary)}
            except llamacpp.ToolError as e:
                build = {"kind": "llama.cpp", "error": str(e)}
            self._identity = {"model": model, "build": build}
        # a copy the caller may change, with the server's state now
        model_now: GgufModel = json.loads(jsonout.dumps(self._identity["model"]))
        build_now: LlamaBuild = json.loads(jsonout.dumps(self._identity["build"]))
        build_now["server_args"] = self.command(self.port or 0)[1:] if self.binary and self.server_started else None
        build_now["server_started"] = self.server_started
        build_now["greedy_samplers"] = self._greedy_samplers_record()
        return {"model": model_now, "build": build_now}
