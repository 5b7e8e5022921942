"""The Python API behind the CLI: run, compare, report, gate (the CLI is a thin shell over these)."""
from __future__ import annotations

import asyncio
import datetime as _dt
import json
import re
import signal
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moebench.config import RunnerProfile, SuiteProfile, load_runner, load_suite, resolve_profile_path
from moebench.datasets import data_dir
from moebench.identity import host_identity, moebench_identity
from moebench.progress import Progress
from moebench.runners import make_runner, runner_schemas
from moebench.runners.base import CapabilityError, Runner, check_capabilities
from moebench.store import RunStore, write_json_atomic
from moebench.tasks import task_class, task_schemas
from moebench.tasks.base import Task, TaskContext


class UsageError(Exception):
    """Bad usage or bad input: exit code 2."""


@dataclass
class RunOptions:
    """Options of one `moebench run` (the CLI flags)."""

    suite: str
    runner: str
    out: str | None = None
    label: str | None = None
    limit: int | None = None
    resume: bool = False
    baseline: str | None = None
    results_dir: str = "results"
    quiet: bool = False


def load_profiles(suite: str, runner: str) -> tuple[SuiteProfile, RunnerProfile]:
    suite_p = load_suite(resolve_profile_path(suite, "suites"), task_schemas())
    runner_p = load_runner(resolve_profile_path(runner, "runners"), runner_schemas())
    return suite_p, runner_p


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "run"


def _find_unfinished(results: Path, suite: str, label: str) -> Path | None:
    """The newest run of this suite and label that did not complete (for `--resume` without `--out`)."""
    candidates = sorted(results.glob(f"*_{_slug(suite)}_{_slug(label)}"), reverse=True)
    for c in candidates:
        try:
            if json.loads((c / "manifest.json").read_text()).get("status") != "complete":
                return c
        except (OSError, json.JSONDecodeError):
            continue
    return None


def default_run_dir(suite_name: str, label: str, results_dir: str = "results") -> Path:
    """A new results/<timestamp>_<suite>_<label>/ path (not created)."""
    results = Path(results_dir)
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    path = results / f"{stamp}_{_slug(suite_name)}_{_slug(label)}"
    n = 1
    while path.exists():
        n += 1
        path = results / f"{stamp}-{n}_{_slug(suite_name)}_{_slug(label)}"
    return path


def _run_dir(opts: RunOptions, suite: SuiteProfile, label: str) -> Path:
    results = Path(opts.results_dir)
    if opts.out:
        return Path(opts.out)
    if opts.resume:
        found = _find_unfinished(results, suite.name, label)
        if found is None:
            raise UsageError(f"--resume: no unfinished run of suite {suite.name!r} labelled {label!r} under {results}/")
        return found
    return default_run_dir(suite.name, label, opts.results_dir)


def _check_resumable(run_dir: Path, suite: SuiteProfile, runner_p: RunnerProfile) -> None:
    manifest_path = run_dir / "manifest.json"
    if not manifest_path.exists():
        return
    try:
        old = json.loads(manifest_path.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"{manifest_path}: not valid JSON ({e}); refusing to write into it") from None
    if old.get("status") == "complete":
        raise UsageError(f"{run_dir} holds a complete run; choose another --out")
    old_suite = (old.get("suite") or {}).get("name")
    if old_suite != suite.name:
        raise UsageError(f"{run_dir} holds a run of suite {old_suite!r}, not {suite.name!r}; refusing to mix them")
    old_runner = (old.get("runner") or {}).get("name")
    if old_runner != runner_p.name:
        raise UsageError(f"{run_dir} was run with runner {old_runner!r}, not {runner_p.name!r}; refusing to mix them")


def _make_tasks(suite: SuiteProfile, ctx: TaskContext, limit: int | None) -> list[Task]:
    tasks = []
    for opts in suite.tasks:
        opts = dict(opts)
        if limit is not None:
            opts["limit"] = min(limit, opts["limit"]) if opts.get("limit") else limit
        tasks.append(task_class(opts["task"])(opts, ctx))
    return tasks


