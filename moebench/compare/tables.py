"""The publishable forms of a compare: one flat row per candidate (matrix.csv / matrix.json), the
Markdown summary (summary.md) and the terminal table, all from compare.json as read (`CompareDoc`)."""
from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from typing import Any

from moebench.compare.figures import EnergyFigures, KldFigures, MemoryFigures, SpeedAbFigures, SpeedFigures
from moebench.compare.records import TaskEntry
from moebench.json_fields import as_object
from moebench.json_types import JsonObject, JsonValue
from moebench.store.records import CompareDoc
from moebench.store.sections import number

# Headline columns after the identity ones; task columns follow as <task>.<field>.
HEADLINE = ("kld.mean", "kld.p99", "kld.same_top_p", "speed.decode_ratio", "speed.prefill_ratio",
            "speed.ttft_ratio", "speed.decode_tok_s", "speed_ab.rounds_won_b", "speed_ab.rounds",
            "speed_ab.decode_ratio", "memory.peak_used_bytes", "memory.peak_used_ratio",
            "energy.decode_j_per_token", "energy.prefill_j_per_token")
TASK_FIELDS = ("n_paired", "baseline_accuracy", "candidate_accuracy", "delta", "delta_ci_low", "delta_ci_high",
               "wins", "losses", "flip_rate", "mcnemar_p", "excluded")


# One flat row of matrix.csv / matrix.json: column -> a number, a label or path, or None (not measured).
Row = dict[str, str | float | None]


def _geomean(vals: list[float | None]) -> float | None:
    xs = [v for v in vals if v is not None and v > 0]
    return math.exp(sum(math.log(v) for v in xs) / len(xs)) if xs else None


@dataclass
class TaskFigures:
    """One task's (or subject's, or the overall block's) figures as a row shows them: TASK_FIELDS."""

    n_paired: int | None
    baseline_accuracy: float | None
    candidate_accuracy: float | None
    delta: float | None
    delta_ci_low: float | None
    delta_ci_high: float | None
    wins: int | None
    losses: int | None
    flip_rate: float | None
    mcnemar_p: float | None
    excluded: int | None

    def to_json(self) -> dict[str, float | None]:
        return {"n_paired": self.n_paired, "baseline_accuracy": self.baseline_accuracy,
                "candidate_accuracy": self.candidate_accuracy, "delta": self.delta,
                "delta_ci_low": self.delta_ci_low, "delta_ci_high": self.delta_ci_high, "wins": self.wins,
                "losses": self.losses, "flip_rate": self.flip_rate, "mcnemar_p": self.mcnemar_p,
                "excluded": self.excluded}


    @classmethod
    def of(cls, t: TaskEntry) -> "TaskFigures":
        """The row's figures from a task entry (or a per_subject entry, or "overall", which counts
        instead of listing): accuracies, delta with its interval, flips, McNemar."""
        n = t.n_paired
        b, c = t.baseline_accuracy, t.candidate_accuracy
        if b is None and n:
            b = (t.baseline_correct or 0) / n
        if c is None and n:
            c = (t.candidate_correct or 0) / n
        ci = t.delta_ci95 if t.delta_ci95 is not None else [None, None]
        return cls(n_paired=int(n) if n is not None else None, baseline_accuracy=b, candidate_accuracy=c,
                   delta=(c - b) if b is not None and c is not None else None,
                   delta_ci_low=ci[0] if ci else None, delta_ci_high=ci[1] if len(ci) > 1 else None,
                   wins=len(t.wins) if t.wins is not None else t.n_wins,
                   losses=len(t.losses) if t.losses is not None else t.n_losses,
                   flip_rate=t.flip_rate, mcnemar_p=t.mcnemar_p,
                   excluded=len(t.excluded) if t.excluded is not None else t.n_excluded)


