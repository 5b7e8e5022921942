"""The HTML report: one self-contained file for a run directory or a compare directory.

Reads only the store (manifest.json, items.jsonl, compare.json and the side files they name).
Rendered by jinja2 with autoescape on, so model text is always shown as text; the only markup that
is marked safe is the SVG produced by `plots`, which escapes its own labels.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup

from moebench import store
from moebench.report import plots
from moebench.report.load import load_context
from moebench.report.rig import rig_context, run_rig_context
from moebench.store.records import (CompareDoc, CompareSide, ItemRecord, Manifest, RecordError, load_typed_run,
                                    typed_run)
from moebench.store.sections import (SPEED_METRICS, needle_cells, needle_counts, number, per_side,
                                      speed_rows)

REPORT_FILE = "report.html"
MATRIX_FILE = "matrix.json"
GATE_FILE = "gate.json"
EXCERPT_CHARS = 240
OUTPUT_CHARS = 20_000          # raw outputs beyond this are cut in the report (the run keeps them)
MAX_ALL_ROWS = 3_000           # unchanged items listed per task; flips are always listed
QUESTION_KEYS = ("question", "prompt_excerpt", "prompt", "input", "text")


class ReportError(ValueError):
    """The input is neither a run nor a compare directory, or one of its files is malformed."""


# --- entry point ------------------------------------------------------------------------------

def render(path: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path:
    """Write the report for a run or compare directory; return the HTML file's path.

    Default output: `report.html` inside `path`.
    """
    src = Path(path)
    if (src / "compare.json").is_file():
        context = compare_context(src)
    elif (src / MATRIX_FILE).is_file():
        context = matrix_context(src)
    elif (src / store.MANIFEST).is_file():
        context = run_context(src)
    else:
        raise ReportError(f"{src}: neither a compare directory (no compare.json) "
                          f"nor a run directory (no {store.MANIFEST})")
    html = _environment().get_template("report.html").render(**context)
    target = Path(out) if out is not None else src / REPORT_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    tmp.write_text(html, encoding="utf-8")
    os.replace(tmp, target)
    return target


def _templates_dir() -> Path:
    """The checkout's templates/ beside this package, else the packaged ones (moebench.templates in a wheel).

    The checkout comes first: an editable install of another checkout maps moebench.templates there."""
    here = Path(__file__).resolve().parents[2] / "templates"
    if (here / "report.html").is_file():
        return here
    try:
        import moebench.templates as packaged  # installed wheel: package-dir maps templates/ here
        return Path(packaged.__file__).parent
    except ImportError:
        return Path(__file__).resolve().parents[2] / "templates"


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(_templates_dir())), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["num"] = fmt_number
    env.filters["pct"] = fmt_percent
    env.filters["gib"] = fmt_gib
    env.filters["pval"] = fmt_p
    return env


# --- formatting -------------------------------------------------------------------------------

def fmt_number(v: Any, digits: int = 4) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        if v != 0 and (abs(v) >= 1e6 or abs(v) < 1e-4):
            return f"{v:.{digits - 1}e}"
        return f"{v:.{digits}g}"
    return str(v)


def fmt_percent(v: Any, digits: int = 1) -> str:
    f = number(v)
    return "–" if f is None else f"{100 * f:.{digits}f}%"


def fmt_gib(v: Any) -> str:
    f = number(v)
    return "–" if f is None else f"{f / 2**30:.2f} GiB"


def fmt_p(v: Any) -> str:
    f = number(v)
    if f is None:
        return "–"
    return f"{f:.2g}" if f < 0.001 else f"{f:.3f}"


def _svg(markup: str) -> Markup:
    return Markup(markup)   # plots.py escapes every data-derived label itself


# --- shared pieces ----------------------------------------------------------------------------

def _load_json(path: Path) -> Any:
    try:
        with path.open(encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ReportError(f"{path}: not valid JSON ({e})") from None


def wilson(correct: int, n: int, z: float = 1.959964) -> tuple[float, float] | None:
    if n <= 0:
        return None
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def identity(manifest: Manifest) -> list[tuple[str, str]]:
    """The manifest's identity fields as (key, text) pairs for the report header."""
    pairs: list[tuple[str, str]] = []
    for key in ("label", "run_id", "status", "started_at", "ended_at"):
        if getattr(manifest, key) is not None:
            pairs.append((key, str(getattr(manifest, key))))
    if manifest.suite_name:
        pairs.append(("suite", str(manifest.suite_name)))
    runner = manifest.runner
    if runner is not None:
        pairs.append(("runner", " / ".join(str(runner[k]) for k in ("kind", "name") if runner.get(k))))
    data = data_line(manifest.extra.get("data_verification"))
    if data:
        pairs.append(("data", data))
    for section in ("model", "build", "host"):
        value = getattr(manifest, section)
        if value is not None:
            for k, v in value.items():
                if isinstance(v, (str, int, float, bool)) or v is None:
                    pairs.append((f"{section}.{k}", fmt_number(v) if not isinstance(v, str) else v))
                elif isinstance(v, list) and all(isinstance(x, (str, int, float)) for x in v) and len(v) <= 8:
                    pairs.append((f"{section}.{k}", ", ".join(map(str, v))))
                elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
                    names = [str(x.get("name") or x.get("model") or x.get("id") or "?") for x in v[:8]]
                    pairs.append((f"{section}.{k}", ", ".join(names)))
                elif isinstance(v, dict):
                    small = {kk: vv for kk, vv in v.items() if isinstance(vv, (str, int, float, bool))}
                    if small:
                        pairs.append((f"{section}.{k}", ", ".join(f"{kk}={vv}" for kk, vv in small.items())))
    return [(k, v if len(v) <= 300 else v[:300] + "…") for k, v in pairs]


