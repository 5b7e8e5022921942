"""Noise-aware speed rules end to end: `moebench run` (speed suite) against servers with a known pace,
`moebench compare`, then the gate. Too few samples is INCONCLUSIVE and says why; with enough samples
the verdict follows the 95% bootstrap interval of the ratio. Also Holm over several tasks."""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from test_speed import HAYSTACK, _runner_profile, paced  # noqa: F401 (fixture)

from moebench import api
from moebench.gate import EXIT_INCONCLUSIVE, run_gate
from moebench.gate import fmt as gate_fmt
from moebench.scoring.stats import holm_adjust

pytestmark = pytest.mark.skipif(not HAYSTACK.is_file(), reason=f"{HAYSTACK} not in the data mirror")


def speed_run(tmp_path: Path, name: str, url: str, repeats: int) -> Path:
    suite = tmp_path / f"speed-{repeats}.toml"
    suite.write_text('name = "tiny-speed"\n[[tasks]]\ntask = "speed"\nprompt_lengths = [200]\noutput_tokens = 8\n'
                     f'repeats = {repeats}\nclients = 1\nwarmup = 0\n[probes]\nnvml = false\n')
    run_dir, code = api.run(api.RunOptions(suite=str(suite), runner=str(_runner_profile(tmp_path, name, url)),
                                           out=str(tmp_path / f"{name}-{repeats}"), label=name, quiet=True))
    assert code == 0
    return run_dir