def task_figures(t: JsonObject) -> TaskFigures:
    """The per-task figures of a row from compare.json's tasks.<task> object (`TaskFigures.of`)."""
    return TaskFigures.of(TaskEntry.from_json(t))


def matrix_row(cmp: CompareDoc, compare_dir: str | None = None) -> Row:
    """One flat row for a candidate: identity, model bytes, per-task figures, KLD, speed, memory, energy."""
    cand = cmp.candidate
    model = cand.extra.get("model") if isinstance(cand.extra.get("model"), dict) else {}
    row: Row = {"candidate": cand.label, "run": cand.run, "run_id": cand.extra.get("run_id"),
                "runner": cand.extra.get("runner"), "compare_dir": compare_dir, "model_bytes": model.get("bytes")}
    for name, t in cmp.tasks.items():
        if isinstance(t, dict):
            row.update({f"{name}.{k}": v for k, v in task_figures(t).to_json().items()})
    if isinstance(cmp.section("overall"), dict):
        row.update({f"overall.{k}": v for k, v in task_figures(cmp.section("overall")).to_json().items()})
    kld = KldFigures.from_json(as_object(cmp.section("kld")))
    row["kld.mean"], row["kld.p99"], row["kld.same_top_p"] = kld.mean, kld.p99, kld.same_top_p
    speed = SpeedFigures.from_json(as_object(cmp.section("speed")))
    for k in ("decode", "prefill", "ttft"):
        row[f"speed.{k}_ratio"] = speed.geomean[k]
    row["speed.decode_tok_s"] = _geomean(speed.decode_candidate)
    has_ab = bool(as_object(cmp.section("speed_ab")))
    ab = SpeedAbFigures.from_json(as_object(cmp.section("speed_ab")))
    row["speed_ab.rounds_won_b"] = ab.rounds_won_b if has_ab else None
    row["speed_ab.rounds"] = len(ab.round_winners or []) if has_ab else None
    decode_ab = ab.paired.get("decode_tok_s")
    row["speed_ab.decode_ratio"] = decode_ab.median_ratio if has_ab and decode_ab is not None else None
    memory = MemoryFigures.from_json(as_object(cmp.section("memory")))
    row["memory.peak_used_bytes"], row["memory.peak_used_ratio"] = memory.peak_used_candidate, memory.peak_used_ratio
    energy = EnergyFigures.from_json(as_object(cmp.section("energy")))
    row["energy.decode_j_per_token"], row["energy.prefill_j_per_token"] = \
        energy.decode_j_per_token, energy.prefill_j_per_token
    return row




def columns(rows: list[Row]) -> list[str]:
    """Identity columns, then the tasks' columns in first-seen task order, then the headline figures."""
    ident = ["candidate", "run", "run_id", "runner", "compare_dir", "model_bytes"]
    tasks: list[str] = []
    for r in rows:
        for k in r:
            if "." in k and not k.startswith(("kld.", "speed.", "speed_ab.", "memory.", "energy.")):
                t = k.rsplit(".", 1)[0]
                if t not in tasks:
                    tasks.append(t)
    task_cols = [f"{t}.{f}" for t in tasks for f in TASK_FIELDS]
    return ident + task_cols + list(HEADLINE)


def to_csv(rows: list[Row]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=columns(rows), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if v is None else v) for k, v in r.items()})
    return buf.getvalue()


# --- text and Markdown ----------------------------------------------------------------------------

def _pct(x: Any, signed: bool = False) -> str:
    v = number(x)
    return "-" if v is None else (f"{100 * v:+.1f}%" if signed else f"{100 * v:.1f}%")


def _n(x: Any, digits: int = 4) -> str:
    v = number(x)
    return "-" if v is None else f"{v:.{digits}g}"


def _ci(lo: Any, hi: Any) -> str:
    return "-" if number(lo) is None or number(hi) is None else f"[{100 * lo:+.1f}, {100 * hi:+.1f}]"


def _gib(x: Any) -> str:
    v = number(x)
    return "-" if v is None else f"{v / 2**30:.2f} GiB"


