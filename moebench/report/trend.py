"""`moebench trend RUN...`: each headline figure of several runs across builds, ordered by time or build.

Reads each run's manifest (and its items for accuracy): per scored task accuracy, KLD mean and same
top p of a run measured against a baseline, speed medians per prompt length and client count (decode,
prefill, TTFT), NVML peak memory, decode J/token, model bytes. Writes trend.json (runs and figures),
trend.csv (a row per run) and trend.html (a line per figure, runs in order on the x axis).
"""
from __future__ import annotations

import csv
import io
import os
from dataclasses import dataclass
from pathlib import Path

from moebench import store
from moebench.json_types import JsonObject
from moebench.store.records import ItemRecord, typed_records
from moebench.store.sections import number

ORDERS = ("time", "build", "given")


def build_id(m: JsonObject) -> str:
    """A short name for the build a run measured (from its manifest): llama.cpp's build number, else
    moebench's git revision."""
    b = m.get("build") if isinstance(m.get("build"), dict) else {}
    if b.get("build_number") is not None:
        commit = b.get("build_commit")
        return f"b{b['build_number']}" + (f" ({commit})" if commit and commit != f"b{b['build_number']}" else "")
    mb = m.get("moebench") if isinstance(m.get("moebench"), dict) else {}
    rev = mb.get("git_revision")
    if rev:
        return f"moebench {str(rev)[:10]}{' dirty' if mb.get('dirty') else ''}"
    return str(mb.get("version") or "?")


def _build_number(m: JsonObject) -> int | None:
    b = m.get("build") if isinstance(m.get("build"), dict) else {}
    v = b.get("build_number")
    return v if isinstance(v, int) else None


@dataclass
class TrendRun:
    """trend.json runs[]: which run, its build and when it started (the figures follow in the row)."""

    run: str
    label: str
    run_id: str | None
    started_at: str | None
    build: str
    build_number: int | None
    status: str | None

    def to_json(self) -> dict[str, str | int | None]:
        return {"run": self.run, "label": self.label, "run_id": self.run_id, "started_at": self.started_at,
                "build": self.build, "build_number": self.build_number, "status": self.status}


Figures = dict[str, float | None]


def run_figures(run_dir: Path) -> tuple[TrendRun, Figures]:
    """(identity, {figure name: value}) for one run. The manifest is read as written (a hand-made one
    may lack the keys `Manifest` requires); its records typed."""
    manifest, raw_records = store.load_run(run_dir)
    records = typed_records(run_dir, raw_records)
    ident = TrendRun(run=str(run_dir.resolve()), label=manifest.get("label") or run_dir.name,
                     run_id=manifest.get("run_id"), started_at=manifest.get("started_at"), build=build_id(manifest),
                     build_number=_build_number(manifest), status=manifest.get("status"))
    figs: Figures = {}
    by_task: dict[str, list[ItemRecord]] = {}
    for r in records:
        by_task.setdefault(r.task, []).append(r)
    for task, recs in by_task.items():
        scored = [r for r in recs if r.status == "ok" and r.correct is not None]
        if scored:
            figs[f"{task} accuracy"] = sum(1 for r in scored if r.correct is True) / len(scored)
    summary = manifest.get("summary") if isinstance(manifest.get("summary"), dict) else {}
    for task, s in summary.items():
        if not isinstance(s, dict):
            continue
        kld = s.get("kld") if isinstance(s.get("kld"), dict) else None
        if kld:
            figs[f"{task} KLD mean"] = number(kld.get("mean"))
            figs[f"{task} KLD same top p"] = number(kld.get("same_top_p"))
        if number(s.get("ppl")) is not None:
            figs[f"{task} perplexity"] = number(s.get("ppl"))
        by_len = s.get("by_prompt_length") if isinstance(s.get("by_prompt_length"), dict) else {}
        for length, per_clients in by_len.items():
            for clients, g in (per_clients or {}).items():
                if not isinstance(g, dict):
                    continue
                where = f"{length} tokens, {clients} client{'s' if str(clients) != '1' else ''}"
                for metric, label in (("decode_tok_s", "decode tok/s"), ("prefill_tok_s", "prefill tok/s"),
                                      ("ttft_s", "TTFT s")):
                    st = g.get(metric)
                    if isinstance(st, dict):
                        figs[f"{label} at {where}"] = number(st.get("median"))
    nv = ((manifest.get("probes") or {}).get("nvml") or {})
    ps = nv.get("summary") if isinstance(nv.get("summary"), dict) else {}
    mem = ps.get("memory") if isinstance(ps.get("memory"), dict) else {}
    if number(mem.get("peak_used_bytes")) is not None:
        figs["peak GPU memory used (GiB)"] = mem["peak_used_bytes"] / 2**30
    per_token = ((ps.get("energy") or {}).get("per_token") or {}) if isinstance(ps.get("energy"), dict) else {}
    for ph in ("prefill", "decode"):
        p = per_token.get(ph)
        if isinstance(p, dict) and number(p.get("net_j_per_token")) is not None:
            figs[f"{ph} J/token"] = number(p.get("net_j_per_token"))
    model = manifest.get("model") if isinstance(manifest.get("model"), dict) else {}
    size = model.get("size_bytes", model.get("bytes"))
    if isinstance(size, int):
        figs["model size (MiB)"] = size / 2**20
    return ident, figs


