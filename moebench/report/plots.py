"""Small inline-SVG plots for the HTML report (no matplotlib, no network, no JavaScript).

Each function returns one `<svg>` element as a string. Every label that comes from data is escaped
here, so the report template may mark the result safe. Plots stay readable without colour alone:
values also appear in `<title>` tooltips and in the tables beside them.
"""
from __future__ import annotations

import math
from html import escape
from typing import Sequence

BASELINE = "#7f7f7f"
CANDIDATE = "#1f6fb4"
SERIES_COLOURS = (BASELINE, CANDIDATE, "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")
# One light, distinct fill per phase (bands sit behind the lines); phases not named here take the
# spares in order of appearance, so no two phases of one chart share a colour.
PHASE_COLOURS = {"load": "#fde2b3", "warmup": "#f6c6de", "baseline_idle": "#d9d9d9", "prefill": "#cfe3f7",
                 "decode": "#d4f0d0", "idle": "#f0f0f0", "baseline_idle_end": "#c9c9e8"}
SPARE_PHASE_COLOURS = ("#e8d8f5", "#fbe3c9", "#d6f0ee", "#f3f0c1", "#f8d3d3", "#dfe8c8")

# The one style every chart shares: sizes in px (the report's CSS sets the font family and colours
# of the "tick" and "label" text classes). Text width is estimated from CHAR_W to keep labels inside.
WIDTH = 640
MARGIN_L, MARGIN_R, MARGIN_T, MARGIN_B = 64, 28, 16, 40
TICK_FONT_PX, LABEL_FONT_PX = 10, 11
CHAR_W = 6.2                 # average width of a tick character at TICK_FONT_PX


def text_width(text: str) -> float:
    return CHAR_W * len(text)


def _num(v: float) -> str:
    return f"{v:.2f}".rstrip("0").rstrip(".") if math.isfinite(v) else "0"


def fmt_tick(v: float) -> str:
    """Compact tick text: 0.05, 1.5k, 2M, 3e-05."""
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e6:
        return f"{v / 1e6:g}M"
    if a >= 1e4:
        return f"{v / 1e3:g}k"
    if a < 1e-3:
        return f"{v:.0e}"
    return f"{v:.4g}"


def fmt_percent_tick(v: float) -> str:
    """A share on a 0-1 axis as the tables write it: 0.25 -> 25%."""
    return f"{100 * v:.4g}%"


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About `n` round tick values from at or below `lo` to at or above `hi`."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0]
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))
    first = math.floor(lo / step + 1e-9)
    last = math.ceil(hi / step - 1e-9)
    return [round(k * step, 12) for k in range(first, last + 1)]


def fmt_tokens(v: float) -> str:
    """Token counts as people write context sizes: 512, 4k, 128k (k = 1024 where it divides)."""
    if isinstance(v, (int, float)) and v >= 1024 and float(v).is_integer() and int(v) % 1024 == 0:
        return f"{int(v) // 1024}k"
    return fmt_tick(v)


def _finite(values: Sequence[float | None]) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


class _Frame:
    """Maps data coordinates to pixels inside the plot margins."""

    def __init__(self, x0, x1, y0, y1, height, log_x=False, width=WIDTH, margin_l=MARGIN_L):
        self.log_x = log_x
        self.width, self.height, self.margin_l = width, height, margin_l
        fx = (lambda v: math.log10(v)) if log_x else (lambda v: v)
        self.fx = fx
        self.x0, self.x1 = fx(x0), fx(x1)
        if self.x1 == self.x0:
            self.x1 = self.x0 + 1
        self.y0, self.y1 = y0, (y1 if y1 != y0 else y0 + 1)

    def px(self, x: float) -> float:
        inner = self.width - self.margin_l - MARGIN_R
        return self.margin_l + (self.fx(x) - self.x0) / (self.x1 - self.x0) * inner

    def py(self, y: float) -> float:
        inner = self.height - MARGIN_T - MARGIN_B
        return self.height - MARGIN_B - (y - self.y0) / (self.y1 - self.y0) * inner


def _open(height: int, label: str, width: int = WIDTH) -> list[str]:
    return [f'<svg class="plot" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
            f'width="{width}" height="{height}" role="img" aria-label="{escape(label)}">']


