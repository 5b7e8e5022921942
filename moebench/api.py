"""The Python API behind the CLI: one function per command (run, compare, trend, report, gate, demo,
tools, zoo, data, tier, import-lm-eval, lm-eval, speed-ab, serve). The CLI parses arguments, calls
one of these and prints what it returns."""
from __future__ import annotations

import asyncio
import datetime as _dt
import errno
import json
import os
import re
import shutil
import signal
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

if sys.version_info >= (3, 11):
    from typing import NotRequired
else:                                   # pyproject installs typing_extensions there
    from typing_extensions import NotRequired

from moebench.config import MAX_ITEMS, RunnerProfile, SuiteProfile, load_suite, resolve_profile_path
from moebench.data_check import check_before_run
from moebench.errors import UsageError
from moebench.datasets import data_dir
from moebench.progress import Progress, StartupLog
from moebench.runners import load_runner_profile, make_runner
from moebench.runners.base import CapabilityError, Runner, Unreachable, check_capabilities
from moebench.runners.responses import describe
from moebench.secrets import redact
from moebench.store import RunLock, RunStore, StoreError, now_iso, write_json_atomic
from moebench.json_types import JsonObject
from moebench.store.records import RunCounts, RunEvent
from moebench.store.session import (ask_record, common_errors, finish_run, new_manifest, open_store,
                                    record_runner_identity)
from moebench.tasks import task_class, task_schemas
from moebench.tasks.base import Task, TaskContext

if TYPE_CHECKING:                       # NVML bindings and the engine (torch): only where a command asks
    from moebench.compare.tables import Row
    from moebench.engine.tiering import Plan
    from moebench.probes.nvml import NvmlProbe


BASELINE_IDLE_END = "baseline_idle_end"   # the optional idle window after the last task

# A run whose first this-many finished items all failed to connect to the server (each after its own
# retries), with no success before them, stops as failed: a server that is down is no measurement.
UNREACHABLE_STOP_AFTER = 3


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
    as_baseline: bool = False        # KLD: this run is the baseline candidates measure against
    results_dir: str = "results"
    quiet: bool = False
    allow_modified_data: bool = False    # run on data files that differ from SHA256SUMS, saying so


def load_profiles(suite: str, runner: str) -> tuple[SuiteProfile, RunnerProfile]:
    suite_p = load_suite(resolve_profile_path(suite, "suites"), task_schemas())
    runner_p = load_runner_profile(resolve_profile_path(runner, "runners"))
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


def _check_resumable(run_dir: Path, suite: SuiteProfile, runner_p: RunnerProfile) -> dict | None:
    """The unfinished run's manifest that a resume continues (None for a fresh run directory)."""
    manifest_path = run_dir / "manifest.json"
    if not manifest_path.exists():
        return None
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
    return old


def _kld_role_of_resumed(opts: RunOptions, old: dict | None, run_dir: Path) -> RunOptions:
    """A resumed run keeps the KLD role it started with: its baseline run, or being a baseline. A flag
    that contradicts the manifest is refused rather than mixing two references in one run."""
    if old is None:
        return opts
    old_base, old_as = old.get("baseline_run"), bool(old.get("as_baseline"))
    if opts.baseline is not None and old_base is not None and Path(opts.baseline).resolve() != Path(old_base).resolve():
        raise UsageError(f"{run_dir} was measured against baseline {old_base}, not {opts.baseline}; refusing to "
                         "mix two baselines in one run")
    if (opts.baseline is not None and old_as) or (opts.as_baseline and old_base is not None):
        raise UsageError(f"{run_dir} was started " + ("as a KLD baseline (--as-baseline)" if old_as else
                                                      f"against baseline {old_base} (--baseline)")
                         + "; resume it with the same role")
    if opts.baseline is None and old_base is not None:
        return replace(opts, baseline=old_base)
    if old_as and not opts.as_baseline:
        return replace(opts, as_baseline=True)
    return opts


def _make_tasks(suite: SuiteProfile, ctx: TaskContext, limit: int | None) -> list[Task]:
    if limit is not None and not 1 <= limit <= MAX_ITEMS:    # 0 would mean every item, -3 all but three
        raise UsageError(f"limit must be between 1 and {MAX_ITEMS:,}, got {limit}")
    tasks = []
    for opts in suite.tasks:
        opts = dict(opts)
        if limit is not None:
            opts["limit"] = min(limit, opts["limit"]) if opts.get("limit") else limit
        tasks.append(task_class(opts["task"])(opts, ctx))
    return tasks


class NvmlAvailability(TypedDict):
    """Whether the run samples the GPU through NVML, and why not (the manifest's probes.nvml, before
    the probe adds what it measured)."""

    available: bool
    reason: NotRequired[str]