def data_line(verification: Any) -> str | None:
    """One line on the run's data: modified files first (a run on them was asked for explicitly),
    then unverified ones, else how many files SHA256SUMS verified."""
    files = verification.get("files") if isinstance(verification, dict) else None
    if not isinstance(files, dict) or not files:
        return None
    by: dict[str, list[str]] = {}
    for rel, entry in files.items():
        by.setdefault(str(entry.get("status")) if isinstance(entry, dict) else "?", []).append(str(rel))
    parts = []
    if by.get("modified"):
        modified = by.pop("modified")
        parts.append(f"MODIFIED (run with --allow-modified-data): {', '.join(modified)} "
                     f"{'differs' if len(modified) == 1 else 'differ'} from SHA256SUMS")
    if by.get("unverified"):
        parts.append(f"unverified: {', '.join(by.pop('unverified'))}")
    verified = by.pop("verified", [])
    if verified:
        parts.append(f"{len(verified)} file(s) verified against SHA256SUMS")
    parts += [f"{status}: {', '.join(rels)}" for status, rels in by.items()]
    return "; ".join(parts)


def question_text(rec: ItemRecord | None, item_id: str) -> str:
    """The item's question as the task recorded it (its `question` or `prompt` field), else its id."""
    if rec:
        for key in QUESTION_KEYS:
            v = rec.extra.get(key)
            if isinstance(v, str) and v.strip():
                return v
    return item_id


CODE_TASKS = ("humaneval",)       # prompts that are code: shown with their whitespace (pre)
CODE_EXCERPT_LINES = 16


def code_excerpt(task: str, text: str) -> str | None:
    """The first lines of a code prompt with its indentation kept; None for a task that is not code."""
    if task not in CODE_TASKS:
        return None
    lines = str(text).strip("\n").splitlines()
    return "\n".join(lines[:CODE_EXCERPT_LINES]) + ("\n…" if len(lines) > CODE_EXCERPT_LINES else "")


def excerpt(text: str, n: int = EXCERPT_CHARS) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


def cut_output(text: Any) -> str:
    if text is None:
        return ""
    s = str(text)
    return s if len(s) <= OUTPUT_CHARS else s[:OUTPUT_CHARS] + f"\n… [{len(s) - OUTPUT_CHARS:,} more characters in items.jsonl]"


# --- single run -------------------------------------------------------------------------------

def run_context(run_dir: Path) -> dict[str, Any]:
    try:
        manifest, raw_records = store.load_run(run_dir)
        typed, records = typed_run(run_dir, manifest, raw_records)
    except store.StoreError as e:
        raise ReportError(str(e)) from None
    tasks: dict[str, list[ItemRecord]] = {}
    for rec in records:
        tasks.setdefault(rec.task, []).append(rec)
    summaries = []
    dots = []
    for name, recs in tasks.items():
        ok = [r for r in recs if r.status == "ok"]
        scored = [r for r in ok if r.correct is not None]
        correct = sum(1 for r in scored if r.correct is True)
        acc = correct / len(scored) if scored else None
        ci = wilson(correct, len(scored))
        summaries.append({"task": name, "n": len(recs), "ok": len(ok),
                          "errors": sum(1 for r in recs if r.status == "error"),
                          "scored": len(scored), "correct": correct, "accuracy": acc, "ci": ci})
        if acc is not None and ci is not None:
            dots.append({"label": name, "value": acc, "lo": ci[0], "hi": ci[1], "colour": plots.CANDIDATE})
    rows = []
    for rec in records:
        q = question_text(rec, rec.item_id)
        kind = ("error" if rec.status == "error" else "correct" if rec.correct is True
                else "wrong" if rec.correct is False else "unscored")
        rows.append({"kind": kind, "task": rec.task, "item_id": rec.item_id, "question": q,
                     "question_excerpt": excerpt(q),
                     "question_code": code_excerpt(rec.task, q) if q != rec.item_id else None,
                     "reference": rec.reference,
                     "answer": rec.answer, "output": cut_output(rec.output),
                     "error": rec.extra.get("error"), "status": rec.status})
    label = typed.label or run_dir.name
    return {
        "mode": "run",
        "title": f"moebench run: {label}",
        "run_path": str(run_dir),
        "identity": identity(typed),
        "summaries": summaries,
        "accuracy_svg": _svg(plots.interval_plot(dots)) if dots else None,
        "rows": rows,
        "counts": {k: sum(1 for r in rows if r["kind"] == k) for k in ("correct", "wrong", "error", "unscored")},
        "rig": run_rig_context(typed, records),
    }


# --- compare ----------------------------------------------------------------------------------

def resolve_run(ref: Any, compare_dir: Path) -> Path | None:
    """A run path from compare.json: absolute, relative to the compare dir, or to the working dir."""
    if not isinstance(ref, str) or not ref:
        return None
    p = Path(ref)
    candidates = [p] if p.is_absolute() else [compare_dir / p, Path.cwd() / p, compare_dir.parent / p.name]
    for c in candidates:
        if (c / store.MANIFEST).is_file():
            return c
    return None


def _side(info: CompareSide, role: str, compare_dir: Path, warnings: list[str]) -> dict[str, Any]:
    run_dir = resolve_run(info.run, compare_dir)
    side = {"role": role, "label": info.label or role, "run": info.run, "found": False,
            "identity": [], "records": {}}
    profile = info.extra.get("profile")
    if run_dir is None and profile and not info.run:
        side["identity"] = [("runner profile", str(profile))]    # a speed-ab side: no run directory
        return side
    if run_dir is None:
        warnings.append(f"{role} run {info.run!r} not found (looked relative to {compare_dir} "
                        f"and {Path.cwd()}): answers and outputs are not shown")
        return side
    try:
        manifest, records = load_typed_run(run_dir)
    except store.StoreError as e:
        warnings.append(f"{role} run unreadable: {e}")
        return side
    side.update(found=True, identity=identity(manifest), label=info.label or manifest.label or role,
                records={r.key: r for r in records})
    return side


