"""The gate's entry points: `run_gate` over a compare directory (or a several-candidate one), `main`.

`run_gate(compare_dir, rules_path) -> int` reads compare.json (as `CompareDoc`) and the rules file,
evaluates, writes summary.md, junit.xml and gate.json into the compare directory (atomically), redraws
an existing report.html so it opens with the verdict, and prints the summary (or gate.json's content).
Exit 2 on a usage or input error, with the file and key in the message.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from moebench import jsonout
from moebench.config import ProfileError
from moebench.gate.evaluation import evaluate
from moebench.gate.rules import load_gate_options, load_rules
from moebench.gate.summary import EXIT_INCONCLUSIVE, GATE_FILE, JUNIT_FILE, SUMMARY_FILE, Verdict, md
from moebench.store.records import CompareDoc, RecordError


class GateInputError(Exception):
    """Usage or input error (exit 2)."""


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _load_compare(compare_dir: Path) -> CompareDoc:
    path = compare_dir / "compare.json"
    if not compare_dir.is_dir():
        raise GateInputError(f"{compare_dir}: not a directory")
    if not path.is_file():
        raise GateInputError(f"{path}: not found (run `moebench compare` first)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise GateInputError(f"{path}: not valid JSON ({e})") from None
    try:
        return CompareDoc.from_dict(data, str(path))
    except RecordError as e:
        raise GateInputError(str(e)) from None


def _matrix_pairs(cdir: Path) -> list[Path] | None:
    """The per-candidate compare directories of a several-candidate compare (matrix.json), else None."""
    path = cdir / "matrix.json"
    if (cdir / "compare.json").is_file() or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        named = [c["compare_dir"] for c in data["candidates"]]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise GateInputError(f"{path}: not a moebench matrix ({type(e).__name__}: {e})") from None
    return [_inside(cdir, path, f"candidates[{i}].compare_dir", d) for i, d in enumerate(named)]


def _inside(cdir: Path, matrix: Path, key: str, named: Any) -> Path:
    """A candidate's compare directory, which must lie inside the compare directory: the gate writes
    summary.md, junit.xml, gate.json and report.html there, and an edited matrix.json must not point
    those writes elsewhere (an absolute path, `..`, or a symlink leading out are all refused)."""
    if not isinstance(named, str) or not named or named in (".", "./"):
        raise GateInputError(f"{matrix}: key {key!r} must name a sub-directory of {cdir}, got {named!r}")
    root = cdir.resolve()
    target = (cdir / named).resolve()
    if Path(named).is_absolute() or root not in target.parents:
        raise GateInputError(f"{matrix}: key {key!r} = {named!r} leads to {target}, outside the compare "
                             f"directory {root}; the gate writes only inside it")
    return cdir / named


def run_gate(compare_dir: str | os.PathLike[str], rules_path: str | os.PathLike[str], as_json: bool = False,
             quiet: bool = False) -> int:
    """Check `compare_dir/compare.json` against the rules; write summary.md, junit.xml, gate.json; exit code.

    A several-candidate compare directory (matrix.json) gates every candidate's directory with the same
    rules; its exit code is the worst (1 over 3 over 0) and its summary.md joins theirs.
    Prints the Markdown summary, or with `as_json` gate.json's content (for several candidates
    {"exit_code", "candidates": [...]}; on an input error {"exit_code": 2, "error"}).
    """
    cdir, rpath = Path(compare_dir), Path(rules_path)
    try:
        pairs = _matrix_pairs(cdir) if cdir.is_dir() else None
    except GateInputError as e:
        print(f"moebench gate: error: {e}", file=sys.stderr)
        if as_json:
            print(jsonout.dumps({"exit_code": 2, "error": str(e), "rules_file": str(rpath)}))
        return 2
    if pairs is not None:
        codes = [run_gate(p, rpath, quiet=as_json or quiet) for p in pairs]
        code = 2 if 2 in codes else 1 if 1 in codes else EXIT_INCONCLUSIVE if EXIT_INCONCLUSIVE in codes else 0
        parts = [(p / SUMMARY_FILE).read_text(encoding="utf-8") for p in pairs if (p / SUMMARY_FILE).is_file()]
        _write(cdir / SUMMARY_FILE, ("\n".join(parts)).encode("utf-8"))
        _rerender(cdir)
        if as_json:
            print(jsonout.dumps({"exit_code": code, "candidates": [
                {"compare_dir": str(p), **(json.loads((p / GATE_FILE).read_text()) if (p / GATE_FILE).is_file()
                                           else {"exit_code": c})} for p, c in zip(pairs, codes)]}))
        return code
    try:
        compare = _load_compare(cdir)
        rules = load_rules(rpath)
        options = load_gate_options(rpath)
    except (GateInputError, ProfileError) as e:
        print(f"moebench gate: error: {e}", file=sys.stderr)
        if cdir.is_dir():   # let CI show why, next to where the table would be
            _write(cdir / SUMMARY_FILE, f"## moebench gate: ERROR\n\n{md(str(e))}\n".encode())
        if as_json:
            print(jsonout.dumps({"exit_code": 2, "error": str(e), "rules_file": str(rpath)}))
        return 2
    verdict = Verdict(evaluate(compare, rules, options.correction), rpath, options.on_inconclusive)
    summary = verdict.markdown(compare)
    try:                 # the figures behind the verdict, as `moebench compare` summarised them
        from moebench.compare.tables import matrix_row, summary_markdown as results_markdown
        details = results_markdown([compare], [matrix_row(compare)])
    except Exception as e:      # a hand-edited compare.json: the verdict still stands
        details = f"(results summary unavailable: {type(e).__name__}: {e})\n"
    _write(cdir / SUMMARY_FILE, (summary + "\n" + details.replace("## moebench compare", "### moebench compare", 1)
                                 ).encode("utf-8"))
    _write(cdir / JUNIT_FILE, verdict.junit_xml())
    verdicts = verdict.to_json()
    _write(cdir / GATE_FILE, (jsonout.document_text(verdicts, indent=2) + "\n").encode("utf-8"))
    _rerender(cdir)
    if as_json:
        print(jsonout.document_text(verdicts))
    elif not quiet:
        print(summary, end="")
    return verdict.exit_code


def _rerender(cdir: Path) -> None:
    """The report opens with the verdict: render an existing report.html again after a gate."""
    if not (cdir / "report.html").is_file():
        return
    try:
        from moebench.report.render import render
        render(cdir)
    except Exception as e:                # the verdict stands even if the report cannot be redrawn
        print(f"moebench gate: warning: report.html not updated ({type(e).__name__}: {e})", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moebench gate", description="Check a compare directory against rules.")
    parser.add_argument("compare_dir")
    parser.add_argument("--rules", required=True, help="rules TOML (see gates/example.toml)")
    args = parser.parse_args(argv)
    return run_gate(args.compare_dir, args.rules)

