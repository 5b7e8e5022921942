"""Server-side counters from a Prometheus `/metrics` page (vLLM, SGLang, TGI expose one).

Used for speculative decoding where a backend keeps its draft counters there instead of in each reply
(vLLM): read before and after a group of requests, the difference is the group's drafted and accepted
tokens.
"""
from __future__ import annotations

import math
import re
from typing import Any

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


def spec_decode_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any] | None:
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