class ProbesAvailability(TypedDict):
    """The manifest's `probes` as the run starts (docs/schema.md)."""

    nvml: NvmlAvailability


def _start_probe(suite: SuiteProfile) -> tuple[NvmlProbe | None, ProbesAvailability]:
    """The NVML probe where the suite asks for it and NVML answers; else None and the reason."""
    if not suite.probes.get("nvml", True):
        return None, {"nvml": {"available": False, "reason": "disabled by the suite"}}
    try:
        from moebench.probes.nvml import NvmlProbe
    except ImportError as e:
        return None, {"nvml": {"available": False, "reason": f"probe not importable: {e}"}}
    from moebench.probes.energy import tariffs_from_probes
    probe = NvmlProbe(interval_ms=suite.probes.get("interval_ms", 100), gpu_index=suite.probes.get("gpu_index", 0),
                      gpu_indices=suite.probes.get("gpu_indices"), idle_s=suite.probes.get("idle_s", 5.0),
                      tariffs=tariffs_from_probes(suite.probes))
    if not probe.available:
        return None, {"nvml": {"available": False, "reason": getattr(probe, "reason", "unavailable")}}
    return probe, {"nvml": {"available": True}}


class ServerUnreachable(Exception):
    """The run's first items all failed to connect: the server is down and nothing was measured."""


class _UnreachableWatch:
    """Decides the early stop: the first UNREACHABLE_STOP_AFTER items to finish (in the order they
    finish, over all tasks) all failed to connect, with no other outcome before them. Any other outcome
    first (an answer, an HTTP error) disarms it: from then on errors are records, retried on resume."""

    def __init__(self, stop_after: int = UNREACHABLE_STOP_AFTER):
        self.stop_after = stop_after
        self.unreachable = 0
        self.armed = stop_after > 0
        self.first_error: str | None = None

    def stop(self, rec: JsonObject) -> ServerUnreachable | None:
        """The reason to stop after this finished item (its line as the store wrote it), else None."""
        if not self.armed:
            return None
        if rec.get("status") != "error" or rec.get("error_type") != Unreachable.__name__:
            self.armed = False
            return None
        self.unreachable += 1
        self.first_error = self.first_error or rec.get("error")
        if self.unreachable < self.stop_after:
            return None
        self.armed = False
        return ServerUnreachable(f"run stopped: the first {self.stop_after} items could not connect to the server "
                                 f"({self.first_error}); start the server and continue with --resume")


async def _evaluate_all(tasks: list[Task], items: dict[str, list], runner: Runner, store: RunStore,
                        quiet: bool, counts: dict[str, int], probe: NvmlProbe | None = None) -> dict[str, int]:
    """Ask every unfinished item; `counts` is updated in place so an interrupted run still has them.
    ServerUnreachable when the first items all fail to connect (_UnreachableWatch)."""
    finished = store.finished_keys()
    counts.update(asked=0, errors=0, skipped_finished=0)
    watch = _UnreachableWatch()
    # Records handed to the store's writer and not yet durable. Each is counted when the store
    # acknowledges it (a done-callback on the loop's thread), even when its item was cancelled
    # meanwhile; the run waits for them all before it ends, so its counts match its records.
    unwritten: set[asyncio.Future] = set()

    def mark(phase: str) -> None:
        if probe is not None:
            probe.mark(phase)

    for task in tasks:
        mark("prepare")                  # datasets, tokenizing: host work, kept out of idle
        await task.prepare(runner)
        all_items = items[task.name]
        todo = [it for it in all_items if (task.name, it.item_id) not in finished]
        counts["skipped_finished"] += len(all_items) - len(todo)
        if not todo:
            continue
        progress = Progress(task.name, len(todo), every_s=10.0 if not quiet else 1e9)
        # Set when the run must stop: a record that could not be written, or the early stop.
        stopped: asyncio.Future = asyncio.get_running_loop().create_future()

        def written(fut: asyncio.Future, progress=progress, stopped=stopped) -> None:
            unwritten.discard(fut)
            if fut.cancelled():
                return
            error = fut.exception()
            if error is not None:           # not written (a full disk): the run stops with that error
                if not stopped.done():
                    stopped.set_exception(error)
                return
            rec = fut.result()
            counts["asked"] += 1
            counts["errors"] += rec["status"] == "error"
            progress.advance(error=rec["status"] == "error")
            stop = watch.stop(rec)
            if stop is not None and not stopped.done():
                stopped.set_exception(stop)

        queue = iter(todo)

        async def worker(task=task, queue=queue, stopped=stopped) -> None:
            # `concurrency` workers take the items in order; a worker moves on to its next item while
            # the record of the last one waits for its group commit.
            for item in queue:
                if stopped.done():
                    return
                rec = await ask_record(task.name, item.item_id, lambda: task.evaluate(item, runner), describe,
                                     passthrough=(CapabilityError,))
                fut = store.append_async(rec)
                unwritten.add(fut)
                fut.add_done_callback(written)

        # A task that marks no phases of its own is booked as a whole under its phase, so that no
        # work lands in "idle"; speed and needle mark prefill/decode/idle per request themselves.
        mark(task.phase or "prepare")
        jobs = [asyncio.ensure_future(worker()) for _ in range(max(1, min(runner.concurrency, len(todo))))]
        everything = asyncio.gather(*jobs)
        try:
            await asyncio.wait([everything, stopped], return_when=asyncio.FIRST_COMPLETED)
            if everything.done():
                everything.result()         # a worker's own failure (CapabilityError, a fatal OSError)
            if unwritten:
                await asyncio.wait(list(unwritten))
            if stopped.done():
                stopped.result()            # raises the early stop or the write error
        finally:
            # An early stop (or any failure) ends the items still asking: unrecorded, they are asked on resume.
            for job in jobs:
                job.cancel()
            await asyncio.gather(everything, return_exceptions=True)
            if unwritten:
                await asyncio.gather(*list(unwritten), return_exceptions=True)
            if not stopped.done():
                stopped.cancel()
            elif not stopped.cancelled():
                stopped.exception()         # retrieved: raised above, or superseded by another failure
            progress.close()
            mark("idle")
    return counts


