"""moebench: benchmark and evaluate compressed Mixture-of-Experts runtimes (a thin shell over moebench.api).

Exit codes: 0 ok, 1 a failed gate or a failed run, 2 bad usage or bad input, 3 a gate with
inconclusive rules and no failure.
"""
from __future__ import annotations

import argparse
import sys

from moebench import __version__
from moebench.commands import COMMANDS
from moebench.commands.common import HelpFormatter

# Modules of the extras (pyproject.toml): a command that needs one says which extra to install.
OPTIONAL_MODULES = {"torch": "engine", "safetensors": "engine", "tokenizers": "engine", "transformers": "engine",
                    "lm_eval": "lmeval", "yaml": "lmeval"}


def _parser() -> argparse.ArgumentParser:
    """The top-level parser; each command module adds its own (moebench.commands)."""
    p = argparse.ArgumentParser(prog="moebench", description=__doc__.splitlines()[0], formatter_class=HelpFormatter,
                                epilog="examples:\n  moebench demo\n"
                                       "  moebench serve --runner engine-bf16 --port 8000 &   # then, from "
                                       "another shell:\n"
                                       "  moebench run smoke --runner serve --label served\n"
                                       "  moebench <command> --help")
    p.add_argument("--version", action="version", version=f"moebench {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for cmd in COMMANDS:
        cmd.add_args(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from moebench import api
    from moebench.config import ProfileError
    from moebench.datasets import DatasetError
    from moebench.runners.base import CapabilityError
    from moebench.kld.runs import KldError
    from moebench.store import StoreError
    try:
        return args.handler(args)
    except (api.UsageError, ProfileError, DatasetError, StoreError, CapabilityError, KldError,
            FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        extra = OPTIONAL_MODULES.get((e.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"error: `moebench {args.command}` needs {e.name}, which is not installed here: "
              f"pip install 'moebench[{extra}]'", file=sys.stderr)
        return 2
    except OSError as e:            # a full disk or a failing filesystem: one line naming path and errno
        print(api.os_error_line(e), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
