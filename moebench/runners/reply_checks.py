"""Checking what a server reports before any of it reaches a record: nothing is taken on trust.

- A token count (`usage.prompt_tokens`, `usage.completion_tokens`, llama-server's `tokens_predicted`,
  `timings.predicted_n`, ...) must be a non-negative integer (a bool is not one): anything else is a
  RunnerError naming the field and the URL, so the item becomes an `error` record.
- `timings` must be an object of numbers (or nulls): finite, and not negative for counts (`*_n`),
  durations (`*_ms`) and rates (`*_per_second`). NaN and Infinity never pass, so no record holds them.
- A log-prob must be a finite number <= LOGPROB_TOLERANCE (a log-prob is at most 0; the tolerance
  absorbs servers' rounding); a probability a finite number in [0, 1 + LOGPROB_TOLERANCE].
- The output token count the server reports is compared with one counted on the client
  (`OutputCount`); beyond the tolerance the record stays `ok`, carries `server_count_mismatch` with
  both numbers, and the client's count is the one used (tok/s among others).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from moebench.json_fields import is_of
from moebench.runners.base import CountMismatch, RunnerError, ServerTimings

LOGPROB_TOLERANCE = 1e-4
# A server's output count may differ from the client's by this many tokens, or this fraction of the
# client's count, whichever is larger: retokenized text loses the EOS and stop-string tokens the server
# generated and may merge tokens at piece boundaries.
COUNT_TOLERANCE_TOKENS = 8
COUNT_TOLERANCE_FRACTION = 0.10
# Each generated token decodes to at least one byte of text, special tokens (EOS, end of turn) aside:
# a count far above the text's byte length is impossible.
SPECIAL_TOKEN_ALLOWANCE = COUNT_TOLERANCE_TOKENS


def count(value: Any, field: str, where: str) -> int | None:
    """A token count the server reported: None when absent, else a non-negative int or RunnerError."""
    if value is None:
        return None
    if not is_of(value, (int,)) or value < 0:
        raise RunnerError(f"{where}: field {field!r} is {_shown(value)}, expected a non-negative integer "
                          "(a token count)")
    return value


@dataclass(frozen=True)
class Usage:
    """The checked counts of an OpenAI-style `usage` object; each None where the server gave none."""

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None
    reasoning_tokens: int | None = None     # from `completion_tokens_details`


def usage(value: Any, where: str) -> Usage:
    """The checked counts of an OpenAI-style `usage` object (reasoning tokens from its
    `completion_tokens_details`); all None when absent."""
    if value is None:
        return Usage()
    if not isinstance(value, dict):
        raise RunnerError(f"{where}: field 'usage' is {_shown(value)}, expected an object")
    details = value.get("completion_tokens_details")
    return Usage(prompt_tokens=count(value.get("prompt_tokens"), "usage.prompt_tokens", where),
                 completion_tokens=count(value.get("completion_tokens"), "usage.completion_tokens", where),
                 total_tokens=count(value.get("total_tokens"), "usage.total_tokens", where),
                 reasoning_tokens=(count(details.get("reasoning_tokens"),
                                         "usage.completion_tokens_details.reasoning_tokens", where)
                                   if isinstance(details, dict) else None))


def logprob(value: Any, field: str, where: str) -> float:
    """A log-prob the server reported, as a float; RunnerError unless finite and <= LOGPROB_TOLERANCE."""
    if not is_of(value, (float,)):
        raise RunnerError(f"{where}: field {field!r} is {_shown(value)}, expected a number (a log-prob)")
    v = float(value)
    if not math.isfinite(v) or v > LOGPROB_TOLERANCE:
        raise RunnerError(f"{where}: field {field!r} is {_shown(value)}, expected a finite log-prob <= 0 "
                          f"(tolerance {LOGPROB_TOLERANCE:g})")
    return v


def probability(value: Any, field: str, where: str) -> float:
    """A probability the server reported; RunnerError unless a finite number in [0, 1 + tolerance]."""
    if not is_of(value, (float,)) or not math.isfinite(value) \
            or not 0 <= value <= 1 + LOGPROB_TOLERANCE:
        raise RunnerError(f"{where}: field {field!r} is {_shown(value)}, expected a probability in [0, 1]")
    return float(value)


def timings(value: Any, where: str) -> ServerTimings:
    """A server's `timings` object, checked value by value; {} when absent."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RunnerError(f"{where}: field 'timings' is {_shown(value)}, expected an object of numbers")
    out: ServerTimings = {}
    for key, v in value.items():
        field = f"timings.{key}"
        if v is None:                       # llama-server writes a rate over a zero duration as null
            out[key] = None
        elif key.endswith("_n") or key.endswith("_n_accepted"):
            out[key] = count(v, field, where)
        elif not is_of(v, (float,)) or not math.isfinite(v):
            raise RunnerError(f"{where}: field {field!r} is {_shown(v)}, expected a finite number")
        elif v < 0 and (key.endswith("_ms") or key.endswith("_per_second")):
            raise RunnerError(f"{where}: field {field!r} is {_shown(v)}, expected a duration or rate >= 0")
        else:
            out[key] = v
    return out


@dataclass
class OutputCount:
    """Output tokens counted on the client, and how: "token-ids" (the ids the server returned),
    "tokenizer" (the profile's local tokenizer on the output text), "server-tokenize" (the server's
    /tokenize on the output text), "stream-pieces" (streamed pieces: a lower bound, as one piece
    may carry several tokens) or "none" (only the text's byte length bounds the count)."""

    value: int | None
    source: str


def reconcile(server: int | None, field: str, client: OutputCount, text: str,
              max_tokens: int | None) -> tuple[int | None, CountMismatch | None]:
    """(the output token count to use, a `server_count_mismatch` flag or None).

    The server's count is used where it lies within the allowed range around the client's count;
    otherwise the client's count is (None where the client could not count)."""
    upper = len(text.encode("utf-8")) + SPECIAL_TOKEN_ALLOWANCE
    lower = 0
    if client.value is not None:
        if client.source == "stream-pieces":
            lower = client.value            # every text-bearing piece holds at least one token
        else:
            slack = max(COUNT_TOLERANCE_TOKENS, math.ceil(COUNT_TOLERANCE_FRACTION * client.value))
            lower, upper = client.value - slack, min(upper, client.value + slack)
    if max_tokens:
        upper = min(upper, max_tokens)
    lower = max(0, min(lower, upper))
    if server is None:
        return client.value, None
    if lower <= server <= upper:
        return server, None
    return client.value, CountMismatch(field, server, client.value, client.source, (lower, upper))


def _shown(value: Any) -> str:
    text = repr(value) if not isinstance(value, (dict, list)) else f"{type(value).__name__} {str(value)[:80]}"
    return f"{text[:100]} ({type(value).__name__})"