def _axes(f: _Frame, xticks, yticks, xlabel: str, ylabel: str, xfmt=fmt_tick, yfmt=fmt_tick) -> list[str]:
    out = []
    bottom, top = f.height - MARGIN_B, MARGIN_T
    for t in yticks:
        y = f.py(t)
        out.append(f'<line class="grid" x1="{f.margin_l}" x2="{f.width - MARGIN_R}" y1="{_num(y)}" y2="{_num(y)}"/>')
        out.append(f'<text class="tick" x="{f.margin_l - 4}" y="{_num(y + 4)}" text-anchor="end">{escape(yfmt(t))}</text>')
    for t in xticks:
        x = f.px(t)
        text = xfmt(t)
        half = text_width(text) / 2
        # a label at an edge is anchored there, so it is never cut by the chart's box
        anchor, tx = (("end", f.width - 2) if x + half > f.width - 2 else
                      ("start", 2) if x - half < 2 else ("middle", x))
        out.append(f'<line class="axis" x1="{_num(x)}" x2="{_num(x)}" y1="{bottom}" y2="{bottom + 4}"/>')
        out.append(f'<text class="tick" x="{_num(tx)}" y="{bottom + 16}" text-anchor="{anchor}">{escape(text)}</text>')
    out.append(f'<line class="axis" x1="{f.margin_l}" x2="{f.width - MARGIN_R}" y1="{bottom}" y2="{bottom}"/>')
    out.append(f'<line class="axis" x1="{f.margin_l}" x2="{f.margin_l}" y1="{top}" y2="{bottom}"/>')
    if xlabel:
        out.append(f'<text class="label" x="{(f.margin_l + f.width - MARGIN_R) / 2}" y="{f.height - 6}" '
                   f'text-anchor="middle">{escape(xlabel)}</text>')
    if ylabel:
        cy = (top + bottom) / 2
        out.append(f'<text class="label" x="12" y="{_num(cy)}" text-anchor="middle" '
                   f'transform="rotate(-90 12 {_num(cy)})">{escape(ylabel)}</text>')
    return out


def _legend(names: Sequence[str], colours: Sequence[str], x: float, y: float = MARGIN_T + 4) -> list[str]:
    out = []
    for i, (name, colour) in enumerate(zip(names, colours)):
        yy = y + i * 14
        out.append(f'<rect x="{_num(x)}" y="{_num(yy)}" width="10" height="10" fill="{colour}"/>')
        out.append(f'<text class="tick" x="{_num(x + 14)}" y="{_num(yy + 9)}">{escape(str(name))}</text>')
    return out


LEGEND_H = 18


def _legend_layout(names: Sequence[str], x0: float = MARGIN_L, width: int = WIDTH) -> list[tuple[float, int]]:
    """(x, row) of each legend entry: entries run left to right and wrap before the chart's edge."""
    x, row, out = x0, 0, []
    for name in names:
        w = 14 + text_width(str(name)) + 16
        if x > x0 and x + w - 16 > width - 4:
            x, row = x0, row + 1
        out.append((x, row))
        x += w
    return out


def legend_height(names: Sequence[str], x0: float = MARGIN_L) -> int:
    rows = 1 + max((r for _, r in _legend_layout(names, x0)), default=0)
    return LEGEND_H * rows


def _legend_row(names: Sequence[str], colours: Sequence[str], y: float, x: float = MARGIN_L) -> list[str]:
    """A legend under the plot, where it cannot cover data or phase bands; wrapped to the chart's width."""
    out = []
    for name, colour, (xx, row) in zip(names, colours, _legend_layout(names, x)):
        yy = y + row * LEGEND_H
        out.append(f'<rect x="{_num(xx)}" y="{_num(yy)}" width="10" height="10" fill="{colour}" stroke="#999" stroke-width="0.5"/>')
        out.append(f'<text class="tick" x="{_num(xx + 14)}" y="{_num(yy + 9)}">{escape(str(name))}</text>')
    return out


def empty_plot(message: str, height: int = 60) -> str:
    out = _open(height, message)
    out.append(f'<text class="label" x="{WIDTH / 2}" y="{height / 2}" text-anchor="middle">{escape(message)}</text>')
    out.append("</svg>")
    return "".join(out)


