"""compare.json["kld"]: KLD statistics of a candidate run measured against its baseline, plus MoE signals.

The candidate run already measured itself against the baseline (it was made with --baseline), so this
reads its per-token arrays (layout: moebench.kld.runs) and, for the MoE signals, both runs' router traces.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moebench.kld.runs import (chunk_file, expert_usage, kld_section, load_skew, read_meta,
                               router_agreement, sampled_section, task_dir)


def kld_compare(base_dir: Path, cand_dir: Path, base_manifest: dict[str, Any], cand_manifest: dict[str, Any],
                base_records: list[dict[str, Any]], cand_records: list[dict[str, Any]]) -> dict[str, Any] | None:
    cand_ok = [r for r in cand_records if r.get("status") == "ok" and r.get("role") == "candidate"]
    if not cand_ok:
        return None                       # the candidate was not run with --baseline: nothing measured
    out: dict[str, Any] = {}
    measured_against = cand_manifest.get("baseline_run")
    if measured_against:
        out["measured_against"] = str(measured_against)
    if measured_against and Path(measured_against).resolve() != Path(base_dir).resolve():
        # the gate reads baseline_mismatch: these figures say nothing about this compare's pair
        out["baseline_mismatch"] = True
        out["warning"] = (f"the candidate was measured against {measured_against}, not {base_dir}; "
                          "its KLD figures refer to that run")
    base_hash = {r["item_id"]: r.get("prompt_hash") for r in base_records if r.get("status") == "ok"}
    mismatched = [r["item_id"] for r in cand_ok if r.get("prompt_hash") and base_hash.get(r["item_id"])
                  and r["prompt_hash"] != base_hash[r["item_id"]]]
    if mismatched:
        out["token_mismatch"] = mismatched
    # A sampled KLD (method = "sampled") measures other contexts than a teacher-forced one: alone it
    # is the section; beside a teacher-forced task it is the section's "sampled" entry.
    sampled = [r for r in cand_ok if r.get("method") == "sampled"]
    forced = [r for r in cand_ok if r.get("method") != "sampled"]
    if forced:
        out.update(kld_section(Path(cand_dir), forced))
    if sampled:
        section = sampled_section(Path(cand_dir), sampled)
        if forced:
            out["sampled"] = section
        else:
            out.update(section)
    out["excluded"] = sorted(r["item_id"] for r in cand_records if r.get("status") != "ok")
    signals = moe_signals(Path(base_dir), Path(cand_dir), forced) if forced else None
    if signals:
        out.update(signals.to_json())
    return out


@dataclass(frozen=True)
class MoeSignals:
    """Router traces of both runs compared: per layer the router agreement and identical-set share (over
    `n_positions` scored tokens), expert usage [layer][expert] and load skew of each side."""

    router_agreement: list[float]
    identical_set_share: list[float]
    n_positions: int
    usage_baseline: list[list[int]]
    usage_candidate: list[list[int]]
    skew_baseline: list[float]
    skew_candidate: list[float]

    def to_json(self) -> dict[str, Any]:
        """compare.json["kld"]'s "per_layer", "expert_usage" and "load_skew"."""
        return {"per_layer": {"router_agreement": self.router_agreement,
                              "identical_set_share": self.identical_set_share, "n_positions": self.n_positions},
                "expert_usage": {"baseline": self.usage_baseline, "candidate": self.usage_candidate},
                "load_skew": {"baseline": self.skew_baseline, "candidate": self.skew_candidate}}


def moe_signals(base_dir: Path, cand_dir: Path, cand_records: list[dict[str, Any]]) -> MoeSignals | None:
    """Per-layer router agreement, expert usage [layer][expert] and load skew of both runs."""
    name = cand_records[0].get("task", "kld")
    try:
        meta = read_meta(base_dir, name)
    except Exception:
        return None
    if meta.format != "npz":
        return None
    b_routes, c_routes = [], []
    for r in sorted(cand_records, key=lambda r: r["chunk"]):
        bf = chunk_file(task_dir(base_dir, name) / "base", r["chunk"])
        if not r.get("file"):
            continue                      # a llama-perplexity candidate keeps no router traces
        cf = Path(cand_dir) / r["file"]
        if not bf.is_file() or not cf.is_file():
            continue
        b, c = np.load(bf), np.load(cf)
        if "routes" in b.files and "routes" in c.files:
            b_routes.append(b["routes"])
            c_routes.append(c["routes"])
    if not b_routes:
        return None
    bcat, ccat = np.concatenate(b_routes, axis=1), np.concatenate(c_routes, axis=1)
    n_exp = meta.num_experts or int(max(bcat.max(), ccat.max())) + 1
    ub, uc = expert_usage(b_routes, n_exp), expert_usage(c_routes, n_exp)
    agreement = router_agreement(bcat, ccat)
    return MoeSignals(agreement["router_agreement"], agreement["identical_set_share"], int(bcat.shape[1]),
                      ub.tolist(), uc.tolist(), load_skew(ub), load_skew(uc))
