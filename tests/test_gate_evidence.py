"""A gate never passes on what it did not see: real runs through the CLI against the planted server
(tests/openai_fake.py), compared and gated as a user would."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import moebench_cli
from openai_fake import serve

RULES = "[gsm8k]\nmax_losses = 0\nfail_on_significant_loss = true\n"


def _suite(tmp: Path, name: str, shots: int, n: int = 4) -> Path:
    p = tmp / f"{name}.toml"
    p.write_text(f'name = "{name}"\n[[tasks]]\ntask = "gsm8k"\nlimit = {n}\nshots = {shots}\n'
                 '[probes]\nnvml = false\n')
    return p


def _runner(tmp: Path, port: int, label: str) -> Path:
    p = tmp / f"{label}.toml"
    p.write_text(f'kind = "http"\nbase_url = "http://127.0.0.1:{port}/v1"\nmodel = "m"\nconcurrency = 1\n'
                 'retries = 0\n')
    return p


def _run(suite: Path, runner: Path, out: Path, *extra: str, env: dict | None = None) -> Path:
    moebench_cli("run", str(suite), "--runner", str(runner), "--out", str(out), *extra, check=True, env=env)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_dir):
    """Three GSM8K runs of 4 items: base (0 shots), same (0 shots), shots2 (2 shots: other prompts)."""
    tmp = tmp_path_factory.mktemp("evidence")
    srv = serve({"default": "#### 18"})       # right on item 0 (18 dollars), wrong elsewhere
    try:
        runner = _runner(tmp, srv.server_address[1], "fake")
        out = {"tmp": tmp, "runner": runner}
        out["base"] = _run(_suite(tmp, "g", 0), runner, tmp / "base")
        out["same"] = _run(_suite(tmp, "g", 0), runner, tmp / "same")
        out["shots2"] = _run(_suite(tmp, "g", 2), runner, tmp / "shots2")
        yield out
    finally:
        srv.shutdown()


def _rules(tmp: Path, text: str = RULES) -> Path:
    p = tmp / "rules.toml"
    p.write_text(text)
    return p


def test_gate_on_a_task_with_zero_paired_items_is_inconclusive_not_pass(runs, tmp_path):
    cmp = tmp_path / "cmp"
    r = moebench_cli("compare", str(runs["base"]), str(runs["shots2"]), "--out", str(cmp))
    assert r.returncode == 0, r.stderr
    assert json.loads((cmp / "compare.json").read_text())["tasks"]["gsm8k"]["n_paired"] == 0
    g = moebench_cli("gate", str(cmp), "--rules", str(_rules(tmp_path)))
    assert g.returncode == 3, g.stdout + g.stderr
    assert g.stdout.startswith("## moebench gate: INCONCLUSIVE (0/2 rules hold, 2 inconclusive)"), g.stdout
    assert "| gsm8k.max_losses | n_paired=0 | <= 0 | *INCONCLUSIVE* |" in g.stdout
    # one line for the task's cause, naming compare's reason and both rules
    why = [x for x in g.stdout.splitlines() if x.startswith("- gsm8k: 0 paired items")]
    assert len(why) == 1 and "prompt hash differs" in why[0] and \
        why[0].endswith("(rules max_losses, fail_on_significant_loss)"), g.stdout
    verdicts = json.loads((cmp / "gate.json").read_text())
    assert verdicts["verdict"] == "inconclusive" and {c["verdict"] for c in verdicts["checks"]} == {"inconclusive"}
    # on_inconclusive applies
    g = moebench_cli("gate", str(cmp), "--rules", str(_rules(tmp_path, RULES + '[gate]\non_inconclusive = "fail"\n')))
    assert g.returncode == 1, g.stdout


def test_gate_below_min_paired_floor_is_inconclusive_and_min_paired_fails(runs, tmp_path):
    cmp = tmp_path / "cmp"
    moebench_cli("compare", str(runs["base"]), str(runs["same"]), "--out", str(cmp), check=True)
    assert json.loads((cmp / "compare.json").read_text())["tasks"]["gsm8k"]["n_paired"] == 4
    g = moebench_cli("gate", str(cmp), "--rules", str(_rules(tmp_path)))
    assert g.returncode == 0, g.stdout            # 4 paired items, over the default floor of 1
    g = moebench_cli("gate", str(cmp), "--rules", str(_rules(tmp_path, RULES + "min_paired = 5\n")))
    assert g.returncode == 1, g.stdout
    checks = {c["rule"]: c for c in json.loads((cmp / "gate.json").read_text())["checks"]}
    assert checks["min_paired"]["verdict"] == "fail"
    assert checks["max_losses"]["verdict"] == "inconclusive"
    assert checks["max_losses"]["message"].startswith("gsm8k: 4 paired items, fewer than the floor of 5 (min_paired)")


def _matrix(runs, cmp: Path) -> None:
    moebench_cli("compare", str(runs["base"]), str(runs["same"]), str(runs["shots2"]), "--out", str(cmp),
                 check=True)


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_gate_refuses_matrix_compare_dir_outside_the_compare_folder(runs, tmp_path, how):
    cmp = tmp_path / "cmp"
    _matrix(runs, cmp)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # a gate-able folder outside: the old gate wrote summary.md, junit.xml, gate.json and report.html here
    first = json.loads((cmp / "matrix.json").read_text())["candidates"][0]["compare_dir"]
    (elsewhere / "compare.json").write_text((cmp / first / "compare.json").read_text())
    (elsewhere / "report.html").write_text("precious")
    m = json.loads((cmp / "matrix.json").read_text())
    if how == "dotdot":
        m["candidates"][1]["compare_dir"] = "../elsewhere"
    elif how == "absolute":
        m["candidates"][1]["compare_dir"] = str(elsewhere)
    else:
        os.symlink(elsewhere, cmp / "link")
        m["candidates"][1]["compare_dir"] = "link"
    (cmp / "matrix.json").write_text(json.dumps(m))
    g = moebench_cli("gate", str(cmp), "--rules", str(_rules(tmp_path)))
    assert g.returncode == 2, g.stdout + g.stderr
    assert "Traceback" not in g.stderr
    assert f"{cmp / 'matrix.json'}: key 'candidates[1].compare_dir'" in g.stderr, g.stderr
    assert "outside the compare directory" in g.stderr
    assert sorted(p.name for p in elsewhere.iterdir()) == ["compare.json", "report.html"]
    assert (elsewhere / "report.html").read_text() == "precious"
    assert not (cmp / first / "gate.json").exists(), "refused before gating anything"


def test_gate_on_matrix_inside_the_folder_still_gates_every_candidate(runs, tmp_path):
    cmp = tmp_path / "cmp"
    _matrix(runs, cmp)
    g = moebench_cli("gate", str(cmp), "--rules", str(_rules(tmp_path)))
    assert g.returncode == 3, g.stdout + g.stderr      # the shots2 candidate paired nothing
    dirs = [c["compare_dir"] for c in json.loads((cmp / "matrix.json").read_text())["candidates"]]
    verdicts = [json.loads((cmp / d / "gate.json").read_text())["verdict"] for d in dirs]
    assert verdicts == ["pass", "inconclusive"]


def _kld_compare(d: Path, **kld) -> Path:
    """A compare.json whose kld section is as moebench.kld.compare writes it (KLD needs model runs:
    tests/test_kld.py makes real ones; the gate reads only these keys)."""
    d.mkdir()
    doc = {"schema_version": 2, "baseline": {"run": "/r/base", "label": "base"},
           "candidate": {"run": "/r/cand", "label": "cand"}, "tasks": {},
           "kld": {"n_tokens": 1020, "mean": 0.01, "p99": 0.1, "same_top_p": 0.97, **kld}}
    (d / "compare.json").write_text(json.dumps(doc))
    return d


def test_gate_on_kld_measured_against_another_baseline_is_inconclusive(tmp_path):
    rules = _rules(tmp_path, "[kld]\nmax_mean = 0.05\nmax_p99 = 1.0\n")
    ok = _kld_compare(tmp_path / "ok", measured_against="/r/base")
    g = moebench_cli("gate", str(ok), "--rules", str(rules))
    assert g.returncode == 0, g.stdout
    other = _kld_compare(tmp_path / "other", measured_against="/r/older-base", baseline_mismatch=True,
                         warning="the candidate was measured against /r/older-base, not /r/base; its KLD "
                                 "figures refer to that run")
    g = moebench_cli("gate", str(other), "--rules", str(rules))
    assert g.returncode == 3, g.stdout
    why = [x for x in g.stdout.splitlines() if x.startswith("- kld:")]
    assert why == ["- kld: the candidate's KLD was measured against /r/older-base, not this compare's baseline "
                   "(rules max_mean, max_p99)"], g.stdout