def _task_summary(name: str, t: dict[str, Any]) -> dict[str, Any]:
    n = number(t.get("n_paired"))
    wins = t.get("wins") if isinstance(t.get("wins"), list) else []
    losses = t.get("losses") if isinstance(t.get("losses"), list) else []
    excluded = t.get("excluded") if isinstance(t.get("excluded"), list) else []
    out: dict[str, Any] = {"task": name, "n_paired": int(n) if n is not None else None,
                           "wins": len(wins), "losses": len(losses), "excluded": len(excluded)}
    for role in ("baseline", "candidate"):
        correct = number(t.get(f"{role}_correct"))
        acc = number(t.get(f"{role}_accuracy"))
        if acc is None and correct is not None and n:
            acc = correct / n
        ci = t.get(f"{role}_ci95")
        if not (isinstance(ci, list) and len(ci) == 2 and all(number(x) is not None for x in ci)):
            ci = wilson(int(correct), int(n)) if correct is not None and n else None
        out[f"{role}_correct"] = int(correct) if correct is not None else None
        out[f"{role}_accuracy"] = acc
        out[f"{role}_ci"] = ci
    flip = number(t.get("flip_rate"))
    if flip is None and n:
        flip = (len(wins) + len(losses)) / n
    out["flip_rate"] = flip
    out["mcnemar_p"] = number(t.get("mcnemar_p"))
    d = t.get("delta_ci95")
    out["delta_ci"] = d if isinstance(d, list) and len(d) == 2 and all(number(x) is not None for x in d) else None
    if out["baseline_accuracy"] is not None and out["candidate_accuracy"] is not None:
        out["delta"] = out["candidate_accuracy"] - out["baseline_accuracy"]
    else:
        out["delta"] = None
    return out


def _overall(o: Any) -> dict[str, Any] | None:
    """The all-tasks row: the builder gives counts (n_wins, n_losses) instead of id lists."""
    if not isinstance(o, dict) or len(o) == 0:
        return None
    t = dict(o)
    for key, count in (("wins", "n_wins"), ("losses", "n_losses"), ("excluded", "n_excluded")):
        if key not in t and isinstance(t.get(count), int):
            t[key] = [None] * t[count]
    return _task_summary("overall (all tasks)", t)


def _task_records(side: dict[str, Any], task: str, ids: list[str]) -> dict[str, ItemRecord]:
    """item_id -> record for one task (records whose task field or id prefix names it).

    Flipped ids not found that way are looked up by id alone (a suite may name a task differently).
    """
    out = {iid: r for (tname, iid), r in side["records"].items()
           if tname == task or iid.startswith(f"{task}/")}
    missing = set(ids) - set(out)
    if missing:
        for (_, iid), r in side["records"].items():
            if iid in missing:
                out[iid] = r
    return out


def _id_list(v: Any) -> list[str]:
    return [str(x) for x in v] if isinstance(v, list) else []


def _flip_rows(task: str, t: dict[str, Any], base: dict[str, Any], cand: dict[str, Any],
               notes: list[str]) -> list[dict[str, Any]]:
    wins, losses = _id_list(t.get("wins")), _id_list(t.get("losses"))
    excluded = set(_id_list(t.get("excluded")))
    b_recs, c_recs = _task_records(base, task, wins + losses), _task_records(cand, task, wins + losses)
    kinds: dict[str, str] = {i: "win" for i in wins}
    kinds.update({i: "loss" for i in losses})
    same = [i for i in b_recs if i in c_recs and i not in kinds and i not in excluded]
    if len(same) > MAX_ALL_ROWS:
        notes.append(f"{task}: {len(same):,} unchanged items; only the first {MAX_ALL_ROWS:,} are listed under 'all'")
        same = same[:MAX_ALL_ROWS]
    for i in same:
        kinds[i] = "same-right" if b_recs[i].correct is True else "same-wrong"
    rows = []
    for item_id, kind in kinds.items():
        b, c = b_recs.get(item_id), c_recs.get(item_id)
        q = question_text(b or c, item_id)
        rows.append({"kind": kind, "item_id": item_id, "question": q, "question_excerpt": excerpt(q),
                     "question_code": code_excerpt(task, q) if q != item_id else None,
                     "reference": (b or c).reference if (b or c) else None,
                     "baseline_answer": b.answer if b else None, "candidate_answer": c.answer if c else None,
                     "baseline_output": cut_output(b.output if b else None),
                     "candidate_output": cut_output(c.output if c else None),
                     "missing": [s for s, r in (("baseline", b), ("candidate", c)) if r is None]})
    return rows


