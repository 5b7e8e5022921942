"""Speed statistics from stored speed records: medians and spread per prompt length, and the
candidate/baseline ratios for compare.json["speed"]. Reads records only (no runner)."""
from __future__ import annotations

import math
import statistics
from typing import Any

METRICS = ("ttft_s", "prefill_tok_s", "decode_tok_s")


def _stats(values: list[float]) -> dict[str, Any] | None:
    vals = sorted(v for v in values if v is not None and math.isfinite(v))
    if not vals:
        return None
    q = statistics.quantiles(vals, n=4, method="inclusive") if len(vals) > 1 else [vals[0]] * 3
    return {"n": len(vals), "median": statistics.median(vals), "p25": q[0], "p75": q[2],
            "iqr": q[2] - q[0], "min": vals[0], "max": vals[-1]}


def summarize_speed(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{prompt_length: {clients: {metric: {n, median, p25, p75, iqr, min, max}, ...}}} over ok records.

    With several clients, `aggregate_decode_tok_s` is the median per-client decode rate times clients.
    """
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in records:
        if r.get("status", "ok") != "ok" or r.get("ttft_s") is None:
            continue
        key = (int(r.get("prompt_length") or _from_id(r, 1)), int(r.get("clients") or _from_id(r, 2)))
        groups.setdefault(key, []).append(r)
    out: dict[str, dict[str, Any]] = {}
    for (length, clients), recs in sorted(groups.items()):
        entry: dict[str, Any] = {m: _stats([r.get(m) for r in recs]) for m in METRICS}
        entry["prompt_tokens"] = _stats([r.get("prompt_tokens") for r in recs])
        entry["output_tokens"] = _stats([r.get("output_tokens") for r in recs])
        dec = entry["decode_tok_s"]
        entry["aggregate_decode_tok_s"] = dec["median"] * clients if dec else None
        out.setdefault(str(length), {})[str(clients)] = entry
    return out


def _from_id(r: dict[str, Any], part: int) -> int:
    return int(str(r["item_id"]).split("/")[part])


def _ratio(a: float | None, b: float | None) -> float | None:
    return (b / a) if a and b is not None and a > 0 else None


def speed_compare(base_records: list[dict[str, Any]], cand_records: list[dict[str, Any]]) -> dict[str, Any]:
    """compare.json["speed"]: candidate/baseline ratios of the medians per prompt length and clients.

    ttft_ratio < 1 and prefill/decode ratios > 1 mean the candidate is faster.
    """
    base = summarize_speed([r for r in base_records if str(r.get("item_id", "")).startswith("speed/")])
    cand = summarize_speed([r for r in cand_records if str(r.get("item_id", "")).startswith("speed/")])
    rows = []
    for length in sorted(set(base) & set(cand), key=int):
        for clients in sorted(set(base[length]) & set(cand[length]), key=int):
            b, c = base[length][clients], cand[length][clients]
            row: dict[str, Any] = {"prompt_length": int(length), "clients": int(clients)}
            for m, name in (("ttft_s", "ttft"), ("prefill_tok_s", "prefill"), ("decode_tok_s", "decode")):
                bm = b[m]["median"] if b[m] else None
                cm = c[m]["median"] if c[m] else None
                row[f"{name}_baseline"], row[f"{name}_candidate"] = bm, cm
                row[f"{name}_ratio"] = _ratio(bm, cm)
            row["n_baseline"] = b["ttft_s"]["n"] if b["ttft_s"] else 0
            row["n_candidate"] = c["ttft_s"]["n"] if c["ttft_s"] else 0
            rows.append(row)

    def geomean(key: str) -> float | None:
        vals = [r[key] for r in rows if r.get(key)]
        return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None

    only = sorted({f"{l}/{c}" for l in base for c in base[l]} ^ {f"{l}/{c}" for l in cand for c in cand[l]})
    return {"rows": rows, "geomean": {k: geomean(f"{k}_ratio") for k in ("ttft", "prefill", "decode")},
            "unpaired_groups": only,
            "ratio_meaning": "candidate / baseline; ttft < 1 and prefill, decode > 1 mean the candidate is faster"}