class _Interrupted(Exception):
    pass


def os_error_line(e: OSError) -> str:
    """One line for a disk or OS error: the path, what went wrong and the errno."""
    name = errno.errorcode.get(e.errno, "?") if e.errno is not None else "?"
    where = f"{e.filename}: " if e.filename else ""
    return f"error: {where}{e.strerror or e} (errno {e.errno} {name})"


def run(opts: RunOptions) -> tuple[Path, int]:
    """Run a suite against a runner into a run directory. Returns (run dir, exit code)."""
    say = StartupLog(quiet=opts.quiet)
    suite, runner_p = load_profiles(opts.suite, opts.runner)
    label = opts.label or runner_p.name
    run_dir = _run_dir(opts, suite, label)
    created = not run_dir.exists()
    _make_run_dir(run_dir, "--out" if opts.out else "the run directory")
    # The lock comes first: a second writer is refused before it reads or touches anything.
    lock = RunLock(run_dir).acquire()
    try:
        store, tasks, runner, items, ctx = _prepare(opts, suite, runner_p, label, run_dir, lock, say)
    except BaseException as e:
        if isinstance(e, OSError) and not created:
            _note_failed_resume(run_dir, e)
        lock.release()
        if created:                 # refused before anything was written: leave no empty folder behind
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    return run_dir, _execute(opts, suite, store, tasks, runner, items, ctx, say)


def _make_run_dir(run_dir: Path, named: str) -> None:
    """Create the run directory; a regular file where it, or a folder above it, should be is bad
    usage (exit 2), said in plain words rather than as an errno."""
    for p in (run_dir, *run_dir.parents):
        if p.exists() and not p.is_dir():
            raise UsageError(f"{named} {run_dir} is a file, not a directory" if p == run_dir
                             else f"{named} {run_dir}: {p} is a file, not a directory")
    run_dir.mkdir(parents=True, exist_ok=True)


def _note_failed_resume(run_dir: Path, e: OSError) -> None:
    """A resume that could not even open the run: its manifest keeps its status and gains the failure
    and an end time, where the disk still lets us write it."""
    try:
        store = RunStore.open(run_dir)
        store.manifest.add_event(RunEvent.now("failed", message=f"resume: {describe(e)}"))
        store.manifest.set(ended_at=now_iso())
        store.write_manifest()
    except (OSError, StoreError):
        pass                        # unreadable or unwritable: it stays as it was, whole


def _check_kld_role(opts: RunOptions, suite: SuiteProfile, tasks: list[Task]) -> None:
    """KLD measures a candidate against a baseline run; without --baseline a run only records a
    baseline and measures nothing. That must be asked for (--as-baseline), or it is said: refused
    before any work when the suite is KLD only, a warning line when other tasks run too."""
    kld = [t.name for t in tasks if t.kind == "kld"]
    if not kld or opts.baseline or opts.as_baseline:
        return
    names = ", ".join(kld)
    if len(kld) == len(tasks):
        raise UsageError(f"suite {suite.name!r} measures only KLD ({names}), which needs a baseline run: give "
                         "--baseline RUN to measure this runner against it, or --as-baseline to record this run "
                         "as the baseline candidates measure against")
    print(f"warning: {names}: no --baseline, so this run records a KLD baseline and measures no KLD (give "
          "--baseline RUN to measure against one, or --as-baseline to say this run is the baseline)",
          file=sys.stderr)


