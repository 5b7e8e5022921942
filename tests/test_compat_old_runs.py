"""Run folders written by an earlier moebench still compare, report, gate and trend exactly as that
version did.

tests/data/compat holds run folders that moebench b6f2c5e wrote (README.md there says how: engine and
llama-server runs of every task kind, a speed-ab directory, sampled KLD, an interrupted run), and
golden/ the outputs that the same old code made from them: every file, exit code, stdout and stderr
of the steps in STEPS (and RESUME). Each test copies the folders to a temporary
stage, runs the current code's CLI there, and compares byte for byte once the stage's own path is
masked (`mask`). A reader that starts refusing or misreading old data changes an output and fails.

`python tests/test_compat_old_runs.py --write-goldens` rewrites golden/ with whichever moebench is
on PYTHONPATH: README.md runs it with the old code; never with the code under test.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO, moebench_cli

FIXTURES = REPO / "tests" / "data" / "compat"
GOLDEN = FIXTURES / "golden"
STAGED = ("base", "cand", "aa", "cand-partial", "llama-bf16", "llama-q4", "ab", "sampled-base", "sampled-cand",
          "suite.toml", "gate-fail.toml", "gate-inconclusive.toml", "gate-pass.toml", "gate-llama.toml", "gate-ab.toml",
          "gate-sampled.toml")
STAGE_MARK = "<STAGE>"


@dataclass(frozen=True)
class Step:
    """One CLI call on the stage: `copy` (a folder to copy first, as source -> destination) lets a gate
    write its files into its own copy of the compare directory."""
    name: str
    args: tuple[str, ...]
    outputs: tuple[str, ...] = ()
    copy: tuple[str, str] | None = None
    python: bool = False
    """`args` are the Python interpreter's (moebench's Python API), not the CLI's."""