def _kld_context(kld: Any) -> dict[str, Any] | None:
    if not isinstance(kld, dict) or not kld or kld.get("method") == "sampled":
        return None                       # a sampled KLD alone: _kld_sampled_context shows it
    order = [("n_tokens", "scored tokens"), ("mean", "mean KLD"), ("max", "maximum"), ("p999", "99.9%"),
             ("p99", "99%"), ("p95", "95%"), ("p90", "90%"), ("median", "median"), ("p10", "10%"),
             ("p5", "5%"), ("p1", "1%"), ("p01", "0.1%"), ("min", "minimum"),
             ("same_top_p", "same top p"), ("ln_ppl_ratio", "mean ln(PPL(Q)/PPL(base))"),
             ("ppl_ratio", "PPL(Q)/PPL(base)")]
    errs = {"mean": "mean_err", "same_top_p": "same_top_p_err", "ln_ppl_ratio": "ln_ppl_ratio_err"}
    stats = []
    for key, label in order:
        if key in kld and not isinstance(kld[key], (dict, list)):
            err = kld.get(errs.get(key, ""))
            stats.append({"key": key, "label": label, "value": kld[key], "err": err})
    dp = kld.get("delta_p") if isinstance(kld.get("delta_p"), dict) else {}
    delta_p = [{"key": k, "value": v} for k, v in dp.items() if not isinstance(v, (dict, list))]
    ctx: dict[str, Any] = {"stats": stats, "delta_p": delta_p, "plots": []}
    hist = kld.get("histogram")
    if isinstance(hist, dict) and isinstance(hist.get("edges"), list) and isinstance(hist.get("counts"), list):
        ctx["plots"].append(("KLD histogram (per scored token)",
                             _svg(plots.histogram(hist["edges"], hist["counts"], "KLD (nats)"))))
    chunks = kld.get("per_chunk")
    if isinstance(chunks, list) and chunks:
        ys = [c if not isinstance(c, dict) else next((c[k] for k in ("mean", "kld", "mean_kld", "kld_mean")
                                                      if k in c), None) for c in chunks]
        ctx["plots"].append(("Mean KLD per chunk", _svg(plots.line_plot(
            [("mean KLD", list(range(len(ys))), ys)], "chunk", "mean KLD (nats)"))))
    layers = kld.get("per_layer") if isinstance(kld.get("per_layer"), dict) else {}
    for key, title, axis, top in (
            ("router_agreement", "Router agreement per layer (top-k set overlap)", "top-k experts shared (%)", 1.0),
            ("identical_set_share", "Share of tokens with identical expert sets per layer",
             "tokens, same expert set (%)", 1.0),
            ("kld", "KLD per layer", "mean KLD (nats)", None)):
        vals = layers.get(key)
        if isinstance(vals, list) and vals:
            ctx["plots"].append((title, _svg(plots.bar_plot(
                [str(i) for i in range(len(vals))], [number(v) for v in vals], axis, y_max=top, xlabel="layer",
                yfmt=plots.fmt_percent_tick if top == 1.0 else plots.fmt_tick))))
    usage = kld.get("expert_usage") if isinstance(kld.get("expert_usage"), dict) else {}
    for role in ("baseline", "candidate"):
        m = usage.get(role)
        if isinstance(m, list) and m and all(isinstance(r, list) for r in m):
            ctx["plots"].append((f"Expert usage by layer ({role}, routed tokens)", _svg(plots.heatmap(
                [[number(v) for v in r] for r in m], [str(i) for i in range(len(m))],
                [str(j) for j in range(max(len(r) for r in m))], "layer", "expert", "routed tokens"))))
    ctx["method"] = kld.get("method")
    est = kld.get("estimate") if isinstance(kld.get("estimate"), dict) else {}
    ctx["method_note"] = est.get("note")
    tool = kld.get("llama_perplexity") if isinstance(kld.get("llama_perplexity"), dict) else None
    if tool:                              # the candidate's own build: which binary, version, flags, commands
        ctx["tool"] = {"binary": tool.get("binary"), "version": tool.get("version"), "source": tool.get("source"),
                       "args": " ".join(map(str, tool.get("args") or [])) or "(none)",
                       "dropped": " ".join(map(str, tool.get("dropped_args") or [])) or "(none)",
                       "commands": [" ".join(map(str, c)) for c in tool.get("commands") or []]}
    skew = kld.get("load_skew") if isinstance(kld.get("load_skew"), dict) else {}
    series = [(role, list(range(len(skew[role]))), [number(v) for v in skew[role]])
              for role in ("baseline", "candidate") if isinstance(skew.get(role), list) and skew[role]]
    if series:
        ctx["plots"].append(("Load skew per layer (share of routed tokens taken by the busiest 25% of experts)",
                             _svg(plots.line_plot(series, "layer", "tokens to the busiest 25% (%)",
                                                  y_range=(0.0, 1.0), yfmt=plots.fmt_percent_tick))))
        ctx["skew_rows"] = [{"layer": i, **{role: (skew.get(role) or [None] * (i + 1))[i]
                                            if i < len(skew.get(role) or []) else None
                                            for role in ("baseline", "candidate")}}
                            for i in range(max(len(s[1]) for s in series))]
    return ctx


def _kld_sampled_context(kld: Any) -> dict[str, Any] | None:
    """The sampled KLD (compare.json["kld"] with method "sampled", or its "sampled" entry beside a
    teacher-forced KLD): estimate, interval, the other estimator and counts."""
    if not isinstance(kld, dict):
        return None
    s = kld if kld.get("method") == "sampled" else kld.get("sampled")
    if not isinstance(s, dict) or not s.get("n_tokens"):
        return None
    other = next((s[k] for k in ("plain", "low_variance") if isinstance(s.get(k), dict)), {})
    other_name = "plain" if "plain" in s else "low-variance"
    return {"mean": s.get("mean"), "interval": s.get("interval") or [None, None], "estimator": s.get("estimator"),
            "confidence": s.get("confidence"), "n_tokens": s.get("n_tokens"), "n_sequences": s.get("n_sequences"),
            "n_prompts": s.get("n_prompts"), "other_name": other_name, "other": other,
            "beside_teacher_forced": s is not kld, "note": s.get("note")}


def _needle_context(needle: Any) -> dict[str, Any] | None:
    cells = needle_cells(needle)
    if not cells:
        return None
    palette = {"both found": "#2ca02c", "lost by candidate": "#d62728", "gained by candidate": "#1f6fb4",
               "neither": "#dddddd"}
    grid, tips = {}, {}
    for c in cells:
        fb, fc = c.get("found_baseline") is True, c.get("found_candidate") is True
        cat = ("both found" if fb and fc else "lost by candidate" if fb else
               "gained by candidate" if fc else "neither")
        key = (c.get("depth"), c.get("length"))
        grid[key] = cat
        tips[key] = (f"length {c.get('length')}, depth {c.get('depth')}, prompt tokens "
                     f"{c.get('prompt_tokens')}: baseline {'found' if fb else 'missed'}, "
                     f"candidate {'found' if fc else 'missed'}")
    depths = sorted({k[0] for k in grid}, key=lambda v: (not isinstance(v, (int, float)), v if isinstance(v, (int, float)) else str(v)))
    lengths = sorted({k[1] for k in grid}, key=lambda v: (not isinstance(v, (int, float)), v if isinstance(v, (int, float)) else str(v)))
    svg = plots.category_grid(grid, depths, lengths, palette, "depth", "context length (tokens)", tips)
    flagged = needle.get("prompt_tokens_flagged") if isinstance(needle.get("prompt_tokens_flagged"), dict) else {}
    return {"counts": needle_counts(cells), "svg": _svg(svg),
            "flagged": {side: ids for side, ids in flagged.items() if ids}}


PERCENTILE_METRICS = (("ttft_s", "TTFT s"), ("tpot_s", "TPOT s"), ("itl_s", "ITL s"), ("e2e_s", "end-to-end s"),
                      ("decode_tok_s", "decode tok/s"), ("prefill_tok_s", "prefill tok/s"))


