"""The CLI says what it is doing (issue 44): help that lists every exit code, errors that list what
exists and suggest the nearest name, profile paths that resolve from any folder, capability errors
that name the profile keys adding the capability, checks before any work, start-up lines."""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import REPO, moebench_cli
from moebench.config import ProfileError, load_runner, load_suite
from moebench.runners import runner_schemas
from moebench.tasks import task_schemas


def test_gate_help_lists_every_exit_code():
    text = " ".join(moebench_cli("gate", "--help", check=True).stdout.split())
    for code, words in (("0", "pass"), ("1", "a rule failed"), ("2", "bad input"), ("3", "inconclusive")):
        assert f"{code} {words}" in text, (code, text[:400])
    top = " ".join(moebench_cli("--help", check=True).stdout.split())
    assert "3 inconclusive" in text and "moebench" in top


def test_profile_not_found_lists_the_available_ones_and_the_nearest(tmp_path):
    proc = moebench_cli("run", "smoke", "--runner", "engine-bf61", cwd=tmp_path, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    err = proc.stderr
    assert "profile 'engine-bf61' not found (did you mean 'engine-bf16'?)" in err, err
    shipped = sorted(p.stem for p in (REPO / "runners").glob("*.toml"))
    assert f"available runners: {', '.join(shipped)}" in err, err
    proc = moebench_cli("run", "smok", "--runner", "http", cwd=tmp_path, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and "did you mean 'smoke'?" in proc.stderr and "available suites:" in proc.stderr


def test_unknown_keys_and_values_suggest_the_nearest_known_one(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text('name = "x"\n[[tasks]]\ntask = "gsm8k"\nshotz = 3\n')
    with pytest.raises(ProfileError, match=r"unknown key 'shotz' \(did you mean 'shots'\?\)"):
        load_suite(p, task_schemas())
    p.write_text('name = "x"\n[[tasks]]\ntask = "humaneva"\n')
    with pytest.raises(ProfileError, match=r"got 'humaneva' \(did you mean 'humaneval'\?\)"):
        load_suite(p, task_schemas())
    r = tmp_path / "r.toml"
    r.write_text('kind = "http"\nbase_url = "http://127.0.0.1:1/v1"\nprompt_logprob = "vllm"\n')
    with pytest.raises(ProfileError, match=r"unknown key 'prompt_logprob' \(did you mean 'prompt_logprobs'\?\)"):
        load_runner(r, runner_schemas())
    r.write_text('kind = "enigne"\n')
    with pytest.raises(ProfileError, match=r"got 'enigne' \(did you mean 'engine'\?\)"):
        load_runner(r, runner_schemas())
    r.write_text('kind = "http"\nbase_url = "http://127.0.0.1:1/v1"\napi = "chatt"\n')
    with pytest.raises(ProfileError, match=r"got 'chatt' \(did you mean 'chat'\?\)"):
        load_runner(r, runner_schemas())
    # nothing close: no suggestion, the allowed keys as before
    p.write_text('name = "x"\n[[tasks]]\ntask = "gsm8k"\nzzzzzz = 3\n')
    with pytest.raises(ProfileError) as e:
        load_suite(p, task_schemas())
    assert "did you mean" not in str(e.value) and "allowed keys:" in str(e.value)


def test_gate_rule_typo_suggests_the_rule(tmp_path):
    from moebench.gate import load_rules
    g = tmp_path / "g.toml"
    g.write_text("[gsm8k]\nmax_loses = 2\n")
    with pytest.raises(ProfileError, match=r"unknown key 'max_loses' \(did you mean 'max_losses'\?\)"):
        load_rules(g)
