"""The publishable forms of a compare: one flat row per candidate (matrix.csv / matrix.json), the
Markdown summary (summary.md) and the terminal table, all from compare.json objects only."""
from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from typing import Any

from moebench.store.records import Section
from moebench.store.sections import memory_value, number

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


def task_figures(t: Section) -> TaskFigures:
    """The per-task figures of a row from compare.json's tasks.<task> (or a per_subject entry, or
    "overall", which counts instead of listing): accuracies, delta with its interval, flips, McNemar."""
    n = number(t.get("n_paired"))
    b, c = number(t.get("baseline_accuracy")), number(t.get("candidate_accuracy"))
    if b is None and n:
        b = (number(t.get("baseline_correct")) or 0) / n
    if c is None and n:
        c = (number(t.get("candidate_correct")) or 0) / n
    ci = t.get("delta_ci95") if isinstance(t.get("delta_ci95"), list) else [None, None]
    count = lambda k, alt: len(t[k]) if isinstance(t.get(k), list) else t.get(alt)  # noqa: E731
    return TaskFigures(n_paired=int(n) if n is not None else None, baseline_accuracy=b, candidate_accuracy=c,
                       delta=(c - b) if b is not None and c is not None else None,
                       delta_ci_low=number(ci[0]) if ci else None,
                       delta_ci_high=number(ci[1]) if len(ci) > 1 else None,
                       wins=count("wins", "n_wins"), losses=count("losses", "n_losses"),
                       flip_rate=number(t.get("flip_rate")), mcnemar_p=number(t.get("mcnemar_p")),
                       excluded=count("excluded", "n_excluded"))


def matrix_row(cmp: dict[str, Any], compare_dir: str | None = None) -> Row:
    """One flat row for a candidate: identity, model bytes, per-task figures, KLD, speed, memory, energy."""
    cand = cmp.get("candidate") if isinstance(cmp.get("candidate"), dict) else {}
    model = cand.get("model") if isinstance(cand.get("model"), dict) else {}
    row: Row = {"candidate": cand.get("label"), "run": cand.get("run"), "run_id": cand.get("run_id"),
                           "runner": cand.get("runner"), "compare_dir": compare_dir,
                           "model_bytes": model.get("bytes")}
    for name, t in (cmp.get("tasks") or {}).items():
        if isinstance(t, dict):
            row.update({f"{name}.{k}": v for k, v in task_figures(t).to_json().items()})
    if isinstance(cmp.get("overall"), dict):
        row.update({f"overall.{k}": v for k, v in task_figures(cmp["overall"]).to_json().items()})
    kld = cmp.get("kld") if isinstance(cmp.get("kld"), dict) else {}
    row["kld.mean"], row["kld.p99"], row["kld.same_top_p"] = (number(kld.get(k)) for k in ("mean", "p99", "same_top_p"))
    speed = cmp.get("speed") if isinstance(cmp.get("speed"), dict) else {}
    geo = speed.get("geomean") if isinstance(speed.get("geomean"), dict) else {}
    for k in ("decode", "prefill", "ttft"):
        row[f"speed.{k}_ratio"] = number(geo.get(k))
    row["speed.decode_tok_s"] = _geomean([number(r.get("decode_candidate")) for r in speed.get("rows", [])
                                          if isinstance(r, dict)])
    ab = cmp.get("speed_ab") if isinstance(cmp.get("speed_ab"), dict) else {}
    row["speed_ab.rounds_won_b"] = (ab.get("rounds_won") or {}).get("B") if ab else None
    row["speed_ab.rounds"] = len(ab.get("rounds") or []) if ab else None
    row["speed_ab.decode_ratio"] = number(((ab.get("paired") or {}).get("decode_tok_s") or {}).get("median_ratio")) \
        if ab else None
    memory = cmp.get("memory")
    row["memory.peak_used_bytes"] = memory_value(memory, "peak_used_bytes", "candidate")
    row["memory.peak_used_ratio"] = number(memory.get("peak_used_ratio")) if isinstance(memory, dict) else None
    energy = cmp.get("energy") if isinstance(cmp.get("energy"), dict) else {}
    per_token = energy.get("per_token") if isinstance(energy.get("per_token"), dict) else {}
    for ph in ("decode", "prefill"):
        p = per_token.get(ph) if isinstance(per_token.get(ph), dict) else {}
        row[f"energy.{ph}_j_per_token"] = number(p.get("candidate_net_j_per_token"))
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


def task_table(cmp: dict[str, Any]) -> list[list[str]]:
    rows = [["task", "n", "baseline", "candidate", "delta", "delta 95% CI (pp)", "wins", "losses", "McNemar p"]]
    items = list((cmp.get("tasks") or {}).items())
    if isinstance(cmp.get("overall"), dict):
        items.append(("overall", cmp["overall"]))
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


