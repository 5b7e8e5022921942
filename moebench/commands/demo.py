"""`moebench demo`: the embedded default end to end (api.demo)."""
from __future__ import annotations

import argparse

from moebench.commands.common import command


def add_args(sub: argparse._SubParsersAction) -> None:
    d = command(sub, "demo", "the embedded default end to end: engine, tiny MoE, BF16 vs tiered, report",
                "moebench demo\nmoebench demo --out /tmp/demo")
    d.add_argument("--out", help="demo directory (default: results/demo)")
    d.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from moebench import api
    print(api.demo(args.out))
    return 0
