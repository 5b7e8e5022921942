"""The regression gate on a hand-written compare.json: every rule passing and failing, exit codes, outputs."""
from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from moebench.gate import SECTION_RULES, TASK_RULES, load_rules, run_gate
from moebench.config import ProfileError

REPO = Path(__file__).resolve().parents[1]


def ids(task: str, idx) -> list[str]:
    return [f"{task}/{i}" for i in idx]


COMPARE = {
    "baseline": {"run": "results/bf16", "label": "bf16"},
    "candidate": {"run": "results/tiered-q2", "label": "tiered-q2"},
    "tasks": {
        # 4 wins vs 9 losses: exact two-sided McNemar p = 2 * 1093 / 8192 = 0.2668 (not significant)
        "gsm8k": {"n_paired": 200, "baseline_correct": 151, "candidate_correct": 146,
                  "baseline_accuracy": 0.755, "candidate_accuracy": 0.73,
                  "wins": ids("gsm8k/test", [3, 40, 77, 150]),
                  "losses": ids("gsm8k/test", [9, 12, 31, 58, 90, 101, 133, 170, 188]),
                  "excluded": ["gsm8k/test/64"], "flip_rate": 0.065, "mcnemar_p": 0.2668,
                  "delta_ci95": [-0.061, 0.011]},
        # 2 wins vs 15 losses: p = 2 * 154 / 131072 = 0.00235 (a significant regression)
        "cmmlu": {"n_paired": 300, "baseline_correct": 120, "candidate_correct": 107,
                  "wins": ids("cmmlu/anatomy", [1, 2]), "losses": ids("cmmlu/anatomy", range(10, 25)),
                  "excluded": [], "mcnemar_p": 0.00235, "delta_ci95": [-0.075, -0.012]},
    },
    "kld": {"n_tokens": 16256, "mean": 0.0312, "mean_err": 0.0004, "median": 0.0121, "p90": 0.071,
            "p95": 0.12, "p99": 0.41, "p999": 1.37, "max": 4.2, "min": 0.0, "same_top_p": 0.9431,
            "delta_p": {"mean": -0.0021, "rms": 0.0412}, "ln_ppl_ratio": 0.0187, "ppl_ratio": 1.0189,
            "per_layer": {"router_agreement": [0.97, 0.91, 0.95]}},
    # ten timed requests per side and group; 95% intervals of the ratios narrow enough to decide
    "speed": {"rows": [{"prompt_length": L, "clients": 1, "n_baseline": 10, "n_candidate": 10,
                        "baseline": {"ttft_s": t_b, "prefill_tok_s": p_b, "decode_tok_s": d_b},
                        "candidate": {"ttft_s": t_c, "prefill_tok_s": p_c, "decode_tok_s": d_c},
                        "ttft_ratio_ci95": [t_c / t_b - 0.03, t_c / t_b + 0.03],
                        "prefill_ratio_ci95": [p_c / p_b - 0.01, p_c / p_b + 0.01],
                        "decode_ratio_ci95": [d_c / d_b - 0.005, d_c / d_b + 0.005],
                        "tpot_ratio": d_b / d_c, "tpot_ratio_ci95": [d_b / d_c - 0.01, d_b / d_c + 0.01],
                        "itl_ratio": d_b / d_c, "itl_ratio_ci95": [d_b / d_c - 0.01, d_b / d_c + 0.01],
                        "e2e_ratio": 1.1, "e2e_ratio_ci95": [1.08, 1.12], "acceptance_candidate": acc}
                       for L, t_b, t_c, p_b, p_c, d_b, d_c, acc in [
                           (512, 0.1, 0.13, 5120.0, 3993.6, 40.0, 36.8, 0.8),     # decode 0.92, ttft 1.3
                           (4096, 0.5, 0.6, 8192.0, 6389.76, 38.0, 34.2, 0.65),  # decode 0.90, prefill 0.78
                           (16384, 2.0, 2.4, 8192.0, 6881.28, 30.0, 26.7, 0.7)]],  # decode 0.89
              # serving load: goodput per rate, 50 requests per side; the lowest ratio 0.93 [0.9, 0.96]
              "load": {"rows": [{"prompt_length": 512, "rate": rate, "baseline": {"goodput": gb},
                                 "candidate": {"goodput": gc}, "goodput_ratio": gc / gb,
                                 "goodput_ratio_ci95": [gc / gb - 0.03, gc / gb + 0.03],
                                 "n_baseline": 50, "n_candidate": 50}
                                for rate, gb, gc in [(2.0, 1.9, 1.9), (8.0, 6.0, 5.58)]]}},
    "needle": {"cells": [{"length": L, "depth": d, "prompt_tokens": L - 2, "found_baseline": True,
                          "found_candidate": not (L == 16384 and d == 0.9)}
                         for L in (4096, 8192, 16384) for d in (0.1, 0.5, 0.9)]},
    # B (the candidate) won rounds 1, 2 and 4 of 4; paired ratios over 24 prompts measured in both
    "speed_ab": {"rounds": [{"round": i + 1, "winner": w} for i, w in enumerate("BBAB")],
                 "paired": {"decode_tok_s": {"median_ratio": 1.08, "ratio_ci95": [1.05, 1.11], "n_pairs": 24},
                            "prefill_tok_s": {"median_ratio": 1.02, "ratio_ci95": [1.01, 1.03], "n_pairs": 24},
                            "ttft_s": {"median_ratio": 0.97, "ratio_ci95": [0.95, 0.99], "n_pairs": 24}},
                 "identity": {"n_differ_any": 2}},
    "memory": {"baseline": {"peak_used_bytes": 40 * 2**30}, "candidate": {"peak_used_bytes": 35 * 2**30}},
    "energy": {"per_token": {"decode": {"net_ratio": 1.05}},
               "gpus": {"sum": {"baseline": {"idle_power_w": 80.0, "whole_run_counter_j": 15000.0},
                                "candidate": {"idle_power_w": 90.0, "whole_run_counter_j": 12000.0}}}},
}