def _speed_ab_lines(cmp: dict[str, Any]) -> list[str]:
    ab = cmp.get("speed_ab")
    if not isinstance(ab, dict):
        return []
    from moebench.speed.ab_compare import format_rounds
    return ["speed-ab (A,B,B,A order kept):"] + format_rounds(ab).splitlines()


def _load_lines(cmp: dict[str, Any]) -> list[str]:
    sp = cmp.get("speed")
    load = sp.get("load") if isinstance(sp, dict) else None
    if not isinstance(load, dict) or not load.get("rows"):
        return []
    from moebench.speed.load_compare import format_load
    return format_load(load)


def summary_markdown(cmps: list[dict[str, Any]], rows: list[Row]) -> str:
    """summary.md of a compare: headline table over the candidates, then each candidate's task table."""
    base = (cmps[0].get("baseline") or {}).get("label") if cmps else None
    lines = [f"## moebench compare: {len(cmps)} candidate{'s' if len(cmps) != 1 else ''} against `{base}`", ""]
    for cmp, row in zip(cmps, rows):       # different experiments: said before any figure
        prefix = f"{row['candidate']}: " if len(cmps) > 1 else ""
        lines += [f"> **Not like for like:** {prefix}{d}" for d in cmp.get("setup_differences") or []]
    if lines[-1] != "":
        lines.append("")
    lines += _markdown(headline_table(rows)) + [""]
    for cmp, row in zip(cmps, rows):
        lines += [f"### {row['candidate']}", ""]
        if cmp.get("tasks"):
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
        for w in cmp.get("warnings", []) or []:
            lines.append(f"- warning: {w}")
    return "\n".join(lines).rstrip() + "\n"


def _per_subject_lines(cmp: dict[str, Any], markdown: bool) -> list[str]:
    """The CMMLU subjects with flips, worst net change first (all subjects are in compare.json)."""
    out: list[str] = []
    for name, t in (cmp.get("tasks") or {}).items():
        subjects = t.get("per_subject") if isinstance(t, dict) else None
        if not isinstance(subjects, dict):
            continue
        flipped = [(s, v) for s, v in subjects.items() if v.get("wins") or v.get("losses")]
        flipped.sort(key=lambda sv: (len(sv[1]["wins"]) - len(sv[1]["losses"]), sv[0]))
        if not flipped:
            continue
        table = [[f"{name} subject", "n", "baseline", "candidate", "wins", "losses"]]
        for s, v in flipped[:10]:
            table.append([s, str(v["n_paired"]), _pct(v["baseline_accuracy"]), _pct(v["candidate_accuracy"]),
                          str(len(v["wins"])), str(len(v["losses"]))])
        out += (_markdown(table) if markdown else _text(table))
        if len(flipped) > 10:
            out.append(f"({len(flipped) - 10} more subjects with flips in compare.json)")
    return out


def text_table(cmps: list[dict[str, Any]], rows: list[Row]) -> str:
    """What `moebench compare` prints by default."""
    lines: list[str] = []
    for cmp, row in zip(cmps, rows):       # different experiments: said before any figure
        prefix = f"{row['candidate']}: " if len(cmps) > 1 else ""
        lines += [f"NOT LIKE FOR LIKE: {prefix}{d}" for d in cmp.get("setup_differences") or []]
    for cmp, row in zip(cmps, rows):
        if len(cmps) > 1:
            lines.append(f"== {row['candidate']}")
        if cmp.get("tasks"):
            lines += _text(task_table(cmp))
        k = cmp.get("kld")
        lines += sampled_kld_lines(k)
        if isinstance(k, dict) and k.get("method") != "sampled":
            lines.append(f"kld: n_tokens={k.get('n_tokens')} mean={_n(k.get('mean'), 6)} median={_n(k.get('median'), 6)} "
                         f"p99={_n(k.get('p99'), 6)} max={_n(k.get('max'), 6)} same_top_p={_n(k.get('same_top_p'), 6)} "
                         f"ppl_ratio={_n(k.get('ppl_ratio'), 6)}")
        sp = cmp.get("speed")
        if isinstance(sp, dict) and sp.get("rows"):
            lines.append(f"speed (candidate/baseline, geomean over groups): decode {_n(row['speed.decode_ratio'], 4)}, "
                         f"prefill {_n(row['speed.prefill_ratio'], 4)}, ttft {_n(row['speed.ttft_ratio'], 4)}")
        lines += _speed_ab_lines(cmp)
        lines += _load_lines(cmp)
        for w in cmp.get("warnings", []) or []:
            lines.append(f"warning: {w}")
    if len(cmps) > 1:
        lines += ["", *(_text(headline_table(rows)))]
    return "\n".join(lines)


def sampled_kld_lines(kld: Any) -> list[str]:
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