def _speed_context(speed: Any) -> dict[str, Any] | None:
    rows = speed_rows(speed)
    if not rows:
        return None
    client_counts = sorted({r["clients"] for r in rows}, key=lambda c: (c is None, c or 0))
    figs = []
    for metric, label in (("decode_tok_s", "decode tok/s"), ("prefill_tok_s", "prefill tok/s"),
                          ("ttft_s", "TTFT (s)")):
        series, colours = [], []
        for clients in client_counts:
            group = [r for r in rows if r["clients"] == clients]
            suffix = f", {clients} clients" if len(client_counts) > 1 and clients is not None else ""
            for role, colour in (("baseline", plots.BASELINE), ("candidate", plots.CANDIDATE)):
                series.append((role + suffix, [r["prompt_length"] for r in group],
                               [r[f"{role}_{metric}"] for r in group]))
                colours.append(colour if len(client_counts) == 1 else
                               plots.SERIES_COLOURS[(len(colours)) % len(plots.SERIES_COLOURS)])
        if any(v is not None for _, _, ys in series for v in ys):
            figs.append((f"{label} vs prompt length", _svg(plots.line_plot(
                series, "prompt tokens", label, log_x=True, xfmt=plots.fmt_tokens, colours=colours))))
    geo = speed.get("geomean") if isinstance(speed, dict) and isinstance(speed.get("geomean"), dict) else {}
    metrics = [m for m in SPEED_METRICS if any(r.get(f"{m}_ratio") is not None for r in rows)]
    percentiles = []
    for r in rows:
        for m, label in PERCENTILE_METRICS:
            b, c = r["baseline_stats"].get(m), r["candidate_stats"].get(m)
            if isinstance(b, dict) or isinstance(c, dict):
                percentiles.append({"prompt_length": r["prompt_length"], "clients": r["clients"], "metric": label,
                                    "baseline": b or {}, "candidate": c or {}})
    sampling = speed.get("sampling") if isinstance(speed, dict) and isinstance(speed.get("sampling"), dict) else {}
    return {"rows": rows, "metrics": metrics, "plots": figs, "show_clients": len(client_counts) > 1,
            "labels": dict(PERCENTILE_METRICS), "higher_better": ("decode_tok_s", "prefill_tok_s"),
            "geomean": [(k, v) for k, v in geo.items() if number(v) is not None], "percentiles": percentiles,
            "sampling": [(side, _sampling_text(sampling.get(side))) for side in ("baseline", "candidate")
                         if sampling.get(side)],
            "acceptance": any(r.get("acceptance_baseline") is not None or r.get("acceptance_candidate") is not None
                              for r in rows)}


def _sampling_text(s: Any) -> str:
    if not isinstance(s, dict):
        return "-"
    if not s.get("temperature"):
        return f"greedy (seed {s.get('seed')})"
    parts = [f"temperature {s['temperature']:g}"]
    parts += [f"{k} {s[k]:g}" for k in ("top_p", "top_k") if s.get(k) is not None]
    return ", ".join(parts) + f", seed {s.get('seed')}"


def _speed_ab_context(ab: Any) -> dict[str, Any] | None:
    if not isinstance(ab, dict) or not isinstance(ab.get("rounds"), list):
        return None
    paired = ab.get("paired") if isinstance(ab.get("paired"), dict) else {}
    return {"rounds": [r for r in ab["rounds"] if isinstance(r, dict)], "order": ab.get("order"),
            "profiles": ab.get("profiles") or {}, "won": ab.get("rounds_won") or {},
            "paired": [(m, v) for m, v in paired.items() if isinstance(v, dict)],
            "identity": ab.get("identity") if isinstance(ab.get("identity"), dict) else {},
            "metric": ab.get("round_metric", "decode_tok_s")}


def _gate_context(directory: Path, warnings: list[str]) -> dict[str, Any] | None:
    path = directory / GATE_FILE
    if not path.is_file():
        return None
    try:
        data = _load_json(path)
    except ReportError as e:
        warnings.append(str(e))
        return None
    return data if isinstance(data, dict) and isinstance(data.get("checks"), list) else None


def reading(ratio: Any, higher_is_better: bool, more: str, less: str) -> str:
    """Which way a candidate / baseline ratio went, in words with an arrow: "▼ 16.7% slower"."""
    r = number(ratio)
    if r is None:
        return "–"
    if abs(r - 1) < 5e-4:
        return "= same"
    word = more if r > 1 else less
    better = (r > 1) == higher_is_better
    return f"{'▲' if r > 1 else '▼'} {abs(r - 1) * 100:.1f}% {word} ({'better' if better else 'worse'})"


def _verdict_context(tasks: list[dict[str, Any]], cmp: dict[str, Any], overall: dict[str, Any] | None,
                     gate: dict[str, Any] | None, compare_dir: Path) -> dict[str, Any]:
    """The opening tables: what a reviewer needs to know whether the candidate regressed. Each figure
    with its baseline, candidate, the ratio and which way is better."""
    from moebench.compare.tables import matrix_row
    row = matrix_row(CompareDoc.from_dict(cmp))
    figures = []
    kld = cmp.get("kld") if isinstance(cmp.get("kld"), dict) else {}
    if row["kld.mean"] is not None:
        figures.append({"label": "KLD mean (nats; 0 = same distribution)", "baseline": "0",
                        "candidate": fmt_number(row["kld.mean"], 4), "ratio": "", "reading": "lower is better"})
    if row["kld.same_top_p"] is not None:
        figures.append({"label": "same top token", "baseline": "100%", "candidate": fmt_percent(row["kld.same_top_p"], 2),
                        "ratio": "", "reading": "higher is better"})
    for key, label, higher, more, less in (("decode", "decode speed (tok/s, geomean ratio)", True, "faster", "slower"),
                                           ("prefill", "prefill speed (tok/s, geomean ratio)", True, "faster", "slower"),
                                           ("ttft", "time to first token (geomean ratio)", False, "longer", "shorter")):
        r = row[f"speed.{key}_ratio"]
        if r is not None:
            figures.append({"label": label, "baseline": "", "candidate": "", "ratio": fmt_number(r, 3),
                            "reading": reading(r, higher, more, less)})
    memory = cmp.get("memory") if isinstance(cmp.get("memory"), dict) else {}
    mb = (memory.get("baseline") or {}).get("peak_used_bytes") if isinstance(memory.get("baseline"), dict) else None
    mc = row["memory.peak_used_bytes"]
    if mc is not None:
        r = _ratio(mb, mc)
        figures.append({"label": "peak GPU memory used (GiB)", "baseline": fmt_gib_plain(mb),
                        "candidate": fmt_gib_plain(mc), "ratio": fmt_number(r, 3),
                        "reading": reading(r, False, "more", "less")})
    energy = cmp.get("energy") if isinstance(cmp.get("energy"), dict) else {}
    dec = ((energy.get("per_token") or {}).get("decode") or {}) if isinstance(energy.get("per_token"), dict) else {}
    if number(dec.get("candidate_net_j_per_token")) is not None:
        r = number(dec.get("net_ratio"))
        figures.append({"label": "decode energy (J/token, net of idle)",
                        "baseline": fmt_number(dec.get("baseline_net_j_per_token"), 3),
                        "candidate": fmt_number(dec.get("candidate_net_j_per_token"), 3), "ratio": fmt_number(r, 3),
                        "reading": reading(r, False, "more", "less")})
    if row["speed_ab.rounds"]:
        figures.append({"label": "speed-ab rounds won by B", "baseline": "", "candidate": "",
                        "ratio": f"{row['speed_ab.rounds_won_b']} of {row['speed_ab.rounds']}", "reading": ""})
    from moebench.compare.provenance import kld_notes
    missing = cmp.get("missing_sections") if isinstance(cmp.get("missing_sections"), dict) else {}
    # what the KLD figures mean (or why there are none) belongs beside them, not only in the warnings
    notes = kld_notes(kld) + [f"{k}: no figures: {v}" for k, v in missing.items()]
    return {"tasks": tasks, "overall": overall, "figures": figures, "notes": notes,
            "no_gate": None if gate else f"No gate ran on this compare (moebench gate {compare_dir} --rules "
                                         "GATES.toml judges it; gates/example.toml is a start)."}


