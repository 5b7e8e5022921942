"""Speed A/B: two runner profiles measured interleaved (default A, B, B, A), each pass in a FRESH
process (`python -m moebench.speed.ab --runner PROFILE --options JSON --out FILE`), so that neither
side inherits the other's warm caches or allocator; then the pooled speed of each side, B against A,
and whether the outputs of A and B are identical (moebench/speed/ab_compare.py). `moebench speed-ab`
calls `run_ab`; the directory it writes has an ab.json and a compare.json that report and gate read.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from moebench import jsonout
from moebench.config import COMMON_TASK_SCHEMA, resolve_profile_path, validate
from moebench.datasets import data_dir
from moebench.runners import load_runner_profile, make_runner
from moebench.runners.base import RunnerError
from moebench.runners.responses import describe
from moebench.json_types import JsonObject
from moebench.speed.ab_compare import AbPass, AbSection, ab_section
from moebench.speed.compare import SpeedSection, speed_section, speed_summary, summary_json
from moebench.json_fields import Fields
from moebench.speed.stored import read_records
from moebench.speed.task import SpeedTask
from moebench.store import write_json_atomic
from moebench.store.records import COMPARE_SCHEMA_VERSION
from moebench.store.session import ask_item
from moebench.tasks.base import TaskContext


async def _measure_in_process(runner_path: str, options: JsonObject, data_dir: str) -> JsonObject:
    profile = load_runner_profile(resolve_profile_path(runner_path, "runners"))
    opts = validate({"task": "speed", **options}, {**COMMON_TASK_SCHEMA, **SpeedTask.options}, "speed options")
    task = SpeedTask(opts, TaskContext(data_dir=Path(data_dir), runner_profile=profile))
    runner = make_runner(profile)
    t0 = time.perf_counter()
    await runner.start()
    load_s = time.perf_counter() - t0
    try:
        await task.prepare(runner)
        records = [await ask_item(task.name, it.item_id, lambda it=it: task.evaluate(it, runner), describe)
                   for it in task.items()]
    finally:
        await runner.close()
    return {"runner": profile.redacted(), "pid": os.getpid(), "load_s": load_s,
            "records": records, "summary": task.summarize(records)}


def _main(argv: list[str] | None = None) -> int:
    """One A/B pass: `python -m moebench.speed.ab --runner PROFILE --options JSON --out FILE`."""
    ap = argparse.ArgumentParser(prog="python -m moebench.speed.ab")
    ap.add_argument("--runner", required=True, help="runner profile (path or name)")
    ap.add_argument("--options", default="{}", help="speed task options as JSON")
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--data-dir", default=None)
    args = ap.parse_args(argv)
    result = asyncio.run(_measure_in_process(args.runner, json.loads(args.options),
                                             args.data_dir or str(data_dir())))
    Path(args.out).write_text(jsonout.document_text(result, default=str))
    return 0


def run_ab(profile_a_path: str, profile_b_path: str, suite_options: JsonObject, out_dir: str,
           order: str = "ABBA", timeout_s: float = 3600.0) -> JsonObject:
    """Interleave passes of two runner profiles (default A, B, B, A), each in a fresh process.

    Returns (and writes to out_dir/ab.json): per profile the pooled speed summary, the B/A
    `speed_compare`, and output identity: for every measurement present in a pass of A and of B,
    whether the outputs (token ids where the runner returns them, else text) are identical.
    """
    if not order or set(order) - {"A", "B"} or "A" not in order or "B" not in order:
        raise ValueError(f"run_ab: order must be a string of A and B holding both, got {order!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    profiles = {"A": str(profile_a_path), "B": str(profile_b_path)}
    passes: list[AbPass] = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    for i, which in enumerate(order):
        path = out / f"pass{i}_{which}.json"
        cmd = [sys.executable, "-m", "moebench.speed.ab", "--runner", profiles[which],
               "--options", jsonout.dumps(suite_options), "--out", str(path), "--data-dir", str(data_dir())]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        if proc.returncode != 0 or not path.is_file():
            raise RunnerError(f"A/B pass {i} ({which}, {profiles[which]}) failed with exit code "
                              f"{proc.returncode}: {proc.stderr.strip()[-1500:]}")
        passes.append(read_pass(path, which, i, time.perf_counter() - t0))

    pooled = {w: [r for p in passes if p.which == w for r in p.records] for w in "AB"}
    section = ab_section(passes, order, profiles)
    speed = speed_section(pooled["A"], pooled["B"])
    result: JsonObject = {
        "order": order,
        "profiles": dict(profiles),
        "passes": [p.to_json() for p in passes],
        "summary": {w: summary_json(speed_summary(pooled[w])) for w in "AB"},
        "speed_b_vs_a": speed.to_json(),
        "outputs": section.identity.to_json(),
        "speed_ab": section.to_json(),
    }
    (out / "ab.json").write_text(jsonout.document_text(result, indent=2, default=str))
    write_json_atomic(out / "compare.json", ab_compare(profiles, speed, section))
    return result


def read_pass(path: Path, which: str, index: int, process_s: float) -> AbPass:
    """A pass's file (written by `_main`) read back; a bad one is refused naming the file and key."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    f = Fields(data, str(path))
    summary = f.at("summary")
    if summary is None:
        raise ValueError(f"{path}: key 'summary' is missing (expected the speed task's summary)")
    return AbPass(which=which, index=index, pid=f.need_int("pid"), load_s=f.need_num("load_s"),
                  process_s=process_s, records=read_records(f.items("records"), str(path)),
                  n_ok=summary.need_int("n_ok"), n_errors=summary.need_int("n_errors"))


def ab_compare(profiles: dict[str, str], speed: SpeedSection, speed_ab: AbSection) -> JsonObject:
    """A compare.json for an A/B directory (A the baseline, B the candidate), so that `moebench report`
    and `moebench gate` read it like any other compare; `speed` and `speed_ab` are its sections."""
    return {"schema_version": COMPARE_SCHEMA_VERSION,
            "baseline": {"run": None, "label": f"A: {Path(profiles['A']).stem}", "profile": profiles["A"]},
            "candidate": {"run": None, "label": f"B: {Path(profiles['B']).stem}", "profile": profiles["B"]},
            "tasks": {}, "overall": None, "speed": speed.to_json(), "speed_ab": speed_ab.to_json()}


if __name__ == "__main__":
    sys.exit(_main())