def _continuing_line(run_dir: Path, old: dict, label: str) -> str:
    """What a run onto an unfinished run directory does, said before anything else."""
    try:
        with (run_dir / "items.jsonl").open("rb") as f:
            recorded = sum(1 for line in f if line.strip())
    except OSError:
        recorded = 0
    old_label = old.get("label")
    relabel = f"; its label {old_label!r} becomes {label!r}" if old_label and old_label != label else ""
    return (f"continuing the unfinished run in {run_dir} (status {old.get('status')}, {recorded} item "
            f"record(s) kept; errored and missing items run again{relabel})")


def _prepare(opts: RunOptions, suite: SuiteProfile, runner_p: RunnerProfile, label: str, run_dir: Path,
             lock: RunLock, say: StartupLog | None = None
             ) -> tuple[RunStore, list[Task], Runner, dict[str, list], TaskContext]:
    say = say or StartupLog(quiet=True)
    if opts.baseline and opts.as_baseline:
        raise UsageError("--baseline and --as-baseline exclude each other: a run is either measured against a "
                         "baseline or is one")
    old = _check_resumable(run_dir, suite, runner_p)
    if old is not None:         # --resume or an --out that holds one: never silently
        print(_continuing_line(run_dir, old, label), file=sys.stderr, flush=True)
    opts = _kld_role_of_resumed(opts, old, run_dir)
    baseline = Path(opts.baseline) if opts.baseline else None
    if baseline is not None and not (baseline / "manifest.json").is_file():
        raise UsageError(f"--baseline {baseline}: not a moebench run (no manifest.json)")

    ctx = TaskContext(data_dir=data_dir(), run_dir=run_dir, baseline_run=baseline, runner_profile=runner_p)
    tasks = _make_tasks(suite, ctx, opts.limit)
    runner = make_runner(runner_p)
    # Capabilities are checked before anything starts: never mid-run.
    needs = {t.name: t.needs(runner) for t in tasks}
    check_capabilities(runner, needs)
    runner.needed = set().union(*needs.values()) if needs else set()
    for t in tasks:                  # task-specific checks against the runner (e.g. KLD's flags)
        t.check(runner)
    _check_kld_role(opts, suite, tasks)
    # Items are listed before the run starts so bad data fails fast (and data files get hashed).
    items = {t.name: t.items() for t in tasks}
    # ... and data that is not the mirror's is refused before any request.
    verification, notes = check_before_run(ctx.data_dir, ctx.data_files, opts.allow_modified_data)
    for line in notes:
        print(line, file=sys.stderr)
    # said once the checks before any work passed (a refusal stays the one line it is)
    say(f"suite {suite.name}, runner {runner_p.name} ({runner_p.kind}), run directory {run_dir}: runner, items "
        "and data files checked")

    manifest = new_manifest(label, redact(suite.to_dict()), runner_p.redacted(), ctx.data_dir,
                            data_files=ctx.data_files, data_verification=verification.to_json(),
                            baseline_run=str(baseline) if baseline else None, as_baseline=opts.as_baseline,
                            limit=opts.limit)
    return open_store(run_dir, manifest, runner_p.settings.to_json(), lock=lock), tasks, runner, items, ctx


