"""`moebench report`: report.html for a run or compare directory (api.report)."""
from __future__ import annotations

import argparse

from moebench.commands.common import command


def add_args(sub: argparse._SubParsersAction) -> None:
    rp = command(sub, "report", "render report.html for a run or compare directory",
                 "moebench report results/cmp\nmoebench report results/base --out /tmp/base.html")
    rp.add_argument("path", help="a run directory (manifest.json) or a compare directory (compare.json)")
    rp.add_argument("--out", help="output HTML file (default: report.html inside the directory)")
    rp.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from moebench import api
    print(api.report(args.path, args.out))
    return 0
