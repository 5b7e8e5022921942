"""The regression gate: check a compare directory against rules, for CI.

The package: `rules.py` (the rule types and the rules file), `evaluation.py` (a RuleResult per rule,
the INCONCLUSIVE logic), `summary.py` (the Verdict: exit code, summary.md, junit.xml, gate.json),
`entry.py` (`run_gate` over a compare directory, `main`); `python -m moebench.gate DIR --rules FILE`.

`run_gate(compare_dir, rules_path) -> int`: 0 when every rule holds, 1 when any fails, 2 on a usage
or input error (no compare.json, malformed rules: the message names the file and key), 3 when no rule
fails but at least one is INCONCLUSIVE (see below; `[gate] on_inconclusive` changes that). It writes
`summary.md` (a markdown table for `$GITHUB_STEP_SUMMARY`), `junit.xml` (one testcase per rule; an
inconclusive rule is a skipped testcase with its reason) and `gate.json` (the verdicts, which the
report shows first) into the compare directory and prints the summary.

Rules file (TOML); a table per task named as in compare.json's "tasks", plus the optional sections:

    [gsm8k]
    min_paired = 100                 # the task really ran on enough items; below it the other rules
                                     # are INCONCLUSIVE (default floor 1: 0 paired items judge nothing)
    min_accuracy = 0.5               # candidate accuracy
    max_accuracy_drop = 0.02         # baseline minus candidate accuracy
    max_losses = 5                   # right in baseline, wrong in candidate
    max_flip_rate = 0.1              # (wins + losses) / n_paired
    fail_on_significant_loss = true  # fail when losses outnumber wins at McNemar p < alpha
    alpha = 0.05
    min_delta_ci_low = -0.05         # lower end of the paired bootstrap CI of the accuracy change
    max_excluded = 0                 # errored or missing items on either side
    [kld]
    max_mean = 0.05
    max_p99 = 1.0
    min_same_top_p = 0.9
    [speed]
    min_decode_ratio = 0.9           # candidate / baseline decode tok/s, every prompt length and client count
    max_ttft_ratio = 1.2             # also min_prefill_ratio, max_tpot_ratio, max_itl_ratio, max_e2e_ratio
    min_samples = 5                  # timed requests per side and group below which a group is inconclusive
    min_acceptance_rate = 0.6        # speculative decoding: the candidate's draft acceptance, every group
    min_goodput_ratio = 0.9          # serving load: candidate / baseline goodput, every prompt length and rate
    [speed_ab]                       # `moebench speed-ab` results (B is the candidate)
    min_rounds_won = 3               # B won at least 3 rounds ...
    min_rounds = 4                   # ... of at least 4
    min_decode_ratio = 1.0           # paired B/A decode ratio (interval verdict, as [speed])
    max_differing_outputs = 0        # A/B output identity, over every A pass against every B pass
    [needle]
    min_found = 10
    [memory]
    max_peak_used_gib = 80           # the run's headline: its one card, or the sum of its cards
    [memory.gpu1]                    # one card by NVML index (runs sampled with gpu_indices)
    max_peak_used_gib = 22
    [energy]
    max_whole_run_kj = 50            # candidate energy over the whole run (NVML counter), kJ
    max_idle_power_w = 400           # candidate idle draw, measured after load
    max_decode_net_j_per_token_ratio = 1.1
    [energy.sum]                     # the sum over cards (the headline with several cards)
    max_whole_run_kj = 150

    [gate]
    on_inconclusive = "exit3"        # exit3 (default) | fail (exit 1) | pass (exit 0, still listed)
    correction = "holm"              # holm (default) | none: fail_on_significant_loss over several tasks

A task whose name collides with a section (e.g. a scored "needle" task) goes under [tasks.NAME].
A rule whose task or section is absent from compare.json FAILS: a gate never passes on missing data.
A task with fewer paired items than its floor (`min_paired`, else DEFAULT_MIN_PAIRED = 1) has every
other rule INCONCLUSIVE, with compare's reason (prompts or data differ, errors); `min_paired` itself
fails. KLD rules are INCONCLUSIVE when the candidate measured its KLD against another baseline run.
The rules of a task or section whose data no SHA256SUMS vouched for on either side (compare.json
`data_unverified`) are INCONCLUSIVE: a verdict on data nobody checked is no evidence.
A several-candidate compare's matrix.json may only name directories inside the compare directory.

Speed ratio rules judge intervals, not single numbers: per prompt length and client count, the 95%
bootstrap interval of the candidate/baseline ratio. A group FAILS when its whole interval is on the
wrong side of the limit, PASSES when its whole interval is on the right side, and is INCONCLUSIVE when
the interval straddles the limit, is missing, either side timed fewer than `min_samples` requests, or
the sample counts are unknown (a compare.json older than schema 2); the summary says which. The rule fails when any group fails, else is inconclusive when any group is.

`fail_on_significant_loss` on several tasks is one family of tests: the McNemar p-values are
Holm-adjusted over those tasks before they are compared with each task's alpha.
"""
from moebench.gate.entry import GateInputError, main, run_gate
from moebench.gate.evaluation import RuleResult, evaluate
from moebench.gate.rules import (DEFAULT_MIN_PAIRED, DEFAULT_MIN_SAMPLES, SECTION_RULES, TASK_RULES, GateOptions,
                                 Rule, RuleTable, fmt, load_gate_options, load_rules)
from moebench.gate.summary import EXIT_INCONCLUSIVE, GATE_FILE, JUNIT_FILE, SUMMARY_FILE, Verdict

__all__ = ["DEFAULT_MIN_PAIRED", "DEFAULT_MIN_SAMPLES", "EXIT_INCONCLUSIVE", "GATE_FILE", "JUNIT_FILE",
           "SECTION_RULES", "SUMMARY_FILE", "TASK_RULES", "GateInputError", "GateOptions", "Rule", "RuleResult",
           "RuleTable", "Verdict", "evaluate", "fmt", "load_gate_options", "load_rules", "main", "run_gate"]
