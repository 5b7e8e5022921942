"""`moebench trend`: headline figures of several runs side by side (api.trend)."""
from __future__ import annotations

import argparse

from moebench.commands.common import command


def add_args(sub: argparse._SubParsersAction) -> None:
    tr = command(sub, "trend", "headline figures of several runs across builds: trend.html, .csv, .json",
                 "moebench trend results/run-b11000 results/run-b11434 --order build --out results/trend")
    tr.add_argument("runs", nargs="+", metavar="run", help="run directories to put side by side")
    tr.add_argument("--out", help="trend directory (default: results/trend_<n>_runs/)")
    tr.add_argument("--order", choices=("time", "build", "given"), default="time",
                    help="x axis order: start time, llama.cpp build number, or as given")
    tr.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from moebench import api
    out_dir = api.trend(args.runs, args.out, order=args.order)
    print((out_dir / "trend.csv").read_text(encoding="utf-8"), end="")
    print(out_dir)
    return 0
