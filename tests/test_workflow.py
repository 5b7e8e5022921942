"""The example workflow: the dataset mirror is fetched and cached, and the baseline run's cache key
changes with the data files, moebench's version and the scoring code."""
from __future__ import annotations

import os
import shutil
import subprocess

import yaml

from conftest import REPO


def _steps():
    wf = yaml.safe_load((REPO / ".github" / "workflows" / "moebench.yml").read_text())
    return wf, {s.get("name"): s for s in wf["jobs"]["gate"]["steps"]}


def test_mirror_is_fetched_and_cached():
    wf, steps = _steps()
    assert wf["env"]["MOEBENCH_DATA_DIR"].endswith("/data")
    cache = steps["Restore the dataset mirror"]
    assert cache["with"]["path"] == "data" and "moebench/mirror/SHA256SUMS" in cache["with"]["key"]
    fetch = steps["Fetch the dataset mirror (cache miss only)"]
    assert fetch["run"].strip() == "moebench data fetch --to data" and "cache-hit != 'true'" in fetch["if"]
    names = list(steps)
    assert names.index("Fetch the dataset mirror (cache miss only)") < names.index("Run the baseline (cache miss only)")


def test_baseline_key_covers_data_version_and_scoring_code(tmp_path):
    _, steps = _steps()
    key = steps["Restore the baseline run"]["with"]["key"]
    for part in ("steps.baseline-key.outputs.version", "steps.baseline-key.outputs.data", "moebench/tasks/**",
                 "moebench/scoring/**", "env.SUITE", "env.BASELINE"):
        assert part in key, part
    # The digest step, run for real: it changes when one data file changes.
    script = steps["Baseline cache key (data file hashes, moebench version, scoring code)"]["run"]
    from moebench.datasets import data_dir

    def digest(mirror):
        out = tmp_path / f"out-{mirror.name}"
        env = {**os.environ, "MOEBENCH_DATA_DIR": str(mirror), "GITHUB_OUTPUT": str(out)}
        subprocess.run(["bash", "-euo", "pipefail", "-c", script], env=env, check=True, cwd=REPO)
        return dict(line.split("=", 1) for line in out.read_text().split())

    base = digest(data_dir())
    import moebench
    assert base["version"] == moebench.__version__ and len(base["data"]) == 16
    copy = tmp_path / "mirror"
    shutil.copytree(data_dir(), copy)
    assert digest(copy)["data"] == base["data"]               # same bytes, another folder: same key
    (copy / "gsm8k" / "test.jsonl").chmod(0o644)
    with (copy / "gsm8k" / "test.jsonl").open("a") as f:
        f.write("\n")
    assert digest(copy)["data"] != base["data"]
