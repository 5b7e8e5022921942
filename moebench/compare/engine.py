"""compare.json["engine"]: what each run's in-repo engine recorded about itself (manifest["engine"]):
the decode path it chose, torch memory per phase, and the tier counters per layer, with the share
of host-tier picks served from GPU memory beside the run's decode speed.
"""
from __future__ import annotations

from statistics import median
from typing import Any

SIDES = ("baseline", "candidate")
LAYER_KEYS = ("routed", "picks_gpu", "picks_host", "host_hits", "host_misses", "host_direct", "prefetch_hits",
              "route_tail_skips", "stage_copies", "bytes_h2d", "bytes_host_read", "copy_wait_s")


def tier_rates(counters: dict[str, Any]) -> dict[str, float | None]:
    """Shares from one layer's (or the total's) counters.

    gpu_pick_share: picks whose expert lives on the GPU tier; host_hit_rate: host-tier picks served
    from GPU memory (the LRU cache or a prefetch stage) rather than copied or read over PCIe."""
    routed, host = counters.get("routed") or 0, counters.get("picks_host") or 0
    served = (counters.get("host_hits") or 0) + (counters.get("prefetch_hits") or 0)
    return {"gpu_pick_share": (counters.get("picks_gpu") or 0) / routed if routed else None,
            "host_hit_rate": served / host if host else None}


def _decode_median(records: list[dict[str, Any]]) -> float | None:
    vals = [r["decode_tok_s"] for r in records
            if r.get("task") == "speed" and r.get("status") == "ok" and isinstance(r.get("decode_tok_s"), (int, float))]
    return median(vals) if vals else None


def _side(manifest: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any] | None:
    eng = manifest.get("engine")
    if not isinstance(eng, dict):
        return None
    out: dict[str, Any] = {"choices": {k: (v.get("value") if isinstance(v, dict) else v)
                                       for k, v in (eng.get("choices") or {}).items()},
                           "decode_steps": eng.get("decode_steps"), "torch_memory": eng.get("torch_memory"),
                           "decode_tok_s_median": _decode_median(records)}
    tiers = eng.get("tiers")
    if isinstance(tiers, dict):
        total = tiers.get("total") or {}
        out["tiers"] = {"total": {**{k: total.get(k) for k in LAYER_KEYS}, **tier_rates(total)},
                        "layers": [{"layer": i, **{k: layer.get(k) for k in LAYER_KEYS}, **tier_rates(layer)}
                                   for i, layer in enumerate(tiers.get("layers") or [])]}
    return out


def engine_compare(base_manifest: dict[str, Any], cand_manifest: dict[str, Any],
                   base_records: list[dict[str, Any]], cand_records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """{"baseline": ..., "candidate": ..., "hit_rate_vs_speed": [...]} or None when neither run is an
    engine run. A side without engine telemetry is None."""
    sides = {"baseline": _side(base_manifest, base_records), "candidate": _side(cand_manifest, cand_records)}
    if not any(sides.values()):
        return None
    points = []
    for name, s in sides.items():
        if s and s.get("tiers"):
            points.append({"run": name, "host_hit_rate": s["tiers"]["total"]["host_hit_rate"],
                           "gpu_pick_share": s["tiers"]["total"]["gpu_pick_share"],
                           "decode_tok_s_median": s["decode_tok_s_median"]})
    return {**sides, "hit_rate_vs_speed": points}