def _execute(opts: RunOptions, suite: SuiteProfile, store: RunStore, tasks: list[Task], runner: Runner,
             items: dict[str, list], ctx: TaskContext, say: StartupLog | None = None) -> int:
    """Run the tasks into an open store and finish its manifest whatever happens. Returns the exit code."""
    say = say or StartupLog(quiet=True)
    run_dir = store.path
    previous_status = store.previous_status
    status, exit_code = "failed", 1
    counts: dict[str, int] = {}
    probe = None
    reported = False                    # an error line was printed already

    def on_term(signum, frame):     # SIGTERM ends the run as "interrupted", like Ctrl-C
        raise _Interrupted(f"signal {signum}")

    old_term = signal.signal(signal.SIGTERM, on_term) if _is_main_thread() else None
    try:
        probe, probe_info = _start_probe(suite)
        ctx.probe = probe
        store.update_manifest(probes=probe_info)

        async def main() -> dict[str, int]:
            # Inside the loop SIGTERM cancels the run at its next await, never between writing a
            # record and counting it, so an interrupted run's counts match its records.
            term = old_term is not None
            if term:
                asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, asyncio.current_task().cancel)
            if probe is not None:
                probe.start(run_dir, idle_s=0)
                probe.mark("load")
            try:
                say(runner.startup_note(str(run_dir)))
                await runner.start(str(run_dir))
                say(f"{runner.kind} runner ready; warming up")
                record_runner_identity(store, runner)
                # Idle is measured loaded and warm, before the first task: the draw the tasks' energy
                # is net of (before the load, the card idles at another level).
                if probe is not None:
                    probe.mark("warmup")
                await runner.warmup()
                if probe is not None:
                    idle_s = float(suite.probes.get("idle_s", 5.0))
                    say(f"warm; measuring the GPU's idle draw for {idle_s:g} s")
                    await asyncio.to_thread(probe.measure_idle, idle_s)
                n_items = sum(len(v) for v in items.values())
                say(f"starting {len(tasks)} task(s), {n_items} item(s): {', '.join(t.name for t in tasks)}")
                try:
                    return await _evaluate_all(tasks, items, runner, store, opts.quiet, counts, probe)
                finally:
                    if probe is not None and suite.probes.get("idle_end_s"):
                        await asyncio.to_thread(probe.measure_idle, float(suite.probes["idle_end_s"]),
                                                BASELINE_IDLE_END)
                    telemetry = runner.telemetry()
                    if telemetry:
                        store.update_manifest(engine=telemetry)
            finally:
                if term:
                    asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)
                    signal.signal(signal.SIGTERM, on_term)
                await runner.close()

        asyncio.run(main())
        status = "complete"
        exit_code = 0
        if counts.get("asked") and counts["errors"] == counts["asked"]:
            # Every item errored: nothing was measured, so the run is no finished one (and --resume,
            # which a complete run refuses, asks them all again).
            status, exit_code = "failed", 1
            _try(store.add_event, "failed", message=f"every item asked ({counts['asked']}) errored")
    except (KeyboardInterrupt, _Interrupted, asyncio.CancelledError):
        status, exit_code = "interrupted", 130
    except ServerUnreachable as e:
        status, exit_code = "failed", 1
        _try(store.add_event, "failed", message=str(e))
        print(f"error: {e}", file=sys.stderr)
        reported = True
    except CapabilityError as e:
        status, exit_code = "failed", 2
        _try(store.add_event, "capability_error", message=str(e))
        print(f"error: {e}", file=sys.stderr)
    except OSError as e:                # a full disk, a vanished folder: one line, no traceback chain
        print(os_error_line(e), file=sys.stderr)
        reported = True
        status, exit_code = "failed", 1
        _try(store.add_event, "failed", message=describe(e))
    except Exception as e:
        _try(store.add_event, "failed", message=describe(e))
        print(f"error: run failed: {describe(e)}", file=sys.stderr)
        status, exit_code = "failed", 1
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        if status == "failed" and previous_status is not None:
            # A resume that failed leaves the run as it found it (a crashed writer's "running" reads
            # as interrupted), with the failure in its events.
            status = "interrupted" if previous_status == "running" else previous_status
        probe_summary = None
        if probe is not None:
            try:
                probe_summary = probe.stop()
            except Exception as e:   # a probe problem never loses the run
                probe_summary = {"error": describe(e)}
        try:
            records = list(store.records().values())
            summary = {t.name: t.summarize([r.to_dict() for r in records if r.task == t.name]) for t in tasks}
            probes = dict(store.manifest.probes or {})
            if probe_summary is not None:
                probes["nvml"] = {**probes.get("nvml", {}), **probe_summary}
            finish_run(store, status, runner, summary, counts=RunCounts(**counts), probes=probes,
                       data_files=ctx.data_files, error_causes=common_errors(records))
        except OSError as e:         # the manifest keeps its last whole version; say why once
            if not reported:
                print(os_error_line(e), file=sys.stderr)
            exit_code = exit_code or 1
        finally:
            store.close()
    return exit_code


def _try(fn, *args: Any, **kwargs: Any) -> None:
    """Record something in the manifest if the disk still lets us; the caller reports the failure."""
    try:
        fn(*args, **kwargs)
    except OSError:
        pass


def _is_main_thread() -> bool:
    import threading
    return threading.current_thread() is threading.main_thread()


# --- compare / report / gate -------------------------------------------------------------------

MATRIX_JSON = "matrix.json"
MATRIX_CSV = "matrix.csv"
SUMMARY_MD = "summary.md"


def _check_run(p: str) -> None:
    if not (Path(p) / "manifest.json").is_file():
        raise UsageError(f"{p}: not a moebench run (no manifest.json)")


def compare(baseline: str, candidate: str, out: str | None = None, results_dir: str = "results",
            write_report: bool = True, speed_ab: str | None = None,
            allow_reversed: bool = False) -> tuple[Path, JsonObject]:
    """Compare one candidate with the baseline: compare.json, summary.md, matrix.csv/json, report.html."""
    out_dir, cmps, _ = compare_many(baseline, [candidate], out, results_dir, write_report, speed_ab,
                                    allow_reversed)
    return out_dir, cmps[0]