def _start_probe(suite: SuiteProfile) -> tuple[Any, dict[str, Any]]:
    """The NVML probe where the suite asks for it and NVML answers; else None and the reason."""
    if not suite.probes.get("nvml", True):
        return None, {"nvml": {"available": False, "reason": "disabled by the suite"}}
    try:
        from moebench.probes.nvml import NvmlProbe
    except ImportError as e:
        return None, {"nvml": {"available": False, "reason": f"probe not importable: {e}"}}
    from moebench.probes.energy import tariffs_from_probes
    probe = NvmlProbe(interval_ms=suite.probes.get("interval_ms", 100), gpu_index=suite.probes.get("gpu_index", 0),
                      tariffs=tariffs_from_probes(suite.probes))
    if not probe.available:
        return None, {"nvml": {"available": False, "reason": getattr(probe, "reason", "unavailable")}}
    return probe, {"nvml": {"available": True}}


async def _evaluate_all(tasks: list[Task], items: dict[str, list], runner: Runner, store: RunStore,
                        quiet: bool) -> dict[str, int]:
    finished = store.finished_keys()
    counts = {"asked": 0, "errors": 0, "skipped_finished": 0}
    for task in tasks:
        await task.prepare(runner)
        all_items = items[task.name]
        todo = [it for it in all_items if (task.name, it.item_id) not in finished]
        counts["skipped_finished"] += len(all_items) - len(todo)
        if not todo:
            continue
        progress = Progress(task.name, len(todo), every_s=10.0 if not quiet else 1e9)
        sem = asyncio.Semaphore(max(1, runner.concurrency))

        async def one(item, task=task, progress=progress):
            async with sem:
                t0 = time.perf_counter()
                base = {"task": task.name, "item_id": item.item_id, "correct": None, "answer": None,
                        "reference": None, "output": None}
                try:
                    fields = await task.evaluate(item, runner)
                    rec = {**base, "status": "ok", **fields}
                except CapabilityError:
                    raise
                except Exception as e:   # recorded, retried on resume, never counted as wrong
                    rec = {**base, "status": "error", "correct": None, "error": f"{type(e).__name__}: {e}"}
                rec["task"], rec["item_id"] = task.name, item.item_id
                rec["wall_s"] = round(time.perf_counter() - t0, 4)
                store.append(rec)
                counts["asked"] += 1
                counts["errors"] += rec["status"] == "error"
                progress.advance(error=rec["status"] == "error")

        try:
            await asyncio.gather(*(one(it) for it in todo))
        finally:
            progress.close()
    return counts


class _Interrupted(Exception):
    pass


