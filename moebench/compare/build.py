"""Build compare.json (DESIGN.md section 5) from two run directories; reads only the store."""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Callable

from moebench.compare.pairs import pair_runs
from moebench.store import load_run

COMPARE_SCHEMA_VERSION = 1


def _optional(module: str, name: str) -> Callable[..., Any] | None:
    """A section builder from a module that may not be installed in this build."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ModuleNotFoundError, AttributeError):
        return None


def _records_of(records: list[dict[str, Any]], task: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get("task") == task]


def build_compare(base_dir: str | Path, cand_dir: str | Path) -> dict[str, Any]:
    base_dir, cand_dir = Path(base_dir), Path(cand_dir)
    bm, brecs = load_run(base_dir)
    cm, crecs = load_run(cand_dir)
    paired = pair_runs(brecs, crecs)
    out: dict[str, Any] = {
        "schema_version": COMPARE_SCHEMA_VERSION,
        "baseline": {"run": str(base_dir.resolve()), "label": bm.get("label"), "run_id": bm.get("run_id"),
                     "status": bm.get("status"), "runner": (bm.get("runner") or {}).get("name")},
        "candidate": {"run": str(cand_dir.resolve()), "label": cm.get("label"), "run_id": cm.get("run_id"),
                      "status": cm.get("status"), "runner": (cm.get("runner") or {}).get("name")},
        "tasks": paired["tasks"],
        "overall": paired["overall"],
    }
    if bm.get("status") != "complete" or cm.get("status") != "complete":
        out["warnings"] = [f"{side} run status is {m.get('status')!r}, not 'complete'"
                           for side, m in (("baseline", bm), ("candidate", cm)) if m.get("status") != "complete"]

    kld = _optional("moebench.compare.kld", "kld_compare")
    if kld is not None and (any(r.get("task") == "kld" for r in crecs)):
        section = kld(base_dir, cand_dir, bm, cm, _records_of(brecs, "kld"), _records_of(crecs, "kld"))
        if section:
            out["kld"] = section
    needle = _optional("moebench.compare.needle", "needle_compare")
    if needle is not None and any(r.get("task") == "needle" for r in brecs + crecs):
        out["needle"] = needle(_records_of(brecs, "needle"), _records_of(crecs, "needle"))
    if any(r.get("task") == "speed" for r in brecs + crecs):
        from moebench.compare.speed import read_token_times, speed_compare
        out["speed"] = speed_compare(_records_of(brecs, "speed"), _records_of(crecs, "speed"),
                                     read_token_times(base_dir), read_token_times(cand_dir))
    mem = _optional("moebench.probes.energy", "memory_energy_compare")
    if mem is not None and (bm.get("probes") or cm.get("probes")):
        section = mem(bm, cm)
        if section:
            out.update({k: v for k, v in section.items() if k in ("memory", "energy")})
    return out


def format_table(cmp: dict[str, Any]) -> str:
    """The short table `moebench compare` prints."""
    rows = [("task", "n", "base acc", "cand acc", "wins", "losses", "excl", "McNemar p", "delta 95% CI")]
    for task, t in cmp["tasks"].items():
        rows.append((
            task, str(t["n_paired"]),
            _pct(t["baseline_accuracy"]), _pct(t["candidate_accuracy"]),
            str(len(t["wins"])), str(len(t["losses"])), str(len(t["excluded"])),
            f"{t['mcnemar_p']:.3g}",
            f"[{t['delta_ci95'][0]:+.3f}, {t['delta_ci95'][1]:+.3f}]",
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    if "kld" in cmp:
        k = cmp["kld"]
        lines.append(
            f"kld: n_tokens={k.get('n_tokens')} mean={_num(k.get('mean'))} median={_num(k.get('median'))} "
            f"p99={_num(k.get('p99'))} max={_num(k.get('max'))} same_top_p={_num(k.get('same_top_p'))} "
            f"ppl_ratio={_num(k.get('ppl_ratio'))}")
    for w in cmp.get("warnings", []):
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: Any) -> str:
    return "-" if x is None else (f"{x:.6g}" if isinstance(x, float) else str(x))
