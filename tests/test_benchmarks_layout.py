"""benchmarks/ holds scripts and the latest results of record, nothing else: the code the scripts
share is the package moebench.bench, imported like any module (no script or test edits sys.path),
benchmarks/results keeps at most MAX_RESULTS files (older results are in git's history), and every
`benchmarks/results/...` path that a doc, script, test or module names is there."""
from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MAX_RESULTS = 20


def sys_path_edits(files: list[Path]) -> list[str]:
    """`file:line` of every call on sys.path (insert, append, extend, ...) or assignment to it."""
    found = []
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            target = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                target = node.func.value
            elif isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                target = next((t for t in targets if ast.unparse(t) == "sys.path"), None)
            if target is not None and ast.unparse(target) == "sys.path":
                found.append((str(path.relative_to(path.parents[1])), node.lineno))
    return [f"{name}:{line}" for name, line in sorted(found)]


def named_results(text: str) -> set[str]:
    """The benchmarks/results paths `text` names, braces expanded (`x.{json,log}`); a glob stays a glob."""
    out = set()
    for m in re.finditer(r"benchmarks/results/([\w./*{},-]*[\w*}])", text):
        parts = re.split(r"\{([^}]*)\}", m.group(1))
        choices = [p.split(",") if i % 2 else [p] for i, p in enumerate(parts)]
        out |= {"".join(c) for c in itertools.product(*choices)}
    return out


def missing_results(root: Path = ROOT) -> list[str]:
    """`source: name` for each named results path that matches no file or folder under benchmarks/results."""
    results = root / "benchmarks" / "results"
    sources = [*root.glob("docs/*.md"), root / "README.md", *root.glob("benchmarks/*.py"), *root.glob("benchmarks/*.sh"),
               *root.glob("tests/*.py"), *root.glob("moebench/**/*.py")]
    gone = []
    for src in sources:
        if not src.is_file() or src.name == Path(__file__).name:
            continue
        for name in sorted(named_results(src.read_text(encoding="utf-8"))):
            if not any(results.glob(name.rstrip("/.") or ".")):
                gone.append(f"{src.relative_to(root)}: benchmarks/results/{name}")
    return gone


def test_no_script_or_test_edits_sys_path() -> None:
    files = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("tests/*.py")])
    assert len(files) > 20
    assert sys_path_edits(files) == []


def test_results_keep_the_latest_of_record_only() -> None:
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    assert 0 < len(files) <= MAX_RESULTS, sorted(str(p.relative_to(RESULTS)) for p in files)


def test_every_named_result_is_there() -> None:
    assert missing_results() == []


def test_the_checks_see_an_edit_a_missing_result_and_braces(tmp_path: Path) -> None:
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "a.json").write_text("{}")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "x.md").write_text("see benchmarks/results/a.{json,log} and benchmarks/results/a.*\n")
    script = tmp_path / "benchmarks" / "s.py"
    script.write_text("import sys\nsys.path.insert(0, '.')\nsys.path = []\nprint(sys.path)\n")
    assert sys_path_edits([script]) == ["benchmarks/s.py:2", "benchmarks/s.py:3"]
    assert named_results("benchmarks/results/a.{json,log}, benchmarks/results/rig/") == {"a.json", "a.log", "rig"}
    assert missing_results(tmp_path) == ["docs/x.md: benchmarks/results/a.log"]