# moebench.results (docs/schema.md's Python loaders) on every old run and on the compares the steps
# before it wrote, as CSV: values, column order and the True/False/None of `correct`.
RESULTS_API = """
from moebench.results import load_compare, load_items, load_matrix
for run in ("base", "cand", "llama-q4"):
    print(f"== load_items({run!r})"); print(load_items(run).to_csv(index=False))
for cmp in ("cmp", "matrix", "cmp-llama"):
    print(f"== load_compare({cmp!r})"); print(load_compare(cmp).to_csv(index=False))
    print(f"== load_matrix({cmp!r})"); print(load_matrix(cmp).to_csv(index=False))
"""
CMP_FILES = ("compare.json", "summary.md", "matrix.csv", "matrix.json", "report.html")
GATE_FILES = ("summary.md", "junit.xml", "gate.json")
STEPS = (
    Step("compare", ("compare", "base", "cand", "--out", "cmp"), tuple(f"cmp/{f}" for f in CMP_FILES)),
    Step("compare-format-json", ("compare", "base", "cand", "--out", "cmp-json", "--format", "json")),
    Step("report-compare", ("report", "cmp", "--out", "report-cmp.html"), ("report-cmp.html",)),
    Step("report-base", ("report", "base", "--out", "report-base.html"), ("report-base.html",)),
    Step("report-cand", ("report", "cand", "--out", "report-cand.html"), ("report-cand.html",)),
    Step("gate-fail", ("gate", "gate-fail", "--rules", "gate-fail.toml"),
         tuple(f"gate-fail/{f}" for f in GATE_FILES), copy=("cmp", "gate-fail")),
    Step("gate-inconclusive", ("gate", "gate-inconclusive", "--rules", "gate-inconclusive.toml"),
         tuple(f"gate-inconclusive/{f}" for f in GATE_FILES), copy=("cmp", "gate-inconclusive")),
    Step("gate-pass", ("gate", "gate-pass", "--rules", "gate-pass.toml", "--json"),
         tuple(f"gate-pass/{f}" for f in GATE_FILES), copy=("cmp", "gate-pass")),
    Step("trend", ("trend", "base", "cand", "--out", "trend"),
         ("trend/trend.csv", "trend/trend.json", "trend/trend.html")),
    # Several candidates: the matrix, and each candidate's own compare (their report.html pages are left
    # out: the same renderer as cmp/report.html; the gated 02_aa page is kept below).
    Step("compare-matrix", ("compare", "base", "cand", "aa", "--out", "matrix"),
         ("matrix/matrix.csv", "matrix/matrix.json", "matrix/summary.md", "matrix/report.html",
          "matrix/01_cand/compare.json", "matrix/01_cand/summary.md", "matrix/02_aa/compare.json",
          "matrix/02_aa/summary.md")),
    # A gate on a matrix judges each candidate in its folder and redraws the reports with the verdicts.
    Step("gate-matrix", ("gate", "gate-matrix", "--rules", "gate-pass.toml"),
         ("gate-matrix/summary.md", "gate-matrix/report.html", "gate-matrix/01_cand/gate.json",
          *(f"gate-matrix/02_aa/{f}" for f in (*GATE_FILES, "report.html"))), copy=("matrix", "gate-matrix")),
    # llama-server runs: its build stamp, and serving load (open-loop groups, goodput, /metrics).
    Step("compare-llama", ("compare", "llama-bf16", "llama-q4", "--out", "cmp-llama"),
         tuple(f"cmp-llama/{f}" for f in CMP_FILES)),
    Step("gate-llama", ("gate", "gate-llama", "--rules", "gate-llama.toml"),
         tuple(f"gate-llama/{f}" for f in GATE_FILES), copy=("cmp-llama", "gate-llama")),
    Step("report-llama-q4", ("report", "llama-q4", "--out", "report-llama-q4.html"), ("report-llama-q4.html",)),
    # A speed-ab directory: gated ([speed_ab]), folded into a run compare, reported.
    Step("gate-ab", ("gate", "gate-ab", "--rules", "gate-ab.toml"),
         tuple(f"gate-ab/{f}" for f in (*GATE_FILES, "report.html")), copy=("ab", "gate-ab")),
    Step("compare-speed-ab", ("compare", "base", "cand", "--speed-ab", "ab", "--out", "cmp-ab"),
         ("cmp-ab/compare.json", "cmp-ab/summary.md", "cmp-ab/report.html")),
    Step("report-ab", ("report", "ab", "--out", "report-ab.html"), ("report-ab.html",)),
    # Sampled KLD (Monte Carlo on the baseline's own continuations).
    Step("compare-sampled", ("compare", "sampled-base", "sampled-cand", "--out", "cmp-sampled"),
         tuple(f"cmp-sampled/{f}" for f in CMP_FILES)),
    Step("gate-sampled", ("gate", "gate-sampled", "--rules", "gate-sampled.toml"),
         tuple(f"gate-sampled/{f}" for f in GATE_FILES), copy=("cmp-sampled", "gate-sampled")),
    Step("results-api", ("-c", RESULTS_API), python=True),
)
# Need the zoo's checkpoints: the runner profile is checked before the run folder is.
RESUME = Step("resume-complete", ("run", "suite.toml", "--runner", "engine-bf16", "--out", "resume-base", "--resume"),
              copy=("base", "resume-base"))
RESUME_INTERRUPTED = Step("resume-interrupted", ("run", "suite.toml", "--runner", "engine-tiered", "--label",
                                                 "cand-partial", "--baseline", "base", "--out", "cand-partial",
                                                 "--resume"))

# Outputs the old code wrote byte-identical to an earlier step's (`report CMP` redraws the page compare
# wrote, a matrix's first candidate is the one-candidate compare): golden/same.json maps each to the
# golden it equals, so that one file is kept once.
SAME_FILE = GOLDEN / "same.json"


def mask(text: str, stage: Path) -> str:
    """`text` with the stage's absolute path (a new temporary folder each time; trend and compare print
    the runs' absolute paths) as STAGE_MARK. It is the only thing masked: the old code wrote the same
    bytes twice in a row, so nothing else (no timestamp, no host name) differs between invocations."""
    return text.replace(str(stage.resolve()), STAGE_MARK).replace(str(stage), STAGE_MARK)


EDGES = re.compile(r'("edges": \[)([^\]]*)(\])')


def same_on_every_cpu(text: str) -> str:
    """`text` with the KLD histograms' bin edges to 12 significant digits. They come from numpy's
    logspace, whose powers run SIMD code chosen by the CPU: with AVX-512 (where the goldens were
    written) and without it they differ in the last bit (9.999999999999999e-06 against 1e-05). No
    other figure in these outputs differs between the two."""
    def edges(m: re.Match) -> str:
        return m[1] + re.sub(r"-?\d[\d.e+-]*", lambda f: format(float(f[0]), ".12g"), m[2]) + m[3]
    return EDGES.sub(edges, text)


