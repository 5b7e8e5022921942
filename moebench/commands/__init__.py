"""The CLI's commands: one module per command, each an `add_args(subparsers)` that adds its parser
(and its sub-commands') and a handler that calls its `moebench.api` function and prints.

`COMMANDS` is the order `moebench --help` lists them in; `moebench.cli` builds its parser from it and
calls the handler a parsed command set (`args.handler`).
"""
from __future__ import annotations

from moebench.commands import (compare, data, demo, gate, import_lm_eval, lm_eval, report, run, serve, speed_ab,
                               tier, tools, trend, zoo)

COMMANDS = (run, compare, trend, report, gate, demo, tools, zoo, data, tier, import_lm_eval, lm_eval, speed_ab, serve)
