"""KLD never goes missing quietly: a run says when it measures no KLD, its summary prints the KLD
figures, compare carries its KLD caveats to every output, and the gate says once why a section is
missing. Real runs of the engine on the zoo's tiny MoE (CPU, float32), through the CLI."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import hf_zoo_dir, moebench_cli

KLD_SUITE = 'name = "kld-tiny"\n[[tasks]]\ntask = "kld"\ncontext = 64\nchunks = 2\ntop_k = 16\nfull_chunks = 2\n' \
            '[probes]\nnvml = false\n'
RULES = "[kld]\nmax_mean = 0.05\nmax_p99 = 1.0\nmin_same_top_p = 0.9\n"


def _run(tmp: Path, out: str, *extra: str) -> tuple[Path, object]:
    r = moebench_cli("run", str(tmp / "kld.toml"), "--runner", str(tmp / "engine.toml"), "--out", str(tmp / out),
                     *extra)
    return tmp / out, r


@pytest.fixture(scope="module")
def kld_runs(tmp_path_factory):
    """base and base2: two recorded baselines (--as-baseline); cand: measured against base."""
    tmp = tmp_path_factory.mktemp("kldev")
    hf = hf_zoo_dir(tmp_path_factory)
    (tmp / "kld.toml").write_text(KLD_SUITE)
    (tmp / "engine.toml").write_text(f'kind = "engine"\nmodel = "{hf}"\ndtype = "float32"\ndevice = "cpu"\n')
    out = {"tmp": tmp, "hf": hf}
    for name, extra in (("base", ("--as-baseline",)), ("base2", ("--as-baseline",)),
                        ("cand", ("--baseline", str(tmp / "base")))):
        out[name], out[f"{name}_proc"] = _run(tmp, name, *extra)
        assert out[f"{name}_proc"].returncode == 0, out[f"{name}_proc"].stderr
    return out


def test_kld_only_run_without_baseline_exits_2_before_any_work(kld_runs):
    run_dir, r = _run(kld_runs["tmp"], "forgot")
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == ("error: suite 'kld-tiny' measures only KLD (kld), which needs a baseline run: give "
                                "--baseline RUN to measure this runner against it, or --as-baseline to record this "
                                "run as the baseline candidates measure against"), r.stderr
    assert not run_dir.exists(), "refused before anything was written"
    both = _run(kld_runs["tmp"], "both", "--as-baseline", "--baseline", str(kld_runs["base"]))[1]
    assert both.returncode == 2 and "exclude each other" in both.stderr


def test_mixed_suite_without_baseline_warns_that_it_measures_no_kld(kld_runs, tmp_path, data_dir):
    suite = tmp_path / "mixed.toml"
    suite.write_text('name = "mixed"\n[[tasks]]\ntask = "gsm8k"\nlimit = 1\nshots = 0\nmax_tokens = 4\n'
                     + KLD_SUITE.split("\n", 1)[1])
    r = moebench_cli("run", str(suite), "--runner", str(kld_runs["tmp"] / "engine.toml"), "--out", str(tmp_path / "r"))
    assert r.returncode == 0, r.stderr
    warned = [x for x in r.stderr.splitlines() if x.startswith("warning: kld: no --baseline")]
    assert len(warned) == 1 and "measures no KLD" in warned[0], r.stderr
    r = moebench_cli("run", str(suite), "--runner", str(kld_runs["tmp"] / "engine.toml"), "--out",
                     str(tmp_path / "r2"), "--as-baseline")
    assert r.returncode == 0 and "warning: kld" not in r.stderr, r.stderr


def test_run_summary_prints_the_kld_figures(kld_runs):
    base_line = [x for x in kld_runs["base_proc"].stdout.splitlines() if x.startswith("kld: ")]
    assert len(base_line) == 1 and "role=baseline" in base_line[0] and "no KLD measured" in base_line[0]
    m = json.loads((kld_runs["cand"] / "manifest.json").read_text())
    k = m["summary"]["kld"]["kld"]
    line = [x for x in kld_runs["cand_proc"].stdout.splitlines() if x.startswith("kld: ")]
    assert len(line) == 1, kld_runs["cand_proc"].stdout
    assert f"role=candidate against {kld_runs['base']}: tokens={k['n_tokens']} kld_mean={k['mean']:.6g} " \
           f"p99={k['p99']:.6g}" in line[0], line
    assert "scored=0" not in line[0]


def test_compare_and_gate_say_once_why_kld_is_missing(kld_runs, tmp_path):
    cmp = tmp_path / "cmp"
    r = moebench_cli("compare", str(kld_runs["base"]), str(kld_runs["base2"]), "--out", str(cmp))
    assert r.returncode == 0, r.stderr
    doc = json.loads((cmp / "compare.json").read_text())
    assert "kld" not in doc
    assert doc["missing_sections"]["kld"].startswith("the candidate ran KLD without --baseline")
    assert "warning: kld: no KLD figures: the candidate ran KLD without --baseline" in r.stdout
    rules = tmp_path / "rules.toml"
    rules.write_text(RULES)
    g = moebench_cli("gate", str(cmp), "--rules", str(rules))
    assert g.returncode == 1, g.stdout
    lines = [x for x in g.stdout.splitlines() if "not in compare.json" in x]
    assert lines == ["- section 'kld' is not in compare.json: the candidate ran KLD without --baseline: it recorded "
                     "a KLD baseline and measured nothing; run it again with --baseline BASE "
                     "(rules max_mean, max_p99, min_same_top_p)"], g.stdout


def test_compare_carries_the_other_baseline_warning_everywhere(kld_runs, tmp_path):
    cmp = tmp_path / "cmp"
    r = moebench_cli("compare", str(kld_runs["base2"]), str(kld_runs["cand"]), "--out", str(cmp))
    assert r.returncode == 0, r.stderr
    said = f"kld: the candidate was measured against {kld_runs['base']}, not {kld_runs['base2']}"
    assert f"warning: {said}" in r.stdout
    assert f"- warning: {said}" in (cmp / "summary.md").read_text()
    html = (cmp / "report.html").read_text()
    notes = html[html.index('<ul class="verdict-notes">'):]
    assert said in notes[:notes.index("</ul>")]
    assert json.loads((cmp / "compare.json").read_text())["kld"]["baseline_mismatch"] is True


def test_kld_notes_name_a_lower_bound_beside_the_exact_figure():
    """The top-K lower bound comes from a prompt-logprobs server (tests/test_http_kld.py runs one);
    here the note is read off the section as kld.runs.kld_section writes it."""
    from moebench.compare.provenance import kld_notes
    section = {"mean": 0.0123, "estimate": {"k": 20, "lower_bound": True},
               "topk_vs_exact": {"n_tokens": 255, "exact_mean": 0.0187}}
    assert kld_notes(section) == ["kld: mean 0.0123 is a top-20 lower bound of the full KLD; the exact mean on "
                                  "the 255 tokens of the full chunks is 0.0187"]
    assert kld_notes({"mean": 0.01, "estimate": {"k": 20, "lower_bound": False}}) == []


def _unfinished_copy(src: Path, dst: Path) -> Path:
    """The run `src` as an interruption leaves one: status interrupted, no item finished yet."""
    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m["status"] = "interrupted"
    (dst / "manifest.json").write_text(json.dumps(m))
    (dst / "items.jsonl").write_text("")
    return dst


def test_resume_keeps_the_kld_role_the_run_started_with(kld_runs):
    tmp = kld_runs["tmp"]
    # A candidate resumed without --baseline keeps measuring against the baseline it started with.
    cand = _unfinished_copy(kld_runs["cand"], tmp / "cand_resumed")
    r = moebench_cli("run", str(tmp / "kld.toml"), "--runner", str(tmp / "engine.toml"), "--out", str(cand),
                     "--resume")
    assert r.returncode == 0, r.stdout + r.stderr
    m = json.loads((cand / "manifest.json").read_text())
    assert m["status"] == "complete" and m["baseline_run"] == str(kld_runs["base"]), m
    assert m["summary"]["kld"]["role"] == "candidate" and "kld_mean=" in r.stdout, r.stdout
    # ... and is refused a second reference.
    again = _unfinished_copy(kld_runs["cand"], tmp / "cand_other")
    r = moebench_cli("run", str(tmp / "kld.toml"), "--runner", str(tmp / "engine.toml"), "--out", str(again),
                     "--resume", "--baseline", str(kld_runs["base2"]))
    assert r.returncode == 2 and "mix two baselines" in r.stderr, r.stderr
    # A baseline resumed without --as-baseline stays a baseline.
    base = _unfinished_copy(kld_runs["base"], tmp / "base_resumed")
    r = moebench_cli("run", str(tmp / "kld.toml"), "--runner", str(tmp / "engine.toml"), "--out", str(base),
                     "--resume")
    assert r.returncode == 0, r.stdout + r.stderr
    m = json.loads((base / "manifest.json").read_text())
    assert m["status"] == "complete" and m["as_baseline"] is True and m["summary"]["kld"]["role"] == "baseline", m
