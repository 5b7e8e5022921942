"""`moebench data fetch`: the dataset mirror from its public sources (api.data_fetch)."""
from __future__ import annotations

import argparse
import sys

from moebench.commands.common import command


def add_args(sub: argparse._SubParsersAction) -> None:
    da = command(sub, "data", "the dataset mirror (GSM8K, HumanEval, CMMLU, WikiText-2, haystacks)",
                 "moebench data fetch --to data\nMOEBENCH_DATA_DIR=data moebench run smoke --runner http")
    dsub = da.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    df = command(dsub, "fetch", "download the mirror from its public sources, checking every file's sha256",
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
    df.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from moebench import api
    from moebench.data_fetch import FetchError
    try:
        print(api.data_fetch(args.to, args.source, base_url=args.base_url, hub_repo=args.hub_repo,
                             hub_revision=args.hub_revision, hub_endpoint=args.hub_endpoint, only=args.only))
    except FetchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
