"""`moebench lm-eval`: lm-eval tasks through a moebench runner, stored as a run (api.lm_eval)."""
from __future__ import annotations

import argparse

from moebench.commands.common import RUNNER_HELP, command


def add_args(sub: argparse._SubParsersAction) -> None:
    le = command(sub, "lm-eval", "run lm-eval tasks through a moebench runner; stores a moebench run",
                 "moebench lm-eval --runner http --tasks gsm8k --limit 20\n"
                 "moebench lm-eval --runner engine-bf16 --tasks gsm8k,cmmlu --out results/lm-eval-base")
    le.add_argument("--runner", required=True, help=RUNNER_HELP)
    le.add_argument("--tasks", required=True, help="comma-separated lm-eval task names (gsm8k, cmmlu, ...)")
    le.add_argument("--limit", type=int, metavar="N", help="at most N documents per task (default: all)")
    le.add_argument("--out", help="run directory (default: results/<timestamp>_lm-eval_<runner>/)")
    le.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from moebench import api
    print(api.lm_eval(args.runner, args.tasks, args.limit, args.out))
    return 0