def _mib(x: Any) -> str:
    v = number(x)
    return "-" if v is None else f"{v / 2**20:.1f} MiB"


def task_table(cmp: CompareDoc) -> list[list[str]]:
    rows = [["task", "n", "baseline", "candidate", "delta", "delta 95% CI (pp)", "wins", "losses", "McNemar p"]]
    items = list(cmp.tasks.items())
    overall = cmp.section("overall")
    if isinstance(overall, dict):
        items.append(("overall", overall))
    for name, t in items:
        f = task_figures(t)
        rows.append([name, _n(f.n_paired), _pct(f.baseline_accuracy), _pct(f.candidate_accuracy),
                     _pct(f.delta, signed=True), _ci(f.delta_ci_low, f.delta_ci_high),
                     str(f.wins), str(f.losses), _n(f.mcnemar_p, 3)])
    return rows


def headline_table(rows: list[Row]) -> list[list[str]]:
    out = [["candidate", "model", "KLD mean", "KLD p99", "same top", "decode ratio", "prefill ratio",
            "peak used", "decode J/token"]]
    for r in rows:
        out.append([str(r["candidate"]), _mib(r["model_bytes"]), _n(r["kld.mean"]), _n(r["kld.p99"]),
                    _pct(r["kld.same_top_p"]), _n(r["speed.decode_ratio"], 3), _n(r["speed.prefill_ratio"], 3),
                    _gib(r["memory.peak_used_bytes"]), _n(r["energy.decode_j_per_token"], 3)])
    return out


def _markdown(table: list[list[str]]) -> list[str]:
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    return ["| " + " | ".join(esc(c) for c in table[0]) + " |", "|" + "---|" * len(table[0])] + \
        ["| " + " | ".join(esc(c) for c in r) + " |" for r in table[1:]]


def _text(table: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]


def _speed_ab_lines(cmp: CompareDoc) -> list[str]:
    ab = cmp.section("speed_ab")
    if not isinstance(ab, dict):
        return []
    from moebench.speed.ab_compare import format_rounds
    return ["speed-ab (A,B,B,A order kept):"] + format_rounds(ab).splitlines()


def _load_lines(cmp: CompareDoc) -> list[str]:
    sp = cmp.section("speed")
    load = sp.get("load") if isinstance(sp, dict) else None
    if not isinstance(load, dict) or not load.get("rows"):
        return []
    from moebench.speed.load_compare import format_load
    return format_load(load)


def summary_markdown(cmps: list[CompareDoc], rows: list[Row]) -> str:
    """summary.md of a compare: headline table over the candidates, then each candidate's task table."""
    base = cmps[0].baseline.label if cmps else None
    lines = [f"## moebench compare: {len(cmps)} candidate{'s' if len(cmps) != 1 else ''} against `{base}`", ""]
    for cmp, row in zip(cmps, rows):       # different experiments: said before any figure
        prefix = f"{row['candidate']}: " if len(cmps) > 1 else ""
        lines += [f"> **Not like for like:** {prefix}{d}" for d in cmp.extra.get("setup_differences") or []]
    if lines[-1] != "":
        lines.append("")
    lines += _markdown(headline_table(rows)) + [""]
    for cmp, row in zip(cmps, rows):
        lines += [f"### {row['candidate']}", ""]
        if cmp.tasks:
            lines += _markdown(task_table(cmp)) + [""]
        sub = _per_subject_lines(cmp, markdown=True)
        if sub:
            lines += sub + [""]
        ab = _speed_ab_lines(cmp)
        if ab:
            lines += [f"- {x}" for x in ab] + [""]
        load = _load_lines(cmp)
        if load:
            lines += [load[0], ""] + [f"- {x.strip()}" for x in load[1:]] + [""]
        for w in cmp.warnings:
            lines.append(f"- warning: {w}")
    return "\n".join(lines).rstrip() + "\n"