def _pair_dir_name(i: int, label: Any, run: str) -> str:
    return f"{i + 1:02d}_{_slug(str(label or Path(run).name))}"


def compare_many(baseline: str, candidates: list[str], out: str | None = None, results_dir: str = "results",
                 write_report: bool = True, speed_ab: str | None = None, allow_reversed: bool = False
                 ) -> tuple[Path, list[JsonObject], list[Row]]:
    """Compare each candidate with the baseline. Returns (compare dir, compare.json objects, matrix rows).

    One candidate: compare.json (docs/design.md section 5) in the compare directory itself. Several: one
    complete two-run compare directory per candidate, `NN_<label>/` (compare.json, summary.md,
    report.html: each gate-able alone), and in the top directory matrix.json, matrix.csv, summary.md
    and report.html over all of them. Both layouts write matrix.csv/matrix.json (a row per candidate).
    A candidate whose runs look given the wrong way round (the baseline was run with --baseline
    CANDIDATE) is refused before anything is written, unless `allow_reversed`.
    """
    from moebench.compare.build import compare_runs
    from moebench.compare.tables import matrix_row, summary_markdown, to_csv
    if not candidates:
        raise UsageError("compare: give at least one candidate run")
    for p in (baseline, *candidates):
        _check_run(p)
    if speed_ab is not None and len(candidates) != 1:
        raise UsageError("--speed-ab: an A/B directory belongs to one candidate; compare one candidate with it")
    if out:
        out_dir = Path(out)
    elif len(candidates) == 1:
        out_dir = Path(results_dir) / f"compare_{Path(baseline).name}_vs_{Path(candidates[0]).name}"
    else:
        out_dir = Path(results_dir) / f"compare_{Path(baseline).name}_vs_{len(candidates)}_candidates"
    built = []
    for cand in candidates:
        try:
            built.append(compare_runs(baseline, cand, speed_ab=speed_ab, allow_reversed=allow_reversed))
        except ValueError as e:
            raise UsageError(str(e)) from None
    out_dir.mkdir(parents=True, exist_ok=True)
    cmps, docs, rows, pair_dirs = [], [], [], []
    for i, (cand, doc) in enumerate(zip(candidates, built)):
        cmp = doc.to_dict()
        if len(candidates) == 1:
            pair_dir = out_dir
        else:
            pair_dir = out_dir / _pair_dir_name(i, cmp["candidate"].get("label"), cand)
            pair_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(pair_dir / "compare.json", cmp)
        row = matrix_row(doc, "." if pair_dir == out_dir else pair_dir.name)
        if pair_dir != out_dir:
            (pair_dir / SUMMARY_MD).write_text(summary_markdown([doc], [row]), encoding="utf-8")
        docs.append(doc)
        cmps.append(cmp)
        rows.append(row)
        pair_dirs.append(pair_dir)
    matrix = {"schema_version": 1, "baseline": cmps[0]["baseline"],
              "candidates": [{"label": c["candidate"].get("label"), "run": c["candidate"].get("run"),
                              "compare_dir": r["compare_dir"]} for c, r in zip(cmps, rows)],
              "rows": rows}
    write_json_atomic(out_dir / MATRIX_JSON, matrix)
    (out_dir / MATRIX_CSV).write_text(to_csv(rows), encoding="utf-8")
    (out_dir / SUMMARY_MD).write_text(summary_markdown(docs, rows), encoding="utf-8")
    if write_report:
        for d in pair_dirs:
            if d != out_dir:
                report(str(d))
        report(str(out_dir))
    return out_dir, cmps, rows


def trend(runs: list[str], out: str | None = None, results_dir: str = "results", order: str = "time") -> Path:
    """Headline figures of several runs ordered by build and time: trend.json, trend.csv, trend.html."""
    from moebench.report.trend import write_trend
    for p in runs:
        _check_run(p)
    if len(runs) < 2:
        raise UsageError("trend: give at least two runs")
    out_dir = Path(out) if out else Path(results_dir) / f"trend_{len(runs)}_runs"
    return write_trend([Path(r) for r in runs], out_dir, order)


def report(path: str, out: str | None = None) -> Path:
    from moebench.report.render import ReportError, render
    p = Path(path)
    if not ((p / "compare.json").is_file() or (p / "manifest.json").is_file() or (p / MATRIX_JSON).is_file()):
        raise UsageError(f"{p}: neither a run (manifest.json) nor a compare directory (compare.json, matrix.json)")
    try:
        return render(p, Path(out) if out else None)
    except ReportError as e:          # a malformed input file: bad input, named in the message
        raise UsageError(str(e)) from None


