"""The gate's verdict over all its rules: the exit code and the three files CI reads.

`Verdict` holds the RuleResults of one compare directory with the rules file and its [gate]
on_inconclusive; it gives the overall verdict, the exit code (0 pass, 1 a rule failed, 3 inconclusive
and no failure, unless on_inconclusive maps that to 1 or 0), summary.md (`markdown`, a table for
`$GITHUB_STEP_SUMMARY`), junit.xml (`junit_xml`, a testcase per rule; an inconclusive rule is a skipped
testcase with its reason) and gate.json (`to_json`, which the report shows first).
"""
from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from moebench.gate.evaluation import RuleResult
from moebench.gate.rules import OnInconclusive
from moebench.json_types import JsonObject
from moebench.store.records import CompareDoc

SUMMARY_FILE = "summary.md"
JUNIT_FILE = "junit.xml"
GATE_FILE = "gate.json"
EXIT_INCONCLUSIVE = 3

RESULT_TEXT = {"pass": "PASS", "fail": "**FAIL**", "inconclusive": "*INCONCLUSIVE*"}


def md(text: str) -> str:
    """Text made safe for one Markdown table cell or list line."""
    return text.replace("|", "\\|").replace("\n", " ")


@dataclass(frozen=True)
class Verdict:
    """Every rule's result for one compare directory, and what they add up to."""

    results: list[RuleResult]
    rules_file: Path
    on_inconclusive: OnInconclusive = "exit3"

    @property
    def overall(self) -> str:
        """"fail" when any rule failed, else "inconclusive" when any is, else "pass"."""
        if any(c.verdict == "fail" for c in self.results):
            return "fail"
        return "inconclusive" if any(c.verdict == "inconclusive" for c in self.results) else "pass"

    @property
    def exit_code(self) -> int:
        verdict = self.overall
        if verdict == "fail":
            return 1
        if verdict == "inconclusive":
            return {"exit3": EXIT_INCONCLUSIVE, "fail": 1, "pass": 0}[self.on_inconclusive]
        return 0

    def markdown(self, compare: CompareDoc) -> str:
        """summary.md's verdict part: the headline, the pair, a row per rule, then why rules failed or
        could not be judged."""
        checks = self.results
        failed = [c for c in checks if c.verdict == "fail"]
        unsure = [c for c in checks if c.verdict == "inconclusive"]
        held = len(checks) - len(failed) - len(unsure)
        counts = f"{held}/{len(checks)} rules hold" + (f", {len(unsure)} inconclusive" if unsure else "")
        base, cand = compare.baseline.label, compare.candidate.label
        lines = [f"## moebench gate: {self.overall.upper()} ({counts})", ""]
        if base or cand:
            lines += [f"Candidate `{md(str(cand or '?'))}` against baseline `{md(str(base or '?'))}`; "
                      f"rules from `{md(str(self.rules_file))}`.", ""]
        lines += ["| rule | value | limit | result |", "|---|---|---|---|"]
        for c in checks:
            lines.append(f"| {md(c.section)}.{md(c.rule)} | {md(c.value)} | {md(c.limit)} | "
                         f"{RESULT_TEXT[c.verdict]} |")
        if failed:
            lines += ["", "Failures:", ""] + [f"- {md(m)}" for m in _reasons(failed)]
        if unsure:
            effect = {"exit3": f"exit code {EXIT_INCONCLUSIVE}", "fail": "counted as failures",
                      "pass": "not failing the gate"}[self.on_inconclusive]
            lines += ["", f"Inconclusive ({effect}; measure more samples or see the A/A noise floor):", ""]
            lines += [f"- {md(m)}" for m in _reasons(unsure)]
        return "\n".join(lines) + "\n"

    def junit_xml(self) -> bytes:
        checks = self.results
        failures = sum(1 for c in checks if c.verdict == "fail")
        skipped = sum(1 for c in checks if c.verdict == "inconclusive")
        suites = ET.Element("testsuites", name="moebench gate", tests=str(len(checks)), failures=str(failures))
        suite = ET.SubElement(suites, "testsuite", name="moebench gate", tests=str(len(checks)),
                              failures=str(failures), errors="0", skipped=str(skipped))
        for c in checks:
            case = ET.SubElement(suite, "testcase", classname=f"moebench.gate.{c.section}", name=c.rule)
            ET.SubElement(case, "system-out").text = f"value {c.value}; limit {c.limit}"
            if c.verdict == "fail":
                ET.SubElement(case, "failure", message=c.message, type="GateFailure").text = c.message
            elif c.verdict == "inconclusive":
                ET.SubElement(case, "skipped", message=c.message).text = c.message
        ET.indent(suites)
        return ET.tostring(suites, encoding="utf-8", xml_declaration=True)

    def to_json(self) -> JsonObject:
        """gate.json: the verdict and every rule's, for the report's opening table."""
        return {"verdict": self.overall, "exit_code": self.exit_code, "rules_file": str(self.rules_file),
                "checks": [{"section": c.section, "rule": c.rule, "value": c.value, "limit": c.limit,
                            "verdict": c.verdict, "message": c.message} for c in self.results]}


def _reasons(checks: list[RuleResult]) -> list[str]:
    """One line per check, except that checks sharing a section-wide cause share one line naming
    their rules (a missing kld section is one line, not one per KLD rule)."""
    lines: list[str] = []
    line_of: dict[tuple[str, str], int] = {}        # (section, cause) -> its line
    rules: dict[int, list[str]] = {}                # line -> the rules sharing it
    for c in checks:
        if not c.cause:
            lines.append(c.message)
            continue
        i = line_of.setdefault((c.section, c.cause), len(lines))
        if i == len(lines):
            lines.append(c.cause)
        rules.setdefault(i, []).append(c.rule)
    return [f"{line} (rule{'s' if len(rules[i]) > 1 else ''} {', '.join(rules[i])})" if i in rules else line
            for i, line in enumerate(lines)]
