"""The H200 rig run, as a user runs it: `moebench run` of smoke, speed and needle (16k and 173k) on the
engine's BF16 and tiered zoo profiles with `device = "cuda"` and no speed keys (the runner picks the
fast path), then `moebench compare` (compare.json + report.html) for each suite. Beside it:

  - the engine's own loop on the same models and prompt lengths (Engine.generate, its own clock),
    against the speed suite's medians through `moebench run` (item 5 of issue 18: within 10%);
  - the cost of the fused path's pick counters: the tiered model's decode tok/s with
    DecodeConfig.count_tier_picks on and off, interleaved (item 4: within 2%).

Run on the GPU machine from a checkout (or a stage copy) holding models/zoo/tiny-moe and the tiered
plan (models/zoo/tiny-moe-tiered.plan.json; the artifact is packed from it here):
    OUT=/some/dir MOEBENCH_DATA_DIR=... python3 benchmarks/gpu_rig_h200.py
Writes $OUT/rig_summary.json, $OUT/rig_runs.tgz (the run and compare directories) and prints a table.
Every stage is guarded: a failing stage is recorded with its error and the rest still runs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

SPEED_LENGTHS = (128, 512, 2048, 8192, 16384)        # suites/speed.toml
SPEED_REPEATS, SPEED_SEED = 3, 1234                  # suites/speed.toml
NEEDLE_SUITE = """# issue 18's needle cells: 16k and 173k tokens, the needle half way in
name = "needle-rig"
[[tasks]]
task = "needle"
lengths = [16384, 173000]
depths = [0.5]
seed = 1234
max_tokens = 32
[probes]
nvml = true
interval_ms = 100
idle_s = 5.0
idle_end_s = 3.0
"""
RUNNER = """# {what} on CUDA with no speed keys: the runner picks the fast path (manifest: build.choices)
kind = "engine"
model = "{model}"
dtype = "auto"
device = "{device}"
max_seq_len = {max_seq_len}
"""
DRY_SPEED_SUITE = """name = "speed-dry"
[[tasks]]
task = "speed"
prompt_lengths = [64]
output_tokens = 8
repeats = 2
clients = [1]
[probes]
idle_s = 0.5
"""


def log(msg: str) -> None:
    print(f"[rig {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def stage(summary: dict[str, Any], name: str, fn, *args, **kwargs) -> Any:
    t0 = time.perf_counter()
    log(f"{name} ...")
    try:
        out = fn(*args, **kwargs)
        summary.setdefault("stages", {})[name] = {"ok": True, "s": round(time.perf_counter() - t0, 2)}
        log(f"{name} done in {time.perf_counter() - t0:.1f}s")
        return out
    except Exception as e:
        summary.setdefault("stages", {})[name] = {"ok": False, "s": round(time.perf_counter() - t0, 2),
                                                  "error": f"{type(e).__name__}: {e}"}
        log(f"{name} FAILED: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        return None


def cli(args: list[str], timeout: float) -> str:
    """`moebench ...` as a user runs it; returns the last line printed (the run or compare dir)."""
    p = subprocess.run([sys.executable, "-m", "moebench.cli", *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})
    sys.stdout.write(p.stdout[-3000:])
    sys.stderr.write(p.stderr[-3000:])
    if p.returncode != 0:
        raise RuntimeError(f"moebench {' '.join(args)} exited {p.returncode}: {p.stderr[-500:]}")
    return p.stdout.strip().splitlines()[-1]


def pack_tiered(models: Path) -> Path:
    """The zoo's HF folder gets the committed trained weights (from this checkout or, for a stage copy
    inside a checkout's .wt/, from that checkout); the tiered artifact is packed from the plan."""
    import shutil
    from moebench.engine.tiering import Plan, pack
    weights = models / "tiny-moe" / "model.safetensors"
    if not weights.is_file():
        rel = Path("moebench/zoo/weights/model.safetensors")
        src = next((r / rel for r in (ROOT, ROOT.parent.parent) if (r / rel).is_file()), None)
        if src is None:
            raise FileNotFoundError(f"no {rel} under {ROOT} or {ROOT.parent.parent}")
        shutil.copyfile(src, weights)
    out = models / "tiny-moe-tiered"
    if not (out / "plan.json").is_file():
        pack(models / "tiny-moe", Plan.load(models / "tiny-moe-tiered.plan.json"), out)
    return out


