"""Tolerant readers for the optional sections of compare.json (speed, needle, memory, energy).

The per-task section is a contract (docs/design.md section 5); the optional sections are written by
helpers that may nest per-side figures either as `{"baseline": {...}, "candidate": {...}}` or as
`{"metric": {"baseline": x, "candidate": y}}` or as `baseline_<metric>` keys. The report and the gate
read them through these functions so both agree on one interpretation and neither crashes on a
missing key.
They live in the store beside the typed compare document (`store.records.CompareDoc`), so that
compare, report and gate all read through one place and none of them imports another for it.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, TypedDict

from moebench.json_fields import is_of
from moebench.json_types import JsonObject, JsonValue

SIDES = ("baseline", "candidate")
SPEED_METRICS = ("ttft_s", "prefill_tok_s", "decode_tok_s", "tpot_s", "itl_s", "e2e_s")
# Short names some writers use for ratio keys ("decode" for decode_tok_s).
_SHORT = {"ttft_s": "ttft", "prefill_tok_s": "prefill", "decode_tok_s": "decode", "tpot_s": "tpot",
          "itl_s": "itl", "e2e_s": "e2e"}


# One prompt length (and client count) of compare.json's speed section, normalised: per metric both
# sides' figures, the candidate/baseline ratio and its 95% interval; the timed requests per side; both
# sides' percentile summaries and draft acceptance rates. A dict with these named keys, since the
# report's template and the gate look its figures up by metric name.
SpeedRow = TypedDict("SpeedRow", {
    "prompt_length": Optional[int], "clients": Optional[int],
    "baseline_ttft_s": Optional[float], "candidate_ttft_s": Optional[float], "ttft_s_ratio": Optional[float],
    "ttft_s_ratio_ci95": Optional[list[Optional[float]]],
    "baseline_prefill_tok_s": Optional[float], "candidate_prefill_tok_s": Optional[float], "prefill_tok_s_ratio": Optional[float],
    "prefill_tok_s_ratio_ci95": Optional[list[Optional[float]]],
    "baseline_decode_tok_s": Optional[float], "candidate_decode_tok_s": Optional[float], "decode_tok_s_ratio": Optional[float],
    "decode_tok_s_ratio_ci95": Optional[list[Optional[float]]],
    "baseline_tpot_s": Optional[float], "candidate_tpot_s": Optional[float], "tpot_s_ratio": Optional[float],
    "tpot_s_ratio_ci95": Optional[list[Optional[float]]],
    "baseline_itl_s": Optional[float], "candidate_itl_s": Optional[float], "itl_s_ratio": Optional[float],
    "itl_s_ratio_ci95": Optional[list[Optional[float]]],
    "baseline_e2e_s": Optional[float], "candidate_e2e_s": Optional[float], "e2e_s_ratio": Optional[float],
    "e2e_s_ratio_ci95": Optional[list[Optional[float]]],
    "n_baseline": Optional[int], "n_candidate": Optional[int],
    "baseline_stats": JsonObject, "acceptance_baseline": Optional[float],
    "candidate_stats": JsonObject, "acceptance_candidate": Optional[float],
})


class NeedleCounts(TypedDict):
    """How many needle cells each side found, and the flips between them."""

    cells: int
    found_baseline: int
    found_candidate: int
    lost: int
    gained: int


def number(v: object) -> float | None:
    """A finite float, or None for anything else (missing, null, NaN, text)."""
    if not is_of(v, (float,)):
        if isinstance(v, dict):           # summaries like {"median": x, "iqr": [..]}
            for key in ("median", "mean", "value"):
                if key in v:
                    return number(v[key])
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def side_value(row: JsonValue, side: str, metric: str) -> float | None:
    """`metric` of `side` in a row, whichever of the usual nestings it uses."""
    if not isinstance(row, dict):
        return None
    nested = row.get(side)
    if isinstance(nested, dict) and metric in nested:
        return number(nested[metric])
    for key in (f"{side}_{metric}", f"{metric}_{side}"):
        if key in row:
            return number(row[key])
    by_metric = row.get(metric)
    if isinstance(by_metric, dict) and side in by_metric:
        return number(by_metric[side])
    return None


# --- speed ------------------------------------------------------------------------------------

def speed_rows(speed: JsonValue) -> list[SpeedRow]:
    """Normalised speed rows sorted by prompt length: prompt_length, <side>_<metric>, <metric>_ratio."""
    if not isinstance(speed, dict):
        return []
    raw: Iterable[tuple[str | None, JsonValue]]
    source = next((speed[k] for k in ("rows", "per_prompt_length", "by_prompt_length", "lengths")
                   if k in speed), None)
    if isinstance(source, list):
        raw = [(None, r) for r in source]
    elif isinstance(source, dict):
        raw = list(source.items())
    else:  # keyed by length directly: {"512": {...}, "1024": {...}}
        raw = [(k, v) for k, v in speed.items() if isinstance(v, dict) and _is_int(k)]
    rows = []
    for key, r in raw:
        if not isinstance(r, dict):
            continue
        length = number(r.get("prompt_length", r.get("prompt_tokens", r.get("length"))))
        if length is None and key is not None and _is_int(key):
            length = float(key)
        row: SpeedRow = {"prompt_length": int(length) if length is not None else None}  # type: ignore[typeddict-item]
        ratios = r.get("ratios") if isinstance(r.get("ratios"), dict) else {}
        clients = number(r.get("clients"))
        row["clients"] = int(clients) if clients is not None else None
        for metric in SPEED_METRICS:
            short = _SHORT[metric]
            base = side_value(r, "baseline", metric)
            cand = side_value(r, "candidate", metric)
            base = base if base is not None else side_value(r, "baseline", short)
            cand = cand if cand is not None else side_value(r, "candidate", short)
            row[f"baseline_{metric}"] = base
            row[f"candidate_{metric}"] = cand
            ratio = None
            for k in (metric, short):
                if k in ratios:
                    ratio = number(ratios[k])
                    break
            if ratio is None:
                for k in (f"{metric}_ratio", f"{short}_ratio", f"ratio_{metric}", f"ratio_{short}"):
                    if k in r:
                        ratio = number(r[k])
                        break
            if ratio is None and base and cand is not None:
                ratio = cand / base       # candidate over baseline, as the design defines ratios
            row[f"{metric}_ratio"] = ratio
            ci = next((r[k] for k in (f"{short}_ratio_ci95", f"{metric}_ratio_ci95") if k in r), None)
            row[f"{metric}_ratio_ci95"] = (
                [number(ci[0]), number(ci[1])] if isinstance(ci, list) and len(ci) == 2
                and number(ci[0]) is not None and number(ci[1]) is not None else None)
        for side in SIDES:
            n = number(r.get(f"n_{side}"))
            row[f"n_{side}"] = int(n) if n is not None else None
        for side in SIDES:
            st = r.get(f"{side}_stats")
            row[f"{side}_stats"] = st if isinstance(st, dict) else {}
            row[f"acceptance_{side}"] = number(r.get(f"acceptance_{side}"))   # speculative decoding
        rows.append(row)
    rows.sort(key=lambda x: (x["clients"] or 0, x["prompt_length"] is None, x["prompt_length"] or 0))
    return rows


def _is_int(k: object) -> bool:
    try:
        int(str(k))
        return True
    except ValueError:
        return False


# --- needle -----------------------------------------------------------------------------------

def needle_cells(needle: JsonValue) -> list[JsonObject]:
    """The cells of compare.json's needle section (`compare.needle.NeedleCell`'s JSON) that are objects."""
    if not isinstance(needle, dict) or not isinstance(needle.get("cells"), list):
        return []
    return [c for c in needle["cells"] if isinstance(c, dict)]


def needle_counts(cells: list[JsonObject]) -> NeedleCounts:
    """How many cells each side found, and the flips between them."""
    fb = [c.get("found_baseline") is True for c in cells]
    fc = [c.get("found_candidate") is True for c in cells]
    return {
        "cells": len(cells),
        "found_baseline": sum(fb),
        "found_candidate": sum(fc),
        "lost": sum(1 for b, c in zip(fb, fc) if b and not c),
        "gained": sum(1 for b, c in zip(fb, fc) if c and not b),
    }


# --- memory / energy --------------------------------------------------------------------------

def flatten(d: JsonValue, prefix: str = "", skip: tuple[str, ...] = ()) -> dict[str, JsonValue]:
    """Nested dicts to dotted keys (the JSON leaves by their paths); lists longer than a few items are
    summarised by their length."""
    out: dict[str, JsonValue] = {}
    if not isinstance(d, dict):
        return out
    for k, v in d.items():
        if k in skip:
            continue
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + ".", skip))
        elif isinstance(v, list) and (len(v) > 6 or any(isinstance(x, (dict, list)) for x in v)):
            out[key] = f"[{len(v)} values]"
        else:
            out[key] = v
    return out


def _split_side(key: str) -> tuple[str, str]:
    """("candidate", "per_token.prefill.net_j_per_token") from "per_token.prefill.candidate_net_j_per_token".

    A side appears as a path component ("baseline.peak_used_bytes"), a prefix ("baseline_idle_power_w")
    or a suffix ("cost_per_million_tokens_candidate"); keys naming no side go to "value".
    """
    parts = key.split(".")
    for i, part in enumerate(parts):
        for side in SIDES:
            if part == side:
                rest = parts[:i] + parts[i + 1:]
            elif part.startswith(side + "_"):
                rest = parts[:i] + [part[len(side) + 1:]] + parts[i + 1:]
            elif part.endswith("_" + side):
                rest = parts[:i] + [part[: -len(side) - 1]] + parts[i + 1:]
            else:
                continue
            return side, ".".join(rest) or side
    return "value", key


def per_side(section: JsonValue, skip: tuple[str, ...] = ()) -> tuple[list[str], dict[str, dict[str, JsonValue]]]:
    """(metric names, {side: {metric: value}}) for a section with figures for both runs, or for one.

    Figures naming no side (ratios, deltas, notes) are returned under the column "value".
    """
    if not isinstance(section, dict):
        return [], {}
    sides: dict[str, dict[str, JsonValue]] = {s: {} for s in (*SIDES, "value")}
    names: list[str] = []
    for key, v in flatten(section, skip=skip).items():
        side, metric = _split_side(key)
        sides[side][metric] = v
        if metric not in names:
            names.append(metric)
    return names, {s: m for s, m in sides.items() if m}


def memory_value(memory: JsonValue, metric: str, side: str = "candidate") -> float | None:
    """One memory figure of a side (falls back to an unsided figure)."""
    if not isinstance(memory, dict):
        return None
    v = side_value(memory, side, metric)
    if v is None and metric in memory:
        v = number(memory[metric])
    return v
