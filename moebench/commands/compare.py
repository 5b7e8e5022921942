"""`moebench compare`: pair runs with a baseline (api.compare_many) and print the chosen form."""
from __future__ import annotations

import argparse
import sys

from moebench.commands.common import command


def add_args(sub: argparse._SubParsersAction) -> None:
    c = command(sub, "compare", "pair runs item by item with a baseline; writes compare.json, summary.md, "
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
    c.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from moebench import api
    from moebench.compare.tables import text_table
    from moebench.store.records import CompareDoc
    out_dir, cmps, rows = api.compare_many(args.baseline, args.candidates, args.out, speed_ab=args.speed_ab,
                                           allow_reversed=args.allow_reversed)
    if args.format == "text":
        print(text_table([CompareDoc.from_dict(c) for c in cmps], rows))
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
