"""`moebench tier calibrate | plan | pack`: the three tiering steps with files in between, via the CLI."""
from __future__ import annotations

import json

from conftest import moebench_cli


def test_tier_steps_through_the_cli(zoo, tmp_path):
    ckpt = str(zoo / "tiny-moe")
    stats, plan, art = tmp_path / "stats.safetensors", tmp_path / "plan.json", tmp_path / "art"
    moebench_cli("tier", "calibrate", ckpt, "--out", str(stats), "--tokens", "1024", check=True)
    budget = 200_000
    moebench_cli("tier", "plan", ckpt, str(stats), "--gpu-bytes", str(budget), "--host-bytes", str(budget),
                 "--out", str(plan), check=True)
    p = json.loads(plan.read_text())
    assert p["info"]["budgets"]["gpu_bytes"] == budget
    assert p["info"]["bytes"]["gpu"] <= budget and p["info"]["bytes"]["host"] <= budget
    proc = moebench_cli("tier", "pack", ckpt, str(plan), "--out", str(art), check=True)
    assert proc.stdout.strip().splitlines()[-1] == str(art)
    assert (art / "plan.json").is_file() and (art / "experts.safetensors").is_file()
    # The usage error path: a plan needs a budget or a hot fraction.
    assert moebench_cli("tier", "plan", ckpt, str(stats), "--out", str(tmp_path / "x.json")).returncode == 2
