"""The HTML report: one self-contained file for a run directory or a compare directory.

Reads only the store (manifest.json, items.jsonl, compare.json and the side files they name).
Rendered by jinja2 with autoescape on, so model text is always shown as text; the only markup that
is marked safe is the SVG produced by `plots`, which escapes its own labels.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import jinja2
from markupsafe import Markup

from moebench import store
from moebench.json_fields import as_object
from moebench.json_types import JsonObject, JsonValue
from moebench.report import plots
from moebench.report.load import load_context
from moebench.report.rig import rig_context, run_rig_context
from moebench.report.views import (AbIdentity, AbPaired, AbRoundRow, CompareReport, EnergyPhaseRow, EnergyTokenRow,
                                   EnergyView, Figure, FlipCounts, FlipRow, FlipTable, GateView, IdentityPairs,
                                   IdlePower, Interval, ItemCounts, KldDeltaP, KldSampledView, KldStat, KldTool,
                                   KldView, ManifestFold, MatrixColumn, MatrixFigures, MatrixReport, MatrixTaskCell,
                                   MemoryRow, MemoryView, MetricCell, NeedleView, PercentileRow, Percentiles,
                                   RawFigures, ReportError, RunItemRow, RunReport, RunTaskSummary, SideView,
                                   SkewRow, SpeedAbView, SpeedRow, SpeedView, TaskSummary, TrendReport,
                                   VerdictFigure, VerdictView)
from moebench.store import load_typed_run
from moebench.store.records import CompareDoc, CompareSide, ItemRecord, Manifest, RecordError, typed_run
from moebench.store.sections import (SPEED_METRICS, needle_cells, needle_counts, number, per_side,
                                      speed_rows)

if TYPE_CHECKING:
    import pandas as pd

REPORT_FILE = "report.html"
MATRIX_FILE = "matrix.json"
GATE_FILE = "gate.json"
EXCERPT_CHARS = 240
OUTPUT_CHARS = 20_000          # raw outputs beyond this are cut in the report (the run keeps them)
MAX_ALL_ROWS = 3_000           # unchanged items listed per task; flips are always listed
QUESTION_KEYS = ("question", "prompt_excerpt", "prompt", "input", "text")


# --- entry point ------------------------------------------------------------------------------

def render(path: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path:
    """Write the report for a run or compare directory; return the HTML file's path.

    Default output: `report.html` inside `path`.
    """
    src = Path(path)
    view: CompareReport | MatrixReport | RunReport
    if (src / "compare.json").is_file():
        view = compare_context(src)
    elif (src / MATRIX_FILE).is_file():
        view = matrix_context(src)
    elif (src / store.MANIFEST).is_file():
        view = run_context(src)
    else:
        raise ReportError(f"{src}: neither a compare directory (no compare.json) "
                          f"nor a run directory (no {store.MANIFEST})")
    html = render_html(view)
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


def render_html(view: CompareReport | MatrixReport | RunReport | TrendReport) -> str:
    """report.html filled from a report's view: its top-level fields are the template's variables."""
    return _environment().get_template("report.html").render({f.name: getattr(view, f.name) for f in fields(view)})


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

def _load_json(path: Path) -> JsonValue:
    try:
        with path.open(encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ReportError(f"{path}: not valid JSON ({e})") from None


def wilson(correct: int, n: int, z: float = 1.959964) -> Interval | None:
    if n <= 0:
        return None
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def identity(manifest: Manifest) -> IdentityPairs:
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


def data_line(verification: JsonValue) -> str | None:
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


def cut_output(text: JsonValue) -> str:
    if text is None:
        return ""
    s = str(text)
    return s if len(s) <= OUTPUT_CHARS else s[:OUTPUT_CHARS] + f"\n… [{len(s) - OUTPUT_CHARS:,} more characters in items.jsonl]"


# --- single run -------------------------------------------------------------------------------

def run_context(run_dir: Path) -> RunReport:
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
        summaries.append(RunTaskSummary(task=name, n=len(recs), ok=len(ok),
                                        errors=sum(1 for r in recs if r.status == "error"),
                                        scored=len(scored), correct=correct, accuracy=acc, ci=ci))
        if acc is not None and ci is not None:
            dots.append({"label": name, "value": acc, "lo": ci[0], "hi": ci[1], "colour": plots.CANDIDATE})
    rows = []
    for rec in records:
        q = question_text(rec, rec.item_id)
        kind: Literal["error", "correct", "wrong", "unscored"] = (
            "error" if rec.status == "error" else "correct" if rec.correct is True
            else "wrong" if rec.correct is False else "unscored")
        rows.append(RunItemRow(kind=kind, task=rec.task, item_id=rec.item_id, question=q,
                               question_excerpt=excerpt(q),
                               question_code=code_excerpt(rec.task, q) if q != rec.item_id else None,
                               reference=rec.reference, answer=rec.answer, output=cut_output(rec.output),
                               error=rec.extra.get("error"), status=rec.status))
    label = typed.label or run_dir.name
    kinds = [r.kind for r in rows]
    return RunReport(
        title=f"moebench run: {label}",
        run_path=str(run_dir),
        identity=identity(typed),
        summaries=summaries,
        accuracy_svg=_svg(plots.interval_plot(dots)) if dots else None,
        rows=rows,
        counts=ItemCounts(correct=kinds.count("correct"), wrong=kinds.count("wrong"), error=kinds.count("error"),
                          unscored=kinds.count("unscored")),
        rig=run_rig_context(typed, records),
    )


# --- compare ----------------------------------------------------------------------------------

def resolve_run(ref: JsonValue, compare_dir: Path) -> Path | None:
    """A run path from compare.json: absolute, relative to the compare dir, or to the working dir."""
    if not isinstance(ref, str) or not ref:
        return None
    p = Path(ref)
    candidates = [p] if p.is_absolute() else [compare_dir / p, Path.cwd() / p, compare_dir.parent / p.name]
    for c in candidates:
        if (c / store.MANIFEST).is_file():
            return c
    return None


def _side(info: CompareSide, role: str, compare_dir: Path, warnings: list[str]) -> SideView:
    run_dir = resolve_run(info.run, compare_dir)
    side = SideView(role=role, label=info.label or role, run=info.run)
    profile = info.extra.get("profile")
    if run_dir is None and profile and not info.run:
        side.identity = [("runner profile", str(profile))]    # a speed-ab side: no run directory
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
    side.found, side.identity = True, identity(manifest)
    side.label = info.label or manifest.label or role
    side.records = {r.key: r for r in records}
    return side


def _interval(v: JsonValue) -> Interval | None:
    """A [low, high] pair of finite numbers as written, else None."""
    if isinstance(v, list) and len(v) == 2:
        lo, hi = number(v[0]), number(v[1])
        if lo is not None and hi is not None:
            return lo, hi
    return None


def _task_summary(name: str, t: JsonObject, counts: dict[str, int] | None = None) -> TaskSummary:
    """A task's figures from compare.json tasks.<name>; `counts` stands in for id lists the entry
    gives only as counts (the all-tasks row)."""
    n = number(t.get("n_paired"))
    lists = {key: len(v) if isinstance(v := t.get(key), list) else (counts or {}).get(key, 0)
             for key in ("wins", "losses", "excluded")}
    out = TaskSummary(task=name, n_paired=int(n) if n is not None else None, wins=lists["wins"],
                      losses=lists["losses"], excluded=lists["excluded"])
    for role in ("baseline", "candidate"):
        correct = number(t.get(f"{role}_correct"))
        acc = number(t.get(f"{role}_accuracy"))
        if acc is None and correct is not None and n:
            acc = correct / n
        ci = _interval(t.get(f"{role}_ci95"))
        if ci is None:
            ci = wilson(int(correct), int(n)) if correct is not None and n else None
        setattr(out, f"{role}_correct", int(correct) if correct is not None else None)
        setattr(out, f"{role}_accuracy", acc)
        setattr(out, f"{role}_ci", ci)
    flip = number(t.get("flip_rate"))
    if flip is None and n:
        flip = (out.wins + out.losses) / n
    out.flip_rate = flip
    out.mcnemar_p = number(t.get("mcnemar_p"))
    out.delta_ci = _interval(t.get("delta_ci95"))
    if out.baseline_accuracy is not None and out.candidate_accuracy is not None:
        out.delta = out.candidate_accuracy - out.baseline_accuracy
    return out


def _overall(o: JsonValue) -> TaskSummary | None:
    """The all-tasks row: the builder gives counts (n_wins, n_losses) instead of id lists."""
    if not isinstance(o, dict) or len(o) == 0:
        return None
    counts = {key: c for key, count in (("wins", "n_wins"), ("losses", "n_losses"), ("excluded", "n_excluded"))
              if key not in o and isinstance(c := o.get(count), int)}
    return _task_summary("overall (all tasks)", o, counts)


def _task_records(side: SideView, task: str, ids: list[str]) -> dict[str, ItemRecord]:
    """item_id -> record for one task (records whose task field or id prefix names it).

    Flipped ids not found that way are looked up by id alone (a suite may name a task differently).
    """
    out = {iid: r for (tname, iid), r in side.records.items()
           if tname == task or iid.startswith(f"{task}/")}
    missing = set(ids) - set(out)
    if missing:
        for (_, iid), r in side.records.items():
            if iid in missing:
                out[iid] = r
    return out


def _id_list(v: JsonValue) -> list[str]:
    return [str(x) for x in v] if isinstance(v, list) else []


FlipKind = Literal["win", "loss", "same-right", "same-wrong"]


def _flip_rows(task: str, t: JsonObject, base: SideView, cand: SideView, notes: list[str]) -> list[FlipRow]:
    wins, losses = _id_list(t.get("wins")), _id_list(t.get("losses"))
    excluded = set(_id_list(t.get("excluded")))
    b_recs, c_recs = _task_records(base, task, wins + losses), _task_records(cand, task, wins + losses)
    kinds: dict[str, FlipKind] = {i: "win" for i in wins}
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
        either = b or c
        rows.append(FlipRow(kind=kind, item_id=item_id, question=q, question_excerpt=excerpt(q),
                            question_code=code_excerpt(task, q) if q != item_id else None,
                            reference=either.reference if either else None,
                            baseline_answer=b.answer if b else None, candidate_answer=c.answer if c else None,
                            baseline_output=cut_output(b.output if b else None),
                            candidate_output=cut_output(c.output if c else None),
                            missing=[s for s, r in (("baseline", b), ("candidate", c)) if r is None]))
    return rows


def _kld_context(kld: JsonValue) -> KldView | None:
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
            stats.append(KldStat(key=key, label=label, value=kld[key], err=err))
    dp = as_object(kld.get("delta_p"))
    delta_p = [KldDeltaP(key=k, value=v) for k, v in dp.items() if not isinstance(v, (dict, list))]
    ctx = KldView(stats=stats, delta_p=delta_p, plots=[])
    hist = kld.get("histogram")
    if isinstance(hist, dict) and isinstance(hist.get("edges"), list) and isinstance(hist.get("counts"), list):
        ctx.plots.append(Figure("KLD histogram (per scored token)",
                                _svg(plots.histogram(hist["edges"], hist["counts"], "KLD (nats)"))))
    chunks = kld.get("per_chunk")
    if isinstance(chunks, list) and chunks:
        ys = [c if not isinstance(c, dict) else next((c[k] for k in ("mean", "kld", "mean_kld", "kld_mean")
                                                      if k in c), None) for c in chunks]
        ctx.plots.append(Figure("Mean KLD per chunk", _svg(plots.line_plot(
            [("mean KLD", list(range(len(ys))), ys)], "chunk", "mean KLD (nats)"))))
    layers = as_object(kld.get("per_layer"))
    for key, title, axis, top in (
            ("router_agreement", "Router agreement per layer (top-k set overlap)", "top-k experts shared (%)", 1.0),
            ("identical_set_share", "Share of tokens with identical expert sets per layer",
             "tokens, same expert set (%)", 1.0),
            ("kld", "KLD per layer", "mean KLD (nats)", None)):
        vals = layers.get(key)
        if isinstance(vals, list) and vals:
            ctx.plots.append(Figure(title, _svg(plots.bar_plot(
                [str(i) for i in range(len(vals))], [number(v) for v in vals], axis, y_max=top, xlabel="layer",
                yfmt=plots.fmt_percent_tick if top == 1.0 else plots.fmt_tick))))
    usage = as_object(kld.get("expert_usage"))
    for role in ("baseline", "candidate"):
        m = usage.get(role)
        if isinstance(m, list) and m and all(isinstance(r, list) for r in m):
            ctx.plots.append(Figure(f"Expert usage by layer ({role}, routed tokens)", _svg(plots.heatmap(
                [[number(v) for v in r] for r in m], [str(i) for i in range(len(m))],
                [str(j) for j in range(max(len(r) for r in m))], "layer", "expert", "routed tokens"))))
    ctx.method = kld.get("method")
    ctx.method_note = as_object(kld.get("estimate")).get("note")
    tool = as_object(kld.get("llama_perplexity"))
    if tool:                              # the candidate's own build: which binary, version, flags, commands
        ctx.tool = KldTool(binary=tool.get("binary"), version=tool.get("version"), source=tool.get("source"),
                           args=" ".join(map(str, _list(tool.get("args")))) or "(none)",
                           dropped=" ".join(map(str, _list(tool.get("dropped_args")))) or "(none)",
                           commands=[" ".join(map(str, _list(c))) for c in _list(tool.get("commands"))])
    skew = as_object(kld.get("load_skew"))
    series = [(role, list(range(len(skew[role]))), [number(v) for v in skew[role]])
              for role in ("baseline", "candidate") if isinstance(skew.get(role), list) and skew[role]]
    if series:
        ctx.plots.append(Figure("Load skew per layer (share of routed tokens taken by the busiest 25% of experts)",
                                _svg(plots.line_plot(series, "layer", "tokens to the busiest 25% (%)",
                                                     y_range=(0.0, 1.0), yfmt=plots.fmt_percent_tick))))
        per_role = {role: _list(skew.get(role)) for role in ("baseline", "candidate")}
        ctx.skew_rows = [SkewRow(layer=i, **{role: v[i] if i < len(v) else None for role, v in per_role.items()})
                         for i in range(max(len(s[1]) for s in series))]
    return ctx


def _list(v: JsonValue) -> list[JsonValue]:
    """A JSON list as read; an empty one for null (and anything else that is not a list)."""
    return v if isinstance(v, list) else []


def _kld_sampled_context(kld: JsonValue) -> KldSampledView | None:
    """The sampled KLD (compare.json["kld"] with method "sampled", or its "sampled" entry beside a
    teacher-forced KLD): estimate, interval, the other estimator and counts."""
    if not isinstance(kld, dict):
        return None
    s = kld if kld.get("method") == "sampled" else kld.get("sampled")
    if not isinstance(s, dict) or not s.get("n_tokens"):
        return None
    other = next((as_object(s[k]) for k in ("plain", "low_variance") if isinstance(s.get(k), dict)), {})
    other_name = "plain" if "plain" in s else "low-variance"
    interval, other_interval = s.get("interval"), other.get("interval")
    return KldSampledView(mean=s.get("mean"), interval=interval if isinstance(interval, list) and interval
                          else [None, None], estimator=s.get("estimator"), confidence=s.get("confidence"),
                          n_tokens=s.get("n_tokens"), n_sequences=s.get("n_sequences"), n_prompts=s.get("n_prompts"),
                          other_name=other_name, other_mean=other.get("mean"),
                          other_interval=other_interval if isinstance(other_interval, list) and other_interval
                          else None, beside_teacher_forced=s is not kld, note=s.get("note"))


def _needle_context(needle: JsonValue) -> NeedleView | None:
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
    flagged = as_object(as_object(needle).get("prompt_tokens_flagged"))
    return NeedleView(counts=needle_counts(cells), svg=_svg(svg),
                      flagged={side: [str(i) for i in ids] for side, ids in flagged.items() if isinstance(ids, list)
                               and ids})


PERCENTILE_METRICS = (("ttft_s", "TTFT s"), ("tpot_s", "TPOT s"), ("itl_s", "ITL s"), ("e2e_s", "end-to-end s"),
                      ("decode_tok_s", "decode tok/s"), ("prefill_tok_s", "prefill tok/s"))


def _speed_row(r: JsonObject) -> SpeedRow:
    """A row of `store.sections.speed_rows` (its <side>_<metric>, <metric>_ratio keys) by metric."""
    return SpeedRow(prompt_length=r["prompt_length"], clients=r["clients"], n_baseline=r["n_baseline"],
                    n_candidate=r["n_candidate"],
                    metrics={m: MetricCell(baseline=r[f"baseline_{m}"], candidate=r[f"candidate_{m}"],
                                           ratio=r[f"{m}_ratio"], ratio_ci95=r[f"{m}_ratio_ci95"])
                             for m in SPEED_METRICS},
                    acceptance_baseline=r["acceptance_baseline"], acceptance_candidate=r["acceptance_candidate"])


def _speed_context(speed: JsonValue) -> SpeedView | None:
    raw_rows = speed_rows(speed)
    if not raw_rows:
        return None
    rows = [_speed_row(r) for r in raw_rows]
    client_counts = sorted({r.clients for r in rows}, key=lambda c: (c is None, c or 0))
    figs = []
    for metric, label in (("decode_tok_s", "decode tok/s"), ("prefill_tok_s", "prefill tok/s"),
                          ("ttft_s", "TTFT (s)")):
        series, colours = [], []
        for clients in client_counts:
            group = [r for r in rows if r.clients == clients]
            suffix = f", {clients} clients" if len(client_counts) > 1 and clients is not None else ""
            for role, colour in (("baseline", plots.BASELINE), ("candidate", plots.CANDIDATE)):
                series.append((role + suffix, [r.prompt_length for r in group],
                               [getattr(r.metrics[metric], role) for r in group]))
                colours.append(colour if len(client_counts) == 1 else
                               plots.SERIES_COLOURS[(len(colours)) % len(plots.SERIES_COLOURS)])
        if any(v is not None for _, _, ys in series for v in ys):
            figs.append(Figure(f"{label} vs prompt length", _svg(plots.line_plot(
                series, "prompt tokens", label, log_x=True, xfmt=plots.fmt_tokens, colours=colours))))
    section = as_object(speed)
    geo = as_object(section.get("geomean"))
    metrics = [m for m in SPEED_METRICS if any(r.metrics[m].ratio is not None for r in rows)]
    percentiles = []
    for raw, r in zip(raw_rows, rows):
        for m, label in PERCENTILE_METRICS:
            b, c = raw["baseline_stats"].get(m), raw["candidate_stats"].get(m)
            if isinstance(b, dict) or isinstance(c, dict):
                percentiles.append(PercentileRow(prompt_length=r.prompt_length, clients=r.clients, metric=label,
                                                 baseline=Percentiles.from_json(b),
                                                 candidate=Percentiles.from_json(c)))
    sampling = as_object(section.get("sampling"))
    return SpeedView(rows=rows, metrics=metrics, plots=figs, show_clients=len(client_counts) > 1,
                     labels=dict(PERCENTILE_METRICS), higher_better=("decode_tok_s", "prefill_tok_s"),
                     geomean=[(k, v) for k, v in geo.items() if number(v) is not None], percentiles=percentiles,
                     sampling=[(side, _sampling_text(sampling.get(side))) for side in ("baseline", "candidate")
                               if sampling.get(side)],
                     acceptance=any(r.acceptance_baseline is not None or r.acceptance_candidate is not None
                                    for r in rows))


def _sampling_text(s: JsonValue) -> str:
    if not isinstance(s, dict):
        return "-"
    if not s.get("temperature"):
        return f"greedy (seed {s.get('seed')})"
    parts = [f"temperature {s['temperature']:g}"]
    parts += [f"{k} {s[k]:g}" for k in ("top_p", "top_k") if s.get(k) is not None]
    return ", ".join(parts) + f", seed {s.get('seed')}"


def _speed_ab_context(ab: JsonValue) -> SpeedAbView | None:
    if not isinstance(ab, dict) or not isinstance(ab.get("rounds"), list):
        return None
    paired = as_object(ab.get("paired"))
    profiles, won, ident = as_object(ab.get("profiles")), as_object(ab.get("rounds_won")), as_object(ab.get("identity"))
    identity = None
    if ident:
        identity = AbIdentity(n_pairs=len(_list(ident.get("pairs"))), compared_on=ident.get("compared_on"),
                              n_differ=ident["n_differ_any"] if "n_differ_any" in ident else ident.get("n_differ"),
                              n_compared=ident.get("n_compared"), a_self_n_differ=ident.get("a_self_n_differ"),
                              b_self_n_differ=ident.get("b_self_n_differ"))
    return SpeedAbView(rounds=[AbRoundRow.from_json(r) for r in _list(ab.get("rounds")) if isinstance(r, dict)],
                       order=ab.get("order"), profile_a=profiles.get("A"), profile_b=profiles.get("B"),
                       won_a=won.get("A", 0), won_b=won.get("B", 0), won_tie=won.get("tie", 0),
                       paired=[(m, AbPaired(median_ratio=v.get("median_ratio"), ratio_ci95=v.get("ratio_ci95"),
                                            n_pairs=v.get("n_pairs")))
                               for m, v in paired.items() if isinstance(v, dict)],
                       identity=identity, metric=ab.get("round_metric", "decode_tok_s"))


def _gate_context(directory: Path, warnings: list[str]) -> GateView | None:
    path = directory / GATE_FILE
    if not path.is_file():
        return None
    try:
        data = _load_json(path)
        if not (isinstance(data, dict) and isinstance(data.get("checks"), list)):
            return None
        return GateView.from_json(data, str(path))
    except ReportError as e:
        warnings.append(str(e))
        return None


def reading(ratio: JsonValue, higher_is_better: bool, more: str, less: str) -> str:
    """Which way a candidate / baseline ratio went, in words with an arrow: "▼ 16.7% slower"."""
    r = number(ratio)
    if r is None:
        return "–"
    if abs(r - 1) < 5e-4:
        return "= same"
    word = more if r > 1 else less
    better = (r > 1) == higher_is_better
    return f"{'▲' if r > 1 else '▼'} {abs(r - 1) * 100:.1f}% {word} ({'better' if better else 'worse'})"


def _verdict_context(tasks: list[TaskSummary], doc: CompareDoc, overall: TaskSummary | None,
                     gate: GateView | None, compare_dir: Path) -> VerdictView:
    """The opening tables: what a reviewer needs to know whether the candidate regressed. Each figure
    with its baseline, candidate, the ratio and which way is better."""
    from moebench.compare.tables import matrix_row
    row = matrix_row(doc)
    figures = []
    kld = as_object(doc.section("kld"))
    if row["kld.mean"] is not None:
        figures.append(VerdictFigure(label="KLD mean (nats; 0 = same distribution)", baseline="0",
                                     candidate=fmt_number(row["kld.mean"], 4), ratio="", reading="lower is better"))
    if row["kld.same_top_p"] is not None:
        figures.append(VerdictFigure(label="same top token", baseline="100%",
                                     candidate=fmt_percent(row["kld.same_top_p"], 2), ratio="",
                                     reading="higher is better"))
    for key, label, higher, more, less in (("decode", "decode speed (tok/s, geomean ratio)", True, "faster", "slower"),
                                           ("prefill", "prefill speed (tok/s, geomean ratio)", True, "faster", "slower"),
                                           ("ttft", "time to first token (geomean ratio)", False, "longer", "shorter")):
        r = row[f"speed.{key}_ratio"]
        if r is not None:
            figures.append(VerdictFigure(label=label, baseline="", candidate="", ratio=fmt_number(r, 3),
                                         reading=reading(r, higher, more, less)))
    memory = as_object(doc.section("memory"))
    mb = as_object(memory.get("baseline")).get("peak_used_bytes") if isinstance(memory.get("baseline"), dict) else None
    mc = row["memory.peak_used_bytes"]
    if mc is not None:
        r = _ratio(mb, mc)
        figures.append(VerdictFigure(label="peak GPU memory used (GiB)", baseline=fmt_gib_plain(mb),
                                     candidate=fmt_gib_plain(mc), ratio=fmt_number(r, 3),
                                     reading=reading(r, False, "more", "less")))
    energy = as_object(doc.section("energy"))
    per_token = energy.get("per_token")
    dec = as_object(per_token.get("decode") or {}) if isinstance(per_token, dict) else {}
    if number(dec.get("candidate_net_j_per_token")) is not None:
        r = number(dec.get("net_ratio"))
        figures.append(VerdictFigure(label="decode energy (J/token, net of idle)",
                                     baseline=fmt_number(dec.get("baseline_net_j_per_token"), 3),
                                     candidate=fmt_number(dec.get("candidate_net_j_per_token"), 3),
                                     ratio=fmt_number(r, 3), reading=reading(r, False, "more", "less")))
    if row["speed_ab.rounds"]:
        figures.append(VerdictFigure(label="speed-ab rounds won by B", baseline="", candidate="",
                                     ratio=f"{row['speed_ab.rounds_won_b']} of {row['speed_ab.rounds']}", reading=""))
    from moebench.compare.provenance import kld_notes
    missing = as_object(doc.extra.get("missing_sections"))
    # what the KLD figures mean (or why there are none) belongs beside them, not only in the warnings
    notes = kld_notes(kld) + [f"{k}: no figures: {v}" for k, v in missing.items()]
    return VerdictView(tasks=tasks, overall=overall, figures=figures, notes=notes,
                       no_gate=None if gate else f"No gate ran on this compare (moebench gate {compare_dir} --rules "
                                                 "GATES.toml judges it; gates/example.toml is a start).")


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


def _phase_marks(path: Path, t0: pd.Timestamp | float, t_end: float,
                 warnings: list[str]) -> list[tuple[float, float, str]]:
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


def _memory_context(memory: JsonValue, compare_dir: Path, sides: list[SideView],
                    warnings: list[str]) -> MemoryView | None:
    if not isinstance(memory, dict) or not memory:
        return None
    source = memory.get("source")
    ctx = MemoryView(rows=memory_rows(memory), note=_unavailable(memory) or (None if source is None else str(source)),
                     available=memory.get("available") is not False, plots=[],
                     raw=_raw(memory, skip=("timeline", "timelines")))
    for side in sides:
        role = side.role
        ref = None
        timeline = memory.get("timeline")
        if isinstance(memory.get(role), dict):
            ref = as_object(memory[role]).get("timeline")
        elif isinstance(timeline, dict):
            ref = timeline.get(role)
        elif isinstance(timeline, str) and role == "candidate":
            ref = timeline
        run_dir = resolve_run(side.run, compare_dir)
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
            ctx.plots.append(Figure(f"{side.label} ({role}): memory used over time, {found.name}",
                                    _svg(plots.timeline([(f"{role} used GiB", got[0], got[1])], got[2],
                                                        "seconds", "GPU memory used (GiB)", colours=[colour]))))
    return ctx


def _ratio(b: JsonValue, c: JsonValue) -> float | None:
    b, c = number(b), number(c)
    return c / b if b and c is not None else None


def _unavailable(section: JsonObject) -> str | None:
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


def memory_rows(memory: JsonObject) -> list[MemoryRow]:
    """The memory table a person reads: a row per figure, baseline / candidate / ratio in GiB
    (compare.json keeps the raw bytes)."""
    b, c = as_object(memory.get("baseline")), as_object(memory.get("candidate"))
    rows = []
    for key, label, better in (("peak_used_bytes", "peak used", "lower"), ("min_free_bytes", "least free", "higher"),
                               ("reserved_bytes", "reserved by the driver", ""), ("total_bytes", "total", "")):
        if number(b.get(key)) is None and number(c.get(key)) is None:
            continue
        rows.append(MemoryRow(label=label, baseline=fmt_gib_plain(b.get(key)), candidate=fmt_gib_plain(c.get(key)),
                              ratio=_ratio(b.get(key), c.get(key)), better=better))
    torch = {side: memory.get(f"torch_peak_allocated_bytes_{side}") for side in ("baseline", "candidate")}
    if any(number(v) is not None for v in torch.values()):
        rows.append(MemoryRow(label="torch peak allocated", baseline=fmt_gib_plain(torch["baseline"]),
                              candidate=fmt_gib_plain(torch["candidate"]),
                              ratio=_ratio(torch["baseline"], torch["candidate"]), better="lower"))
    return rows


def fmt_gib_plain(v: JsonValue) -> str:
    f = number(v)
    return "–" if f is None else f"{f / 2**30:.2f}"


def _energy_context(energy: JsonValue) -> EnergyView | None:
    """Energy as tables a person reads: J/token per work phase, and per phase duration, energy, net
    energy and mean power, each baseline / candidate / ratio; the idle baseline in a note."""
    if not isinstance(energy, dict) or not energy:
        return None
    if energy.get("available") is False and not energy.get("phases"):
        return EnergyView(available=False, note=_unavailable(energy), per_token=[], phases=[], idle=None, raw=None)
    per_token = []
    for phase, p in as_object(energy.get("per_token") or {}).items():
        if isinstance(p, dict):
            for kind in ("net", "gross"):
                per_token.append(EnergyTokenRow(label=f"{phase}, {kind}",
                                                baseline=p.get(f"baseline_{kind}_j_per_token"),
                                                candidate=p.get(f"candidate_{kind}_j_per_token"),
                                                ratio=p.get(f"{kind}_ratio")))
    kwh = energy.get("kwh_per_million_tokens")
    if isinstance(kwh, dict):
        b, c = as_object(kwh.get("baseline") or {}), as_object(kwh.get("candidate") or {})
        per_token.append(EnergyTokenRow(label="all work, net, kWh per million tokens", baseline=b.get("net"),
                                        candidate=c.get("net"), ratio=kwh.get("net_ratio")))
    phases = []
    for phase, sides in as_object(energy.get("phases") or {}).items():
        if not isinstance(sides, dict):
            continue
        b, c = as_object(sides.get("baseline") or {}), as_object(sides.get("candidate") or {})
        phases.append(EnergyPhaseRow(phase=phase, b_s=b.get("duration_s"), c_s=c.get("duration_s"),
                                     b_j=b.get("energy_j"), c_j=c.get("energy_j"),
                                     j_ratio=_ratio(b.get("energy_j"), c.get("energy_j")),
                                     b_net=b.get("net_j"), c_net=c.get("net_j"),
                                     b_w=b.get("mean_power_w"), c_w=c.get("mean_power_w")))
    whole = as_object(energy.get("whole_run"))
    wb, wc = as_object(whole.get("baseline") or {}), as_object(whole.get("candidate") or {})
    if wb or wc:
        phases.append(EnergyPhaseRow(phase="whole run (counter)", b_s=wb.get("duration_s"), c_s=wc.get("duration_s"),
                                     b_j=wb.get("counter_j"), c_j=wc.get("counter_j"),
                                     j_ratio=_ratio(wb.get("counter_j"), wc.get("counter_j")), b_net=None,
                                     c_net=None, b_w=None, c_w=None))
    idle = IdlePower(baseline=energy.get("baseline_idle_power_w"), candidate=energy.get("candidate_idle_power_w"))
    return EnergyView(available=True, note=None, per_token=per_token, phases=phases,
                      idle=idle if number(idle.baseline) is not None or number(idle.candidate) is not None else None,
                      raw=_raw(energy))


def _raw(section: JsonObject, skip: tuple[str, ...] = ()) -> RawFigures | None:
    """Every figure of a section under its flattened compare.json key, for a folded table (figures of
    shapes the readable tables do not know stay visible there)."""
    if section.get("available") is False:
        return None
    names, values = per_side(section, skip=skip)
    return RawFigures(names=names, values=values, columns=list(values)) if names else None


def compare_context(compare_dir: Path) -> CompareReport:
    try:
        doc = CompareDoc.from_dict(_load_json(compare_dir / "compare.json"), str(compare_dir / "compare.json"))
    except RecordError as e:
        raise ReportError(str(e)) from None
    # the builder's own: first what makes the runs different experiments, then the rest
    warnings: list[str] = [f"Not like for like: {d}" for d in _id_list(doc.extra.get("setup_differences"))]
    warnings += _id_list(doc.warnings)
    base = _side(doc.baseline, "baseline", compare_dir, warnings)
    cand = _side(doc.candidate, "candidate", compare_dir, warnings)
    tasks, dots, flips = [], [], []
    for name, t in doc.tasks.items():
        if not isinstance(t, dict):
            warnings.append(f"compare.json: tasks.{name} is not an object; skipped")
            continue
        s = _task_summary(name, t)
        tasks.append(s)
        for role, colour, acc, interval in (("baseline", plots.BASELINE, s.baseline_accuracy, s.baseline_ci),
                                            ("candidate", plots.CANDIDATE, s.candidate_accuracy, s.candidate_ci)):
            if acc is not None:
                lo, hi = interval or (acc, acc)
                dots.append({"label": f"{name} · {role}", "value": acc, "lo": lo, "hi": hi, "colour": colour})
        notes: list[str] = []
        rows = _flip_rows(name, t, base, cand, notes)
        reasons = as_object(t.get("excluded_reasons"))
        excluded = [(i, str(reasons.get(i, ""))) for i in _id_list(t.get("excluded"))]
        subjects = as_object(t.get("per_subject"))
        kinds = [r.kind for r in rows]
        flips.append(FlipTable(task=name, rows=rows, notes=notes, excluded=excluded,
                               subjects=[_task_summary(sub, v) for sub, v in subjects.items() if isinstance(v, dict)],
                               counts=FlipCounts(win=kinds.count("win"), loss=kinds.count("loss"),
                                                 same_right=kinds.count("same-right"),
                                                 same_wrong=kinds.count("same-wrong"))))
    overall = _overall(doc.section("overall"))
    gate = _gate_context(compare_dir, warnings)
    return CompareReport(
        title=f"moebench compare: {base.label} vs {cand.label}",
        compare_path=str(compare_dir),
        sides=[base, cand],
        warnings=warnings,
        tasks=tasks,
        accuracy_svg=_svg(plots.interval_plot(dots)) if dots else None,
        overall=overall,
        flips=flips,
        kld=_kld_context(doc.section("kld")),
        kld_sampled=_kld_sampled_context(doc.section("kld")),
        needle=_needle_context(doc.section("needle")),
        speed=_speed_context(doc.section("speed")),
        speed_ab=_speed_ab_context(doc.section("speed_ab")),
        load=load_context(doc.section("speed")),
        memory=_memory_context(doc.section("memory"), compare_dir, [base, cand], warnings),
        energy=_energy_context(doc.section("energy")),
        rig=rig_context(doc.section("memory"), doc.section("energy"), doc.section("engine")),
        gate=gate,
        verdict=_verdict_context(tasks, doc, overall, gate, compare_dir),
    )


# --- several candidates -------------------------------------------------------------------------

def _manifest(run_dir: Path) -> Manifest:
    return Manifest.from_dict(store.load_run(run_dir)[0], str(run_dir / store.MANIFEST))


def matrix_context(matrix_dir: Path) -> MatrixReport:
    """One report over several candidates: the headline table, per-task deltas, the size/KLD/speed
    scatter, and links to each candidate's own report."""
    matrix = _load_json(matrix_dir / MATRIX_FILE)
    if not isinstance(matrix, dict) or not isinstance(matrix.get("rows"), list):
        raise ReportError(f"{matrix_dir / MATRIX_FILE}: expected an object with 'rows'")
    warnings: list[str] = []
    rows = [r for r in _list(matrix["rows"]) if isinstance(r, dict)]
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
        cands.append(MatrixColumn(row=MatrixFigures.from_json(r),
                                  link=f"{r.get('compare_dir')}/{REPORT_FILE}" if d != matrix_dir else None,
                                  gate=gate, tasks=[_matrix_cell(r, t) for t in tasks]))
    points = []
    for r in rows:
        size = number(r.get("model_bytes"))
        points.append({"label": str(r.get("candidate")), "x": size and size / 2**20, "y": number(r.get("kld.mean")),
                       "size": number(r.get("speed.decode_tok_s"))})
    scatter = _svg(plots.scatter(points, "model size (MiB)", "mean KLD against the baseline",
                                 "candidate decode tok/s (geomean over prompt lengths)"))
    base = as_object(matrix.get("baseline"))
    base_dir = resolve_run(base.get("run"), matrix_dir)
    manifests = []
    if base_dir is not None:
        manifests.append(ManifestFold(role="baseline", label=base.get("label"), run=base.get("run"),
                                      identity=identity(_manifest(base_dir))))
    for r in rows:
        d2 = resolve_run(r.get("run"), matrix_dir)
        if d2 is not None:
            manifests.append(ManifestFold(role="candidate", label=r.get("candidate"), run=r.get("run"),
                                          identity=identity(_manifest(d2))))
    return MatrixReport(title=f"moebench compare: {len(rows)} candidates against {base.get('label')}",
                        compare_path=str(matrix_dir), warnings=warnings, candidates=cands, tasks=tasks,
                        scatter=scatter, manifests=manifests)


def _matrix_cell(row: JsonObject, task: str) -> MatrixTaskCell:
    """A task's Δ, interval, wins and losses from a matrix.json row's "<task>.<field>" keys."""
    return MatrixTaskCell(delta=row.get(f"{task}.delta"), delta_ci_low=row.get(f"{task}.delta_ci_low"),
                          delta_ci_high=row.get(f"{task}.delta_ci_high"), wins=row.get(f"{task}.wins"),
                          losses=row.get(f"{task}.losses"))
