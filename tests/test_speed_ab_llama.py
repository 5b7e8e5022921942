"""`moebench speed-ab` on two real llama-server profiles (the zoo's Q8_0 and Q4_0): rounds in A,B,B,A
order, rounds won per side, identity over every A/B pass pair, and a gate on rounds won."""
from __future__ import annotations

import json

from conftest import moebench_cli


def test_speed_ab_two_llama_profiles_rounds_and_gate(zoo, tmp_path):
    out = tmp_path / "ab"
    proc = moebench_cli("speed-ab", "runners/llama-q8_0.toml", "runners/llama-q4_0.toml", "--suite",
                        "speed-smoke", "--order", "ABBA", "--out", str(out), check=True, timeout=1200)
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("round 1: A pass 0 ") and " B pass 1 " in lines[0]
    assert lines[1].startswith("round 2: A pass 3 ") and " B pass 2 " in lines[1]
    assert lines[2].startswith("rounds won: B ")
    ab = json.loads((out / "compare.json").read_text())["speed_ab"]
    won = ab["rounds_won"]
    assert won["A"] + won["B"] + won["tie"] == 2
    assert all(r["n_pairs"] == 12 and r["a_decode_tok_s"] > 0 and r["b_decode_tok_s"] > 0 for r in ab["rounds"])
    ident = ab["identity"]
    assert len(ident["pairs"]) == 4 and ident["compared_on"] == "token_ids" and ident["n_compared"] == 12
    assert ident["a_self_n_differ"] == 0 and ident["b_self_n_differ"] == 0     # greedy: deterministic
    dec = ab["paired"]["decode_tok_s"]
    assert dec["n_pairs"] == 24 and dec["ratio_ci95"][0] <= dec["median_ratio"] <= dec["ratio_ci95"][1]
    assert "A/B speed rounds (ABBA)" in (out / "report.html").read_text(encoding="utf-8")
    rules = tmp_path / "ab.toml"
    rules.write_text("[speed_ab]\nmin_rounds = 2\n")
    assert moebench_cli("gate", str(out), "--rules", str(rules)).returncode == 0
    rules.write_text(f"[speed_ab]\nmin_rounds_won = {won['B'] + 1}\n")      # one more than B won
    gate = moebench_cli("gate", str(out), "--rules", str(rules))
    assert gate.returncode == 1 and "rounds won by B" in (out / "summary.md").read_text()