def make_stage(root: Path) -> Path:
    stage = root / "stage"
    stage.mkdir()
    for name in STAGED:
        src = FIXTURES / name
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, stage / name)
    return stage


def run_step(step: Step, stage: Path) -> dict[str, object]:
    """The step's exit code, stdout and stderr (masked), as golden/console/<name>.json holds them."""
    if step.copy:
        shutil.copytree(stage / step.copy[0], stage / step.copy[1])
    if step.python:
        proc = subprocess.run([sys.executable, *step.args], cwd=stage, capture_output=True, text=True, timeout=120)
    else:
        proc = moebench_cli(*step.args, cwd=stage, timeout=120)
    return {"args": list(step.args), "exit_code": proc.returncode,
            "stdout": mask(proc.stdout, stage), "stderr": mask(proc.stderr, stage)}


def reads_outputs(step: Step, steps: tuple[Step, ...]) -> bool:
    """Whether `step` reads a folder another step writes (a gate on a compare, `report cmp`); the
    Python steps read the compares by name in their script, so they count as such too."""
    written = {out.split("/")[0] for other in steps if other != step for out in other.outputs if "/" in out}
    return step.python or bool(written & {*step.args, *(step.copy or ())})


def run_all(stage: Path, steps: tuple[Step, ...] = STEPS) -> dict[str, dict[str, object]]:
    """Every step: first those that read only the fixtures, then those that read their outputs; two at
    a time (each is a process that mostly starts Python and imports)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        first = [s for s in steps if not reads_outputs(s, steps)]
        results = dict(zip([s.name for s in first], pool.map(lambda s: run_step(s, stage), first)))
        then = [s for s in steps if reads_outputs(s, steps)]
        results.update(zip([s.name for s in then], pool.map(lambda s: run_step(s, stage), then)))
    return {step.name: results[step.name] for step in steps}


@pytest.fixture(scope="module")
def staged_run(tmp_path_factory) -> tuple[Path, dict[str, dict[str, object]]]:
    """Every step run once by the code under test on a fresh copy of the old folders."""
    stage = make_stage(tmp_path_factory.mktemp("compat"))
    return stage, run_all(stage)


def console_golden(name: str) -> Path:
    """Where a step's exit code, stdout and stderr are kept (its files keep their stage paths)."""
    return GOLDEN / "console" / f"{name}.json"


@pytest.mark.parametrize("step", STEPS, ids=[s.name for s in STEPS])
def test_exit_code_and_console_output_as_before(staged_run, step: Step):
    _stage, results = staged_run
    got, want = results[step.name], json.loads(console_golden(step.name).read_text(encoding="utf-8"))
    assert {**got, "stdout": same_on_every_cpu(got["stdout"])} == {**want, "stdout": same_on_every_cpu(want["stdout"])}


OUTPUTS = [(step, out) for step in STEPS for out in step.outputs]


@pytest.mark.parametrize("step,output", OUTPUTS, ids=[out for _s, out in OUTPUTS])
def test_output_file_as_before(staged_run, step: Step, output: str):
    stage, _results = staged_run
    got = mask((stage / output).read_text(encoding="utf-8"), stage)
    golden = json.loads(SAME_FILE.read_text(encoding="utf-8")).get(output, output)
    got, want = same_on_every_cpu(got), same_on_every_cpu((GOLDEN / golden).read_text(encoding="utf-8"))
    assert got == want, f"{output} differs from golden/{golden} (step {step.name})"


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_steps_leave_the_old_folders_as_they_were(staged_run):
    """compare, report, gate, trend and the loaders only read the run folders (the old code wrote nothing
    into them): no file added, removed or changed."""
    stage, _results = staged_run
    for name in (n for n in STAGED if (FIXTURES / n).is_dir()):
        assert tree_bytes(stage / name) == tree_bytes(FIXTURES / name), name


def test_resume_of_a_complete_old_run_is_refused_as_before_and_leaves_its_records_alone(zoo, tmp_path):
    stage = make_stage(tmp_path)
    assert run_step(RESUME, stage) == json.loads(console_golden(RESUME.name).read_text(encoding="utf-8"))
    for name in ("manifest.json", "items.jsonl", "speed_token_times.jsonl"):
        assert (stage / "resume-base" / name).read_bytes() == (FIXTURES / "base" / name).read_bytes(), name