def interval_plot(rows: Sequence[dict], x_min: float = 0.0, x_max: float = 1.0, xlabel: str = "accuracy (%)",
                  xfmt=fmt_percent_tick) -> str:
    """One dot with a horizontal interval per row: rows carry label, value, lo, hi, optional colour."""
    rows = [r for r in rows if isinstance(r.get("value"), (int, float))]
    if not rows:
        return empty_plot("no values")
    label_w = 170
    height = MARGIN_T + MARGIN_B + 18 * len(rows)
    f = _Frame(x_min, x_max, 0, len(rows), height, width=WIDTH, margin_l=label_w)
    out = _open(height, "accuracy with 95% confidence intervals")
    out += _axes(f, nice_ticks(x_min, x_max), [], xlabel, "", xfmt=xfmt)
    for i, r in enumerate(rows):
        y = MARGIN_T + 9 + 18 * i
        colour = r.get("colour", CANDIDATE)
        lo = r.get("lo", r["value"]) if isinstance(r.get("lo"), (int, float)) else r["value"]
        hi = r.get("hi", r["value"]) if isinstance(r.get("hi"), (int, float)) else r["value"]
        tip = f'{r.get("label", "")}: {xfmt(r["value"])} [{xfmt(lo)}, {xfmt(hi)}]'
        out.append(f'<g><title>{escape(tip)}</title>')
        out.append(f'<text class="label" x="{label_w - 6}" y="{y + 4}" text-anchor="end">{escape(str(r.get("label", "")))}</text>')
        out.append(f'<line x1="{_num(f.px(lo))}" x2="{_num(f.px(hi))}" y1="{y}" y2="{y}" stroke="{colour}" stroke-width="2"/>')
        for end in (lo, hi):
            out.append(f'<line x1="{_num(f.px(end))}" x2="{_num(f.px(end))}" y1="{y - 4}" y2="{y + 4}" stroke="{colour}" stroke-width="1.5"/>')
        out.append(f'<circle cx="{_num(f.px(r["value"]))}" cy="{y}" r="4" fill="{colour}"/></g>')
    out.append("</svg>")
    return "".join(out)