# (section, rule, a limit the fixture meets, a limit it breaks)
CASES = [
    ("gsm8k", "min_paired", 200, 201),
    ("gsm8k", "min_accuracy", 0.73, 0.74),
    ("gsm8k", "max_accuracy_drop", 0.03, 0.02),
    ("gsm8k", "max_losses", 9, 8),
    ("gsm8k", "max_flip_rate", 0.07, 0.06),
    ("gsm8k", "min_delta_ci_low", -0.07, -0.05),
    ("gsm8k", "max_excluded", 1, 0),
    ("kld", "max_mean", 0.04, 0.03),
    ("kld", "max_median", 0.02, 0.01),
    ("kld", "max_p90", 0.08, 0.07),
    ("kld", "max_p95", 0.2, 0.1),
    ("kld", "max_p99", 0.5, 0.4),
    ("kld", "max_p999", 1.5, 1.0),
    ("kld", "max_max", 5.0, 4.0),
    ("kld", "min_same_top_p", 0.94, 0.95),
    ("kld", "max_ppl_ratio", 1.02, 1.01),
    ("kld", "max_rms_delta_p", 0.05, 0.04),
    ("kld", "min_router_agreement", 0.9, 0.92),
    ("speed", "min_decode_ratio", 0.85, 0.9),
    ("speed", "min_prefill_ratio", 0.75, 0.8),
    ("speed", "max_ttft_ratio", 1.35, 1.25),
    ("speed", "max_tpot_ratio", 1.14, 1.1),
    ("speed", "max_itl_ratio", 1.14, 1.1),
    ("speed", "max_e2e_ratio", 1.15, 1.05),
    ("speed", "min_acceptance_rate", 0.6, 0.7),       # lowest group: 0.65
    ("speed", "min_goodput_ratio", 0.85, 0.97),       # lowest rate: 0.93 [0.9, 0.96]
    ("speed_ab", "min_rounds_won", 3, 4),
    ("speed_ab", "min_rounds", 4, 5),
    ("speed_ab", "min_decode_ratio", 1.04, 1.12),
    ("speed_ab", "min_prefill_ratio", 1.0, 1.04),
    ("speed_ab", "max_ttft_ratio", 1.0, 0.94),
    ("speed_ab", "max_differing_outputs", 2, 1),
    ("needle", "min_found", 8, 9),
    ("needle", "max_lost", 1, 0),
    ("needle", "min_found_share", 0.85, 0.9),
    ("memory", "max_peak_used_gib", 36.0, 34.0),
    ("memory", "max_peak_used_ratio", 0.9, 0.85),
    ("energy", "max_whole_run_kj", 12.5, 11.5),
    ("energy", "max_idle_power_w", 95.0, 85.0),
    ("energy", "max_decode_net_j_per_token_ratio", 1.1, 1.0),
]


@pytest.fixture
def compare_dir(tmp_path):
    d = tmp_path / "compare_bf16_vs_tiered"
    d.mkdir()
    (d / "compare.json").write_text(json.dumps(COMPARE, indent=1), encoding="utf-8")
    return d