TIME_COLUMNS = ("t_s", "t", "time_s", "elapsed_s", "time", "timestamp", "ts")
USED_COLUMNS = ("used_bytes", "mem_used_bytes", "memory_used_bytes", "used", "mem_used")


def _read_samples(path: Path):
    import pandas as pd
    if path.suffix == ".parquet":
        return pd.read_parquet(path)
    if path.suffix in (".jsonl", ".json"):
        return pd.read_json(path, lines=path.suffix == ".jsonl")
    return pd.read_csv(path)


def _timeline_series(path: Path, warnings: list[str]):
    """(times in s from the first sample, used GiB, phase bands) from an NVML samples file."""
    try:
        df = _read_samples(path)
    except Exception as e:  # a side file we cannot read must not sink the whole report
        warnings.append(f"memory timeline {path}: unreadable ({type(e).__name__}: {e})")
        return None
    tcol = next((c for c in TIME_COLUMNS if c in df.columns), None)
    ucol = next((c for c in USED_COLUMNS if c in df.columns), None)
    if tcol is None or ucol is None or df.empty:
        warnings.append(f"memory timeline {path}: expected a time column ({', '.join(TIME_COLUMNS)}) and a "
                        f"used-memory column ({', '.join(USED_COLUMNS)}); found {', '.join(map(str, df.columns))}")
        return None
    import pandas as pd
    if "gpu" in df.columns and df["gpu"].nunique() > 1:     # several cards: the rig's total per tick
        df = df.groupby(tcol, as_index=False, sort=True)[ucol].sum()
    t = df[tcol]
    if pd.api.types.is_datetime64_any_dtype(t):
        t0 = t.iloc[0]
        t = (t - t0).dt.total_seconds()
    else:
        t = pd.to_numeric(t, errors="coerce").astype(float)
        t0 = float(t.iloc[0])
        t = t - t0
    used = pd.to_numeric(df[ucol], errors="coerce") / 2**30
    times = [float(x) for x in t]
    bands: list[tuple[float, float, str]] = []
    if "phase" in df.columns:
        start, current = times[0], df["phase"].iloc[0]
        for x, ph in zip(times[1:], df["phase"].iloc[1:]):
            if ph != current:
                bands.append((start, x, str(current)))
                start, current = x, ph
        bands.append((start, times[-1], str(current)))
    else:
        bands = _phase_marks(path.parent / PHASES_FILE, t0, times[-1], warnings)
    bands = [b for b in bands if b[2] not in ("", "nan", "None", "end") and b[1] > b[0]]
    return times, [float(u) for u in used], bands


PHASES_FILE = "nvml_phases.json"
SAMPLE_FILES = ("nvml_samples.parquet", "nvml_samples.csv")


def _phase_marks(path: Path, t0: Any, t_end: float, warnings: list[str]) -> list[tuple[float, float, str]]:
    """Phase bands from the probe's marks file: a list of {phase, t} (same clock as the samples)."""
    if not path.is_file():
        return []
    import pandas as pd
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        warnings.append(f"{path}: unreadable phase marks ({e})")
        return []
    marks = data.get("marks", data.get("phases")) if isinstance(data, dict) else data
    points = []
    for m in marks if isinstance(marks, list) else []:
        if not isinstance(m, dict) or "phase" not in m:
            continue
        raw = next((m[k] for k in TIME_COLUMNS + ("start",) if k in m), None)
        if isinstance(raw, str) and isinstance(t0, pd.Timestamp):
            x = (pd.Timestamp(raw) - t0).total_seconds()
        elif isinstance(raw, (int, float)) and isinstance(t0, (int, float)):
            x = float(raw) - float(t0)
        else:
            continue
        points.append((x, str(m["phase"])))
    points.sort()
    return [(x, points[i + 1][0] if i + 1 < len(points) else max(t_end, x), ph)
            for i, (x, ph) in enumerate(points)]


def _memory_context(memory: Any, compare_dir: Path, sides: list[dict[str, Any]],
                    warnings: list[str]) -> dict[str, Any] | None:
    if not isinstance(memory, dict) or not memory:
        return None
    ctx: dict[str, Any] = {"rows": memory_rows(memory), "note": _unavailable(memory) or memory.get("source"),
                           "available": memory.get("available") is not False, "plots": [],
                           "raw": _raw(memory, skip=("timeline", "timelines"))}
    for side in sides:
        role = side["role"]
        ref = None
        if isinstance(memory.get(role), dict):
            ref = memory[role].get("timeline")
        elif isinstance(memory.get("timeline"), dict):
            ref = memory["timeline"].get(role)
        elif isinstance(memory.get("timeline"), str) and role == "candidate":
            ref = memory["timeline"]
        run_dir = resolve_run(side.get("run"), compare_dir)
        if not isinstance(ref, str):   # the probe's own files beside the run's items
            ref = next((str(run_dir / n) for n in SAMPLE_FILES if run_dir and (run_dir / n).is_file()), None)
        if not isinstance(ref, str):
            continue
        options = [Path(ref)] if Path(ref).is_absolute() else \
            [compare_dir / ref, *([run_dir / ref] if run_dir else []), Path.cwd() / ref]
        found = next((p for p in options if p.is_file()), None)
        if found is None:
            warnings.append(f"memory timeline {ref!r} for the {role} run not found")
            continue
        got = _timeline_series(found, warnings)
        if got:   # one plot per run: each run has its own clock and phases
            colour = plots.BASELINE if role == "baseline" else plots.CANDIDATE
            ctx["plots"].append((f"{side['label']} ({role}): memory used over time, {found.name}",
                                 _svg(plots.timeline([(f"{role} used GiB", got[0], got[1])], got[2],
                                                     "seconds", "GPU memory used (GiB)", colours=[colour]))))
    return ctx