def order_runs(items: list[tuple[TrendRun, Figures]], order: str) -> tuple[list[tuple[TrendRun, Figures]], str]:
    """Runs sorted by start time, by build number (where every run has one), or as given."""
    if order == "given":
        return items, "the order given"
    if order == "build":
        if all(i[0].build_number is not None for i in items):
            return sorted(items, key=lambda i: (i[0].build_number, i[0].started_at or "")), "build number"
        order = "time"
    return sorted(items, key=lambda i: (i[0].started_at or "", i[0].label)), "start time"


def is_share(figure: str) -> bool:
    """A figure that is a share of 0 to 1 (accuracy, same top p): drawn on a 0-100% axis."""
    return figure.endswith((" accuracy", "same top p"))


def _cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[: max(n - 1, 1)] + "…"


def write_trend(runs: list[Path], out_dir: Path, order: str = "time") -> Path:
    from moebench.report import plots
    from moebench.report.render import _svg, render_html
    from moebench.report.views import Figure, TrendReport, TrendRunRow
    if order not in ORDERS:
        raise ValueError(f"trend: order must be one of {', '.join(ORDERS)}, got {order!r}")
    items, order_text = order_runs([run_figures(Path(r)) for r in runs], order)
    names: list[str] = []
    for _, figs in items:
        names += [n for n in figs if n not in names]
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [{**ident.to_json(), **{n: figs.get(n) for n in names}} for ident, figs in items]
    store.write_json_atomic(out_dir / "trend.json", {"schema_version": 1, "order": order_text,
                                                     "figures": names, "runs": rows})
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=["label", "build", "started_at", "run_id", "run", *names],
                       extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if v is None else v) for k, v in r.items()})
    (out_dir / "trend.csv").write_text(buf.getvalue(), encoding="utf-8")
    xs = list(range(1, len(rows) + 1))
    # Every chart puts run i at the same x (half a slot of room each side) with its label under it,
    # cut to the width of its slot (the run table above the charts has the whole label).
    slot_chars = max(3, int((plots.WIDTH - plots.MARGIN_L - plots.MARGIN_R) / max(len(rows), 1) / plots.CHAR_W) - 1)
    short = [_cut(str(r["label"]), min(14, slot_chars)) for r in rows]

    def tick(v: float) -> str:         # the run's label under its point
        i = int(round(v)) - 1
        return short[i] if 0 <= i < len(short) and float(v).is_integer() else ""
    figures, warnings = [], []
    for n in names:
        ys = [number(r.get(n)) for r in rows]
        if sum(y is not None for y in ys) < 2:
            warnings.append(f"{n}: measured in fewer than two of the runs; drawn anyway")
        share = is_share(n)
        figures.append(Figure(n, _svg(plots.line_plot(
            [(n, xs, ys)], f"runs by {order_text}", n, y_zero=False, xfmt=tick,
            x_range=(0.5, len(rows) + 0.5), xticks=xs, y_range=(0.0, 1.0) if share else None,
            yfmt=plots.fmt_percent_tick if share else plots.fmt_tick))))
    html = render_html(TrendReport(
        title=f"moebench trend: {len(rows)} runs", trend_path=str(out_dir), order_by=order_text, warnings=warnings,
        runs=[TrendRunRow(label=ident.label, build=ident.build, started_at=ident.started_at) for ident, _ in items],
        figures=figures))
    tmp = out_dir / f".trend.html.tmp{os.getpid()}"
    tmp.write_text(html, encoding="utf-8")
    os.replace(tmp, out_dir / "trend.html")
    return out_dir
