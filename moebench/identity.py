"""Who and where a run ran: moebench version and git revision, host CPU/RAM/GPUs."""
from __future__ import annotations

import os
import platform
import socket
import subprocess
from pathlib import Path
from typing import TypedDict

from moebench import __version__
from moebench.config import repo_root


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=repo_root(), capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


class MoebenchIdentity(TypedDict):
    """The manifest's `moebench` (JSON)."""

    version: str
    git_revision: str | None
    dirty: bool | None          # uncommitted changes to tracked files; None outside a git checkout


class HostGpu(TypedDict):
    index: int
    name: str
    memory_total_bytes: int


class GpuInventory(TypedDict):
    gpus: list[HostGpu]
    driver: str | None
    nvml: str                   # "ok", or why NVML gave no answer


class HostIdentity(GpuInventory):
    """The manifest's `host` (JSON)."""

    hostname: str
    platform: str
    python: str
    cpu: str
    cpu_count: int | None
    ram_bytes: int | None


def moebench_identity() -> MoebenchIdentity:
    rev = _git("rev-parse", "HEAD")
    dirty = None
    if rev is not None:
        status = _git("status", "--porcelain", "--untracked-files=no")
        dirty = bool(status)
    return {"version": __version__, "git_revision": rev, "dirty": dirty}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _gpus() -> GpuInventory:
    """GPU names and driver through NVML where present; empty otherwise (never fails)."""
    try:
        import pynvml
    except ImportError:
        return {"gpus": [], "driver": None, "nvml": "nvidia-ml-py not installed"}
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVML absent (no driver): the normal case on CPU machines
        return {"gpus": [], "driver": None, "nvml": f"unavailable: {e}"}
    try:
        n = pynvml.nvmlDeviceGetCount()
        gpus: list[HostGpu] = []
        for i in range(n):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            gpus.append({"index": i, "name": name.decode() if isinstance(name, bytes) else name,
                         "memory_total_bytes": int(mem.total)})
        drv = pynvml.nvmlSystemGetDriverVersion()
        return {"gpus": gpus, "driver": drv.decode() if isinstance(drv, bytes) else drv, "nvml": "ok"}
    finally:
        pynvml.nvmlShutdown()


def host_identity() -> HostIdentity:
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "ram_bytes": _ram_bytes(),
        **_gpus(),
    }
