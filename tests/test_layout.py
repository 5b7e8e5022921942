"""The package layout of docs/architecture.md, checked on the source with `ast`.

A package is the first component under moebench/ (`moebench/compare/tables.py` is in `compare`,
`moebench/api.py` is `api`). Every import counts, including the lazy ones inside functions, since a
lazy import is still a dependency. The checks:

- the package import graph has no cycle (no package imports one that imports it back, directly or
  through others);
- the module import graph has no cycle either, inside a package as between packages (a module is a
  file; `from a import b` is an import of module a.b where that is a file, else of a);
- the engine imports nothing else of moebench;
- no module assigns to an attribute of another module it imported (`othermod.X = ...`,
  `setattr(othermod, ...)`): settings travel as arguments, never as another module's globals;
- docs/architecture.md names every module by its path under moebench/ (`engine/ssd.py`; a
  package's `__init__.py` by its folder, `engine/kernels/`) and names no `.py` path that is not there.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "moebench"
ARCHITECTURE = ROOT.parent / "docs" / "architecture.md"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(dotted: str, root: Path) -> bool:
    """Whether `dotted` (moebench.x.y) names a module or package file under root."""
    rel = Path(*dotted.split(".")[1:]) if "." in dotted else Path()
    base = root / rel
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _imports(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute dotted name) of every import in the tree; `from a import b` yields a.b."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                if not is_package:
                    base = base[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
    return out


Graph = tuple[dict[str, set[str]], dict[tuple[str, str], list[str]]]


def _graph(root: Path, node_of, target_of) -> Graph:
    """Edges between nodes of `root`'s source and, per edge, where it comes from: node_of(module)
    names a file's node, target_of(imported name, source node) the node it imports (None: no edge)."""
    edges: dict[str, set[str]] = {}
    where: dict[tuple[str, str], list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root)
        src = node_of(module)
        edges.setdefault(src, set())
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for line, name in _imports(tree, module, path.name == "__init__.py"):
            target = target_of(name, src) if name.split(".")[0] == root.name else None
            if target is None:
                continue
            edges[src].add(target)
            at = where.setdefault((src, target), [])
            if f"{path.relative_to(root.parent)}:{line}" not in at:
                at.append(f"{path.relative_to(root.parent)}:{line}")
    return edges, where


def package_graph(root: Path = ROOT) -> Graph:
    """Edges between packages of `root` (a moebench source tree) and, per edge, where it comes from."""
    def package(name: str, src: str) -> str | None:
        parts = name.split(".")
        return None if len(parts) < 2 or parts[1] in (src, "__version__") else parts[1]
    return _graph(root, lambda module: module.split(".")[1] if "." in module else "__init__", package)


def module_graph(root: Path = ROOT) -> Graph:
    """Edges between the modules (files) of `root` and, per edge, where it comes from."""
    def module(name: str, src: str) -> str | None:
        target = name if _is_module(name, root) else name.rsplit(".", 1)[0]
        return None if target == src or not _is_module(target, root) else target
    return _graph(root, lambda module: module, module)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def foreign_module_writes(root: Path = ROOT) -> list[str]:
    """`file:line name.attr` for every assignment (or setattr) onto a module the file imported."""
    found = []
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        modules: set[str] = set()              # local names bound to imported modules
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    modules.add(a.asname or a.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                for line, name in _imports(ast.Module(body=[node], type_ignores=[]), module,
                                           path.name == "__init__.py"):
                    if name.split(".")[0] == root.name and _is_module(name, root):
                        modules.add(next(a.asname or a.name for a in node.names
                                         if name.endswith("." + a.name)))
        if not modules:
            continue

        def root_name(expr: ast.expr) -> str | None:
            while isinstance(expr, ast.Attribute):
                expr = expr.value
            return expr.id if isinstance(expr, ast.Name) else None

        for node in ast.walk(tree):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Delete):
                targets = node.targets
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("setattr", "delattr") and node.args):
                if root_name(node.args[0]) in modules:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.func.id}({ast.unparse(node.args[0])}, ...)")
                continue
            flat: list[ast.expr] = []
            for t in targets:
                flat += list(t.elts) if isinstance(t, (ast.Tuple, ast.List)) else [t]
            for t in flat:
                if isinstance(t, ast.Attribute) and root_name(t) in modules:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {ast.unparse(t)}")
    return found


def test_no_package_import_cycle() -> None:
    edges, where = package_graph()
    assert {"api", "cli", "compare", "report", "store", "engine", "tasks"} <= set(edges), sorted(edges)
    bad = cycles(edges)
    detail = [f"{a} -> {b}: {where[(a, b)][:3]}" for comp in bad for a in comp for b in comp
              if b in edges.get(a, ())]
    assert not bad, f"package import cycles {bad}; the edges inside them: {detail}"


def test_no_module_import_cycle() -> None:
    edges, where = module_graph()
    assert {"moebench.engine.placement", "moebench.engine.ssd", "moebench.engine.ssd_slots"} <= set(edges)
    bad = cycles(edges)
    detail = [f"{a} -> {b}: {where[(a, b)][:3]}" for comp in bad for a in comp for b in comp
              if b in edges.get(a, ())]
    assert not bad, f"module import cycles {bad}; the edges inside them: {detail}"


def test_engine_imports_nothing_else_of_moebench() -> None:
    edges, where = package_graph()
    assert not edges["engine"], {b: where[("engine", b)] for b in edges["engine"]}


