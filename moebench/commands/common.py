"""What every command's parser shares: the help layout (examples kept as written, defaults shown)."""
from __future__ import annotations

import argparse

RUNNER_HELP = "runner profile: a name under runners/ (engine-bf16, http) or a path to a TOML file"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Examples kept as written; every option's default shown where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or default in (None, False, argparse.SUPPRESS)
                or isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
            return text
        return f"{text} (default: {default})"


def command(sub: argparse._SubParsersAction, name: str, help: str, examples: str) -> argparse.ArgumentParser:
    """A subcommand whose --help ends with examples."""
    return sub.add_parser(name, help=help, description=help, formatter_class=HelpFormatter,
                          epilog="examples:\n" + "\n".join(f"  {ln}" for ln in examples.strip().splitlines()))
