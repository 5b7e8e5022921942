"""The regression gate: check a compare directory against rules, for CI.

`run_gate(compare_dir, rules_path) -> int`: 0 when every rule holds, 1 when any fails, 2 on a usage
or input error (no compare.json, malformed rules: the message names the file and key). It writes
`summary.md` (a markdown table for `$GITHUB_STEP_SUMMARY`) and `junit.xml` (one testcase per rule)
into the compare directory and prints the summary.

Rules file (TOML); a table per task named as in compare.json's "tasks", plus the optional sections:

    [gsm8k]
    min_paired = 100                 # the task really ran on enough items
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
    min_decode_ratio = 0.9           # candidate / baseline, worst prompt length
    [needle]
    min_found = 10
    [memory]
    max_peak_used_gib = 80

A task whose name collides with a section (e.g. a scored "needle" task) goes under [tasks.NAME].
A rule whose task or section is absent from compare.json FAILS: a gate never passes on missing data.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from moebench.config import Field, ProfileError, load_toml, non_negative, positive, validate
from moebench.report.sections import memory_value, needle_cells, needle_counts, number, speed_rows

SUMMARY_FILE = "summary.md"
JUNIT_FILE = "junit.xml"


def _fraction(v: Any) -> str | None:
    return None if 0 <= v <= 1 else "must be between 0 and 1"


class Missing(Exception):
    """The value a rule needs is absent from compare.json."""


@dataclass
class Rule:
    """A limit on one figure: `get` reads the figure from the section, `kind` says which side passes."""

    field: Field
    kind: str                                   # "max" | "min" | "flag"
    get: Callable[[dict[str, Any]], float]
    what: str                                   # the figure, for messages


def _req(section: dict[str, Any], key: str, label: str = "") -> float:
    v = number(section.get(key))
    if v is None:
        raise Missing(f"no numeric {label or key!s}")
    return v


def _ids(section: dict[str, Any], key: str) -> int:
    v = section.get(key)
    if not isinstance(v, list):
        raise Missing(f"no list {key!r}")
    return len(v)


def _candidate_accuracy(t: dict[str, Any]) -> float:
    v = number(t.get("candidate_accuracy"))
    if v is None:
        v = _req(t, "candidate_correct") / _nonzero(_req(t, "n_paired"))
    return v


def _accuracy_drop(t: dict[str, Any]) -> float:
    base = number(t.get("baseline_accuracy"))
    if base is None:
        base = _req(t, "baseline_correct") / _nonzero(_req(t, "n_paired"))
    return base - _candidate_accuracy(t)


def _flip_rate(t: dict[str, Any]) -> float:
    v = number(t.get("flip_rate"))
    if v is None:
        v = (_ids(t, "wins") + _ids(t, "losses")) / _nonzero(_req(t, "n_paired"))
    return v


def _delta_ci_low(t: dict[str, Any]) -> float:
    ci = t.get("delta_ci95")
    if not (isinstance(ci, list) and len(ci) == 2 and number(ci[0]) is not None):
        raise Missing("no delta_ci95 [lo, hi]")
    return number(ci[0])  # type: ignore[return-value]


def _mcnemar_p(t: dict[str, Any]) -> float:
    _ids(t, "wins"), _ids(t, "losses")      # the verdict also needs who flipped which way
    return _req(t, "mcnemar_p")


def _nonzero(n: float) -> float:
    if n <= 0:
        raise Missing("n_paired is 0: nothing was compared")
    return n


def _speed(metric: str, worst: Callable[[list[float]], float]) -> Callable[[dict[str, Any]], float]:
    def get(speed: dict[str, Any]) -> float:
        ratios = [r[f"{metric}_ratio"] for r in speed_rows(speed) if r[f"{metric}_ratio"] is not None]
        if not ratios:
            raise Missing(f"no {metric} ratio at any prompt length")
        return worst(ratios)
    return get


def _needle(key: str) -> Callable[[dict[str, Any]], float]:
    def get(needle: dict[str, Any]) -> float:
        cells = needle_cells(needle)
        if not cells:
            raise Missing("no needle cells")
        counts = needle_counts(cells)
        return counts["found_candidate"] / counts["cells"] if key == "found_share" else counts[key]
    return get


def _min_router_agreement(kld: dict[str, Any]) -> float:
    layers = kld.get("per_layer") if isinstance(kld.get("per_layer"), dict) else {}
    vals = [number(v) for v in layers.get("router_agreement") or []]
    vals = [v for v in vals if v is not None]
    if not vals:
        raise Missing("no per_layer.router_agreement")
    return min(vals)


def _rms_delta_p(kld: dict[str, Any]) -> float:
    dp = kld.get("delta_p") if isinstance(kld.get("delta_p"), dict) else {}
    return _req(dp, "rms", "delta_p.rms")


def _peak_gib(memory: dict[str, Any]) -> float:
    v = memory_value(memory, "peak_used_bytes", "candidate")
    if v is None:
        raise Missing("no candidate peak_used_bytes")
    return v / 2**30


def _peak_ratio(memory: dict[str, Any]) -> float:
    cand = memory_value(memory, "peak_used_bytes", "candidate")
    base = memory_value(memory, "peak_used_bytes", "baseline")
    if cand is None or not base:
        raise Missing("peak_used_bytes of both runs needed")
    return cand / base


def _kld_key(key: str) -> Callable[[dict[str, Any]], float]:
    return lambda kld: _req(kld, key)


TASK_RULES: dict[str, Rule] = {
    "min_paired": Rule(Field(int, check=positive), "min", lambda t: _req(t, "n_paired"), "paired items"),
    "min_accuracy": Rule(Field(float, check=_fraction), "min", _candidate_accuracy, "candidate accuracy"),
    "max_accuracy_drop": Rule(Field(float), "max", _accuracy_drop, "accuracy drop (baseline - candidate)"),
    "max_losses": Rule(Field(int, check=non_negative), "max", lambda t: _ids(t, "losses"), "losses"),
    "max_flip_rate": Rule(Field(float, check=_fraction), "max", _flip_rate, "flip rate"),
    "fail_on_significant_loss": Rule(Field(bool), "flag", lambda t: _mcnemar_p(t), "McNemar p"),
    "min_delta_ci_low": Rule(Field(float), "min", _delta_ci_low, "delta CI95 low"),
    "max_excluded": Rule(Field(int, check=non_negative), "max", lambda t: _ids(t, "excluded"), "excluded items"),
}
TASK_OPTIONS: dict[str, Field] = {"alpha": Field(float, default=0.05, check=lambda v: None if 0 < v < 1
                                                  else "must be between 0 and 1 (exclusive)")}

SECTION_RULES: dict[str, dict[str, Rule]] = {
    "kld": {
        **{f"max_{k}": Rule(Field(float, check=non_negative), "max", _kld_key(k), f"KLD {k}")
           for k in ("mean", "median", "p90", "p95", "p99", "p999", "max")},
        "min_same_top_p": Rule(Field(float, check=_fraction), "min", _kld_key("same_top_p"), "same top p"),
        "max_ppl_ratio": Rule(Field(float, check=positive), "max", _kld_key("ppl_ratio"), "PPL ratio"),
        "max_rms_delta_p": Rule(Field(float, check=non_negative), "max", _rms_delta_p, "RMS delta p"),
        "min_router_agreement": Rule(Field(float, check=_fraction), "min", _min_router_agreement,
                                     "router agreement (worst layer)"),
    },
    "speed": {
        "min_decode_ratio": Rule(Field(float, check=positive), "min", _speed("decode_tok_s", min),
                                 "decode tok/s ratio (worst length)"),
        "min_prefill_ratio": Rule(Field(float, check=positive), "min", _speed("prefill_tok_s", min),
                                  "prefill tok/s ratio (worst length)"),
        "max_ttft_ratio": Rule(Field(float, check=positive), "max", _speed("ttft_s", max),
                               "TTFT ratio (worst length)"),
    },
    "needle": {
        "min_found": Rule(Field(int, check=non_negative), "min", _needle("found_candidate"), "cells found"),
        "max_lost": Rule(Field(int, check=non_negative), "max", _needle("lost"), "cells lost"),
        "min_found_share": Rule(Field(float, check=_fraction), "min", _needle("found_share"),
                                "share of cells found"),
    },
    "memory": {
        "max_peak_used_gib": Rule(Field(float, check=positive), "max", _peak_gib, "candidate peak used GiB"),
        "max_peak_used_ratio": Rule(Field(float, check=positive), "max", _peak_ratio, "peak used ratio"),
    },
}


@dataclass
class Check:
    section: str          # "gsm8k", "kld", ...
    rule: str
    value: str
    limit: str
    passed: bool
    message: str


class GateInputError(Exception):
    """Usage or input error (exit 2)."""


# --- rules ------------------------------------------------------------------------------------

def load_rules(path: str | os.PathLike[str]) -> list[tuple[str, bool, dict[str, Any]]]:
    """Parse and validate the rules file: [(section, is_task, settings)]; errors name file and key."""
    p = Path(path)
    raw = load_toml(p)
    out: list[tuple[str, bool, dict[str, Any]]] = []
    task_schema = {**{k: r.field for k, r in TASK_RULES.items()}, **TASK_OPTIONS}

    def add_task(name: str, table: Any, where: str) -> None:
        settings = validate(table, task_schema, where)
        if "alpha" in table and "fail_on_significant_loss" not in table:
            raise ProfileError(f"{where}: key 'alpha' is only used with 'fail_on_significant_loss'")
        out.append((name, True, settings))

    for name, table in raw.items():
        where = f"{p} [{name}]"
        if not isinstance(table, dict):
            raise ProfileError(f"{p}: key {name!r} must be a table ([{name}]) of rules, got {table!r}")
        if name == "tasks":
            for tname, ttable in table.items():
                if not isinstance(ttable, dict):
                    raise ProfileError(f"{p}: key 'tasks.{tname}' must be a table of rules, got {ttable!r}")
                add_task(tname, ttable, f"{p} [tasks.{tname}]")
        elif name in SECTION_RULES:
            out.append((name, False, validate(table, {k: r.field for k, r in SECTION_RULES[name].items()}, where)))
        else:
            add_task(name, table, where)
    if not any(any(k != "alpha" for k in s) for _, _, s in out):
        raise ProfileError(f"{p}: no rules; a gate with nothing to check would always pass")
    return out


# --- evaluation -------------------------------------------------------------------------------

def fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if v.is_integer() and abs(v) < 1e9:
            return str(int(v))
        return f"{v:.4g}"
    return str(v)


def evaluate(compare: dict[str, Any], rules: list[tuple[str, bool, dict[str, Any]]]) -> list[Check]:
    checks: list[Check] = []
    tasks = compare.get("tasks") if isinstance(compare.get("tasks"), dict) else {}
    for section, is_task, settings in rules:
        table = TASK_RULES if is_task else SECTION_RULES[section]
        if is_task:
            data = tasks.get(section)
            absent = (f"task {section!r} is not in compare.json (tasks there: "
                      f"{', '.join(sorted(tasks)) or 'none'})")
        else:
            data = compare.get(section)
            absent = f"section {section!r} is not in compare.json"
        for name, limit in settings.items():
            if name not in table:
                continue              # options such as alpha
            rule = table[name]
            shown_limit = _limit_text(rule, limit)
            if not isinstance(data, dict) or not data:
                checks.append(Check(section, name, "missing", shown_limit, False, absent))
                continue
            try:
                value = rule.get(data)
            except Missing as e:
                checks.append(Check(section, name, "missing", shown_limit, False,
                                    f"{section}: {e} in compare.json; cannot check {rule.what}"))
                continue
            checks.append(_judge(section, name, rule, value, limit, data, settings))
    return checks


def _limit_text(rule: Rule, limit: Any) -> str:
    if rule.kind == "flag":
        return "not (losses > wins and p < alpha)" if limit else "off"
    return f"{'<=' if rule.kind == 'max' else '>='} {fmt(limit)}"


def _judge(section: str, name: str, rule: Rule, value: float, limit: Any, data: dict[str, Any],
           settings: dict[str, Any]) -> Check:
    if rule.kind == "flag":
        alpha = settings.get("alpha", 0.05)
        wins, losses = _ids(data, "wins"), _ids(data, "losses")
        shown = f"p={value:.3g} ({losses} loss{'es' if losses != 1 else ''}, {wins} win{'s' if wins != 1 else ''})"
        if not limit:
            return Check(section, name, shown, "off", True, "rule switched off")
        significant = losses > wins and value < alpha
        msg = (f"{section}: losses ({losses}) outnumber wins ({wins}) with McNemar p = {value:.3g} < {alpha}"
               if significant else f"{section}: no significant loss (p = {value:.3g}, alpha {alpha})")
        return Check(section, name, shown, f"not (losses > wins and p < {alpha})", not significant, msg)
    ok = value <= limit if rule.kind == "max" else value >= limit
    if not math.isfinite(value):
        ok = False
    msg = f"{section}: {rule.what} = {fmt(value)}, {'within' if ok else 'breaks'} the limit {_limit_text(rule, limit)}"
    return Check(section, name, fmt(value), _limit_text(rule, limit), ok, msg)


# --- outputs ----------------------------------------------------------------------------------

def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def summary_markdown(checks: list[Check], compare: dict[str, Any], rules_path: Path) -> str:
    failed = [c for c in checks if not c.passed]
    base = (compare.get("baseline") or {}).get("label") if isinstance(compare.get("baseline"), dict) else None
    cand = (compare.get("candidate") or {}).get("label") if isinstance(compare.get("candidate"), dict) else None
    lines = [f"## moebench gate: {'FAIL' if failed else 'PASS'} "
             f"({len(checks) - len(failed)}/{len(checks)} rules hold)", ""]
    if base or cand:
        lines += [f"Candidate `{_md(str(cand or '?'))}` against baseline `{_md(str(base or '?'))}`; "
                  f"rules from `{_md(str(rules_path))}`.", ""]
    lines += ["| rule | value | limit | result |", "|---|---|---|---|"]
    for c in checks:
        lines.append(f"| {_md(c.section)}.{_md(c.rule)} | {_md(c.value)} | {_md(c.limit)} | "
                     f"{'PASS' if c.passed else '**FAIL**'} |")
    if failed:
        lines += ["", "Failures:", ""] + [f"- {_md(c.message)}" for c in failed]
    return "\n".join(lines) + "\n"


def junit_xml(checks: list[Check]) -> bytes:
    failures = sum(1 for c in checks if not c.passed)
    suites = ET.Element("testsuites", name="moebench gate", tests=str(len(checks)), failures=str(failures))
    suite = ET.SubElement(suites, "testsuite", name="moebench gate", tests=str(len(checks)),
                          failures=str(failures), errors="0", skipped="0")
    for c in checks:
        case = ET.SubElement(suite, "testcase", classname=f"moebench.gate.{c.section}", name=c.rule)
        ET.SubElement(case, "system-out").text = f"value {c.value}; limit {c.limit}"
        if not c.passed:
            ET.SubElement(case, "failure", message=c.message, type="GateFailure").text = c.message
    ET.indent(suites)
    return ET.tostring(suites, encoding="utf-8", xml_declaration=True)


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


# --- entry points -----------------------------------------------------------------------------

def _load_compare(compare_dir: Path) -> dict[str, Any]:
    path = compare_dir / "compare.json"
    if not compare_dir.is_dir():
        raise GateInputError(f"{compare_dir}: not a directory")
    if not path.is_file():
        raise GateInputError(f"{path}: not found (run `moebench compare` first)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise GateInputError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise GateInputError(f"{path}: expected a JSON object")
    return data


def run_gate(compare_dir: str | os.PathLike[str], rules_path: str | os.PathLike[str], as_json: bool = False) -> int:
    """Check `compare_dir/compare.json` against the rules; write summary.md and junit.xml; exit code.

    Prints the Markdown summary, or with `as_json` one JSON object: {"passed", "exit_code", "checks"}.
    """
    cdir, rpath = Path(compare_dir), Path(rules_path)
    try:
        compare = _load_compare(cdir)
        rules = load_rules(rpath)
    except (GateInputError, ProfileError) as e:
        print(f"moebench gate: error: {e}", file=sys.stderr)
        if cdir.is_dir():   # let CI show why, next to where the table would be
            _write(cdir / SUMMARY_FILE, f"## moebench gate: ERROR\n\n{_md(str(e))}\n".encode())
        if as_json:
            print(json.dumps({"passed": False, "exit_code": 2, "rules": str(rpath), "error": str(e), "checks": []},
                             sort_keys=True))
        return 2
    checks = evaluate(compare, rules)
    summary = summary_markdown(checks, compare, rpath)
    _write(cdir / SUMMARY_FILE, summary.encode("utf-8"))
    _write(cdir / JUNIT_FILE, junit_xml(checks))
    code = 1 if any(not c.passed for c in checks) else 0
    if as_json:
        print(json.dumps({"passed": code == 0, "exit_code": code, "rules": str(rpath),
                          "checks": [asdict(c) for c in checks]}, sort_keys=True))
    else:
        print(summary, end="")
    return code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moebench gate", description="Check a compare directory against rules.")
    parser.add_argument("compare_dir")
    parser.add_argument("--rules", required=True, help="rules TOML (see gates/example.toml)")
    args = parser.parse_args(argv)
    return run_gate(args.compare_dir, args.rules)


if __name__ == "__main__":
    sys.exit(main())
