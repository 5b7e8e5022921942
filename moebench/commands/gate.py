"""`moebench gate`: a compare directory against rules (api.gate); the exit code is the verdict's."""
from __future__ import annotations

import argparse

from moebench.commands.common import command


def add_args(sub: argparse._SubParsersAction) -> None:
    g = command(sub, "gate", "check a compare directory against rules; exit 0 pass, 1 a rule failed, 2 bad input, "
                             "3 inconclusive (no rule failed, one could not be judged: too few samples, an "
                             "interval straddling the limit; [gate] on_inconclusive maps it to 0 or 1)",
                "moebench gate results/cmp --rules gates/example.toml\n"
                "moebench gate results/cmp --rules gates/example.toml --json")
    g.add_argument("compare_dir", help="compare directory (compare.json); summary.md and junit.xml are written there")
    g.add_argument("--rules", required=True, help="gate rules TOML (see gates/example.toml)")
    g.add_argument("--json", action="store_true",
                   help="print the checks as one JSON object instead of the Markdown table")
    g.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from moebench import api
    return api.gate(args.compare_dir, args.rules, as_json=args.json)
