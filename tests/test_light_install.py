"""The base install is a client: in a fresh virtual environment, `pip install .` (no extras) drives an
HTTP runner against a real `moebench serve`, then compare, report and gate work, and torch,
transformers and lm-eval are not there.

The server runs in this (full) environment: the in-repo engine on the zoo's checkpoint behind
`moebench serve`. Only pip talks to the package index (PyPI or the configured mirror)."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import venv
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow
IGNORED = shutil.ignore_patterns(".git", "models", "results", "build", "dist", "*.egg-info", "__pycache__",
                                 ".pytest_cache", ".venv", "data")


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory) -> Path:
    """A fresh venv (no system site-packages) with `pip install <copy of the checkout>`, no extras."""
    root = tmp_path_factory.mktemp("light")
    src = root / "src"
    shutil.copytree(REPO, src, ignore=IGNORED)        # build from a copy: the checkout stays clean
    env_dir = root / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False, clear=True).create(env_dir)
    py = env_dir / "bin" / "python"
    proc = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(src)],
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return env_dir


@pytest.fixture(scope="module")
def engine_server(tmp_path_factory):
    """`moebench serve` over the engine on the zoo's HF checkpoint (built here, no llama.cpp)."""
    from moebench.zoo.build import build_zoo

    d = tmp_path_factory.mktemp("serve")
    hf = build_zoo(d / "zoo", gguf=False, log=lambda m: None)["paths"]["hf_dir"]
    prof = d / "engine.toml"
    prof.write_text(f'kind = "engine"\nmodel = "{hf}"\ndtype = "float32"\ndevice = "cpu"\n', encoding="utf-8")
    proc = subprocess.Popen([sys.executable, "-m", "moebench.cli", "serve", "--runner", str(prof), "--port", "0"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url, seen, deadline = None, [], time.monotonic() + 300
    while time.monotonic() < deadline and url is None:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        m = re.search(r"serving \S+ \(engine\) on (\S+)", line)
        url = m.group(1) if m else None
    try:
        assert url, "".join(seen)[-3000:]
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _client(env_dir: Path, *args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    from moebench.datasets import data_dir

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{env_dir / 'bin'}{os.pathsep}{env['PATH']}"
    # The installed copy lives in site-packages, so "../shared/datasets beside the checkout" means nothing
    # to it: name the mirror explicitly, as a client job does.
    env.setdefault("MOEBENCH_DATA_DIR", str(data_dir()))
    proc = subprocess.run([str(env_dir / "bin" / "moebench"), *args], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=900)
    if check and proc.returncode != 0:
        raise AssertionError(f"moebench {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def test_base_install_runs_http_compare_report_gate_without_torch(client_venv, engine_server, tmp_path, data_dir):
    py = client_venv / "bin" / "python"
    for heavy in ("torch", "transformers", "lm_eval", "safetensors"):
        proc = subprocess.run([str(py), "-c", f"import {heavy}"], capture_output=True, text=True,
                              env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
        assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr, heavy
    where = subprocess.run([str(py), "-c", "import moebench; print(moebench.__file__)"], capture_output=True,
                           text=True, cwd=tmp_path, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert "site-packages" in where.stdout, where.stdout + where.stderr    # the installed copy, not the checkout

    (tmp_path / "runners").mkdir()
    (tmp_path / "runners" / "served.toml").write_text(
        f'kind = "http"\nbase_url = "{engine_server}"\nmodel = "any"\nconcurrency = 2\n', encoding="utf-8")
    suite = tmp_path / "client.toml"
    suite.write_text('name = "client"\n'
                     '[[tasks]]\ntask = "gsm8k"\nlimit = 3\nshots = 2\nmax_tokens = 24\n'
                     '[[tasks]]\ntask = "humaneval"\nlimit = 2\nmax_tokens = 48\n'
                     '[probes]\nnvml = true\n', encoding="utf-8")
    runs = []
    for label in ("base", "cand"):
        proc = _client(client_venv, "run", str(suite), "--runner", "served", "--out", str(tmp_path / label),
                       "--label", label, "--json", cwd=tmp_path)
        out = json.loads(proc.stdout)
        assert out["status"] == "complete" and out["exit_code"] == 0, out
        assert out["summary"]["gsm8k"]["n"] == 3 and out["summary"]["humaneval"]["n"] == 2
        assert out["summary"]["gsm8k"]["n_errors"] == 0 and out["summary"]["humaneval"]["n_errors"] == 0
        m = json.loads((tmp_path / label / "manifest.json").read_text())
        assert m["runner"]["kind"] == "http" and "gsm8k/test.jsonl" in m["data_files"]
        runs.append(out["run_dir"])
    proc = _client(client_venv, "compare", *runs, "--out", str(tmp_path / "cmp"), cwd=tmp_path)
    cmp = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert cmp["tasks"]["gsm8k"]["n_paired"] == 3 and cmp["tasks"]["humaneval"]["n_paired"] == 2
    # Greedy decoding on the same server: the same answers, so no flips.
    assert all(not t["wins"] and not t["losses"] for t in cmp["tasks"].values())
    _client(client_venv, "report", str(tmp_path / "cmp"), "--out", str(tmp_path / "r.html"), cwd=tmp_path)
    assert (tmp_path / "r.html").stat().st_size > 5000
    rules = tmp_path / "rules.toml"
    rules.write_text("[gsm8k]\nmax_losses = 0\n[humaneval]\nmax_losses = 0\n", encoding="utf-8")
    proc = _client(client_venv, "gate", str(tmp_path / "cmp"), "--rules", str(rules), "--json", cwd=tmp_path)
    assert json.loads(proc.stdout)["verdict"] == "pass"
    # The engine is an extra: asking for it says so instead of a traceback deep inside.
    (tmp_path / "runners" / "eng.toml").write_text('kind = "engine"\nmodel = "nowhere"\n', encoding="utf-8")
    proc = _client(client_venv, "run", str(suite), "--runner", "eng", "--out", str(tmp_path / "x"), cwd=tmp_path,
                   check=False)
    assert proc.returncode == 2 and "moebench[engine]" in proc.stderr, proc.stderr[-2000:]