def _ratio(b: Any, c: Any) -> float | None:
    b, c = number(b), number(c)
    return c / b if b and c is not None else None


def _unavailable(section: dict[str, Any]) -> str | None:
    """One line on why a memory or energy section has no figures (NVML missing on a side)."""
    if section.get("available") is not False:
        return None
    why = section.get("reason")
    if isinstance(why, dict):
        texts = {str(v) for v in why.values()}
        if len(texts) == 1:
            return f"No figures: {texts.pop()} (both runs)."
        return "No figures: " + "; ".join(f"{side}: {v}" for side, v in why.items()) + "."
    return f"No figures: {why}." if why else "No figures."


def memory_rows(memory: dict[str, Any]) -> list[dict[str, Any]]:
    """The memory table a person reads: a row per figure, baseline / candidate / ratio in GiB
    (compare.json keeps the raw bytes)."""
    b = memory.get("baseline") if isinstance(memory.get("baseline"), dict) else {}
    c = memory.get("candidate") if isinstance(memory.get("candidate"), dict) else {}
    rows = []
    for key, label, better in (("peak_used_bytes", "peak used", "lower"), ("min_free_bytes", "least free", "higher"),
                               ("reserved_bytes", "reserved by the driver", ""), ("total_bytes", "total", "")):
        if number(b.get(key)) is None and number(c.get(key)) is None:
            continue
        rows.append({"label": label, "baseline": fmt_gib_plain(b.get(key)), "candidate": fmt_gib_plain(c.get(key)),
                     "ratio": _ratio(b.get(key), c.get(key)), "better": better})
    torch = {side: memory.get(f"torch_peak_allocated_bytes_{side}") for side in ("baseline", "candidate")}
    if any(number(v) is not None for v in torch.values()):
        rows.append({"label": "torch peak allocated", "baseline": fmt_gib_plain(torch["baseline"]),
                     "candidate": fmt_gib_plain(torch["candidate"]),
                     "ratio": _ratio(torch["baseline"], torch["candidate"]), "better": "lower"})
    return rows


def fmt_gib_plain(v: Any) -> str:
    f = number(v)
    return "–" if f is None else f"{f / 2**30:.2f}"


def _energy_context(energy: Any) -> dict[str, Any] | None:
    """Energy as tables a person reads: J/token per work phase, and per phase duration, energy, net
    energy and mean power, each baseline / candidate / ratio; the idle baseline in a note."""
    if not isinstance(energy, dict) or not energy:
        return None
    if energy.get("available") is False and not energy.get("phases"):
        return {"available": False, "note": _unavailable(energy), "per_token": [], "phases": [], "idle": None,
                "raw": None}
    per_token = []
    for phase, p in (energy.get("per_token") or {}).items():
        if isinstance(p, dict):
            for kind in ("net", "gross"):
                per_token.append({"label": f"{phase}, {kind}", "baseline": p.get(f"baseline_{kind}_j_per_token"),
                                  "candidate": p.get(f"candidate_{kind}_j_per_token"),
                                  "ratio": p.get(f"{kind}_ratio")})
    kwh = energy.get("kwh_per_million_tokens")
    if isinstance(kwh, dict):
        b, c = kwh.get("baseline") or {}, kwh.get("candidate") or {}
        per_token.append({"label": "all work, net, kWh per million tokens", "baseline": b.get("net"),
                          "candidate": c.get("net"), "ratio": kwh.get("net_ratio")})
    phases = []
    for phase, sides in (energy.get("phases") or {}).items():
        if not isinstance(sides, dict):
            continue
        b, c = sides.get("baseline") or {}, sides.get("candidate") or {}
        phases.append({"phase": phase, "b_s": b.get("duration_s"), "c_s": c.get("duration_s"),
                       "b_j": b.get("energy_j"), "c_j": c.get("energy_j"), "j_ratio": _ratio(b.get("energy_j"),
                                                                                         c.get("energy_j")),
                       "b_net": b.get("net_j"), "c_net": c.get("net_j"),
                       "b_w": b.get("mean_power_w"), "c_w": c.get("mean_power_w")})
    whole = energy.get("whole_run") if isinstance(energy.get("whole_run"), dict) else {}
    wb, wc = whole.get("baseline") or {}, whole.get("candidate") or {}
    if wb or wc:
        phases.append({"phase": "whole run (counter)", "b_s": wb.get("duration_s"), "c_s": wc.get("duration_s"),
                       "b_j": wb.get("counter_j"), "c_j": wc.get("counter_j"),
                       "j_ratio": _ratio(wb.get("counter_j"), wc.get("counter_j")), "b_net": None, "c_net": None,
                       "b_w": None, "c_w": None})
    idle = {side: energy.get(f"{side}_idle_power_w") for side in ("baseline", "candidate")}
    return {"available": True, "note": None, "per_token": per_token, "phases": phases,
            "idle": idle if any(number(v) is not None for v in idle.values()) else None, "raw": _raw(energy)}


def _raw(section: dict[str, Any], skip: tuple[str, ...] = ()) -> dict[str, Any] | None:
    """Every figure of a section under its flattened compare.json key, for a folded table (figures of
    shapes the readable tables do not know stay visible there)."""
    if section.get("available") is False:
        return None
    names, values = per_side(section, skip=skip)
    return {"names": names, "values": values, "columns": list(values)} if names else None


