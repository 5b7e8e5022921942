"""`moebench speed-ab`: two runner profiles interleaved in fresh processes (api.speed_ab)."""
from __future__ import annotations

import argparse

from moebench.commands.common import command


def add_args(sub: argparse._SubParsersAction) -> None:
    ab = command(sub, "speed-ab", "A/B speed: two runner profiles interleaved A,B,B,A in fresh processes",
                 "moebench speed-ab engine-bf16 engine-tiered --out results/ab")
    ab.add_argument("profile_a", help="runner profile A (a name under runners/ or a path)")
    ab.add_argument("profile_b", help="runner profile B (a name under runners/ or a path)")
    ab.add_argument("--suite", default="speed", help="a suite whose first speed task gives the options")
    ab.add_argument("--order", default="ABBA", help="the order of passes, a string of A and B")
    ab.add_argument("--out", required=True, help="output directory (ab.json)")
    ab.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from moebench import api
    from moebench.speed.ab_compare import format_rounds
    result = api.speed_ab(args.profile_a, args.profile_b, args.out, suite=args.suite, order=args.order)
    print(format_rounds(result["speed_ab"]))
    outs = result.get("outputs", {})
    print(f"outputs compared: {outs.get('n_compared')} prompts over {len(outs.get('pairs', []))} A/B pass "
          f"pairs, differing in any pair: {outs.get('n_differ')}")
    print(args.out)
    return 0