def _per_subject_lines(cmp: CompareDoc, markdown: bool) -> list[str]:
    """The CMMLU subjects with flips, worst net change first (all subjects are in compare.json)."""
    out: list[str] = []
    for name, t in cmp.tasks.items():
        subjects = t.get("per_subject") if isinstance(t, dict) else None
        if not isinstance(subjects, dict):
            continue
        figures = {s: TaskFigures.of(TaskEntry.from_json(v)) for s, v in subjects.items() if isinstance(v, dict)}
        flipped = [(s, f) for s, f in figures.items() if f.wins or f.losses]
        flipped.sort(key=lambda sf: ((sf[1].wins or 0) - (sf[1].losses or 0), sf[0]))
        if not flipped:
            continue
        table = [[f"{name} subject", "n", "baseline", "candidate", "wins", "losses"]]
        for s, f in flipped[:10]:
            table.append([s, str(f.n_paired), _pct(f.baseline_accuracy), _pct(f.candidate_accuracy),
                          str(f.wins), str(f.losses)])
        out += (_markdown(table) if markdown else _text(table))
        if len(flipped) > 10:
            out.append(f"({len(flipped) - 10} more subjects with flips in compare.json)")
    return out


def text_table(cmps: list[CompareDoc], rows: list[Row]) -> str:
    """What `moebench compare` prints by default."""
    lines: list[str] = []
    for cmp, row in zip(cmps, rows):       # different experiments: said before any figure
        prefix = f"{row['candidate']}: " if len(cmps) > 1 else ""
        lines += [f"NOT LIKE FOR LIKE: {prefix}{d}" for d in cmp.extra.get("setup_differences") or []]
    for cmp, row in zip(cmps, rows):
        if len(cmps) > 1:
            lines.append(f"== {row['candidate']}")
        if cmp.tasks:
            lines += _text(task_table(cmp))
        raw_kld = cmp.section("kld")
        lines += sampled_kld_lines(raw_kld)
        if isinstance(raw_kld, dict):
            k = KldFigures.from_json(raw_kld)
            if k.method != "sampled":
                lines.append(f"kld: n_tokens={k.n_tokens} mean={_n(k.mean, 6)} median={_n(k.median, 6)} "
                             f"p99={_n(k.p99, 6)} max={_n(k.max, 6)} same_top_p={_n(k.same_top_p, 6)} "
                             f"ppl_ratio={_n(k.ppl_ratio, 6)}")
        sp = cmp.section("speed")
        if isinstance(sp, dict) and sp.get("rows"):
            lines.append(f"speed (candidate/baseline, geomean over groups): decode {_n(row['speed.decode_ratio'], 4)}, "
                         f"prefill {_n(row['speed.prefill_ratio'], 4)}, ttft {_n(row['speed.ttft_ratio'], 4)}")
        lines += _speed_ab_lines(cmp)
        lines += _load_lines(cmp)
        for w in cmp.warnings:
            lines.append(f"warning: {w}")
    if len(cmps) > 1:
        lines += ["", *(_text(headline_table(rows)))]
    return "\n".join(lines)


def sampled_kld_lines(kld: JsonValue) -> list[str]:
    """The sampled KLD (method = "sampled") as one terminal line: estimate, interval, counts."""
    if not isinstance(kld, dict):
        return []
    s = kld if kld.get("method") == "sampled" else kld.get("sampled")
    if not isinstance(s, dict) or not s.get("n_tokens"):
        return []
    lo, hi = (s.get("interval") or [None, None])[:2]
    return [f"kld (sampled, {s.get('estimator')}): mean={_n(s.get('mean'), 6)} "
            f"{round(100 * (s.get('confidence') or 0))}% interval=[{_n(lo, 6)}, {_n(hi, 6)}] "
            f"n_tokens={s.get('n_tokens')} sequences={s.get('n_sequences')}"]
