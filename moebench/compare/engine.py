"""compare.json["engine"]: what each run's in-repo engine recorded about itself (manifest["engine"]):
the decode path it chose, torch memory per phase, and the tier counters per layer, with the share
of host-tier picks served from GPU memory beside the run's decode speed.
"""
from __future__ import annotations

from dataclasses import dataclass
from statistics import median

from moebench.json_fields import as_number, as_object
from moebench.json_types import JsonObject, JsonValue
from moebench.store.records import ItemRecord, Manifest

SIDES = ("baseline", "candidate")
LAYER_KEYS = ("routed", "picks_gpu", "picks_host", "host_hits", "host_misses", "host_direct", "prefetch_hits",
              "route_tail_skips", "stage_copies", "bytes_h2d", "bytes_host_read", "copy_wait_s")


# One layer's (or the total's) tier counters: LAYER_KEYS as recorded (None where absent or not a
# number), then the shares `tier_rates` derives from them.
TierFigures = dict[str, float | None]


def tier_rates(counters: TierFigures) -> TierFigures:
    """Shares from one layer's (or the total's) counters.

    gpu_pick_share: picks whose expert lives on the GPU tier; host_hit_rate: host-tier picks served
    from GPU memory (the LRU cache or a prefetch stage) rather than copied or read over PCIe."""
    routed, host = counters.get("routed") or 0, counters.get("picks_host") or 0
    served = (counters.get("host_hits") or 0) + (counters.get("prefetch_hits") or 0)
    return {"gpu_pick_share": (counters.get("picks_gpu") or 0) / routed if routed else None,
            "host_hit_rate": served / host if host else None}


def _counters(recorded: JsonValue) -> TierFigures:
    """manifest["engine"]["tiers"]'s counters of one layer (or the total), then the shares."""
    raw = as_object(recorded)
    counters: TierFigures = {k: as_number(raw.get(k)) for k in LAYER_KEYS}
    return {**counters, **tier_rates(counters)}


def _decode_median(records: list[ItemRecord]) -> float | None:
    vals = [r.extra["decode_tok_s"] for r in records
            if r.task == "speed" and r.status == "ok" and isinstance(r.extra.get("decode_tok_s"), (int, float))]
    return median(vals) if vals else None


@dataclass
class EngineSide:
    """One run's engine telemetry (manifest["engine"]) as compare.json shows it."""

    choices: dict[str, JsonValue]
    """Each decode choice's value (the manifest also records why)."""
    decode_steps: int | None
    torch_memory: JsonObject | None
    """manifest["engine"]["torch_memory"] as recorded (docs/schema.md)."""
    decode_tok_s_median: float | None
    total: TierFigures | None = None
    """Tiered models: the summed counters and shares; None for a model without tiers."""
    layers: list[TierFigures] | None = None
    """Tiered models: per MoE layer, `layer` (its index) then the counters and shares."""

    def to_json(self) -> JsonObject:
        out: JsonObject = {"choices": self.choices, "decode_steps": self.decode_steps,
                        "torch_memory": self.torch_memory, "decode_tok_s_median": self.decode_tok_s_median}
        if self.total is not None:
            out["tiers"] = {"total": self.total, "layers": self.layers or []}
        return out


def _side(manifest: Manifest | None, records: list[ItemRecord]) -> EngineSide | None:
    eng = manifest.extra.get("engine") if manifest is not None else None
    if not isinstance(eng, dict):
        return None
    side = EngineSide(choices={k: (v.get("value") if isinstance(v, dict) else v)
                               for k, v in (eng.get("choices") or {}).items()},
                      decode_steps=eng.get("decode_steps"), torch_memory=eng.get("torch_memory"),
                      decode_tok_s_median=_decode_median(records))
    tiers = eng.get("tiers")
    if isinstance(tiers, dict):
        side.total = _counters(tiers.get("total"))
        side.layers = [{"layer": i, **_counters(layer)} for i, layer in enumerate(tiers.get("layers") or [])]
    return side


@dataclass
class EngineCompare:
    """compare.json["engine"]: each side's telemetry (None without any), and per tiered side its hit
    rate beside its decode speed."""

    baseline: EngineSide | None
    candidate: EngineSide | None

    def hit_rate_vs_speed(self) -> list[JsonObject]:
        return [{"run": name, "host_hit_rate": s.total["host_hit_rate"], "gpu_pick_share": s.total["gpu_pick_share"],
                 "decode_tok_s_median": s.decode_tok_s_median}
                for name, s in (("baseline", self.baseline), ("candidate", self.candidate))
                if s is not None and s.total is not None]

    def to_json(self) -> JsonObject:
        return {"baseline": self.baseline.to_json() if self.baseline else None,
                "candidate": self.candidate.to_json() if self.candidate else None,
                "hit_rate_vs_speed": self.hit_rate_vs_speed()}


def engine_compare(base_manifest: Manifest | None, cand_manifest: Manifest | None,
                   base_records: list[ItemRecord], cand_records: list[ItemRecord]) -> EngineCompare | None:
    """Both sides' engine telemetry, or None when neither run is an engine run."""
    cmp = EngineCompare(baseline=_side(base_manifest, base_records), candidate=_side(cand_manifest, cand_records))
    return cmp if cmp.baseline or cmp.candidate else None