def speed_medians(run_dir: Path) -> dict[int, float]:
    """Median decode tok/s per prompt length of a speed run's one-client items."""
    by: dict[int, list[float]] = {}
    for line in (run_dir / "items.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r.get("task") == "speed" and r.get("status") == "ok" and r.get("clients") == 1:
            by.setdefault(int(r["prompt_length"]), []).append(float(r["decode_tok_s"]))
    return {k: statistics.median(v) for k, v in sorted(by.items())}


def haystack_ids(eng, n: int) -> list[int]:
    from moebench.datasets import data_dir
    text = (data_dir() / "haystack" / "war_and_peace.txt").read_text(encoding="utf-8")
    ids = eng.tokenize(text[: n * 6])
    if len(ids) < n:
        raise RuntimeError(f"haystack gave {len(ids)} tokens, wanted {n}")
    return ids


def load_like_runner(profile_path: Path):
    """An Engine loaded as the engine runner loads it for this profile: its choices (prefetch
    included), its DecodeConfig and the profile's max_seq_len, so the KV cache has the run's shape."""
    import asyncio
    from moebench.config import load_runner
    from moebench.runners import make_runner, runner_schemas
    runner = make_runner(load_runner(profile_path, runner_schemas()))
    asyncio.run(runner.start())
    return runner.engine, {k: v["value"] for k, v in runner.choices.items()}


def suite_prompts(eng, length: int, repeats: int = SPEED_REPEATS, seed: int = SPEED_SEED) -> list[list[int]]:
    """The speed suite's one-client prompts for this length: the same unique opening per repeat
    (speed.task.measurement_prefix), then the haystack's prose, cut to `length` tokens. The tiered
    model's speed depends on which experts the text routes to the host tier, so the loop must see
    the suite's text."""
    from moebench.datasets import data_dir
    from moebench.tasks.needle import load_haystack
    from moebench.speed.task import measurement_prefix
    text = load_haystack(data_dir() / "haystack" / "war_and_peace.txt")[: length * 8]
    out = []
    for rep in range(repeats):
        ids = eng.tokenize(measurement_prefix(seed, length, 1, rep, 0) + text)
        if len(ids) < length:
            raise RuntimeError(f"haystack gave {len(ids)} tokens, wanted {length}")
        out.append(ids[:length])
    return out


def engine_loop(profile_path: Path, output_tokens: int = 128, passes: int = 3) -> dict[str, Any]:
    """The engine's own loop: Engine.generate on the speed suite's prompts of each length, each prompt
    `passes` times, decode tok/s = (n - 1) / (t_last - t_first), the median over all of them."""
    eng, choices = load_like_runner(profile_path)
    eng.generate([haystack_ids(eng, 64)], 16, ignore_eos=True)   # warm-up, as the run's runner does
    out: dict[str, Any] = {"choices": choices, "decode_tok_s": {}}
    for L in SPEED_LENGTHS:
        prompts = suite_prompts(eng, L)
        eng.generate([prompts[0]], output_tokens, ignore_eos=True)  # the suite's warm-up request
        rates = []
        for _ in range(passes):
            for ids in prompts:
                t = eng.generate([ids], output_tokens, ignore_eos=True)[0].token_times
                rates.append((len(t) - 1) / (t[-1] - t[0]))
        out["decode_tok_s"][L] = statistics.median(rates)
    return out


def counter_overhead(profile_path: Path, rounds: int = 10, tokens: int = 1024) -> dict[str, Any]:
    """Tiered decode tok/s with the fused path's pick counters on and off, interleaved ABAB..."""
    from dataclasses import replace
    eng, choices = load_like_runner(profile_path)
    plain = eng.decode
    ids = haystack_ids(eng, 256)
    # as long as a measured generation, so every KV bucket's graph is captured before the clock runs
    # (a capture inside the first measured round makes its first mode ~25% slower)
    eng.generate([ids[:128]], tokens, ignore_eos=True)
    rates: dict[str, list[float]] = {"on": [], "off": []}
    try:
        for r in range(rounds):
            for mode in (("on", "off") if r % 2 == 0 else ("off", "on")):
                eng.reconfigure(replace(plain, count_tier_picks=mode == "on"))
                eng.generate([ids[:128]], 16, ignore_eos=True)     # settle into the mode
                t = eng.generate([ids[r: r + 128]], tokens, ignore_eos=True)[0].token_times
                rates[mode].append((len(t) - 1) / (t[-1] - t[0]))
    finally:
        eng.reconfigure(plain)
    return {"choices": choices, "tokens": tokens, "rounds": rounds, "tok_s_on": rates["on"], "tok_s_off": rates["off"],
            **counter_cost(rates["on"], rates["off"])}


def counter_cost(on: list[float], off: list[float]) -> dict[str, float]:
    """Slowdown from paired rounds (each round runs both modes on the same prompt, whose host-tier
    picks set the speed: rounds differ by 10%, the modes within a round by far less), and from the
    medians of each mode for reference."""
    paired = [a / b for a, b in zip(on, off)]
    return {"median_on": statistics.median(on), "median_off": statistics.median(off),
            "slowdown_of_medians": 1.0 - statistics.median(on) / statistics.median(off),
            "paired_ratios": paired, "slowdown": 1.0 - statistics.median(paired)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--models", default="models/zoo")
    ap.add_argument("--results", default="results/rig")
    ap.add_argument("--skip", default="", help="comma-separated stages to skip: tests,smoke,speed,needle,loop,overhead")
    ap.add_argument("--dry", action="store_true", help="the plumbing on the CPU: tiny suites, no GPU stages")
    a = ap.parse_args()
    out, models, results = Path(a.out), ROOT / a.models, ROOT / a.results
    skip = set(filter(None, a.skip.split(",")))
    if a.dry:
        skip |= {"tests", "loop", "overhead"}
    out.mkdir(parents=True, exist_ok=True)
    results.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        import torch
        summary["device"] = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
                             "gpus": torch.cuda.device_count()}
    except Exception as e:
        summary["device"] = {"error": str(e)}

    stage(summary, "pack_tiered", pack_tiered, models)
    profiles = {}
    for name, model, what in (("engine-bf16-cuda", models / "tiny-moe", "the zoo's tiny MoE at BF16"),
                              ("engine-tiered-cuda", models / "tiny-moe-tiered",
                               "the zoo's tiered candidate (int8 hot on the GPU, ternary cold in host RAM)")):
        p = results / f"{name}.toml"
        p.write_text(RUNNER.format(what=what, model=model.relative_to(ROOT), device="cpu" if a.dry else "cuda",
                                   max_seq_len=4096 if a.dry else 180224))
        profiles[name] = p
    needle_suite = results / "needle-rig.toml"
    needle_suite.write_text(NEEDLE_SUITE.replace("[16384, 173000]", "[512]") if a.dry else NEEDLE_SUITE)
    speed_suite = "speed"
    if a.dry:
        speed_suite = str(results / "speed-dry.toml")
        Path(speed_suite).write_text(DRY_SPEED_SUITE)

    if "tests" not in skip:
        def tests():
            p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cuda or nvml",
                                "tests/test_engine_telemetry.py", "tests/test_probes.py", "tests/test_probes_gpus.py"],
                               cwd=ROOT, capture_output=True, text=True, timeout=240)
            (out / "rig_cuda_tests.log").write_text(p.stdout + p.stderr)
            summary["cuda_tests"] = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else p.stderr[-300:]
            log(f"cuda tests: {summary['cuda_tests']}")
        stage(summary, "cuda_tests", tests)

    runs: dict[str, dict[str, str]] = {}
    for suite, suite_arg, limit in (("smoke", "smoke", 300), ("speed", speed_suite, 300),
                                    ("needle", str(needle_suite), 400)):
        if suite in skip:
            continue
        for label in ("engine-bf16-cuda", "engine-tiered-cuda"):
            extra = (["--baseline", runs[suite]["engine-bf16-cuda"]] if suite == "smoke" and runs.get(suite) else
                     ["--as-baseline"] if suite == "smoke" else [])
            got = stage(summary, f"run_{suite}_{label}", cli,
                        ["run", suite_arg, "--runner", str(profiles[label]), "--out", str(results / f"{suite}_{label}"),
                         "--label", label, *extra, *(["--limit", "2"] if a.dry else [])], limit * (3 if a.dry else 1))
            if got:
                runs.setdefault(suite, {})[label] = got
        pair = runs.get(suite, {})
        if len(pair) == 2:
            stage(summary, f"compare_{suite}", cli, ["compare", pair["engine-bf16-cuda"], pair["engine-tiered-cuda"],
                                                     "--out", str(results / f"compare_{suite}")], 120)
    summary["runs"] = runs

    if "speed" in runs:
        summary["speed_via_run"] = {label: speed_medians(Path(d)) for label, d in runs["speed"].items()}
    if "loop" not in skip:
        loops = {}
        for label in ("engine-bf16-cuda", "engine-tiered-cuda"):
            got = stage(summary, f"engine_loop_{label}", engine_loop, profiles[label])
            if got:
                loops[label] = got
        summary["engine_loop"] = loops
        ratios = {}
        for label, loop in loops.items():
            via = (summary.get("speed_via_run") or {}).get(label) or {}
            ratios[label] = {L: via[L] / loop["decode_tok_s"][L] for L in loop["decode_tok_s"] if L in via}
        summary["run_over_loop"] = ratios
    if "overhead" not in skip:
        summary["counter_overhead"] = stage(summary, "counter_overhead", counter_overhead,
                                            profiles["engine-tiered-cuda"])

    (out / "rig_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    # The KLD baseline's full distributions (hundreds of MB) stay behind; everything else travels.
    left = []

    def keep(info: tarfile.TarInfo):
        if info.isfile() and ("/kld/" in info.name or info.size > 8 << 20):
            left.append(f"{info.name} ({info.size} bytes)")
            return None
        return info
    with tarfile.open(out / "rig_runs.tgz", "w:gz") as tar:
        for d in sorted(results.iterdir()):
            tar.add(d, arcname=f"rig/{d.name}", filter=keep)
    summary["left_out_of_tar"] = left
    (out / "rig_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print_table(summary)
    return 0


def print_table(s: dict[str, Any]) -> None:
    print("\n== stages")
    for k, v in (s.get("stages") or {}).items():
        print(f"  {k:40s} {'ok ' if v['ok'] else 'FAIL'} {v['s']:7.1f}s {v.get('error', '')[:120]}")
    print("== decode tok/s: moebench run (speed suite, 1 client, median) vs the engine's own loop")
    for label, loop in (s.get("engine_loop") or {}).items():
        via = (s.get("speed_via_run") or {}).get(label) or {}
        for L, v in loop["decode_tok_s"].items():
            r = via.get(L)
            print(f"  {label:20s} {L:6d}  run {r if r is None else round(r, 1)!s:>8}  loop {v:8.1f}  "
                  f"ratio {'-' if r is None else f'{r / v:.3f}'}")
    co = s.get("counter_overhead")
    if co:
        print(f"== pick counters: on {co['median_on']:.1f} tok/s, off {co['median_off']:.1f} tok/s (medians); "
              f"slowdown {100 * co['slowdown']:.2f}% (median of paired rounds)")


if __name__ == "__main__":
    raise SystemExit(main())
