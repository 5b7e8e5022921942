"""Errors shared across layers: defined here, below everything that raises them."""
from __future__ import annotations


class UsageError(Exception):
    """Bad usage or bad input: exit code 2 (also reachable as `moebench.api.UsageError`)."""
