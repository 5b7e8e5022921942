"""Build compare.json (docs/design.md section 5) from two run directories; reads only the store."""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Callable

from moebench.compare.pairs import pair_runs
from moebench.compare.provenance import (data_mismatch, data_mismatch_reason, kld_absent_reason, kld_notes,
                                         unverified_data, unverified_reason,
                                         reversed_pair, setup_differences)
from moebench.store import load_run
from moebench.store.records import COMPARE_SCHEMA_VERSION  # noqa: F401  (re-exported: one definition, in the store)


def _optional(module: str, name: str) -> Callable[..., Any] | None:
    """A section builder from a module that may not be installed in this build."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ModuleNotFoundError, AttributeError):
        return None


def _records_of(records: list[dict[str, Any]], task: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get("task") == task]


def _kld_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records of every KLD task, whatever its suite name (a sampled one beside a teacher-forced one
    needs a name of its own); KLD item ids start with "kld/"."""
    return [r for r in records if r.get("task") == "kld" or str(r.get("item_id", "")).startswith("kld/")]


def _side_info(run_dir: Path, m: dict[str, Any]) -> dict[str, Any]:
    model = m.get("model") if isinstance(m.get("model"), dict) else {}
    size = model.get("size_bytes", model.get("bytes"))
    return {"run": str(run_dir.resolve()), "label": m.get("label"), "run_id": m.get("run_id"),
            "status": m.get("status"), "runner": (m.get("runner") or {}).get("name"),
            "started_at": m.get("started_at"),
            "model": {"path": model.get("path"), "bytes": size if isinstance(size, int) else None}}


class ReversedRuns(ValueError):
    """The run given as the baseline measured itself against the run given as the candidate."""


def build_compare(base_dir: str | Path, cand_dir: str | Path, speed_ab: str | Path | None = None,
                  allow_reversed: bool = False) -> dict[str, Any]:
    """compare.json for two runs; `speed_ab`, a `moebench speed-ab` directory, adds its section.
    Runs that look given the wrong way round are refused (ReversedRuns) unless `allow_reversed`."""
    base_dir, cand_dir = Path(base_dir), Path(cand_dir)
    bm, brecs = load_run(base_dir)
    cm, crecs = load_run(cand_dir)
    swapped = reversed_pair(base_dir, cand_dir, bm)
    if swapped and not allow_reversed:
        raise ReversedRuns(swapped + "; --allow-reversed compares them as given")
    tasks = {str(r.get("task")) for r in brecs + crecs}
    mismatched = {t: f for t in sorted(tasks) if (f := data_mismatch(bm, cm, t))}
    paired = pair_runs(brecs, crecs, refuse={t: data_mismatch_reason(f) for t, f in mismatched.items()})
    for t, files in mismatched.items():
        if t in paired["tasks"]:
            paired["tasks"][t]["data_mismatch"] = files
    out: dict[str, Any] = {
        "schema_version": COMPARE_SCHEMA_VERSION,
        "baseline": _side_info(base_dir, bm),
        "candidate": _side_info(cand_dir, cm),
        "tasks": paired["tasks"],
        "overall": paired["overall"],
    }
    # what makes the two runs different experiments: shown first wherever the compare is shown
    differences = ([swapped] if swapped else []) + setup_differences(bm, cm)
    if differences:
        out["setup_differences"] = differences
    warnings = [f"{side} run status is {m.get('status')!r}, not 'complete'"
                for side, m in (("baseline", bm), ("candidate", cm)) if m.get("status") != "complete"]
    warnings += [f"{t}: nothing paired: {r['unpaired_reason']}" for t, r in paired["tasks"].items()
                 if r.get("unpaired_reason")]
    # tasks that are not paired item by item (kld, speed, needle) still measured different inputs
    warnings += [f"{t}: {data_mismatch_reason(f, paired=False)}" for t, f in mismatched.items()
                 if t not in paired["tasks"]]
    # data run with --allow-modified-data, or that no SHA256SUMS listed: said, and the gate's rules
    # on that task are INCONCLUSIVE
    unvouched = {t: sides for t in sorted(tasks)
                 if (sides := {side: f for side, m in (("baseline", bm), ("candidate", cm))
                               if (f := unverified_data(m, t))})}
    if unvouched:
        out["data_unverified"] = unvouched
        warnings += [f"{t}: {unverified_reason(sides)}" for t, sides in unvouched.items()]

    kld = _optional("moebench.kld.compare", "kld_compare")
    if kld is not None and _kld_records(crecs):
        section = kld(base_dir, cand_dir, bm, cm, _kld_records(brecs), _kld_records(crecs))
        if section:
            out["kld"] = section
            warnings += kld_notes(section)
    absent = kld_absent_reason(crecs, cm) if "kld" not in out else None
    if absent:
        out["missing_sections"] = {"kld": absent}
        warnings.append(f"kld: no KLD figures: {absent}")
    if warnings:
        out["warnings"] = warnings
    needle = _optional("moebench.compare.needle", "needle_compare")
    if needle is not None and any(r.get("task") == "needle" for r in brecs + crecs):
        out["needle"] = needle(_records_of(brecs, "needle"), _records_of(crecs, "needle"))
    if any(r.get("task") == "speed" for r in brecs + crecs):
        from moebench.speed.compare import read_token_times, speed_compare
        out["speed"] = speed_compare(_records_of(brecs, "speed"), _records_of(crecs, "speed"),
                                     read_token_times(base_dir), read_token_times(cand_dir))
    mem = _optional("moebench.probes.energy", "memory_energy_compare")
    if mem is not None and (bm.get("probes") or cm.get("probes")):
        section = mem(bm, cm)
        if section:
            out.update({k: v for k, v in section.items() if k in ("memory", "energy")})
    engine = _optional("moebench.compare.engine", "engine_compare")
    if engine is not None:
        section = engine(bm, cm, brecs, crecs)
        if section:
            out["engine"] = section
    if speed_ab is not None:
        out["speed_ab"] = load_speed_ab(speed_ab)
    return out


def load_speed_ab(ab_dir: str | Path) -> dict[str, Any]:
    """The speed_ab section of a `moebench speed-ab` directory (its ab.json)."""
    import json
    path = Path(ab_dir) / "ab.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (a `moebench speed-ab --out DIR` directory holds it)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("speed_ab"), dict):
        raise ValueError(f"{path}: no 'speed_ab' object (written by an older moebench; run speed-ab again)")
    return {**data["speed_ab"], "source": str(Path(ab_dir).resolve())}


def format_table(cmp: dict[str, Any]) -> str:
    """The short table `moebench compare` prints for one candidate."""
    from moebench.compare.tables import matrix_row, text_table
    return text_table([cmp], [matrix_row(cmp)])