def test_no_module_writes_another_modules_attributes() -> None:
    assert foreign_module_writes() == []


def architecture_gaps(root: Path = ROOT, doc: Path = ARCHITECTURE) -> tuple[list[str], list[str]]:
    """(modules the doc does not name, `.py` paths the doc names that exist neither under root nor
    under the repository root). Names count in backticks only."""
    named = set(re.findall(r"`([\w./-]+)`", doc.read_text(encoding="utf-8")))
    missing = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        want = f"{rel.parent.as_posix()}/" if path.name == "__init__.py" else rel.as_posix()
        if want != "./" and want not in named:
            missing.append(want)
    stale = sorted(n for n in named if n.endswith(".py") and not (root / n).is_file()
                   and not (root.parent / n).is_file())
    return missing, stale


def test_every_package_ships_in_the_wheel() -> None:
    """pyproject.toml lists its packages (the templates need a mapping): each folder of moebench/
    with an __init__.py must be among them, or `pip install .` leaves it out."""
    import tomllib
    listed = set(tomllib.loads((ROOT.parent / "pyproject.toml").read_text(encoding="utf-8"))
                 ["tool"]["setuptools"]["packages"])
    here = {_module_name(p, ROOT) for p in ROOT.rglob("__init__.py")}
    assert here - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"


def test_architecture_doc_names_every_module() -> None:
    missing, stale = architecture_gaps()
    assert not missing, f"{ARCHITECTURE.name} does not name these modules (by their path under moebench/): {missing}"
    assert not stale, f"{ARCHITECTURE.name} names modules that are not in the tree: {stale}"


def test_architecture_check_sees_a_missing_and_a_stale_name(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"__init__.py": "", "engine/__init__.py": "", "engine/ssd.py": "", "api.py": ""})
    doc = tmp_path / "architecture.md"
    doc.write_text("`engine/`: `engine/placement.py`; `api.py`\n", encoding="utf-8")
    assert architecture_gaps(root, doc) == (["engine/ssd.py"], ["engine/placement.py"])
    doc.write_text("`engine/`: `engine/ssd.py`; `api.py`\n", encoding="utf-8")
    assert architecture_gaps(root, doc) == ([], [])


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "moebench"
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    return root


def test_checks_catch_a_cycle_and_a_foreign_write(tmp_path: Path) -> None:
    """The checks themselves: a three-package cycle through a lazy relative import and a module
    attribute write are found; the same tree without them is clean."""
    root = _tree(tmp_path, {
        "__init__.py": "",
        "a/__init__.py": "from moebench.b import thing\n",
        "b/__init__.py": "thing = 1\nimport moebench.c.mod as m\n",
        "c/__init__.py": "",
        "c/mod.py": "def f():\n    from ..a import x\n",
        "d.py": "from moebench.c import mod\nimport moebench.b\nmod.SWITCH = 3\nmoebench.b.thing += 1\n"
                "setattr(mod, 'X', 1)\nlocal = object()\nlocal.y = 2\n",
    })
    edges, where = package_graph(root)
    assert edges["a"] == {"b"} and edges["b"] == {"c"} and edges["c"] == {"a"}
    assert where[("c", "a")] == ["moebench/c/mod.py:2"]
    assert cycles(edges) == [["a", "b", "c"]]
    assert foreign_module_writes(root) == ["moebench/d.py:3 mod.SWITCH", "moebench/d.py:4 moebench.b.thing",
                                           "moebench/d.py:5 setattr(mod, ...)"]
    modules, where = module_graph(root)
    assert modules["moebench.c.mod"] == {"moebench.a"} and where[("moebench.c.mod", "moebench.a")] == ["moebench/c/mod.py:2"]
    assert cycles(modules) == [["moebench.a", "moebench.b", "moebench.c.mod"]]
    (root / "c/mod.py").write_text("def f():\n    pass\n", encoding="utf-8")
    (root / "d.py").write_text("from moebench.c import mod\nlocal = object()\nlocal.y = mod\n", encoding="utf-8")
    edges, _ = package_graph(root)
    assert cycles(edges) == [] and foreign_module_writes(root) == []


def test_module_check_catches_a_cycle_inside_one_package(tmp_path: Path) -> None:
    """Two modules of one package that import each other (one lazily, inside a function, by a
    relative name) are a module cycle the package graph cannot see; a third module that both
    import instead is clean."""
    root = _tree(tmp_path, {
        "__init__.py": "",
        "engine/__init__.py": "",
        "engine/placement.py": "from .quant import Q\ndef f():\n    from .ssd import TABLE\n",
        "engine/ssd.py": "from .placement import Expert\nTABLE = {}\n",
        "engine/quant.py": "Q = 1\n",
    })
    assert cycles(package_graph(root)[0]) == []
    edges, where = module_graph(root)
    assert cycles(edges) == [["moebench.engine.placement", "moebench.engine.ssd"]]
    assert where[("moebench.engine.placement", "moebench.engine.ssd")] == ["moebench/engine/placement.py:3"]
    (root / "engine/types.py").write_text("Expert = 1\nTABLE = {}\n", encoding="utf-8")
    (root / "engine/placement.py").write_text("from .types import TABLE, Expert\n", encoding="utf-8")
    (root / "engine/ssd.py").write_text("from .types import Expert\n", encoding="utf-8")
    edges, _ = module_graph(root)
    assert cycles(edges) == [] and edges["moebench.engine.ssd"] == {"moebench.engine.types"}