def gate(compare_dir: str, rules: str, as_json: bool = False) -> int:
    from moebench.gate import run_gate
    return run_gate(compare_dir, _rules_file(rules), as_json=as_json)


def _rules_file(rules: str) -> str:
    """`--rules NAME`: a bare name that is no file is ./gates/NAME.toml, else the shipped gates/NAME.toml
    (moebench.shipped); anything else, or a name found in neither, goes to the gate as given, which
    names what it could not read."""
    from moebench.shipped import shipped_dir
    if Path(rules).exists() or Path(rules).suffix == ".toml" or os.sep in rules:
        return rules
    found = [c for c in (Path("gates") / f"{rules}.toml", shipped_dir("gates") / f"{rules}.toml") if c.is_file()]
    return str(found[0]) if found else rules


# --- the other commands ----------------------------------------------------------------------------

def _fresh(run_dir: Path) -> Path:
    """The demo always measures anew: remove an earlier demo run (only if it is a moebench run)."""
    if (run_dir / "manifest.json").is_file():
        shutil.rmtree(run_dir)
    return run_dir


def demo(out: str | Path | None = None, log=print) -> Path:
    """`moebench demo`: the embedded default end to end, with no server and no GPU. Builds (or reuses)
    the zoo's tiny MoE, packs a tiered candidate, runs the smoke suite on the BF16 baseline and on the
    candidate with the engine runner, compares them; returns the report's path."""
    from moebench.compare.build import format_table
    from moebench.config import profile_root
    from moebench.demo import ZOO, pack_tiered
    from moebench.shipped import shipped_dir
    from moebench.store.records import CompareDoc
    from moebench.zoo.build import build_zoo
    out = Path(out) if out else Path("results") / "demo"
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    runners = shipped_dir("runners")
    # The zoo where the shipped runner profiles look for it (a checkout's models/zoo from any working
    # directory), so the runs read the models this demo built and packed.
    zoo = profile_root(runners / "engine-tiered.toml") / ZOO
    build_zoo(str(zoo), gguf=False)     # the engine reads the HF checkpoint: no llama.cpp needed
    pack_tiered(zoo / "tiny-moe", zoo / "tiny-moe-tiered", log=log)
    smoke = str(shipped_dir("suites") / "smoke.toml")
    base_dir, code = run(RunOptions(suite=smoke, runner=str(runners / "engine-bf16.toml"),
                                    out=str(_fresh(out / "engine-bf16")), label="engine-bf16", as_baseline=True))
    if code != 0:
        raise RuntimeError(f"demo: the baseline run failed (exit {code}); see {base_dir}/manifest.json")
    cand_dir, code = run(RunOptions(suite=smoke, runner=str(runners / "engine-tiered.toml"),
                                    out=str(_fresh(out / "engine-tiered")), label="engine-tiered",
                                    baseline=str(base_dir)))
    if code != 0:
        raise RuntimeError(f"demo: the candidate run failed (exit {code}); see {cand_dir}/manifest.json")
    cmp_dir, cmp = compare(str(base_dir), str(cand_dir), out=str(out / "compare"))
    log(format_table(CompareDoc.from_dict(cmp)))
    log(f"demo finished in {time.perf_counter() - t0:.0f}s")
    return cmp_dir / "report.html"


def build_llamacpp(cuda: bool = False, jobs: int = 2) -> Path:
    """`moebench tools build-llamacpp`: the folder holding the (cached) llama.cpp binaries."""
    from moebench.tools.llamacpp import ensure_built
    return ensure_built(cuda=cuda, jobs=jobs)


def zoo_build(out: str = "models/zoo", retrain: bool = False, gguf: bool = True) -> JsonObject:
    """`moebench zoo build`: the tiny MoE in Hugging Face (and GGUF) form; returns what was written."""
    from moebench.zoo.build import build_zoo
    return build_zoo(out, retrain=retrain, gguf=gguf)


def data_fetch(to: str, source: str = "github", base_url: str | None = None, hub_repo: str | None = None,
               hub_revision: str = "main", hub_endpoint: str | None = None,
               only: list[str] | None = None) -> Path:
    """`moebench data fetch`: download the dataset mirror, checking every file's sha256."""
    from moebench.data_fetch import fetch_mirror, github_source, hub_source
    src = hub_source(hub_repo, hub_revision, hub_endpoint) if source == "hub" else github_source(base_url)
    return fetch_mirror(Path(to), src, only=only)


def tier_calibrate(checkpoint: str, out: str, tokens: int = 16384) -> int:
    """`moebench tier calibrate`: expert statistics on real text, saved to `out`; returns the token count."""
    from moebench.demo import calibrate_zoo
    stats = calibrate_zoo(Path(checkpoint), n_tokens=tokens)
    stats.save(out)
    return int(stats.tokens)


