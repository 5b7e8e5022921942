"""compare.json read into typed figures (compare.records.TaskEntry, compare.figures): the values the gate
and the matrix row see, and what a figure of the wrong type becomes (None, reported by the rule that
needs it, naming the key)."""
from __future__ import annotations

import copy

from test_gate import COMPARE

from moebench.compare.figures import (EnergyFigures, KldFigures, MemoryFigures, NeedleFigures, SpeedAbFigures,
                                      SpeedFigures, read_section)
from moebench.compare.records import TaskEntry
from moebench.compare.tables import matrix_row
from moebench.gate.evaluation import evaluate
from moebench.gate.rules import RuleTable
from moebench.store.records import CompareDoc


def test_task_entry_reads_the_paired_figures_and_refuses_odd_types_to_none():
    t = TaskEntry.from_json(COMPARE["tasks"]["gsm8k"])
    assert (t.n_paired, t.baseline_correct, t.candidate_accuracy) == (200, 151, 0.73)
    assert t.wins == ["gsm8k/test/3", "gsm8k/test/40", "gsm8k/test/77", "gsm8k/test/150"]
    assert len(t.losses) == 9 and t.excluded == ["gsm8k/test/64"]
    assert t.delta_ci95 == [-0.061, 0.011] and t.mcnemar_p == 0.2668 and t.unpaired_reason is None
    odd = TaskEntry.from_json({"n_paired": "many", "wins": "3", "delta_ci95": ["low", 0.1], "mcnemar_p": True,
                               "n_wins": 2.5, "unpaired_reason": ""})
    assert odd.n_paired is None and odd.wins is None and odd.mcnemar_p is None and odd.n_wins is None
    assert odd.delta_ci95 == [None, 0.1] and odd.unpaired_reason is None


def test_section_figures_from_the_gate_fixture():
    kld = KldFigures.from_json(COMPARE["kld"])
    assert (kld.mean, kld.p999, kld.ppl_ratio, kld.rms_delta_p) == (0.0312, 1.37, 1.0189, 0.0412)
    assert kld.router_agreement == [0.97, 0.91, 0.95] and not kld.baseline_mismatch and kld.n_tokens == 16256
    speed = SpeedFigures.from_json(COMPARE["speed"])
    assert [g.prompt_length for g in speed.groups] == [512, 4096, 16384]
    assert round(speed.groups[0].ratio["decode_tok_s"], 4) == 0.92 and speed.groups[0].n_baseline == 10
    assert speed.groups[0].where == "512 tokens, 1 client"
    assert [(g.rate, g.n_candidate, g.skipped) for g in speed.load] == [(2.0, 50, False), (8.0, 50, False)]
    ab = SpeedAbFigures.from_json(COMPARE["speed_ab"])
    assert ab.round_winners == ["B", "B", "A", "B"] and ab.n_differ_any == 2
    assert (ab.paired["decode_tok_s"].median_ratio, ab.paired["decode_tok_s"].ratio_ci95,
            ab.paired["decode_tok_s"].n_pairs) == (1.08, (1.05, 1.11), 24)
    needle = NeedleFigures.from_json(COMPARE["needle"])
    assert (len(needle.found), needle.found_candidate, needle.lost) == (9, 8, 1)
    memory = MemoryFigures.from_json(COMPARE["memory"])
    assert (memory.peak_used_baseline, memory.peak_used_candidate) == (40 * 2**30, 35 * 2**30)
    energy = EnergyFigures.from_json({**COMPARE["energy"], **COMPARE["energy"]["gpus"]["sum"]})
    assert (energy.whole_run_counter_j, energy.idle_power_w, energy.decode_net_ratio) == (12000.0, 90.0, 1.05)


def test_an_absent_or_odd_section_reads_as_one_without_figures():
    assert read_section("memory.gpu3", None) == MemoryFigures(None, None, None)
    kld = read_section("kld", {"mean": "low", "per_layer": {"router_agreement": [None, "a", 0.5]},
                               "delta_p": [1], "measured_against": "", "baseline_mismatch": 1})
    assert isinstance(kld, KldFigures)
    assert kld.mean is None and kld.router_agreement == [0.5] and kld.rms_delta_p is None
    assert kld.measured_against is None and kld.baseline_mismatch
    ab = read_section("speed_ab", {"rounds": [{"winner": "B"}, "junk"], "paired": {"ttft_s": {}, "x": 3}})
    assert isinstance(ab, SpeedAbFigures) and ab.round_winners == ["B", None] and ab.paired == {}


def test_a_figure_of_the_wrong_type_fails_its_rule_naming_the_key():
    cmp = copy.deepcopy(COMPARE)
    cmp["tasks"]["gsm8k"]["losses"] = "nine"
    cmp["kld"]["delta_p"]["rms"] = "small"
    doc = CompareDoc.from_dict(cmp)
    results = evaluate(doc, [RuleTable("gsm8k", True, {"max_losses": 10, "min_paired": 100}),
                             RuleTable("kld", False, {"max_rms_delta_p": 0.1, "max_mean": 0.1})])
    by_rule = {(r.section, r.rule): r for r in results}
    assert by_rule["gsm8k", "max_losses"].verdict == "fail"
    assert by_rule["gsm8k", "max_losses"].message == \
        "gsm8k: no list 'losses' in compare.json; cannot check losses"
    assert by_rule["gsm8k", "min_paired"].verdict == "pass"
    assert by_rule["kld", "max_rms_delta_p"].message == \
        "kld: no numeric delta_p.rms in compare.json; cannot check RMS delta p"
    assert by_rule["kld", "max_mean"].verdict == "pass"


def test_matrix_row_reads_the_typed_document():
    row = matrix_row(CompareDoc.from_dict(COMPARE), "pair")
    assert (row["candidate"], row["run"], row["compare_dir"]) == ("tiered-q2", "results/tiered-q2", "pair")
    assert (row["gsm8k.n_paired"], row["gsm8k.wins"], row["gsm8k.losses"], row["gsm8k.excluded"]) == (200, 4, 9, 1)
    assert row["cmmlu.baseline_accuracy"] == 0.4                    # from baseline_correct / n_paired
    assert (row["kld.mean"], row["kld.p99"], row["kld.same_top_p"]) == (0.0312, 0.41, 0.9431)
    assert (row["speed_ab.rounds"], row["speed_ab.decode_ratio"]) == (4, 1.08)
    assert row["memory.peak_used_bytes"] == 35 * 2**30
