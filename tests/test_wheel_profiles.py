"""A wheel carries the shipped profiles: built offline from a copy of the checkout, installed into a
fresh folder, and used from a working directory with no checkout, moebench finds suites/, runners/ and
gates/ by name inside the installed package (moebench/profiles/<folder>/), lists them where a name is
wrong, and says how a shipped runner profile's relative model path resolves (the working directory)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow
IGNORED = shutil.ignore_patterns(".git", "models", "results", "build", "dist", "*.egg-info", "__pycache__",
                                 ".pytest_cache", ".venv", "data", "tests", "benchmarks", "docs")

PROBE = """
import json, moebench
from moebench.config import available_profiles, load_suite, resolve_profile_path
from moebench.shipped import is_checkout, shipped_dir
from moebench.tasks import task_schemas
suite = load_suite(resolve_profile_path("smoke", "suites"), task_schemas())
print(json.dumps({"package": moebench.__file__, "checkout": is_checkout(),
                  "smoke": str(resolve_profile_path("smoke", "suites")),
                  "engine-bf16": str(resolve_profile_path("engine-bf16", "runners")),
                  "smoke_tasks": [t["task"] for t in suite.tasks],
                  "lists": {f: available_profiles(f) for f in ("suites", "runners", "gates")},
                  "gates_dir": str(shipped_dir("gates"))}))
"""


def _run(args: list[str], cwd: Path, site: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)           # the installed wheel, ahead of any editable checkout
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The folder a wheel of this checkout was installed into (pip, offline, no dependencies)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    shutil.copytree(REPO, src, ignore=IGNORED)          # build from a copy: the checkout stays clean
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    built = subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w",
                            str(root / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    wheel = next((root / "dist").glob("moebench-*.whl"))
    site = root / "site"
    inst = subprocess.run([*pip, "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
                          capture_output=True, text=True, timeout=600)
    assert inst.returncode == 0, inst.stdout[-3000:] + inst.stderr[-3000:]
    return site


def test_installed_wheel_finds_the_shipped_profiles_by_name(installed, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = _run(["-c", PROBE], elsewhere, installed)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    profiles = installed / "moebench" / "profiles"
    assert Path(got["package"]).parent == installed / "moebench" and got["checkout"] is False
    assert Path(got["smoke"]) == profiles / "suites" / "smoke.toml"
    assert Path(got["engine-bf16"]) == profiles / "runners" / "engine-bf16.toml"
    assert Path(got["gates_dir"]) == profiles / "gates"
    for folder in ("suites", "runners", "gates"):       # every shipped file, and the same bytes
        assert got["lists"][folder] == sorted(p.stem for p in (REPO / folder).glob("*.toml")), folder
        for p in (REPO / folder).glob("*.toml"):
            assert (profiles / folder / p.name).read_bytes() == p.read_bytes(), p
    shipped = tomllib.loads((REPO / "suites" / "smoke.toml").read_text(encoding="utf-8"))
    assert got["smoke_tasks"] == [t["task"] for t in shipped["tasks"]]


def test_installed_cli_lists_the_shipped_names_and_gates_by_name(installed, tmp_path):
    proc = _run(["-m", "moebench.cli", "run", "smok", "--runner", "http"], tmp_path, installed)
    assert proc.returncode == 2
    assert "profile 'smok' not found (did you mean 'smoke'?)" in proc.stderr
    assert str(installed / "moebench" / "profiles" / "suites" / "smok.toml") in proc.stderr
    names = ", ".join(sorted(p.stem for p in (REPO / "suites").glob("*.toml")))
    assert f"available suites: {names}" in proc.stderr
    # `--rules NAME` finds a shipped gate: the gate reads it (and then finds no compare.json)
    proc = _run(["-m", "moebench.cli", "gate", str(tmp_path), "--rules", "example", "--json"], tmp_path, installed)
    assert proc.returncode == 2
    out = json.loads(proc.stdout)
    assert out["rules_file"] == str(installed / "moebench" / "profiles" / "gates" / "example.toml")
    assert "compare.json: not found" in out["error"]


def test_installed_runner_profile_paths_mean_the_working_directory(installed, tmp_path):
    probe = ("from moebench.runners import load_runner_profile\nfrom moebench.config import resolve_profile_path\n"
             "p = load_runner_profile(resolve_profile_path('engine-bf16', 'runners'))\nprint(p.settings.model)")
    bare = tmp_path / "bare"
    bare.mkdir()
    proc = _run(["-c", probe], bare, installed)
    assert proc.returncode != 0
    assert "key 'model' must name an existing" in proc.stderr and str(bare / "models/zoo/tiny-moe") in proc.stderr
    assert "ships inside the installed moebench package, so its relative paths mean the working directory" \
        in proc.stderr
    assert str(installed / "moebench" / "models") not in proc.stderr     # no checkout above an installed profile
    with_zoo = tmp_path / "with_zoo"
    (with_zoo / "models" / "zoo").mkdir(parents=True)
    (with_zoo / "models" / "zoo" / "tiny-moe").symlink_to(REPO / "models" / "zoo" / "tiny-moe")
    proc = _run(["-c", probe], with_zoo, installed)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "models/zoo/tiny-moe"       # right from the working directory: kept as written


def test_a_checkout_reads_its_own_top_level_folders(tmp_path, monkeypatch):
    """From a checkout the shipped folders are its top-level ones, from any working directory; a shipped
    runner profile there keeps the checkout above it as a base for its relative paths."""
    from moebench.config import path_bases, resolve_profile_path
    from moebench.shipped import is_checkout, is_installed_profile, shipped_dir
    monkeypatch.chdir(tmp_path)
    assert is_checkout() and [shipped_dir(f) for f in ("suites", "runners", "gates")] == \
        [REPO / "suites", REPO / "runners", REPO / "gates"]
    assert resolve_profile_path("llama-bf16", "runners") == REPO / "runners" / "llama-bf16.toml"
    assert not is_installed_profile(REPO / "runners" / "llama-bf16.toml")
    assert path_bases(REPO / "runners" / "llama-bf16.toml") == [REPO / "runners", REPO, tmp_path]
    with pytest.raises(ValueError, match="'templates' is not a shipped folder"):
        shipped_dir("templates")