def run(opts: RunOptions) -> tuple[Path, int]:
    """Run a suite against a runner into a run directory. Returns (run dir, exit code)."""
    suite, runner_p = load_profiles(opts.suite, opts.runner)
    label = opts.label or runner_p.name
    run_dir = _run_dir(opts, suite, label)
    _check_resumable(run_dir, suite, runner_p)
    baseline = Path(opts.baseline) if opts.baseline else None
    if baseline is not None and not (baseline / "manifest.json").is_file():
        raise UsageError(f"--baseline {baseline}: not a moebench run (no manifest.json)")

    ctx = TaskContext(data_dir=data_dir(), run_dir=run_dir, baseline_run=baseline, runner_profile=runner_p)
    tasks = _make_tasks(suite, ctx, opts.limit)
    runner = make_runner(runner_p)
    # Capabilities are checked before anything starts: never mid-run.
    check_capabilities(runner, {t.name: t.needs(runner) for t in tasks})
    # Items are listed before the run starts so bad data fails fast (and data files get hashed).
    items = {t.name: t.items() for t in tasks}

    manifest = {
        "run_id": uuid.uuid4().hex[:12],
        "label": label,
        "suite": suite.to_dict(),
        "runner": runner_p.redacted(),
        "moebench": moebench_identity(),
        "host": host_identity(),
        "data_dir": str(ctx.data_dir),
        "data_files": ctx.data_files,
        "baseline_run": str(baseline) if baseline else None,
        "limit": opts.limit,
    }
    store = RunStore.create_or_resume(run_dir, manifest)
    probe, probe_info = _start_probe(suite)
    ctx.probe = probe
    store.update_manifest(probes=probe_info)

    def on_term(signum, frame):     # SIGTERM ends the run as "interrupted", like Ctrl-C
        raise _Interrupted(f"signal {signum}")

    old_term = signal.signal(signal.SIGTERM, on_term) if _is_main_thread() else None
    status, exit_code = "failed", 1
    counts: dict[str, int] = {}
    try:
        async def main() -> dict[str, int]:
            if probe is not None:
                probe.start(run_dir)
                probe.mark("load")
            try:
                await runner.start(str(run_dir))
                ident = runner.identity()
                store.update_manifest(model=ident.get("model"), build=ident.get("build"))
                if probe is not None:
                    probe.mark("idle")
                return await _evaluate_all(tasks, items, runner, store, opts.quiet)
            finally:
                await runner.close()

        counts = asyncio.run(main())
        status = "complete"
        exit_code = 0
        if counts.get("asked") and counts["errors"] == counts["asked"]:
            exit_code = 1              # every item errored: the run did not measure anything
    except (KeyboardInterrupt, _Interrupted):
        status, exit_code = "interrupted", 130
    except CapabilityError as e:
        status, exit_code = "failed", 2
        store.add_event("capability_error", message=str(e))
        print(f"error: {e}", file=sys.stderr)
    except Exception as e:
        store.add_event("failed", message=f"{type(e).__name__}: {e}")
        print(f"error: run failed: {type(e).__name__}: {e}", file=sys.stderr)
        status, exit_code = "failed", 1
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        probe_summary = None
        if probe is not None:
            try:
                probe_summary = probe.stop()
            except Exception as e:   # a probe problem never loses the run
                probe_summary = {"error": f"{type(e).__name__}: {e}"}
        records = list(store.records().values())
        summary = {t.name: t.summarize([r for r in records if r.get("task") == t.name]) for t in tasks}
        events = store.manifest.get("events", []) + list(getattr(runner, "events", []))
        probes = dict(store.manifest.get("probes") or {})
        if probe_summary is not None:
            probes["nvml"] = {**probes.get("nvml", {}), **probe_summary}
        store.finish(status, summary=summary, counts=counts, events=events, probes=probes,
                     data_files=ctx.data_files)
        store.close()
    return run_dir, exit_code


def _is_main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


# --- compare / report / gate -------------------------------------------------------------------

def compare(baseline: str, candidate: str, out: str | None = None, results_dir: str = "results",
            write_report: bool = True) -> tuple[Path, dict[str, Any]]:
    from moebench.compare.build import build_compare
    for p in (baseline, candidate):
        if not (Path(p) / "manifest.json").is_file():
            raise UsageError(f"{p}: not a moebench run (no manifest.json)")
    cmp = build_compare(baseline, candidate)
    out_dir = Path(out) if out else Path(results_dir) / f"compare_{Path(baseline).name}_vs_{Path(candidate).name}"
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out_dir / "compare.json", cmp)
    if write_report:
        report(str(out_dir))
    return out_dir, cmp


def report(path: str, out: str | None = None) -> Path:
    from moebench.report.render import render
    p = Path(path)
    if not ((p / "compare.json").is_file() or (p / "manifest.json").is_file()):
        raise UsageError(f"{p}: neither a run (manifest.json) nor a compare directory (compare.json)")
    return render(p, Path(out) if out else None)


def gate(compare_dir: str, rules: str, as_json: bool = False) -> int:
    from moebench.gate import run_gate
    return run_gate(compare_dir, rules, as_json=as_json)