def gib_or_bytes(flag: str, exact: int | None, gib: float | None) -> int:
    """A byte count given as --FLAG-bytes or --FLAG-gib (0 when neither)."""
    if exact is not None and gib is not None:
        raise UsageError(f"tier plan: give --{flag}-bytes or --{flag}-gib, not both")
    value = exact if exact is not None else round(gib * (1 << 30)) if gib is not None else 0
    if value < 0:
        raise UsageError(f"tier plan: --{flag}-bytes/--{flag}-gib is {value} bytes; expected >= 0")
    return value


def tier_plan(checkpoint: str, stats: str, out: str, gpu_bytes: int | None = None, host_bytes: int = 0,
              ladder: str = "bf16,int8,int4,ternary", hot_fraction: float | None = None, hot: str = "int8",
              cold: str = "ternary", ssd_bytes: int = 0, ssd_cache_bytes: int = 0, ssd_fraction: float = 0.0) -> Plan:
    """`moebench tier plan`: a precision and a home for every expert (greedy within byte budgets, or
    rule-based with `hot_fraction`), saved to `out`; returns the plan. ssd_bytes (greedy) or
    ssd_fraction (rule-based) put the coldest experts on disk, behind a host-RAM cache of
    ssd_cache_bytes."""
    from moebench.engine.tiering import Budgets, CalibrationStats, plan, plan_hot_cold
    calib = CalibrationStats.load(stats)
    if hot_fraction is not None:
        p = plan_hot_cold(calib, hot_fraction=hot_fraction, hot=hot, cold=cold, ssd_fraction=ssd_fraction,
                          ssd_cache_bytes=ssd_cache_bytes)
    else:
        if gpu_bytes is None:
            raise UsageError("tier plan: give --gpu-bytes (greedy planner) or --hot-fraction (rule-based)")
        p = plan(calib, checkpoint, Budgets(gpu_bytes, host_bytes, ssd_bytes), ladder=ladder.split(","))
        p.ssd_cache_bytes = ssd_cache_bytes
    p.save(out)
    return p


def tier_pack(checkpoint: str, plan_path: str, out: str) -> Path:
    """`moebench tier pack`: the tiered artifact the engine runner loads; returns its directory."""
    from moebench.engine.tiering import Plan, pack
    return pack(checkpoint, Plan.load(plan_path), out)


def import_lm_eval(paths: list[str], out: str) -> Path:
    """`moebench import-lm-eval`: lm-eval --log_samples files as a moebench run directory."""
    from moebench.lmeval.importer import import_lm_eval as do_import
    return do_import([Path(p) for p in paths], Path(out))


def lm_eval(runner: str, tasks: str | list[str], limit: int | None = None, out: str | None = None) -> Path:
    """`moebench lm-eval`: lm-eval tasks through a moebench runner, stored as a run; returns its directory."""
    from moebench.lmeval.adapter import run_lm_eval
    profile = resolve_profile_path(runner, "runners")
    names = [t.strip() for t in tasks.split(",")] if isinstance(tasks, str) else list(tasks)
    names = [t for t in names if t]
    if not names:
        raise UsageError(f"--tasks {tasks!r}: no task names")
    out_dir = Path(out) if out else default_run_dir("lm-eval", profile.stem)
    return run_lm_eval(profile, names, limit, out_dir)


def speed_ab(profile_a: str, profile_b: str, out: str, suite: str = "speed", order: str = "ABBA") -> JsonObject:
    """`moebench speed-ab`: two runner profiles' speed passes interleaved in fresh processes, written
    to `out` (ab.json, compare.json, report.html); returns the A/B result."""
    from moebench.speed.ab import run_ab
    suite_p = load_suite(resolve_profile_path(suite, "suites"), task_schemas())
    speed = [t for t in suite_p.tasks if t["task"] == "speed"]
    if not speed:
        raise UsageError(f"{suite_p.path}: has no speed task")
    opts = {k: v for k, v in speed[0].items() if k not in ("task", "name", "limit")}
    result = run_ab(str(resolve_profile_path(profile_a, "runners")), str(resolve_profile_path(profile_b, "runners")),
                    opts, out, order=order)
    report(out)
    return result


def serve(runner: str, host: str = "127.0.0.1", port: int = 8000, api_key_env: str | None = None,
          max_logprobs: int = 100) -> None:
    """`moebench serve`: an OpenAI-compatible server over a runner profile, until interrupted."""
    from moebench.serve import serve as run_server
    run_server(str(resolve_profile_path(runner, "runners")), host=host, port=port, api_key_env=api_key_env,
               max_logprobs=max_logprobs)