def compare_context(compare_dir: Path) -> dict[str, Any]:
    try:
        doc = CompareDoc.from_dict(_load_json(compare_dir / "compare.json"), str(compare_dir / "compare.json"))
    except RecordError as e:
        raise ReportError(str(e)) from None
    compare = doc.to_dict()
    # the builder's own: first what makes the runs different experiments, then the rest
    warnings: list[str] = [f"Not like for like: {d}" for d in _id_list(doc.extra.get("setup_differences"))]
    warnings += _id_list(doc.warnings)
    base = _side(doc.baseline, "baseline", compare_dir, warnings)
    cand = _side(doc.candidate, "candidate", compare_dir, warnings)
    tasks_raw = doc.tasks
    tasks, dots, flips = [], [], []
    for name, t in tasks_raw.items():
        if not isinstance(t, dict):
            warnings.append(f"compare.json: tasks.{name} is not an object; skipped")
            continue
        s = _task_summary(name, t)
        tasks.append(s)
        for role, colour in (("baseline", plots.BASELINE), ("candidate", plots.CANDIDATE)):
            if s[f"{role}_accuracy"] is not None:
                ci = s[f"{role}_ci"] or (s[f"{role}_accuracy"],) * 2
                dots.append({"label": f"{name} · {role}", "value": s[f"{role}_accuracy"],
                             "lo": number(ci[0]), "hi": number(ci[1]), "colour": colour})
        notes: list[str] = []
        rows = _flip_rows(name, t, base, cand, notes)
        reasons = t.get("excluded_reasons") if isinstance(t.get("excluded_reasons"), dict) else {}
        excluded = [(i, str(reasons.get(i, ""))) for i in _id_list(t.get("excluded"))]
        subjects = t.get("per_subject") if isinstance(t.get("per_subject"), dict) else {}
        flips.append({"task": name, "rows": rows, "notes": notes, "excluded": excluded,
                      "subjects": [_task_summary(sub, v) for sub, v in subjects.items() if isinstance(v, dict)],
                      "counts": {k: sum(1 for r in rows if r["kind"] == k)
                                 for k in ("win", "loss", "same-right", "same-wrong")}})
    overall = _overall(doc.section("overall"))
    gate = _gate_context(compare_dir, warnings)
    return {
        "mode": "compare",
        "title": f"moebench compare: {base['label']} vs {cand['label']}",
        "compare_path": str(compare_dir),
        "sides": [base, cand],
        "warnings": warnings,
        "tasks": tasks,
        "accuracy_svg": _svg(plots.interval_plot(dots)) if dots else None,
        "overall": overall,
        "flips": flips,
        "kld": _kld_context(doc.section("kld")),
        "kld_sampled": _kld_sampled_context(doc.section("kld")),
        "needle": _needle_context(doc.section("needle")),
        "speed": _speed_context(doc.section("speed")),
        "speed_ab": _speed_ab_context(doc.section("speed_ab")),
        "load": load_context(doc.section("speed")),
        "memory": _memory_context(doc.section("memory"), compare_dir, [base, cand], warnings),
        "energy": _energy_context(doc.section("energy")),
        "rig": rig_context(compare),
        "gate": gate,
        "verdict": _verdict_context(tasks, compare, overall, gate, compare_dir),
    }


# --- several candidates -------------------------------------------------------------------------

def _manifest(run_dir: Path) -> Manifest:
    return Manifest.from_dict(store.load_run(run_dir)[0], str(run_dir / store.MANIFEST))


def matrix_context(matrix_dir: Path) -> dict[str, Any]:
    """One report over several candidates: the headline table, per-task deltas, the size/KLD/speed
    scatter, and links to each candidate's own report."""
    from moebench.compare.tables import TASK_FIELDS
    matrix = _load_json(matrix_dir / MATRIX_FILE)
    if not isinstance(matrix, dict) or not isinstance(matrix.get("rows"), list):
        raise ReportError(f"{matrix_dir / MATRIX_FILE}: expected an object with 'rows'")
    warnings: list[str] = []
    rows = [r for r in matrix["rows"] if isinstance(r, dict)]
    tasks: list[str] = []
    for r in rows:
        for k in r:
            if k.endswith(".delta") and not k.startswith(("kld.", "speed")):
                t = k[: -len(".delta")]
                if t not in tasks:
                    tasks.append(t)
    cands = []
    for r in rows:
        d = matrix_dir / str(r.get("compare_dir") or ".")
        gate = _gate_context(d, warnings) if d != matrix_dir else None
        if d != matrix_dir and (d / "compare.json").is_file():   # different experiments: said first
            pair = _load_json(d / "compare.json")
            warnings += [f"Not like for like: {r.get('candidate')}: {x}"
                         for x in _id_list(pair.get("setup_differences") if isinstance(pair, dict) else None)]
        cands.append({"row": r, "link": f"{r.get('compare_dir')}/{REPORT_FILE}" if d != matrix_dir else None,
                      "gate": gate,
                      "tasks": [{"task": t, **{f: r.get(f"{t}.{f}") for f in TASK_FIELDS}} for t in tasks]})
    points = [{"label": str(r.get("candidate")), "x": number(r.get("model_bytes")) and r["model_bytes"] / 2**20,
               "y": number(r.get("kld.mean")), "size": number(r.get("speed.decode_tok_s"))} for r in rows]
    scatter = _svg(plots.scatter(points, "model size (MiB)", "mean KLD against the baseline",
                                 "candidate decode tok/s (geomean over prompt lengths)"))
    base = matrix.get("baseline") if isinstance(matrix.get("baseline"), dict) else {}
    base_dir = resolve_run(base.get("run"), matrix_dir)
    manifests = []
    if base_dir is not None:
        manifests.append({"role": "baseline", "label": base.get("label"), "run": base.get("run"),
                          "identity": identity(_manifest(base_dir))})
    for r in rows:
        d = resolve_run(r.get("run"), matrix_dir)
        if d is not None:
            manifests.append({"role": "candidate", "label": r.get("candidate"), "run": r.get("run"),
                              "identity": identity(_manifest(d))})
    return {"mode": "matrix", "title": f"moebench compare: {len(rows)} candidates against {base.get('label')}",
            "compare_path": str(matrix_dir), "warnings": warnings, "candidates": cands, "tasks": tasks,
            "scatter": scatter, "manifests": manifests}
