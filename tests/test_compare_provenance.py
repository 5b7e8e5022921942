"""compare reads the runs' manifests before pairing: different data is not paired, different suites or
sampling are said first, and runs given the wrong way round are refused. Real runs through the CLI
against the planted server (tests/openai_fake.py)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from conftest import moebench_cli
from openai_fake import serve


def _suite(tmp: Path, name: str, shots: int = 0, n: int = 4, extra: str = "") -> Path:
    p = tmp / f"{name}-{shots}.toml"
    p.write_text(f'name = "{name}"\n[[tasks]]\ntask = "gsm8k"\nlimit = {n}\nshots = {shots}\n{extra}'
                 '[probes]\nnvml = false\n')
    return p


def _runner(tmp: Path, port: int, name: str, extra: str = "") -> Path:
    p = tmp / f"{name}.toml"
    p.write_text(f'kind = "http"\nbase_url = "http://127.0.0.1:{port}/v1"\nmodel = "m"\nconcurrency = 1\n'
                 f'retries = 0\n{extra}')
    return p


def _run(suite: Path, runner: Path, out: Path, *extra: str, env: dict | None = None) -> Path:
    moebench_cli("run", str(suite), "--runner", str(runner), "--out", str(out), *extra, check=True, env=env)
    return out


def _changed_mirror(src: Path, dst: Path) -> Path:
    """A copy of the mirror whose GSM8K test item 0 has another answer (19 instead of 18), with its
    SHA256SUMS made to match: a mirror that is consistent, just not the same data."""
    (dst / "gsm8k").mkdir(parents=True)
    for d in src.iterdir():
        if d.name not in ("gsm8k", "SHA256SUMS"):
            (dst / d.name).symlink_to(d)
    (dst / "gsm8k" / "train.jsonl").symlink_to(src / "gsm8k" / "train.jsonl")
    lines = (src / "gsm8k" / "test.jsonl").read_text(encoding="utf-8").splitlines()
    first = json.loads(lines[0])
    assert first["answer"].endswith("#### 18")
    first["answer"] = first["answer"][:-2] + "19"
    lines[0] = json.dumps(first)
    (dst / "gsm8k" / "test.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    new = hashlib.sha256((dst / "gsm8k" / "test.jsonl").read_bytes()).hexdigest()
    sums = [f"{new}  gsm8k/test.jsonl" if ln.endswith("  gsm8k/test.jsonl") else ln
            for ln in (src / "SHA256SUMS").read_text().splitlines()]
    (dst / "SHA256SUMS").write_text("\n".join(sums) + "\n")
    return dst


@pytest.fixture(scope="module")
def server():
    srv = serve({"default": "#### 18"})        # right on GSM8K test item 0 of the real data
    yield srv.server_address[1]
    srv.shutdown()


def test_compare_refuses_to_pair_a_task_whose_data_differs(server, tmp_path, data_dir):
    runner = _runner(tmp_path, server, "fake")
    suite = _suite(tmp_path, "g")
    base = _run(suite, runner, tmp_path / "base")
    mirror = _changed_mirror(data_dir, tmp_path / "mirror")
    # The run itself refuses data its SHA256SUMS does not vouch for; the user overrides that on purpose.
    cand = _run(suite, runner, tmp_path / "cand", "--allow-modified-data", env={"MOEBENCH_DATA_DIR": str(mirror)})
    cmp = tmp_path / "cmp"
    r = moebench_cli("compare", str(base), str(cand), "--out", str(cmp))
    assert r.returncode == 0, r.stderr
    doc = json.loads((cmp / "compare.json").read_text())
    t = doc["tasks"]["gsm8k"]
    # the same ids and prompts: without the data check item 0 is a "loss" (18 right, then "wrong")
    assert t["n_paired"] == 0 and t["losses"] == [] and len(t["excluded"]) == 4
    assert t["unpaired_reason"].startswith("the runs read different data (gsm8k/test.jsonl: sha256 3730d312f6e3 "
                                           "in the baseline, ")
    assert set(t["data_mismatch"]) == {"gsm8k/test.jsonl"}
    assert doc["overall"]["n_paired"] == 0
    said = "gsm8k: nothing paired: the runs read different data"
    assert any(line.startswith(f"warning: {said}") for line in r.stdout.splitlines()), r.stdout
    assert f"- warning: {said}" in (cmp / "summary.md").read_text()
    assert said in (cmp / "report.html").read_text()
    rules = tmp_path / "rules.toml"
    rules.write_text("[gsm8k]\nmax_losses = 0\n")
    g = moebench_cli("gate", str(cmp), "--rules", str(rules))
    assert g.returncode == 3, g.stdout                 # no evidence either way: INCONCLUSIVE
    assert "the runs read different data" in g.stdout


def test_gate_on_data_no_sha256sums_vouched_for_is_inconclusive(server, tmp_path, data_dir):
    """Both runs read the same modified data (--allow-modified-data): the items pair, and the candidate
    loses nothing, but a verdict on data nobody vouched for is no evidence: INCONCLUSIVE, said why."""
    runner = _runner(tmp_path, server, "fake")
    suite = _suite(tmp_path, "g")
    mirror = _changed_mirror(data_dir, tmp_path / "mirror")
    env = {"MOEBENCH_DATA_DIR": str(mirror)}
    base = _run(suite, runner, tmp_path / "base", "--allow-modified-data", env=env)
    cand = _run(suite, runner, tmp_path / "cand", "--allow-modified-data", env=env)
    cmp = tmp_path / "cmp"
    r = moebench_cli("compare", str(base), str(cand), "--out", str(cmp))
    assert r.returncode == 0, r.stderr
    doc = json.loads((cmp / "compare.json").read_text())
    assert doc["tasks"]["gsm8k"]["n_paired"] == 4 and doc["tasks"]["gsm8k"]["losses"] == []
    assert doc["data_unverified"] == {"gsm8k": {"baseline": {"gsm8k/test.jsonl": "modified"},
                                                "candidate": {"gsm8k/test.jsonl": "modified"}}}
    said = "gsm8k: the baseline read gsm8k/test.jsonl (modified); the candidate read gsm8k/test.jsonl (modified)"
    assert f"warning: {said}" in r.stdout, r.stdout
    assert said in (cmp / "summary.md").read_text()
    rules = tmp_path / "rules.toml"
    rules.write_text("[gsm8k]\nmax_losses = 0\nmin_paired = 4\n")
    g = moebench_cli("gate", str(cmp), "--rules", str(rules))
    assert g.returncode == 3, g.stdout
    assert "gsm8k: unverified data (the baseline read gsm8k/test.jsonl (modified)" in g.stdout, g.stdout
    gate = json.loads((cmp / "gate.json").read_text())
    verdicts = {c["rule"]: c["verdict"] for c in gate["checks"]}
    assert verdicts == {"min_paired": "pass", "max_losses": "inconclusive"}, gate


def test_compare_says_first_when_suites_or_sampling_differ(server, tmp_path, data_dir):
    base = _run(_suite(tmp_path, "g"), _runner(tmp_path, server, "a"), tmp_path / "base")
    cand = _run(_suite(tmp_path, "g2", extra="max_tokens = 64\n"),
                _runner(tmp_path, server, "b", 'extra_body = {temperature = 0.7, seed = 3}\n'), tmp_path / "cand")
    cmp = tmp_path / "cmp"
    r = moebench_cli("compare", str(base), str(cand), "--out", str(cmp))
    assert r.returncode == 0, r.stderr
    expected = ["different suites: the baseline ran 'g', the candidate 'g2'",
                "gsm8k: suite settings differ: max_tokens 256 (baseline) vs 64 (candidate)",
                "runner sampling settings differ: extra_body.seed None (baseline) vs 3 (candidate), "
                "extra_body.temperature None (baseline) vs 0.7 (candidate)"]
    assert json.loads((cmp / "compare.json").read_text())["setup_differences"] == expected
    assert r.stdout.splitlines()[:3] == [f"NOT LIKE FOR LIKE: {d}" for d in expected], r.stdout
    summary = (cmp / "summary.md").read_text().splitlines()
    assert summary[2:5] == [f"> **Not like for like:** {d}" for d in expected], summary
    html = (cmp / "report.html").read_text()
    assert html.index("Not like for like: different suites") < html.index('id="verdict"')


def test_compare_of_the_same_setup_says_nothing_about_differences(server, tmp_path, data_dir):
    runner = _runner(tmp_path, server, "a")
    base = _run(_suite(tmp_path, "g"), runner, tmp_path / "base")
    cand = _run(_suite(tmp_path, "g"), runner, tmp_path / "cand")
    r = moebench_cli("compare", str(base), str(cand), "--out", str(tmp_path / "cmp"))
    assert r.returncode == 0 and "NOT LIKE FOR LIKE" not in r.stdout, r.stdout
    doc = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert "setup_differences" not in doc and doc["tasks"]["gsm8k"]["n_paired"] == 4


def test_compare_refuses_runs_given_the_wrong_way_round(server, tmp_path, data_dir):
    runner = _runner(tmp_path, server, "a")
    suite = _suite(tmp_path, "g")
    base = _run(suite, runner, tmp_path / "base")
    cand = _run(suite, runner, tmp_path / "cand", "--baseline", str(tmp_path / "base"))
    cmp = tmp_path / "cmp"
    r = moebench_cli("compare", str(cand), str(base), "--out", str(cmp))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert f"the runs look swapped: {cand}, given as the baseline, was run with --baseline {base}" in r.stderr
    assert f"`moebench compare {base} {cand}`" in r.stderr and "--allow-reversed" in r.stderr
    assert not cmp.exists(), "refused before anything is written"
    r = moebench_cli("compare", str(cand), str(base), "--out", str(cmp), "--allow-reversed")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("NOT LIKE FOR LIKE: the runs look swapped"), r.stdout
    ok = moebench_cli("compare", str(base), str(cand), "--out", str(tmp_path / "right"))
    assert ok.returncode == 0 and "swapped" not in ok.stdout


def test_several_candidates_say_which_one_differs_first(server, tmp_path, data_dir):
    runner = _runner(tmp_path, server, "a")
    base = _run(_suite(tmp_path, "g"), runner, tmp_path / "base")
    same = _run(_suite(tmp_path, "g"), runner, tmp_path / "same", "--label", "same")
    other = _run(_suite(tmp_path, "g", shots=2), runner, tmp_path / "other", "--label", "other")
    cmp = tmp_path / "cmp"
    r = moebench_cli("compare", str(base), str(same), str(other), "--out", str(cmp))
    assert r.returncode == 0, r.stderr
    said = "other: gsm8k: suite settings differ: shots 0 (baseline) vs 2 (candidate)"
    assert r.stdout.splitlines()[0] == f"NOT LIKE FOR LIKE: {said}", r.stdout
    assert (cmp / "summary.md").read_text().splitlines()[2] == f"> **Not like for like:** {said}"
    html = (cmp / "report.html").read_text()
    assert html.index(f"Not like for like: {said}") < html.index('id="verdict"')
    assert "same: " not in html.split('id="verdict"')[0]