def rules(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "rules.toml"
    p.write_text(text)
    return p


def junit_cases(d: Path) -> dict[str, ET.Element]:
    return {c.get("name"): c for c in ET.parse(d / "junit.xml").getroot().iter("testcase")}


def test_speed_gate_too_few_samples_then_interval_verdicts(paced, tmp_path, capsys):
    fast = paced(first_ms=30, every_ms=25)           # paces far above what a loaded CPU adds
    slow = paced(first_ms=30, every_ms=50)           # decode at half the rate

    # two samples per side: a decode ratio near 0.5, but min_samples = 5 -> inconclusive, saying why
    base2, cand2 = speed_run(tmp_path, "fast", fast.url, 2), speed_run(tmp_path, "slow", slow.url, 2)
    group = json.loads((base2 / "manifest.json").read_text())["summary"]["speed"]["by_prompt_length"]["200"]["1"]
    assert group["itl_s"]["n"] == 14 and group["tpot_s"]["p50"] == pytest.approx(0.025, rel=0.3)
    assert group["e2e_s"]["p99"] >= group["e2e_s"]["p90"] >= group["e2e_s"]["p50"] > group["ttft_s"]["p50"]
    cmp2, cmp = api.compare(str(base2), str(cand2), str(tmp_path / "cmp2"))
    row = cmp["speed"]["rows"][0]
    assert row["n_baseline"] == row["n_candidate"] == 2
    # a loaded CPU adds the same few ms to every gap of both servers: ratios within 30%
    assert row["decode_ratio"] == pytest.approx(0.5, rel=0.3)
    assert row["tpot_ratio"] == pytest.approx(2.0, rel=0.3)
    assert row["itl_ratio"] == pytest.approx(2.0, rel=0.3)               # from speed_token_times.jsonl
    for side in ("baseline_stats", "candidate_stats"):
        st = row[side]["ttft_s"]
        assert st["p50"] <= st["p90"] <= st["p99"] <= st["max"]
        assert row[side]["itl_s"]["n"] == 2 * 7                           # 8 tokens: 7 gaps per request
    r = rules(tmp_path, "[speed]\nmin_decode_ratio = 0.9\nmax_tpot_ratio = 1.1\n")
    assert run_gate(cmp2, r) == EXIT_INCONCLUSIVE
    summary = (cmp2 / "summary.md").read_text()
    assert summary.startswith("## moebench gate: INCONCLUSIVE (0/2 rules hold, 2 inconclusive)")
    assert "2 samples per side, fewer than min_samples = 5" in summary
    skipped = junit_cases(cmp2)["min_decode_ratio"].find("skipped")
    assert skipped is not None and "fewer than min_samples = 5" in skipped.get("message")
    gate = json.loads((cmp2 / "gate.json").read_text())
    assert gate["verdict"] == "inconclusive" and gate["exit_code"] == EXIT_INCONCLUSIVE
    # the documented exits for inconclusive rules
    assert run_gate(cmp2, rules(tmp_path, "[gate]\non_inconclusive = \"fail\"\n[speed]\nmin_decode_ratio = 0.9\n")) == 1
    assert run_gate(cmp2, rules(tmp_path, "[gate]\non_inconclusive = \"pass\"\n[speed]\nmin_decode_ratio = 0.9\n")) == 0
    assert "*INCONCLUSIVE*" in (cmp2 / "summary.md").read_text()          # still listed, never silent
    # a lower min_samples lets two samples decide: the interval lies wholly below 0.9
    assert run_gate(cmp2, rules(tmp_path, "[speed]\nmin_decode_ratio = 0.9\nmin_samples = 2\n")) == 1
    capsys.readouterr()

    # eight samples per side: the verdict follows the interval
    base8, cand8 = speed_run(tmp_path, "fast", fast.url, 8), speed_run(tmp_path, "slow", slow.url, 8)
    cmp8, cmp = api.compare(str(base8), str(cand8), str(tmp_path / "cmp8"))
    lo, hi = cmp["speed"]["rows"][0]["decode_ratio_ci95"]
    assert 0 < lo <= cmp["speed"]["rows"][0]["decode_ratio"] <= hi < 0.9   # (a loaded CPU widens it)
    assert run_gate(cmp8, rules(tmp_path, "[speed]\nmin_decode_ratio = 0.9\n")) == 1        # interval below
    msg = junit_cases(cmp8)["min_decode_ratio"].find("failure").get("message")
    assert "breaks the limit >= 0.9: the whole interval is beyond it at 200 tokens, 1 client" in msg
    below = round(lo * 0.95, 4)
    assert run_gate(cmp8, rules(tmp_path, f"[speed]\nmin_decode_ratio = {below}\n")) == 0   # interval above
    # the midpoint at full precision: an interval narrower than 0.001 (an idle CPU) rounds out of itself
    straddled = (lo + hi) / 2
    assert lo < straddled < hi
    assert run_gate(cmp8, rules(tmp_path, f"[speed]\nmin_decode_ratio = {straddled!r}\n")) == EXIT_INCONCLUSIVE
    assert f"straddles {gate_fmt(straddled)}" in (cmp8 / "summary.md").read_text()
    # the same pace on both sides (an A/A pair): the interval lies around 1, so generous limits pass
    # (this CPU is shared: an A/A interval of [0.8, 1.25] has been seen under load)
    aa, cmp = api.compare(str(base8), str(speed_run(tmp_path, "fast-again", fast.url, 8)), str(tmp_path / "aa"))
    lo, hi = cmp["speed"]["rows"][0]["decode_ratio_ci95"]
    assert lo <= 1.0 <= hi or abs(cmp["speed"]["rows"][0]["decode_ratio"] - 1) < 0.15, (lo, hi)
    assert run_gate(aa, rules(tmp_path, "[speed]\nmin_decode_ratio = 0.6\nmax_ttft_ratio = 1.6\n")) == 0, \
        (aa / "summary.md").read_text()


def test_significant_loss_over_several_tasks_is_holm_adjusted(tmp_path):
    # gsm8k p = 0.03 and cmmlu p = 0.04: each below alpha 0.05 alone, but over the family of two the
    # Holm-adjusted p-values are 0.06 and 0.06: neither is significant.
    def task(n_w, n_l, p):
        return {"n_paired": 100, "baseline_correct": 50, "candidate_correct": 50 - n_l + n_w,
                "wins": [f"w{i}" for i in range(n_w)], "losses": [f"l{i}" for i in range(n_l)], "excluded": [],
                "mcnemar_p": p, "delta_ci95": [-0.1, 0.0]}
    d = tmp_path / "cmp"
    d.mkdir()
    (d / "compare.json").write_text(json.dumps({"baseline": {"label": "b"}, "candidate": {"label": "c"},
                                                "tasks": {"gsm8k": task(2, 10, 0.03), "cmmlu": task(3, 11, 0.04)}}))
    assert holm_adjust([0.03, 0.04]) == [pytest.approx(0.06), pytest.approx(0.06)]
    both = "[gsm8k]\nfail_on_significant_loss = true\n[cmmlu]\nfail_on_significant_loss = true\n"
    assert run_gate(d, rules(tmp_path, both)) == 0
    msgs = json.loads((d / "gate.json").read_text())["checks"]
    assert "Holm-adjusted over 2 tasks 0.06" in msgs[0]["message"]
    assert run_gate(d, rules(tmp_path, "[gate]\ncorrection = \"none\"\n" + both)) == 1
    assert run_gate(d, rules(tmp_path, "[gsm8k]\nfail_on_significant_loss = true\n")) == 1   # one task: no family


def test_compare_folds_in_speed_ab_rounds(paced, tmp_path):
    """`compare BASE CAND --speed-ab DIR`: the A/B rounds join the runs' compare, summary and gate."""
    from conftest import moebench_cli
    from moebench.speed.ab import run_ab
    a, b = paced(first_ms=20, every_ms=60), paced(first_ms=20, every_ms=30)
    base, cand = speed_run(tmp_path, "a", a.url, 5), speed_run(tmp_path, "b", b.url, 5)
    pa, pb = _runner_profile(tmp_path, "pa", a.url), _runner_profile(tmp_path, "pb", b.url)
    run_ab(str(pa), str(pb), {"prompt_lengths": [200], "output_tokens": 6, "repeats": 3, "clients": 1,
                              "warmup": 0}, str(tmp_path / "ab"), order="ABBA")
    out = tmp_path / "cmp"
    proc = moebench_cli("compare", str(base), str(cand), "--out", str(out), "--speed-ab", str(tmp_path / "ab"),
                        "--format", "md", check=True)
    assert "- round 1: A pass 0 " in proc.stdout and "- round 2: A pass 3 " in proc.stdout
    assert "rounds won: B 2, A 0, tied 0 of 2" in proc.stdout
    cmp = json.loads((out / "compare.json").read_text())
    assert cmp["speed_ab"]["source"] == str((tmp_path / "ab").resolve())
    assert cmp["speed"]["rows"][0]["decode_ratio"] > 1.3             # the runs agree with the rounds
    r = rules(tmp_path, "[speed_ab]\nmin_rounds_won = 2\nmin_rounds = 2\n")
    assert run_gate(out, r) == 0
    assert "A/B speed rounds (ABBA)" in (out / "report.html").read_text(encoding="utf-8")
    bad = moebench_cli("compare", str(base), str(cand), "--out", str(out), "--speed-ab", str(tmp_path))
    assert bad.returncode == 2 and "ab.json: not found" in bad.stderr
