"""Build compare.json (docs/design.md section 5) from two run directories; reads only the store."""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Callable

from moebench.compare.engine import engine_compare
from moebench.compare.needle import needle_compare
from moebench.compare.pairs import pair_runs
from moebench.compare.provenance import (data_mismatch, data_mismatch_reason, kld_absent_reason, kld_notes,
                                         unverified_data, unverified_reason,
                                         reversed_pair, setup_differences)
from moebench.store import load_run
from moebench.json_types import JsonObject, JsonValue
from moebench.store.records import (COMPARE_SCHEMA_VERSION, COMPARE_SECTIONS, CompareDoc, CompareSide, Manifest,
                                    typed_run)


def _optional(module: str, name: str) -> Callable[..., Any] | None:
    """A section builder from a module that may not be installed in this build."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ModuleNotFoundError, AttributeError):
        return None


# The KLD and speed wings' section builders read items.jsonl's records as JSON objects: these hand
# them the records as read.
def _records_of(records: list[JsonObject], task: str) -> list[JsonObject]:
    return [r for r in records if r.get("task") == task]


def _kld_records(records: list[JsonObject]) -> list[JsonObject]:
    """Records of every KLD task, whatever its suite name (a sampled one beside a teacher-forced one
    needs a name of its own); KLD item ids start with "kld/"."""
    return [r for r in records if r.get("task") == "kld" or str(r.get("item_id", "")).startswith("kld/")]


def _side_info(run_dir: Path, m: Manifest) -> CompareSide:
    model = m.model or {}
    size = model.get("size_bytes", model.get("bytes"))
    return CompareSide(run=str(run_dir.resolve()), label=m.label,
                       extra={"run_id": m.run_id, "status": m.status, "runner": m.runner_name,
                              "started_at": m.started_at,
                              "model": {"path": model.get("path"), "bytes": size if isinstance(size, int) else None}})


class ReversedRuns(ValueError):
    """The run given as the baseline measured itself against the run given as the candidate."""


def compare_runs(base_dir: str | Path, cand_dir: str | Path, speed_ab: str | Path | None = None,
                 allow_reversed: bool = False) -> CompareDoc:
    """compare.json for two runs; `speed_ab`, a `moebench speed-ab` directory, adds its section.
    Runs that look given the wrong way round are refused (ReversedRuns) unless `allow_reversed`."""
    base_dir, cand_dir = Path(base_dir), Path(cand_dir)
    bm_raw, brecs_raw = load_run(base_dir)
    cm_raw, crecs_raw = load_run(cand_dir)
    bm, brecs = typed_run(base_dir, bm_raw, brecs_raw)
    cm, crecs = typed_run(cand_dir, cm_raw, crecs_raw)
    swapped = reversed_pair(base_dir, cand_dir, bm)
    if swapped and not allow_reversed:
        raise ReversedRuns(swapped + "; --allow-reversed compares them as given")
    tasks = {r.task for r in brecs + crecs}
    mismatched = {t: f for t in sorted(tasks) if (f := data_mismatch(bm, cm, t))}
    paired = pair_runs(brecs, crecs, refuse={t: data_mismatch_reason(f) for t, f in mismatched.items()})
    for t, files in mismatched.items():
        if t in paired.tasks:
            paired.tasks[t].data_mismatch = files
    # The sections in the order compare.json holds them (CompareDoc.to_dict keeps it).
    sections: dict[str, JsonValue] = {"overall": paired.overall.to_json() if paired.overall else None}
    # what makes the two runs different experiments: shown first wherever the compare is shown
    differences = ([swapped] if swapped else []) + setup_differences(bm, cm)
    if differences:
        sections["setup_differences"] = differences
    warnings = [f"{side} run status is {m.status!r}, not 'complete'"
                for side, m in (("baseline", bm), ("candidate", cm)) if m.status != "complete"]
    warnings += [f"{t}: nothing paired: {r.unpaired_reason}" for t, r in paired.tasks.items() if r.unpaired_reason]
    # tasks that are not paired item by item (kld, speed, needle) still measured different inputs
    warnings += [f"{t}: {data_mismatch_reason(f, paired=False)}" for t, f in mismatched.items()
                 if t not in paired.tasks]
    # data run with --allow-modified-data, or that no SHA256SUMS listed: said, and the gate's rules
    # on that task are INCONCLUSIVE
    unvouched = {t: sides for t in sorted(tasks)
                 if (sides := {side: f for side, m in (("baseline", bm), ("candidate", cm))
                               if (f := unverified_data(m, t))})}
    if unvouched:
        sections["data_unverified"] = unvouched
        warnings += [f"{t}: {unverified_reason(sides)}" for t, sides in unvouched.items()]

    kld = _optional("moebench.kld.compare", "kld_compare")
    if kld is not None and _kld_records(crecs_raw):
        section = kld(base_dir, cand_dir, bm_raw, cm_raw, _kld_records(brecs_raw), _kld_records(crecs_raw))
        if section:
            sections["kld"] = section
            warnings += kld_notes(section)
    absent = kld_absent_reason(crecs, cm) if "kld" not in sections else None
    if absent:
        sections["missing_sections"] = {"kld": absent}
        warnings.append(f"kld: no KLD figures: {absent}")
    if warnings:
        sections["warnings"] = warnings
    if any(r.task == "needle" for r in brecs + crecs):
        sections["needle"] = needle_compare(brecs, crecs).to_json()
    if any(r.task == "speed" for r in brecs + crecs):
        from moebench.speed.compare import read_token_times, speed_compare
        sections["speed"] = speed_compare(_records_of(brecs_raw, "speed"), _records_of(crecs_raw, "speed"),
                                          read_token_times(base_dir), read_token_times(cand_dir))
    mem = _optional("moebench.probes.energy_compare", "memory_energy_compare")
    if mem is not None and (bm.probes or cm.probes):
        section = mem(bm_raw, cm_raw)
        if section:
            sections.update({k: v for k, v in section.items() if k in ("memory", "energy")})
    engine = engine_compare(bm, cm, brecs, crecs)
    if engine is not None:
        sections["engine"] = engine.to_json()
    if speed_ab is not None:
        sections["speed_ab"] = load_speed_ab(speed_ab)
    return CompareDoc(schema_version=COMPARE_SCHEMA_VERSION, baseline=_side_info(base_dir, bm),
                      candidate=_side_info(cand_dir, cm), tasks={t: p.to_json() for t, p in paired.tasks.items()},
                      sections={k: v for k, v in sections.items() if k in COMPARE_SECTIONS},
                      extra={k: v for k, v in sections.items() if k not in COMPARE_SECTIONS})


def build_compare(base_dir: str | Path, cand_dir: str | Path, speed_ab: str | Path | None = None,
                  allow_reversed: bool = False) -> JsonObject:
    """compare.json's JSON object for two runs (`compare_runs`, written out)."""
    return compare_runs(base_dir, cand_dir, speed_ab=speed_ab, allow_reversed=allow_reversed).to_dict()


def load_speed_ab(ab_dir: str | Path) -> JsonObject:
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


def format_table(cmp: CompareDoc) -> str:
    """The short table `moebench compare` prints for one candidate."""
    from moebench.compare.tables import matrix_row, text_table
    return text_table([cmp], [matrix_row(cmp)])