def write_rules(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def toml_value(v) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else repr(v)


def junit(d: Path) -> ET.Element:
    return ET.parse(d / "junit.xml").getroot()


def test_cases_cover_every_rule():
    covered = {(s, r) for s, r, _, _ in CASES}
    expected = {("gsm8k", r) for r in TASK_RULES if r != "fail_on_significant_loss"}
    expected |= {(s, r) for s, rules in SECTION_RULES.items() for r in rules}
    assert covered == expected


@pytest.mark.parametrize("section,rule,ok_limit,bad_limit", CASES, ids=[f"{s}.{r}" for s, r, _, _ in CASES])
def test_each_rule_passes_and_fails(compare_dir, tmp_path, section, rule, ok_limit, bad_limit, capsys):
    good = write_rules(tmp_path / "good.toml", f"[{section}]\n{rule} = {toml_value(ok_limit)}\n")
    assert run_gate(compare_dir, good) == 0
    cases = junit(compare_dir).findall(".//testcase")
    assert [(c.get("classname"), c.get("name")) for c in cases] == [(f"moebench.gate.{section}", rule)]
    assert cases[0].find("failure") is None
    assert "PASS" in (compare_dir / "summary.md").read_text()

    bad = write_rules(tmp_path / "bad.toml", f"[{section}]\n{rule} = {toml_value(bad_limit)}\n")
    assert run_gate(compare_dir, bad) == 1
    failure = junit(compare_dir).find(".//testcase/failure")
    assert failure is not None and "breaks the limit" in failure.get("message")
    out = capsys.readouterr().out
    assert f"| {section}.{rule} |" in out and "**FAIL**" in out


def test_significant_loss_rule(compare_dir, tmp_path):
    rules = write_rules(tmp_path / "r.toml", "[gsm8k]\nfail_on_significant_loss = true\n"
                                             "[cmmlu]\nfail_on_significant_loss = true\nalpha = 0.01\n")
    assert run_gate(compare_dir, rules) == 1
    cases = {c.get("classname"): c for c in junit(compare_dir).findall(".//testcase")}
    assert cases["moebench.gate.gsm8k"].find("failure") is None            # p = 0.27
    msg = cases["moebench.gate.cmmlu"].find("failure").get("message")
    assert "losses (15) outnumber wins (2)" in msg and "0.00235 < 0.01" in msg
    # with alpha below p the same loss count is not significant
    rules = write_rules(tmp_path / "r.toml", "[cmmlu]\nfail_on_significant_loss = true\nalpha = 0.001\n")
    assert run_gate(compare_dir, rules) == 0
    # switched off: reported, passes
    rules = write_rules(tmp_path / "r.toml", "[cmmlu]\nfail_on_significant_loss = false\nmax_losses = 20\n")
    assert run_gate(compare_dir, rules) == 0


def test_example_rules_file_on_the_fixture(compare_dir):
    """gates/example.toml as shipped: parses, and the fixture breaks some of its rules."""
    assert run_gate(compare_dir, REPO / "gates" / "example.toml") == 1
    root = junit(compare_dir)
    suite = root.find("testsuite")
    n_rules = sum(len([k for k in s if k != "alpha"]) for _, _, s in load_rules(REPO / "gates" / "example.toml"))
    assert int(suite.get("tests")) == n_rules == len(root.findall(".//testcase"))
    failed = {(c.get("classname").split(".")[-1], c.get("name"))
              for c in root.findall(".//testcase") if c.find("failure") is not None}
    assert failed == {("gsm8k", "max_losses"), ("gsm8k", "max_excluded"), ("cmmlu", "max_losses"),
                      ("cmmlu", "fail_on_significant_loss"),
                      ("humaneval", "min_paired"), ("humaneval", "max_losses")}     # absent task: fails
    assert int(suite.get("failures")) == len(failed)
    summary = (compare_dir / "summary.md").read_text()
    assert summary.startswith("## moebench gate: FAIL (8/14 rules hold)")
    assert "`tiered-q2` against baseline `bf16`" in summary


def test_absent_task_section_or_value_fails_clearly(compare_dir, tmp_path):
    rules = write_rules(tmp_path / "r.toml", "[humaneval]\nmin_accuracy = 0.1\n[tasks.needle]\nmax_losses = 3\n"
                                             "[energy_is_not_a_section]\nmax_losses = 1\n")
    assert run_gate(compare_dir, rules) == 1
    msgs = [f.get("message") for f in junit(compare_dir).iter("failure")]
    assert msgs[0] == "task 'humaneval' is not in compare.json (tasks there: cmmlu, gsm8k)"
    assert msgs[1].startswith("task 'needle' is not in compare.json")
    assert len(msgs) == 3
    partial = {k: v for k, v in COMPARE.items() if k not in ("kld", "speed")}
    partial["tasks"] = {"gsm8k": {"n_paired": 10, "wins": [], "losses": []}}
    (compare_dir / "compare.json").write_text(json.dumps(partial))
    rules = write_rules(tmp_path / "r.toml", "[gsm8k]\nmin_accuracy = 0.1\nmax_losses = 3\n[kld]\nmax_mean = 1.0\n")
    assert run_gate(compare_dir, rules) == 1
    cases = {c.get("name"): c for c in junit(compare_dir).findall(".//testcase")}
    assert "no numeric candidate_correct" in cases["min_accuracy"].find("failure").get("message")
    assert cases["max_losses"].find("failure") is None
    assert cases["max_mean"].find("failure").get("message") == "section 'kld' is not in compare.json"


@pytest.mark.parametrize("text,expected", [
    ("[gsm8k]\nmax_loss = 3\n", r"r\.toml \[gsm8k\]: unknown key 'max_loss'"),
    ("[gsm8k]\nmax_losses = \"three\"\n", r"\[gsm8k\]: key 'max_losses' must be an integer"),
    ("[gsm8k]\nmin_accuracy = 1.5\n", r"key 'min_accuracy' must be between 0 and 1"),
    ("[kld]\nmin_accuracy = 0.5\n", r"\[kld\]: unknown key 'min_accuracy'"),
    ("max_losses = 3\n", r"key 'max_losses' must be a table"),
    ("[gsm8k]\nalpha = 0.1\n", r"'alpha' is only used with 'fail_on_significant_loss'"),
    ("", r"no rules"),
    ("[gsm8k\n", r"not valid TOML"),
])
def test_malformed_rules_exit_2_naming_file_and_key(compare_dir, tmp_path, capsys, text, expected):
    rules = write_rules(tmp_path / "r.toml", text)
    assert run_gate(compare_dir, rules) == 2
    err = capsys.readouterr().err
    assert __import__("re").search(expected, err), err
    assert not (compare_dir / "junit.xml").exists()
    assert "ERROR" in (compare_dir / "summary.md").read_text()
    with pytest.raises(ProfileError):
        load_rules(rules)


def test_usage_errors_exit_2(tmp_path, capsys):
    rules = write_rules(tmp_path / "r.toml", "[gsm8k]\nmax_losses = 3\n")
    assert run_gate(tmp_path / "nowhere", rules) == 2
    assert "not a directory" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_gate(empty, rules) == 2
    assert "compare.json: not found" in capsys.readouterr().err
    (empty / "compare.json").write_text("[1, 2")
    assert run_gate(empty, rules) == 2
    assert "compare.json: not valid JSON" in capsys.readouterr().err
    (empty / "compare.json").write_text(json.dumps(COMPARE))
    assert run_gate(empty, tmp_path / "missing.toml") == 2
    assert "missing.toml: file not found" in capsys.readouterr().err


def test_module_entry_point_exit_codes(compare_dir, tmp_path):
    ok = write_rules(tmp_path / "ok.toml", "[gsm8k]\nmax_losses = 10\n")
    bad = write_rules(tmp_path / "bad.toml", "[gsm8k]\nmax_losses = 1\n")
    run = lambda *a: subprocess.run([sys.executable, "-m", "moebench.gate", *a], cwd=REPO,  # noqa: E731
                                    capture_output=True, text=True, timeout=60)
    r = run(str(compare_dir), "--rules", str(ok))
    assert r.returncode == 0 and "| gsm8k.max_losses | 9 | <= 10 | PASS |" in r.stdout
    assert run(str(compare_dir), "--rules", str(bad)).returncode == 1
    assert run(str(compare_dir)).returncode == 2          # --rules missing: argparse usage error


def test_workflow_example_runs_the_contract_cli_and_always_publishes():
    yaml = pytest.importorskip("yaml")
    wf = yaml.safe_load((REPO / ".github" / "workflows" / "moebench.yml").read_text())
    steps = wf["jobs"]["gate"]["steps"]
    script = "\n".join(s.get("run", "") for s in steps)
    for command in ('moebench run "$SUITE" --runner "$CANDIDATE" --out results/candidate',
                    "moebench compare results/baseline results/candidate --out results/compare",
                    "moebench report results/compare", 'moebench gate results/compare --rules "$RULES"'):
        assert command in script
    by_name = {s.get("name"): s for s in steps}
    assert by_name["Job summary"]["if"] == "always()"
    assert 'summary.md >> "$GITHUB_STEP_SUMMARY"' in by_name["Job summary"]["run"]
    upload = by_name["Upload the report"]
    assert upload["if"] == "always()" and upload["uses"].startswith("actions/upload-artifact@")
    assert "results/compare/report.html" in upload["with"]["path"]
    assert (REPO / wf["env"]["RULES"].split("'")[1]).is_file()     # the default rules file exists
