"""The CLI's surface: help on every argument (with its default), an example per command, short
profile names for every command that takes a runner, `lm-eval` without `--out`, `--json` on run/gate."""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, moebench_cli


def _commands(parser: argparse.ArgumentParser, path=()):
    """(command path, parser) for every leaf command."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
        return
    for name, p in subs[0].choices.items():
        yield from _commands(p, path + (name,))


def test_every_argument_has_help_with_its_default_and_every_command_an_example():
    from moebench.cli import _parser

    leaves = list(_commands(_parser()))
    assert len(leaves) >= 15
    for path, p in leaves:
        text = p.format_help()
        assert "examples:" in text and "moebench " + path[0] in text.split("examples:")[1], path
        for a in p._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            assert a.help and len(a.help) > 8, (path, a.dest)
            if a.default not in (None, False, argparse.SUPPRESS):
                assert "default" in p._get_formatter()._get_help_string(a), (path, a.dest)
    help_text = moebench_cli("serve", "--help", check=True).stdout
    assert re.search(r"--port PORT\s+TCP port .*\(default: 8000\)", help_text.replace("\n", " ").replace("  ", " "))


@pytest.fixture
def markov_server():
    from moebench.serve import BackgroundServer
    from test_serve import MarkovRunner
    with BackgroundServer(MarkovRunner()) as s:
        yield s


def _short_profile(tmp_path: Path, url: str) -> Path:
    (tmp_path / "runners").mkdir()
    (tmp_path / "runners" / "markov-http.toml").write_text(
        f'kind = "http"\nbase_url = "{url}"\nmodel = "markov"\nconcurrency = 1\n', encoding="utf-8")
    return tmp_path


def test_lm_eval_without_out_and_with_a_short_profile_name(markov_server, tmp_path, data_dir):
    cwd = _short_profile(tmp_path, markov_server.url)
    proc = moebench_cli("lm-eval", "--runner", "markov-http", "--tasks", "gsm8k", "--limit", "2", cwd=cwd,
                        env={"PYTHONPATH": str(REPO)}, check=True, timeout=600)
    run_dir = Path(proc.stdout.strip().splitlines()[-1])
    assert not run_dir.is_absolute() and run_dir.parent == Path("results") and run_dir.name.endswith("_lm-eval_markov-http")
    m = json.loads((cwd / run_dir / "manifest.json").read_text())
    assert m["status"] == "complete"
    recs = [json.loads(x) for x in (cwd / run_dir / "items.jsonl").read_text().splitlines() if x.strip()]
    assert {r["item_id"] for r in recs} == {"gsm8k/test/0", "gsm8k/test/1"}         # one record per filter and document


def test_serve_takes_a_short_profile_name(markov_server, tmp_path):
    import httpx

    cwd = _short_profile(tmp_path, markov_server.url)
    proc = subprocess.Popen([sys.executable, "-m", "moebench.cli", "serve", "--runner", "markov-http", "--port", "0"],
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    try:
        deadline, line = time.monotonic() + 120, ""
        while time.monotonic() < deadline and "serving" not in line:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
        m = re.search(r"serving markov-http \(http\) on (\S+)", line)
        assert m, line
        models = httpx.get(m.group(1).rstrip("/") + "/models", timeout=30).json()
        assert [d["id"] for d in models["data"]] == ["markov-http"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_unknown_short_name_is_a_usage_error(tmp_path):
    proc = moebench_cli("lm-eval", "--runner", "no-such-profile", "--tasks", "gsm8k", cwd=tmp_path,
                        env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and "no-such-profile" in proc.stderr and "Traceback" not in proc.stderr


def test_run_and_gate_json(markov_server, tmp_path, data_dir):
    cwd = _short_profile(tmp_path, markov_server.url)
    suite = tmp_path / "suite.toml"
    suite.write_text('name = "tiny"\n[[tasks]]\ntask = "gsm8k"\nlimit = 3\nshots = 0\nmax_tokens = 8\n'
                     '[probes]\nnvml = false\n', encoding="utf-8")
    runs = []
    for label in ("base", "cand"):
        proc = moebench_cli("run", str(suite), "--runner", "markov-http", "--out", str(tmp_path / label),
                            "--json", cwd=cwd, env={"PYTHONPATH": str(REPO)}, check=True)
        out = json.loads(proc.stdout)          # the whole output is one JSON object
        assert out["status"] == "complete" and out["exit_code"] == 0 and out["run_dir"] == str(tmp_path / label)
        assert out["summary"]["gsm8k"]["n"] == 3
        runs.append(out["run_dir"])
    moebench_cli("compare", *runs, "--out", str(tmp_path / "cmp"), cwd=cwd, env={"PYTHONPATH": str(REPO)}, check=True)
    rules = tmp_path / "rules.toml"
    rules.write_text("[gsm8k]\nmax_losses = 0\n", encoding="utf-8")
    proc = moebench_cli("gate", str(tmp_path / "cmp"), "--rules", str(rules), "--json", cwd=cwd,
                        env={"PYTHONPATH": str(REPO)})
    out = json.loads(proc.stdout)
    assert proc.returncode == 0 and out["verdict"] == "pass" and out["exit_code"] == 0
    assert [(c["section"], c["rule"], c["verdict"]) for c in out["checks"]] == [("gsm8k", "max_losses", "pass")]
    assert json.loads((tmp_path / "cmp" / "gate.json").read_text()) == out      # what gate.json holds
    assert (tmp_path / "cmp" / "summary.md").is_file()
    rules.write_text("[gsm8k]\nmax_lossez = 0\n", encoding="utf-8")
    proc = moebench_cli("gate", str(tmp_path / "cmp"), "--rules", str(rules), "--json", cwd=cwd,
                        env={"PYTHONPATH": str(REPO)})
    out = json.loads(proc.stdout)
    assert proc.returncode == 2 and out["exit_code"] == 2 and "max_lossez" in out["error"]
