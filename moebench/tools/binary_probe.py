"""What a llama.cpp binary prints for `--help` and `--version`, asked once per binary file.

Every reader of a binary's help or version text (the llama-server runner's flag check, the
llama-perplexity argument sorter, the build identity) goes through one `BinaryProbe`, so a binary
is run at most once per flag in a process, with one timeout and one error. A binary is known by its
resolved path and modification time: a rebuilt binary is asked again.
"""
from __future__ import annotations

import os
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

TIMEOUT_S = 60      # a cold start of a CUDA build (driver and device probing) can take tens of seconds


class ProbeError(RuntimeError):
    """The binary could not be read or run (missing, not executable, timed out); names the binary."""


@dataclass(frozen=True)
class ProbeOutput:
    """What `binary flag` printed (stdout then stderr) and its exit code."""

    text: str
    returncode: int


class BinaryProbe:
    """The cache of `binary --help` / `binary --version` outputs for one process (see the module
    docstring); safe to share between threads."""

    def __init__(self, timeout_s: float = TIMEOUT_S):
        self.timeout_s = timeout_s
        self._outputs: dict[tuple[str, float, str], ProbeOutput] = {}
        self._lock = threading.Lock()

    def run(self, binary: str | os.PathLike[str], flag: str) -> ProbeOutput:
        """`binary flag`'s output, from the cache when this binary file was asked before."""
        p = Path(binary)
        try:
            key = (str(p.resolve()), p.stat().st_mtime, flag)
        except OSError as e:
            raise ProbeError(f"{p}: cannot read the binary: {e}") from None
        with self._lock:
            cached = self._outputs.get(key)
        if cached is not None:
            return cached
        try:
            proc = subprocess.run([str(p), flag], capture_output=True, text=True, timeout=self.timeout_s,
                                  errors="replace")
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ProbeError(f"{p} {flag} failed: {type(e).__name__}: {e}") from None
        out = ProbeOutput(proc.stdout + "\n" + proc.stderr, proc.returncode)
        with self._lock:
            self._outputs[key] = out
        return out

    def help_text(self, binary: str | os.PathLike[str]) -> str:
        return self.run(binary, "--help").text

    def version(self, binary: str | os.PathLike[str]) -> ProbeOutput:
        return self.run(binary, "--version")


# The process's one probe: every module that asks a llama.cpp binary for its help or version uses it.
PROBE = BinaryProbe()
