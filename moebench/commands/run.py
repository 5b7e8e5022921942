"""`moebench run`: a suite against a runner into a run directory (api.run), and what it prints."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from moebench import jsonout
from moebench.commands.common import RUNNER_HELP, command


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


def add_args(sub: argparse._SubParsersAction) -> None:
    r = command(sub, "run", "run a suite against a runner into a run directory (last line: the run directory)",
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
    r.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from moebench import api
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
