"""`moebench import-lm-eval`: lm-eval --log_samples files into a moebench run (api.import_lm_eval)."""
from __future__ import annotations

import argparse

from moebench.commands.common import command


def add_args(sub: argparse._SubParsersAction) -> None:
    ie = command(sub, "import-lm-eval", "turn lm-eval --log_samples files into a moebench run",
                 "moebench import-lm-eval out/samples_gsm8k_*.jsonl --out results/lm-eval-gsm8k")
    ie.add_argument("paths", nargs="+", help="samples_<task>_<date>.jsonl files written by lm-eval --log_samples")
    ie.add_argument("--out", required=True, help="run directory to write")
    ie.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from moebench import api
    print(api.import_lm_eval(args.paths, args.out))
    return 0