def resumed_console(result: dict[str, object]) -> dict[str, object]:
    """What of a resumed run's console is the same on every machine: the exit code, the line saying
    what it continues, and the final status (item timings and figures depend on the CPU)."""
    lines = f"{result['stderr']}{result['stdout']}".splitlines()
    return {"args": result["args"], "exit_code": result["exit_code"],
            "lines": [line for line in lines if line.startswith(("continuing the unfinished run", "status:"))]}


def key_order(value: object) -> object:
    """The keys of every JSON object in `value`, in their order, nested (a list by its first element):
    what a writer decides. Values are left out: the items resumed here are the model's outputs, which
    another CPU may round differently."""
    if isinstance(value, dict):
        return [[k, key_order(v)] for k, v in value.items()]
    if isinstance(value, list) and value:
        return ["list of", key_order(value[0])]
    return None


# Keys the code has added since the goldens were written (extensions of the manifest, each in its
# writer's place), as (path of nested keys, the key after which it comes, the new key): the goldens
# stay the old code's output, and any other change of order or keys still fails.
ADDED_KEYS = (
    # engine DecodeConfig: AttentionLaunch.split_from_slots (where KV splitting starts)
    (("manifest.json", "build", "decode", "attention"), "programs_per_sm", "split_from_slots"),
    # engine DecodeConfig: AttentionLaunch's short-context splits and the last split's merge
    (("manifest.json", "build", "decode", "attention"), "split_from_slots", "short_splits"),
    (("manifest.json", "build", "decode", "attention"), "short_splits", "last_split_merges"),
    # engine DecodeConfig: the L2 prefetch sites and their programs
    (("manifest.json", "build", "decode"), "count_tier_picks", "l2_prefetch"),
    (("manifest.json", "build", "decode"), "l2_prefetch", "l2_prefetch_programs"),
    (("manifest.json", "build", "decode"), "l2_prefetch_programs", "experts_evict_first"),
    (("manifest.json", "build", "decode"), "experts_evict_first", "packed_evict_first"),
    # engine DecodeConfig: the byte budget of tiered experts' grouped path
    (("manifest.json", "build", "decode"), "packed_evict_first", "tiered_stack_bytes"),
    # engine DecodeConfig: gate_up and down of a one-group layer in one launch
    (("manifest.json", "build", "decode"), "fused_norm_router", "fused_experts"),
    # the engine runner's profile: that budget in MiB
    (("manifest.json", "runner"), "int8_activations", "tiered_stack_mib"),
    # the speed summary: requests a runner sent more than once
    (("manifest.json", "summary", "speed"), "n_prompt_tokens_flagged", "n_resent"),
)


def with_added_keys(orders: dict[str, object]) -> dict[str, object]:
    """The golden key orders with ADDED_KEYS inserted where the current code writes them; a key path
    the golden lacks is an error (the list must track the goldens)."""
    orders = json.loads(json.dumps(orders))
    for path, after, key in ADDED_KEYS:
        node: object = orders[path[0]]
        for name in path[1:]:
            node = next(sub for k, sub in node if k == name)     # type: ignore[union-attr]
        names = [k for k, _ in node]                               # type: ignore[union-attr]
        node.insert(names.index(after) + 1, [key, None])           # type: ignore[union-attr]
    return orders


def resumed_key_orders(run: Path, kept: int) -> dict[str, object]:
    """The key order of the resumed run's manifest and of each record written after the `kept` ones."""
    records = [json.loads(line) for line in (run / "items.jsonl").read_text(encoding="utf-8").splitlines()]
    return {"manifest.json": key_order(json.loads((run / "manifest.json").read_text(encoding="utf-8"))),
            "items.jsonl": {r["item_id"]: key_order(r) for r in records[kept:]}}


