"""Publishable compare outputs on run directories of real GSM8K and CMMLU items: several candidates
(one compare directory each plus matrix.json/csv, summary.md, one report), --format md|csv|json,
per-subject CMMLU flips, moebench.results loaders, trend, and gating a several-candidate compare."""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from conftest import moebench_cli
from test_report import DATA, gsm8k_items, svgs

from moebench import api
from moebench.gate import run_gate
from moebench.results import load_compare, load_items, load_matrix

CMMLU = DATA / "cmmlu" / "test"
SUBJECTS = ("anatomy", "astronomy")


def cmmlu_rows(subject: str, n: int) -> list[dict]:
    path = CMMLU / f"{subject}.csv"
    if not path.is_file():
        pytest.skip(f"dataset mirror missing: {path}")
    rows = list(csv.DictReader(path.open(encoding="utf-8")))[:n]
    return [{"question": r["Question"], "reference": r["Answer"]} for r in rows]


def make_run(path: Path, label: str, gsm_wrong: set[int], cmmlu_wrong: set[str], *, model_bytes: int,
             started: str, retried: int | None = None, decode: float = 40.0) -> Path:
    """A complete run: 10 GSM8K items, 5 CMMLU items of each of two subjects, 6 speed measurements."""
    path.mkdir(parents=True)
    manifest = {"schema_version": 1, "run_id": f"run-{label}", "label": label, "status": "complete",
                "started_at": started, "suite": {"name": "t"}, "runner": {"kind": "llama-server", "name": label},
                "model": {"path": f"models/{label}.gguf", "size_bytes": model_bytes, "sha256": "0" * 64},
                "build": {"kind": "llama.cpp", "build_number": 11434, "build_commit": "abc1234"},
                "summary": {"speed": {"by_prompt_length": {"128": {"1": {
                    "decode_tok_s": {"n": 6, "median": decode}, "ttft_s": {"n": 6, "median": 0.05}}}}}}}
    (path / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    with (path / "items.jsonl").open("w", encoding="utf-8") as f:
        for i, it in enumerate(gsm8k_items(10)):
            wrong = i in gsm_wrong
            rec = {"task": "gsm8k", "item_id": f"gsm8k/test/{i}", "status": "ok", "correct": not wrong,
                   "answer": "007" if wrong else it["reference"], "reference": it["reference"],
                   "output": f"The answer is {it['reference']}", "question": it["question"], "prompt_hash": f"g{i}"}
            if i == retried:     # an error, then the retry on resume: the last record wins
                f.write(json.dumps({**rec, "status": "error", "correct": None, "answer": None,
                                    "error": "RunnerError: reset"}) + "\n")
            f.write(json.dumps(rec) + "\n")
        for subject in SUBJECTS:
            for i, it in enumerate(cmmlu_rows(subject, 5)):
                item_id = f"cmmlu/{subject}/{i}"
                wrong = item_id in cmmlu_wrong
                ans = ("B" if it["reference"] != "B" else "C") if wrong else it["reference"]
                f.write(json.dumps({"task": "cmmlu", "item_id": item_id, "status": "ok", "correct": not wrong,
                                    "answer": ans, "reference": it["reference"], "output": ans,
                                    "question": it["question"], "prompt_hash": f"c{subject}{i}"}) + "\n")
        for rep in range(6):
            f.write(json.dumps({"task": "speed", "item_id": f"speed/128/1/{rep}/0", "status": "ok", "correct": None,
                                "answer": None, "reference": None, "output": "", "prompt_length": 128,
                                "clients": 1, "prompt_tokens": 128, "output_tokens": 16, "ttft_s": 0.05,
                                "prefill_tok_s": 2560.0, "e2e_s": 0.05 + 15 / (decode * (1 + 0.01 * rep)),
                                "decode_tok_s": decode * (1 + 0.01 * rep)}) + "\n")
    return path


@pytest.fixture
def runs(tmp_path):
    base = make_run(tmp_path / "bf16", "bf16", {8}, {"cmmlu/anatomy/4"}, model_bytes=40 << 20,
                    started="2026-01-01T00:00:00+00:00", retried=3)
    q8 = make_run(tmp_path / "q8_0", "q8_0", {8}, {"cmmlu/anatomy/4"}, model_bytes=21 << 20,
                  started="2026-01-02T00:00:00+00:00", decode=44.0)
    q4 = make_run(tmp_path / "q4_0", "q4_0", {1, 2}, {"cmmlu/anatomy/1", "cmmlu/anatomy/2", "cmmlu/astronomy/0"},
                  model_bytes=11 << 20, started="2026-01-03T00:00:00+00:00", decode=52.0)
    tiered = make_run(tmp_path / "tiered", "tiered", {8, 9}, {"cmmlu/astronomy/3"}, model_bytes=15 << 20,
                      started="2026-01-04T00:00:00+00:00", decode=30.0)
    return base, [q8, q4, tiered]


def test_three_candidates_one_report_and_a_table_with_three_rows(runs, tmp_path):
    base, cands = runs
    out = tmp_path / "cmp"
    proc = moebench_cli("compare", str(base), *map(str, cands), "--out", str(out), "--format", "csv", check=True)
    table = list(csv.DictReader(io.StringIO(proc.stdout)))
    assert [r["candidate"] for r in table] == ["q8_0", "q4_0", "tiered"]
    assert proc.stderr.strip().splitlines()[-1] == str(out)       # the directory, off stdout
    q4 = table[1]
    assert (q4["gsm8k.wins"], q4["gsm8k.losses"]) == ("1", "2")  # item 8 won, 1 and 2 lost
    assert (q4["cmmlu.wins"], q4["cmmlu.losses"]) == ("1", "3")
    assert float(q4["gsm8k.delta"]) == pytest.approx(-0.1)
    assert int(q4["model_bytes"]) == 11 << 20
    assert float(q4["speed.decode_ratio"]) == pytest.approx(52 / 40, rel=1e-6)
    assert float(q4["gsm8k.mcnemar_p"]) == pytest.approx(1.0)
    # one complete, gate-able compare directory per candidate; compare.json keeps the two-run contract
    for i, r in enumerate(table, start=1):
        d = out / r["compare_dir"]
        assert d.name.startswith(f"{i:02d}_")
        cmp = json.loads((d / "compare.json").read_text())
        for key in ("n_paired", "baseline_correct", "candidate_correct", "wins", "losses", "excluded",
                    "mcnemar_p", "delta_ci95"):
            assert key in cmp["tasks"]["gsm8k"]
        assert cmp["baseline"]["label"] == "bf16" and cmp["candidate"]["label"] == r["candidate"]
        assert (d / "report.html").is_file() and (d / "summary.md").is_file()
    matrix = json.loads((out / "matrix.json").read_text())
    assert [c["label"] for c in matrix["candidates"]] == ["q8_0", "q4_0", "tiered"]
    # one report over all three: verdict table first, a scatter of size vs KLD vs decode, manifests folded last
    html = (out / "report.html").read_text(encoding="utf-8")
    assert html.index('id="verdict"') < html.index('id="scatter"') < html.index('id="manifests"')
    assert all(f'href="{r["compare_dir"]}/report.html"' in html for r in table)
    # these runs measured no KLD: the scatter says so instead of drawing points on a missing axis
    assert any(s.get("aria-label") == "mean KLD against the baseline vs model size (MiB): no candidate has both values"
               for s in svgs(html))
    assert "<details><summary>baseline: bf16</summary>" in html
    summary = (out / "summary.md").read_text()
    assert summary.startswith("## moebench compare: 3 candidates against `bf16`")
    assert "| q4_0 | 11.0 MiB |" in summary

    # the other formats print the same facts
    md = moebench_cli("compare", str(base), *map(str, cands), "--out", str(out), "--format", "md", check=True)
    assert md.stdout == summary
    js = moebench_cli("compare", str(base), *map(str, cands), "--out", str(out), "--json", check=True)
    assert json.loads(js.stdout)["rows"][1]["cmmlu.losses"] == 3
    text = moebench_cli("compare", str(base), *map(str, cands), "--out", str(out), check=True)
    assert text.stdout.strip().splitlines()[-1] == str(out) and "== tiered" in text.stdout


def test_two_run_compare_writes_its_summary_and_loaders(runs, tmp_path):
    base, cands = runs
    out = tmp_path / "pair"
    js = moebench_cli("compare", str(base), str(cands[1]), "--out", str(out), "--format", "json", check=True)
    cmp = json.loads(js.stdout)
    assert cmp == json.loads((out / "compare.json").read_text())           # the contract file itself
    assert sorted(p.name for p in out.iterdir()) == ["compare.json", "matrix.csv", "matrix.json", "report.html",
                                                      "summary.md"]
    # per-subject CMMLU accuracy and flips
    subjects = cmp["tasks"]["cmmlu"]["per_subject"]
    assert set(subjects) == set(SUBJECTS)
    assert subjects["anatomy"]["losses"] == ["cmmlu/anatomy/1", "cmmlu/anatomy/2"]
    assert subjects["anatomy"]["wins"] == ["cmmlu/anatomy/4"]
    assert subjects["astronomy"]["losses"] == ["cmmlu/astronomy/0"] and subjects["astronomy"]["n_paired"] == 5
    assert subjects["anatomy"]["baseline_accuracy"] == pytest.approx(0.8)
    summary = (out / "summary.md").read_text()
    assert "| cmmlu subject | n | baseline | candidate | wins | losses |" in summary
    html = (out / "report.html").read_text(encoding="utf-8")
    assert "cmmlu per subject (2): accuracy and flips" in html
    assert html.index('id="verdict"') < html.index('id="accuracy"') < html.index('id="manifests"')

    items = load_items(base)
    assert len(items) == 10 + 10 + 6                                          # the retried item once
    g3 = items[items["item_id"] == "gsm8k/test/3"].iloc[0]
    assert g3["status"] == "ok" and g3["correct"] is True
    wrong = items[items["item_id"] == "gsm8k/test/8"].iloc[0]
    assert wrong["answer"] == "007" and isinstance(wrong["answer"], str)      # not 7.0
    assert items[items["item_id"] == "gsm8k/test/0"].iloc[0]["answer"] == "18"
    assert items[items["task"] == "speed"]["correct"].tolist() == [None] * 6
    tasks = load_compare(out)
    row = tasks[(tasks["task"] == "cmmlu/anatomy")].iloc[0]
    assert (row["wins"], row["losses"], row["candidate"]) == (1, 2, "q4_0")
    assert set(tasks["task"]) == {"gsm8k", "cmmlu", "cmmlu/anatomy", "cmmlu/astronomy", "overall"}
    assert load_matrix(out).loc[0, "candidate"] == "q4_0"


def test_gate_over_a_several_candidate_compare(runs, tmp_path, capsys):
    base, cands = runs
    out, _, _ = api.compare_many(str(base), [str(c) for c in cands], str(tmp_path / "cmp"))
    rules = tmp_path / "rules.toml"
    rules.write_text("[gsm8k]\nmax_losses = 1\n")
    assert run_gate(out, rules) == 1                            # q4_0 lost two
    summary = (out / "summary.md").read_text()
    assert summary.count("## moebench gate:") == 3 and "`q4_0` against baseline `bf16`" in summary
    pair = out / "02_q4_0"
    assert json.loads((pair / "gate.json").read_text())["verdict"] == "fail"
    html = (pair / "report.html").read_text(encoding="utf-8")       # re-rendered with the verdict first
    assert html.index("Gate: FAIL") < html.index('id="accuracy"')
    rules.write_text("[gsm8k]\nmax_losses = 2\n")
    assert run_gate(out, rules) == 0
    capsys.readouterr()


def test_trend_over_runs_draws_each_figure(runs, tmp_path):
    base, cands = runs
    order = [cands[2], base, cands[1], cands[0]]                 # given out of time order
    proc = moebench_cli("trend", *map(str, order), "--out", str(tmp_path / "trend"), check=True)
    rows = list(csv.DictReader(io.StringIO(proc.stdout.rsplit("\n", 2)[0] + "\n")))
    assert [r["label"] for r in rows] == ["bf16", "q8_0", "q4_0", "tiered"]      # by start time
    assert [float(r["gsm8k accuracy"]) for r in rows] == [0.9, 0.9, 0.8, 0.8]
    assert [float(r["decode tok/s at 128 tokens, 1 client"]) for r in rows] == [40.0, 44.0, 52.0, 30.0]
    assert rows[0]["build"] == "b11434 (abc1234)"
    data = json.loads((tmp_path / "trend" / "trend.json").read_text())
    html = (tmp_path / "trend" / "trend.html").read_text(encoding="utf-8")
    labels = [s.get("aria-label") for s in svgs(html)]
    assert labels == data["figures"] and "model size (MiB)" in labels and "cmmlu accuracy" in labels
    given = moebench_cli("trend", *map(str, order), "--out", str(tmp_path / "t2"), "--order", "given", check=True)
    assert given.stdout.splitlines()[1].startswith("tiered,")
    assert moebench_cli("trend", str(base)).returncode == 2      # one run is no trend
