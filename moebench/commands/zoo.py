"""`moebench zoo build`: the tiny model zoo (api.zoo_build)."""
from __future__ import annotations

import argparse

from moebench.commands.common import command


def add_args(sub: argparse._SubParsersAction) -> None:
    z = command(sub, "zoo", "the tiny model zoo", "moebench zoo build\nmoebench zoo build --hf-only")
    zsub = z.add_subparsers(dest="zoo_command", required=True, metavar="ACTION")
    zb = command(zsub, "build", "build the tiny MoE in Hugging Face and GGUF form (GGUF needs llama.cpp: built on demand)",
                 "moebench zoo build --out models/zoo\nmoebench zoo build --hf-only     # the engine's checkpoint, no llama.cpp")
    zb.add_argument("--out", default="models/zoo", help="zoo folder")
    zb.add_argument("--retrain", action="store_true", help="retrain from the seed instead of the committed weights")
    zb.add_argument("--hf-only", action="store_true",
                    help="only the Hugging Face checkpoint (what the engine and the demo read): no llama.cpp build")
    zb.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from moebench import api
    info = api.zoo_build(args.out, retrain=args.retrain, gguf=not args.hf_only)
    for k, v in (info.get("paths") or {}).items():
        if k != "out_dir":
            print(f"{k}: {v}")
    print(info.get("paths", {}).get("out_dir", args.out))
    return 0
