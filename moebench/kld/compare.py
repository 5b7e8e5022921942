"""compare.json["kld"]: KLD statistics of a candidate run measured against its baseline, plus MoE signals.

The candidate run already measured itself against the baseline (it was made with --baseline), so this
reads its per-token arrays (layout: moebench.kld.runs) and, for the MoE signals, both runs' router traces.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
import numpy as np

from moebench.json_types import JsonObject, JsonValue
from moebench.kld.chunk_records import KldItem, read_items
from moebench.kld.runs import (chunk_file, expert_usage, kld_section, load_skew, read_meta,
                               router_agreement, sampled_section, task_dir)
from moebench.kld.sections import KldSection, SampledSection
from moebench.store import ITEMS


def kld_compare(base_dir: Path, cand_dir: Path, base_manifest: JsonObject, cand_manifest: JsonObject,
                base_records: list[JsonObject], cand_records: list[JsonObject]) -> JsonObject | None:
    """compare.json["kld"] of two runs, from their manifest.json and items.jsonl KLD records as read
    (compare/build.py hands them over); None where the candidate measured nothing (no --baseline)."""
    comparison = compare_kld(Path(base_dir), Path(cand_dir), _text(cand_manifest.get("baseline_run")),
                             read_items(base_records, str(Path(base_dir) / ITEMS)),
                             read_items(cand_records, str(Path(cand_dir) / ITEMS)))
    return comparison.to_json() if comparison is not None else None


def _text(value: JsonValue) -> str | None:
    return str(value) if value else None


@dataclass(frozen=True)
class KldComparison:
    """compare.json["kld"]: which baseline the candidate measured against (and whether that is this
    compare's), items whose token ids differ, the teacher-forced and/or sampled figures, the items
    left out (errored), and the MoE signals where both runs traced their routers."""

    measured_against: str | None
    baseline_mismatch: bool
    warning: str | None
    token_mismatch: list[str]
    forced: KldSection | None
    sampled: SampledSection | None
    excluded: list[str]
    signals: MoeSignals | None

    def to_json(self) -> JsonObject:
        out: JsonObject = {}
        if self.measured_against:
            out["measured_against"] = self.measured_against
        if self.baseline_mismatch:
            out["baseline_mismatch"] = True
            out["warning"] = self.warning
        if self.token_mismatch:
            out["token_mismatch"] = list(self.token_mismatch)
        # A sampled KLD measures other contexts than a teacher-forced one: alone it is the section;
        # beside a teacher-forced task it is the section's "sampled" entry.
        if self.forced is not None:
            out.update(self.forced.to_json())
        if self.sampled is not None:
            if self.forced is not None:
                out["sampled"] = self.sampled.to_json()
            else:
                out.update(self.sampled.to_json())
        out["excluded"] = list(self.excluded)
        if self.signals is not None:
            out.update(self.signals.to_json())
        return out


def compare_kld(base_dir: Path, cand_dir: Path, measured_against: str | None, base_records: list[KldItem],
                cand_records: list[KldItem]) -> KldComparison | None:
    cand_ok = [r for r in cand_records if r.is_ok_candidate]
    if not cand_ok:
        return None                       # the candidate was not run with --baseline: nothing measured
    # the gate reads baseline_mismatch: these figures say nothing about this compare's pair
    mismatch = bool(measured_against) and Path(str(measured_against)).resolve() != base_dir.resolve()
    warning = (f"the candidate was measured against {measured_against}, not {base_dir}; "
               "its KLD figures refer to that run") if mismatch else None
    base_hash = {r.item_id: r.prompt_hash for r in base_records if r.status == "ok"}
    token_mismatch = [r.item_id for r in cand_ok if r.prompt_hash and base_hash.get(r.item_id)
                      and r.prompt_hash != base_hash[r.item_id]]
    sampled = [r for r in cand_ok if r.method == "sampled"]
    forced = [r for r in cand_ok if r.method != "sampled"]
    return KldComparison(
        measured_against=measured_against, baseline_mismatch=mismatch, warning=warning,
        token_mismatch=token_mismatch, forced=kld_section(cand_dir, forced) if forced else None,
        sampled=sampled_section(cand_dir, sampled) if sampled else None,
        excluded=sorted(r.item_id for r in cand_records if r.status != "ok"),
        signals=moe_signals(base_dir, cand_dir, forced) if forced else None)


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

    def to_json(self) -> JsonObject:
        """compare.json["kld"]'s "per_layer", "expert_usage" and "load_skew"."""
        return {"per_layer": {"router_agreement": self.router_agreement,
                              "identical_set_share": self.identical_set_share, "n_positions": self.n_positions},
                "expert_usage": {"baseline": self.usage_baseline, "candidate": self.usage_candidate},
                "load_skew": {"baseline": self.skew_baseline, "candidate": self.skew_candidate}}


def moe_signals(base_dir: Path, cand_dir: Path, cand_records: list[KldItem]) -> MoeSignals | None:
    """Per-layer router agreement, expert usage [layer][expert] and load skew of both runs."""
    name = cand_records[0].task
    try:
        meta = read_meta(base_dir, name)
    except Exception:
        return None
    if meta.format != "npz":
        return None
    b_routes, c_routes = [], []
    for r in sorted(cand_records, key=lambda r: r.chunk or 0):
        bf = chunk_file(task_dir(base_dir, name) / "base", r.chunk or 0)
        if not r.file:
            continue                      # a llama-perplexity candidate keeps no router traces
        cf = Path(cand_dir) / r.file
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
    agreement, identical = router_agreement(bcat, ccat)
    return MoeSignals(agreement, identical, int(bcat.shape[1]),
                      ub.tolist(), uc.tolist(), load_skew(ub), load_skew(uc))