def histogram(edges: Sequence[float], counts: Sequence[float], xlabel: str, log_y: bool = True,
              height: int = 220) -> str:
    """Bars over bins given by `edges` (len(counts) + 1); equal-width bars so log-spaced bins read well."""
    counts = [float(c) if isinstance(c, (int, float)) else 0.0 for c in counts]
    if not counts or len(edges) != len(counts) + 1:
        return empty_plot("histogram: edges and counts do not match")
    scale = (lambda c: math.log10(1 + c)) if log_y else (lambda c: c)
    top = max(scale(c) for c in counts) or 1.0
    f = _Frame(0, len(counts), 0, top, height)
    out = _open(height, f"histogram of {xlabel}")
    if log_y:
        yticks = [0.0] + [scale(10 ** k) for k in range(1, int(math.ceil(top)) + 1) if scale(10 ** k) <= top * 1.05]
        yfmt = lambda v: fmt_tick(round(10 ** v - 1))  # noqa: E731
    else:
        yticks, yfmt = nice_ticks(0, top), fmt_tick
    step = max(1, len(counts) // 8)
    xt = list(range(0, len(counts) + 1, step))
    out += _axes(f, xt, yticks, xlabel, "count" + (" (log)" if log_y else ""),
                 xfmt=lambda i: fmt_tick(float(edges[int(i)])), yfmt=yfmt)
    bw = f.px(1) - f.px(0)
    for i, c in enumerate(counts):
        y = f.py(scale(c))
        tip = f"[{edges[i]:.4g}, {edges[i + 1]:.4g}): {int(c)}"
        out.append(f'<rect x="{_num(f.px(i) + 0.5)}" y="{_num(y)}" width="{_num(max(bw - 1, 0.5))}" '
                   f'height="{_num(f.py(0) - y)}" fill="{CANDIDATE}"><title>{escape(tip)}</title></rect>')
    out.append("</svg>")
    return "".join(out)


def line_plot(series: Sequence[tuple[str, Sequence[float], Sequence[float]]], xlabel: str, ylabel: str,
              log_x: bool = False, height: int = 220, y_zero: bool = True,
              colours: Sequence[str] | None = None, xfmt=fmt_tick, yfmt=fmt_tick,
              x_range: tuple[float, float] | None = None, y_range: tuple[float, float] | None = None,
              xticks: Sequence[float] | None = None) -> str:
    """Lines with markers; `series` is (name, xs, ys); points with a missing value are skipped.

    x_range/y_range fix an axis (the trend page puts every run at the same x on every chart; a share
    stays within 0-1); xticks fixes the tick positions. A single x value sits in the middle of its axis.
    Default colours: baseline grey and candidate blue for two series, blue for one.
    """
    pts_all = []
    clean = []
    for name, xs, ys in series:
        pts = [(float(x), float(y)) for x, y in zip(xs, ys)
               if isinstance(x, (int, float)) and isinstance(y, (int, float))
               and math.isfinite(x) and math.isfinite(y) and (x > 0 or not log_x)]
        clean.append((name, pts))
        pts_all += pts
    if not pts_all:
        return empty_plot(f"{ylabel}: no values")
    xs = [p[0] for p in pts_all]
    ys = [p[1] for p in pts_all]
    if y_range is not None:
        yt = nice_ticks(*y_range)
        yt = [t for t in yt if y_range[0] - 1e-12 <= t <= y_range[1] + 1e-12]
        y_lo, y_hi = y_range
    else:
        y_lo = min(0.0, min(ys)) if y_zero else min(ys)
        y_hi = max(ys)
        if y_hi == y_lo:                          # a flat line: a band around it, not 0 to 2x
            pad = abs(y_hi) * 0.1 or 1.0
            y_lo, y_hi = (y_lo if y_zero else y_lo - pad), y_hi + pad
        yt = nice_ticks(y_lo, y_hi)
    x_lo, x_hi = x_range if x_range is not None else (min(xs), max(xs))
    if x_range is None and x_lo == x_hi:          # one x: in the middle, not at the left edge
        x_lo, x_hi = (x_lo / 2, x_hi * 2) if log_x else (x_lo - 1, x_hi + 1)
    f = _Frame(x_lo, x_hi, min(yt[0], y_lo), max(yt[-1], y_hi), height, log_x=log_x)
    if xticks is not None:
        xt = list(xticks)
    elif log_x:
        xt = sorted(set(xs)) if len(set(xs)) <= 10 else [10 ** k for k in range(
            int(math.floor(math.log10(min(xs)))), int(math.ceil(math.log10(max(xs)))) + 1)]
    else:
        xt = nice_ticks(min(xs), max(xs)) if len(set(xs)) > 1 else sorted(set(xs))
        if all(x.is_integer() for x in xs):      # layers, chunks: no fractional ticks
            xt = [t for t in xt if float(t).is_integer() and min(xs) <= t <= max(xs)] or sorted(set(xs))
    if colours is None:
        colours = (CANDIDATE,) if len(clean) == 1 else SERIES_COLOURS
    legend = len(clean) > 1
    names = [n for n, _ in clean]
    out = _open(height + (legend_height(names) if legend else 0), ylabel)
    out += _axes(f, xt, yt, xlabel, ylabel, xfmt=xfmt, yfmt=yfmt)
    for (name, pts), colour in zip(clean, colours):
        if not pts:
            continue
        path = " ".join(f"{_num(f.px(x))},{_num(f.py(y))}" for x, y in pts)
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{path}"/>')
        for x, y in pts:
            out.append(f'<circle cx="{_num(f.px(x))}" cy="{_num(f.py(y))}" r="2.5" fill="{colour}">'
                       f'<title>{escape(f"{name}: {xfmt(x)}, {yfmt(y)}")}</title></circle>')
    if legend:
        out += _legend_row([n for n, _ in clean], colours, height + 2)
    out.append("</svg>")
    return "".join(out)


def bar_plot(labels: Sequence[str], values: Sequence[float | None], ylabel: str,
             y_max: float | None = None, height: int = 200, colour: str = CANDIDATE, xlabel: str = "",
             yfmt=fmt_tick) -> str:
    """Vertical bars, one per label (e.g. router agreement per layer)."""
    vals = [float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None for v in values]
    ok = _finite(vals)
    if not ok:
        return empty_plot(f"{ylabel}: no values")
    top = y_max if y_max is not None else max(max(ok), 1e-12)
    yt = [t for t in nice_ticks(0, top) if y_max is None or t <= y_max + 1e-12]
    f = _Frame(0, len(vals), 0, max(top, yt[-1]), height)   # the top tick inside the frame, not above it
    step = max(1, len(vals) // 16)
    xt = [i + 0.5 for i in range(0, len(vals), step)]
    out = _open(height, ylabel)
    out += _axes(f, xt, yt, xlabel, ylabel, xfmt=lambda i: str(labels[int(i)]), yfmt=yfmt)
    bw = f.px(1) - f.px(0)
    for i, v in enumerate(vals):
        if v is None:
            continue
        y = f.py(v)
        out.append(f'<rect x="{_num(f.px(i) + bw * 0.1)}" y="{_num(y)}" width="{_num(bw * 0.8)}" '
                   f'height="{_num(f.py(0) - y)}" fill="{colour}"><title>{escape(f"{labels[i]}: {yfmt(v)}")}</title></rect>')
    out.append("</svg>")
    return "".join(out)


def _mix(t: float) -> str:
    """White -> dark blue for t in [0, 1]."""
    t = min(1.0, max(0.0, t))
    r = int(255 + (8 - 255) * t)
    g = int(255 + (48 - 255) * t)
    b = int(255 + (107 - 255) * t)
    return f"#{r:02x}{g:02x}{b:02x}"


def heatmap(matrix: Sequence[Sequence[float | None]], row_labels: Sequence[str], col_labels: Sequence[str],
            row_title: str, col_title: str, value_name: str = "value") -> str:
    """Numeric heatmap (rows x columns), colour scaled to the matrix maximum; tooltips carry values."""
    rows = len(matrix)
    cols = max((len(r) for r in matrix), default=0)
    vals = _finite([v for r in matrix for v in r])
    if not rows or not cols or not vals:
        return empty_plot(f"{value_name}: no values")
    top = max(vals) or 1.0
    label_w = 70
    cell_w = max(4.0, min(40.0, (WIDTH - label_w - MARGIN_R) / cols))
    cell_h = max(6.0, min(24.0, 320 / rows))
    width = int(label_w + cell_w * cols + MARGIN_R)
    height = int(MARGIN_T + cell_h * rows + MARGIN_B)
    out = _open(height, f"{value_name} by {row_title} and {col_title}", width=width)
    col_step = max(1, cols // 16)
    row_step = max(1, rows // 16)
    for j in range(0, cols, col_step):
        x = label_w + cell_w * (j + 0.5)
        out.append(f'<text class="tick" x="{_num(x)}" y="{_num(MARGIN_T + cell_h * rows + 14)}" '
                   f'text-anchor="middle">{escape(str(col_labels[j]) if j < len(col_labels) else str(j))}</text>')
    for i in range(0, rows, row_step):
        y = MARGIN_T + cell_h * (i + 0.5) + 4
        out.append(f'<text class="tick" x="{label_w - 4}" y="{_num(y)}" text-anchor="end">'
                   f'{escape(str(row_labels[i]) if i < len(row_labels) else str(i))}</text>')
    for i, row in enumerate(matrix):
        for j, v in enumerate(row):
            ok = isinstance(v, (int, float)) and math.isfinite(v)
            fill = _mix(v / top) if ok else "#f8d7da"
            rl = row_labels[i] if i < len(row_labels) else i
            cl = col_labels[j] if j < len(col_labels) else j
            tip = f"{row_title} {rl}, {col_title} {cl}: " + (f"{v:.4g}" if ok else "missing")
            out.append(f'<rect x="{_num(label_w + cell_w * j)}" y="{_num(MARGIN_T + cell_h * i)}" '
                       f'width="{_num(cell_w)}" height="{_num(cell_h)}" fill="{fill}" stroke="#fff" '
                       f'stroke-width="0.5"><title>{escape(tip)}</title></rect>')
    out.append(f'<text class="label" x="{_num(label_w + cell_w * cols / 2)}" y="{height - 6}" '
               f'text-anchor="middle">{escape(col_title)} (max {escape(fmt_tick(top))})</text>')
    out.append(f'<text class="label" x="12" y="{_num(MARGIN_T + cell_h * rows / 2)}" text-anchor="middle" '
               f'transform="rotate(-90 12 {_num(MARGIN_T + cell_h * rows / 2)})">{escape(row_title)}</text>')
    out.append("</svg>")
    return "".join(out)


def category_grid(cells: dict[tuple, str], row_keys: Sequence, col_keys: Sequence, palette: dict[str, str],
                  row_title: str, col_title: str, tips: dict[tuple, str] | None = None) -> str:
    """A grid of categorical cells (e.g. needle found/lost per depth x length) with a legend."""
    if not row_keys or not col_keys:
        return empty_plot("no cells")
    label_w = 70
    cell_w = max(12.0, min(64.0, (WIDTH - label_w - MARGIN_R - 130) / len(col_keys)))
    cell_h = max(10.0, min(26.0, 300 / len(row_keys)))
    width = int(label_w + cell_w * len(col_keys) + MARGIN_R + 140)
    height = int(MARGIN_T + cell_h * len(row_keys) + MARGIN_B)
    out = _open(height, f"{row_title} by {col_title}", width=width)
    for j, c in enumerate(col_keys):
        out.append(f'<text class="tick" x="{_num(label_w + cell_w * (j + 0.5))}" '
                   f'y="{_num(MARGIN_T + cell_h * len(row_keys) + 14)}" text-anchor="middle">{escape(fmt_tokens(c) if isinstance(c, (int, float)) else str(c))}</text>')
    for i, r in enumerate(row_keys):
        out.append(f'<text class="tick" x="{label_w - 4}" y="{_num(MARGIN_T + cell_h * (i + 0.5) + 4)}" '
                   f'text-anchor="end">{escape(str(r))}</text>')
        for j, c in enumerate(col_keys):
            cat = cells.get((r, c))
            fill = palette.get(cat, "#ffffff") if cat else "#ffffff"
            tip = (tips or {}).get((r, c), f"{row_title} {r}, {col_title} {c}: {cat or 'not run'}")
            out.append(f'<rect x="{_num(label_w + cell_w * j)}" y="{_num(MARGIN_T + cell_h * i)}" '
                       f'width="{_num(cell_w)}" height="{_num(cell_h)}" fill="{fill}" stroke="#999" '
                       f'stroke-width="0.5"><title>{escape(tip)}</title></rect>')
    out += _legend(list(palette), list(palette.values()), label_w + cell_w * len(col_keys) + 12)
    out.append(f'<text class="label" x="{_num(label_w + cell_w * len(col_keys) / 2)}" y="{height - 6}" '
               f'text-anchor="middle">{escape(col_title)}</text>')
    out.append(f'<text class="label" x="12" y="{_num(MARGIN_T + cell_h * len(row_keys) / 2)}" text-anchor="middle" '
               f'transform="rotate(-90 12 {_num(MARGIN_T + cell_h * len(row_keys) / 2)})">{escape(row_title)}</text>')
    out.append("</svg>")
    return "".join(out)


def timeline(series: Sequence[tuple[str, Sequence[float], Sequence[float]]],
             bands: Sequence[tuple[float, float, str]], xlabel: str, ylabel: str, height: int = 240,
             colours: Sequence[str] = SERIES_COLOURS) -> str:
    """Lines over time with shaded phase bands (start, end, phase) behind them; legend underneath."""
    pts = [(x, y) for _, xs, ys in series for x, y in zip(xs, ys)
           if isinstance(x, (int, float)) and isinstance(y, (int, float))]
    if not pts:
        return empty_plot(f"{ylabel}: no samples")
    x_lo = min([p[0] for p in pts] + [b[0] for b in bands])
    x_hi = max([p[0] for p in pts] + [b[1] for b in bands])
    y_hi = max(p[1] for p in pts)
    yt = nice_ticks(0, y_hi)
    f = _Frame(x_lo, x_hi, 0, max(yt[-1], y_hi), height)
    phase_names = list(dict.fromkeys(str(b[2]) for b in bands))
    spares = iter(SPARE_PHASE_COLOURS * (1 + len(phase_names) // len(SPARE_PHASE_COLOURS)))
    phase_colour = {ph: PHASE_COLOURS.get(ph) or next(spares) for ph in phase_names}
    series_names = [name for name, xs, ys in series]
    out = _open(height + legend_height(series_names + phase_names), ylabel)
    seen = {}
    for start, end, phase in bands:
        colour = phase_colour[str(phase)]
        seen[str(phase)] = colour
        out.append(f'<rect x="{_num(f.px(start))}" y="{MARGIN_T}" width="{_num(max(f.px(end) - f.px(start), 0.5))}" '
                   f'height="{height - MARGIN_T - MARGIN_B}" fill="{colour}">'
                   f'<title>{escape(f"{phase}: {start:.3g} to {end:.3g} s")}</title></rect>')
    out += _axes(f, nice_ticks(x_lo, x_hi), yt, xlabel, ylabel)
    names = []
    used_colours = []
    for (name, xs, ys), colour in zip(series, colours):
        p = [(x, y) for x, y in zip(xs, ys) if isinstance(x, (int, float)) and isinstance(y, (int, float))]
        if not p:
            continue
        names.append(name)
        used_colours.append(colour)
        path = " ".join(f"{_num(f.px(x))},{_num(f.py(y))}" for x, y in p)
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{path}"/>')
    out += _legend_row(names + list(seen), used_colours + list(seen.values()), height + 2)
    out.append("</svg>")
    return "".join(out)


def _point_title(p: dict, size_text: str) -> str:
    return f"{p['label']}: x={float(p['x']):.4g}, y={float(p['y']):.4g}{size_text}"


def scatter(points: Sequence[dict], xlabel: str, ylabel: str, size_label: str, height: int = 300,
            log_x: bool = False) -> str:
    """Labelled points: each dict has label, x, y and optionally size (drawn as the marker's area,
    scaled to the largest) and colour. Points with a missing x or y are listed under the plot instead."""
    ok = [p for p in points if isinstance(p.get("x"), (int, float)) and isinstance(p.get("y"), (int, float))
          and math.isfinite(p["x"]) and math.isfinite(p["y"]) and (p["x"] > 0 or not log_x)]
    if not ok:
        return empty_plot(f"{ylabel} vs {xlabel}: no candidate has both values")
    xs, ys = [float(p["x"]) for p in ok], [float(p["y"]) for p in ok]
    pad_x = (max(xs) - min(xs)) * 0.08 or abs(xs[0]) * 0.1 or 1.0
    x_lo, x_hi = (min(xs) / 1.3, max(xs) * 1.3) if log_x else (min(xs) - pad_x, max(xs) + pad_x)
    yt = nice_ticks(min(0.0, min(ys)), max(ys) * 1.1 if max(ys) > 0 else 1.0)
    # one point, or points close together: a tick at each point, not a crammed run of round values
    xt = (sorted(set(xs)) if log_x or len(set(xs)) == 1 else
          [t for t in nice_ticks(x_lo, x_hi, 4) if x_lo <= t <= x_hi] or sorted(set(xs)))
    f = _Frame(x_lo, x_hi, yt[0], yt[-1], height, log_x=log_x)
    sizes = [p.get("size") for p in ok]
    s_max = max((s for s in sizes if isinstance(s, (int, float)) and s > 0), default=None)
    missing = [p for p in points if p not in ok]
    out = _open(height + 16 * (1 + bool(missing)), f"{ylabel} vs {xlabel}")
    out += _axes(f, xt, yt, xlabel, ylabel, xfmt=lambda v: fmt_tick(v))
    for i, p in enumerate(ok):
        s = p.get("size")
        r = 4 + 10 * math.sqrt(s / s_max) if s_max and isinstance(s, (int, float)) and s > 0 else 4
        colour = p.get("colour") or SERIES_COLOURS[(i + 1) % len(SERIES_COLOURS)]
        cx, cy = f.px(float(p["x"])), f.py(float(p["y"]))
        size_text = f", {size_label} {s:.4g}" if isinstance(s, (int, float)) else f", {size_label} n/a"
        out.append(f'<circle cx="{_num(cx)}" cy="{_num(cy)}" r="{_num(r)}" fill="{colour}" fill-opacity="0.6" '
                   f'stroke="{colour}"><title>{escape(_point_title(p, size_text))}</title></circle>')
        if cx > WIDTH * 0.7:         # near the right edge: the label goes left of its marker
            out.append(f'<text class="tick" x="{_num(cx - r - 3)}" y="{_num(cy + 4)}" text-anchor="end">'
                       f'{escape(str(p["label"]))}</text>')
        else:
            out.append(f'<text class="tick" x="{_num(cx + r + 3)}" y="{_num(cy + 4)}">{escape(str(p["label"]))}</text>')
    out.append(f'<text class="tick" x="{MARGIN_L}" y="{height + 12}">marker area: {escape(size_label)}'
               f'{" (largest = " + fmt_tick(s_max) + ")" if s_max else " (no values: equal markers)"}</text>')
    if missing:
        out.append(f'<text class="tick" x="{MARGIN_L}" y="{height + 28}">not drawn (a value missing): '
                   f'{escape(", ".join(str(p["label"]) for p in missing))}</text>')
    out.append("</svg>")
    return "".join(out)
