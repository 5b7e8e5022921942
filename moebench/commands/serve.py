"""`moebench serve`: an OpenAI-compatible server over a runner (api.serve)."""
from __future__ import annotations

import argparse

from moebench.commands.common import RUNNER_HELP, command


def add_args(sub: argparse._SubParsersAction) -> None:
    s = command(sub, "serve", "an OpenAI-compatible server over a runner (/v1/completions, /v1/chat/completions)",
                "moebench serve --runner engine-bf16 --port 8000\n"
                "moebench serve --runner llama-q4_0 --port 8081\n"
                "MOEBENCH_KEY=secret moebench serve --runner http --host 0.0.0.0 --api-key-env MOEBENCH_KEY")
    s.add_argument("--runner", required=True, help=RUNNER_HELP)
    s.add_argument("--port", type=int, default=8000, help="TCP port (0: pick a free one)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--max-logprobs", type=int, default=100,
                   help="largest logprobs a request may ask (the vocabulary size gives whole distributions)")
    s.add_argument("--api-key-env", metavar="NAME",
                   help="require 'Authorization: Bearer KEY', KEY read from environment variable NAME "
                        "(required with a --host beyond loopback)")
    s.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    from moebench import api
    api.serve(args.runner, host=args.host, port=args.port, api_key_env=args.api_key_env,
              max_logprobs=args.max_logprobs)
    return 0
