"""Server-side counters from a Prometheus `/metrics` page (vLLM, SGLang, TGI expose one).

Used for speculative decoding where a backend keeps its draft counters there instead of in each reply
(vLLM): read before and after a group of requests, the difference is the group's drafted and accepted
tokens.
"""
from __future__ import annotations

import math
import re
from typing import TypedDict

# (drafted, accepted) counter names, in the order tried; vLLM's V0 and V1 engines both use these.
SPEC_COUNTERS = (("vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"),
                 ("sglang:spec_num_draft_tokens_total", "sglang:spec_num_accepted_tokens_total"))

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse_prometheus(text: str) -> dict[str, float]:
    """Metric name -> value summed over its label sets (several models, engines or endpoints)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        if math.isfinite(value):
            out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


class SpecDecodeDelta(TypedDict):
    """Speculative decoding counters over a span (JSON: the speed records' fields)."""

    draft_n: int
    draft_n_accepted: int
    acceptance_rate: float | None
    source: str


def spec_decode_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> SpecDecodeDelta | None:
    """Drafted and accepted tokens between two readings; None where the server keeps no such counters."""
    if not before or not after:
        return None
    for drafted_name, accepted_name in SPEC_COUNTERS:
        if all(n in before and n in after for n in (drafted_name, accepted_name)):
            drafted = int(round(after[drafted_name] - before[drafted_name]))
            accepted = int(round(after[accepted_name] - before[accepted_name]))
            return {"draft_n": drafted, "draft_n_accepted": accepted,
                    "acceptance_rate": accepted / drafted if drafted > 0 else None,
                    "source": f"/metrics {drafted_name.split(':')[0]}"}
    return None


# --- serving state under load ------------------------------------------------------------------
# Names each server documents for its scheduler and cache state, read during a load group.
# Sources:
#   vLLM 0.32 (V1 engine): vllm/v1/metrics/loggers.py (PrometheusStatLogger): vllm:num_requests_running,
#     vllm:num_requests_waiting, vllm:kv_cache_usage_perc (0-1), counters vllm:prefix_cache_queries /
#     vllm:prefix_cache_hits (tokens) and vllm:num_preemptions (prometheus_client adds `_total`).
#     The V0 engine's vllm:gpu_cache_usage_perc is tried after the V1 name.
#   SGLang: docs.sglang.io "Production Metrics" (server started with --enable-metrics):
#     sglang:num_running_reqs, sglang:num_queue_reqs, sglang:token_usage (KV pool share, 0-1),
#     sglang:cache_hit_rate (a gauge). SGLang documents no preemption counter there.
#   llama-server (b11434, --metrics): tools/server/server-task.cpp to_metrics(): llamacpp:requests_processing,
#     llamacpp:requests_deferred, counters llamacpp:prompt_tokens_total (prompt tokens processed,
#     excluding cached ones) and llamacpp:prompt_tokens_cached_total. It exports no KV-cache usage.
#   moebench serve: moebench:num_requests_running, moebench:num_requests_waiting (moebench/serve.py).
GAUGES = {
    "kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"),
    "queue_length": ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "llamacpp:requests_deferred",
                     "moebench:num_requests_waiting"),
    "running": ("vllm:num_requests_running", "sglang:num_running_reqs", "llamacpp:requests_processing",
                "moebench:num_requests_running"),
}
# prefix-cache hit rate from counters: (hits, denominator, denominator adds the hits); else a gauge
HIT_COUNTERS = (("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", False),
                ("llamacpp:prompt_tokens_cached_total", "llamacpp:prompt_tokens_total", True))
HIT_GAUGES = ("sglang:cache_hit_rate",)
PREEMPTION_COUNTERS = ("vllm:num_preemptions_total",)


def _family(names: set[str]) -> str | None:
    for prefix in ("vllm", "sglang", "llamacpp", "moebench"):
        if any(n.startswith(prefix + ":") for n in names):
            return "llama-server" if prefix == "llamacpp" else ("moebench serve" if prefix == "moebench" else prefix)
    return None


def _first(reading: dict[str, float], names: tuple[str, ...]) -> str | None:
    return next((n for n in names if n in reading), None)


class GaugeStats(TypedDict):
    mean: float
    max: float


class ServingSummary(TypedDict):
    """One load group's server state (JSON: the speed section's `server`); each figure None where the
    server exports no such name, `names` the metric each figure came from."""

    source: str | None
    n_samples: int
    interval_s: float
    names: dict[str, str]
    kv_cache_usage: GaugeStats | None
    queue_length: GaugeStats | None
    running: GaugeStats | None
    prefix_cache_hit_rate: float | None
    preemptions: int | None


def serving_summary(samples: list[tuple[float, dict[str, float]]], interval_s: float) -> ServingSummary | None:
    """One group's server state from readings of /metrics taken every `interval_s` while it ran
    (the first just before its first request, the last just after its last reply).

    Gauges (KV-cache usage, queue length, running requests): mean and max over the readings.
    Counters (prefix-cache hits, preemptions): the difference between the first and last reading.
    None where no reading holds any known name (the server has no /metrics, or other names).
    """
    readings = [r for _, r in samples if r]
    if not readings:
        return None
    names = set().union(*readings)
    names_used: dict[str, str] = {}
    gauges: dict[str, GaugeStats | None] = {}
    known = False
    for key, candidates in GAUGES.items():
        name = next((n for n in candidates if any(n in r for r in readings)), None)
        vals = [r[name] for r in readings if name is not None and name in r]
        gauges[key] = {"mean": sum(vals) / len(vals), "max": max(vals)} if vals else None
        if name:
            names_used[key], known = name, True
    out: ServingSummary = {"source": _family(names), "n_samples": len(readings), "interval_s": interval_s,
                           "names": names_used, "kv_cache_usage": gauges["kv_cache_usage"],
                           "queue_length": gauges["queue_length"], "running": gauges["running"],
                           "prefix_cache_hit_rate": None, "preemptions": None}
    first, last = readings[0], readings[-1]
    for hits, denom, adds in HIT_COUNTERS:
        if all(n in first and n in last for n in (hits, denom)):
            dh, dd = last[hits] - first[hits], last[denom] - first[denom]
            total = dd + dh if adds else dd
            out["prefix_cache_hit_rate"] = dh / total if total > 0 else None
            out["names"]["prefix_cache_hit_rate"], known = f"{hits} / {denom}" + (" + hits" if adds else ""), True
            break
    else:
        name = next((n for n in HIT_GAUGES if any(n in r for r in readings)), None)
        if name:
            vals = [r[name] for r in readings if name in r]
            out["prefix_cache_hit_rate"] = sum(vals) / len(vals)
            out["names"]["prefix_cache_hit_rate"], known = name + " (mean of the gauge)", True
    name = _first(first, PREEMPTION_COUNTERS)
    out["preemptions"] = int(round(last[name] - first[name])) if name and name in last else None
    if name:
        out["names"]["preemptions"], known = name, True
    return out if known else None