def test_an_interrupted_old_candidate_resumes_and_compares(zoo_tiered, data_dir, tmp_path):
    """`cand-partial` is a candidate run the old code was interrupted in after 19 items (every accuracy
    item, no KLD chunk). The current code continues it: the old records stay as written, the rest (KLD
    against the old baseline's top-K and full-distribution chunk, needle, speed) are new, and compare
    pairs it with the old baseline. Chunk 0 is the one whose whole distribution the baseline kept, so
    its exact KLD must be the old candidate's (same model, same tokens); a misread baseline moves it."""
    stage = make_stage(tmp_path)
    result = resumed_console(run_step(RESUME_INTERRUPTED, stage))
    assert result == json.loads(console_golden(RESUME_INTERRUPTED.name).read_text(encoding="utf-8"))
    old_lines = (FIXTURES / "cand-partial" / "items.jsonl").read_bytes().splitlines(keepends=True)
    assert (stage / "cand-partial" / "items.jsonl").read_bytes().splitlines(keepends=True)[:len(old_lines)] == old_lines
    manifest = json.loads((stage / "cand-partial" / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["status"] == "complete" and manifest["counts"]["skipped_finished"] == len(old_lines) == 19
    # The old code, resuming the same folder, wrote its manifest and the new records with these keys.
    orders = json.loads((GOLDEN / "resume-interrupted-key-orders.json").read_text(encoding="utf-8"))
    assert resumed_key_orders(stage / "cand-partial", len(old_lines)) == with_added_keys(orders)

    cmp = moebench_cli("compare", "base", "cand-partial", "--out", "cmp-resumed", cwd=stage, timeout=120)
    assert cmp.returncode == 0, cmp.stdout + cmp.stderr
    new = json.loads((stage / "cmp-resumed" / "compare.json").read_text(encoding="utf-8"))
    old = json.loads((GOLDEN / "cmp" / "compare.json").read_text(encoding="utf-8"))
    paired = {t: old["tasks"][t]["n_paired"] for t in old["tasks"]}
    assert {t: new["tasks"][t]["n_paired"] for t in new["tasks"]} == paired
    assert new["kld"]["measured_against"] == "base" and "warning" not in new["kld"]
    assert new["kld"]["n_tokens"] == old["kld"]["n_tokens"] == 12
    assert new["kld"]["topk_vs_exact"]["n_tokens"] == old["kld"]["topk_vs_exact"]["n_tokens"] == 3
    assert new["kld"]["topk_vs_exact"]["exact_mean"] == pytest.approx(old["kld"]["topk_vs_exact"]["exact_mean"],
                                                                      rel=1e-3)
    assert new["kld"]["per_chunk"] == pytest.approx(old["kld"]["per_chunk"], rel=1e-3)
    assert ([(r["prompt_length"], r["clients"], r["n_baseline"], r["n_candidate"]) for r in new["speed"]["rows"]]
            == [(r["prompt_length"], r["clients"], r["n_baseline"], r["n_candidate"]) for r in old["speed"]["rows"]])


def write_goldens() -> None:
    """golden/ from the moebench on PYTHONPATH (README.md: the old code at b6f2c5e)."""
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        stage = make_stage(Path(tmp))
        results = run_all(stage, (*STEPS, RESUME))
        if GOLDEN.exists():
            shutil.rmtree(GOLDEN)
        (GOLDEN / "console").mkdir(parents=True)
        written: dict[str, str] = {}     # output text -> the golden that holds it
        same: dict[str, str] = {}
        for step in (*STEPS, RESUME):
            console = json.dumps(results[step.name], indent=1, ensure_ascii=False) + "\n"
            console_golden(step.name).write_text(console, encoding="utf-8")
            for out in step.outputs:
                text = mask((stage / out).read_text(encoding="utf-8"), stage)
                if text in written:
                    same[out] = written[text]
                    continue
                written[text] = out
                (GOLDEN / out).parent.mkdir(parents=True, exist_ok=True)
                (GOLDEN / out).write_text(text, encoding="utf-8")
        SAME_FILE.write_text(json.dumps(same, indent=1) + "\n", encoding="utf-8")
        resumed = resumed_console(run_step(RESUME_INTERRUPTED, stage))
        console_golden(RESUME_INTERRUPTED.name).write_text(json.dumps(resumed, indent=1) + "\n", encoding="utf-8")
        kept = len((FIXTURES / "cand-partial" / "items.jsonl").read_text(encoding="utf-8").splitlines())
        (GOLDEN / "resume-interrupted-key-orders.json").write_text(
            json.dumps(resumed_key_orders(stage / "cand-partial", kept)) + "\n", encoding="utf-8")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-goldens"]:
        sys.exit("usage: PYTHONPATH=<old moebench> python tests/test_compat_old_runs.py --write-goldens")
    write_goldens()
