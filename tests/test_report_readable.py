"""The report reads at a glance (issue 44), checked in its HTML and SVG: memory and energy as tables with
units and ratios (raw figures still in compare.json), a verdict that says which way each ratio is better
and whether a gate ran, charts with units, percent axes and labels inside their box, a trend page whose
runs sit at the same x on every chart, code shown with its whitespace, CJK fonts named, and filters that
need JavaScript hidden without it."""
from __future__ import annotations

import json
import re
from html import escape
import xml.etree.ElementTree as ET
from pathlib import Path

from moebench.compare.build import build_compare
from moebench.report import plots
from moebench.report.render import render
from test_rig_report import _layer, _run

SVG = "{http://www.w3.org/2000/svg}"


def _rig_compare(tmp_path: Path) -> tuple[Path, dict]:
    base = _run(tmp_path / "bf16", "bf16", [70.0, 60.0, 60.0], [400.0, 60.0, 60.0], [20, 1, 1], None, 1800.0)
    layers = [_layer(600, 150, 50), _layer(500, 100, 50, prefetch=150)]
    total = {k: sum(layer[k] for layer in layers) for k in layers[0]}
    cand = _run(tmp_path / "tiered", "tiered", [70.0, 60.0, 60.0], [300.0, 90.0, 60.0], [12, 4, 1],
                {"layers": layers, "total": total}, 1500.0)
    cmp = build_compare(base, cand)
    cdir = tmp_path / "cmp"
    cdir.mkdir()
    (cdir / "compare.json").write_text(json.dumps(cmp))
    return cdir, cmp


def _section(html: str, start: str, end: str) -> str:
    return html[html.index(start):html.index(end, html.index(start))]


def _rows(table_html: str) -> list[list[str]]:
    out = []
    for tr in re.findall(r"<tr[^>]*>(.*?)</tr>", table_html, re.S):
        cells = [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", tr, re.S)]
        out.append([" ".join(c.split()) for c in cells])
    return out


def test_memory_and_energy_are_tables_with_units_ratios_and_the_idle_note(tmp_path):
    cdir, cmp = _rig_compare(tmp_path)
    raw = (cdir / "compare.json").read_text()
    html = render(cdir).read_text()
    assert (cdir / "compare.json").read_text() == raw                  # the report changes no raw figure
    memory = _section(html, 'id="memory"', 'id="energy"')
    visible = memory.split('<details class="raw">')[0]
    rows = _rows(visible)
    assert rows[0] == ["GPU memory", "baseline GiB", "candidate GiB", "candidate / baseline"]
    assert ["peak used (lower is better)", "22.00", "17.00", "0.773"] in rows, rows
    assert "peak_used_bytes" not in visible and "gpus.sum" not in visible     # no flattened keys up front
    assert "gpus.sum.peak_used_bytes" in memory                               # ... but folded, all there
    energy = _section(html, 'id="energy"', 'id="gpus"')
    visible = energy.split('<details class="raw">')[0]
    rows = _rows(visible)
    assert rows[0] == ["energy per token", "baseline J/token", "candidate J/token", "candidate / baseline"]
    assert ["decode, net", "3.3", "2.6", "0.788"] in rows, rows
    assert "Idle baseline: 190 W (baseline run), 190 W (candidate run)" in " ".join(visible.split())
    assert "per_token" not in visible
    phases = _rows(_section(html, 'id="energy-phases"', 'id="engine"'))
    assert ["decode", "2080", "1800", "0.865", "1320", "1040"] in phases, phases
    assert ["decode", "4", "4", "520", "450"] in phases, phases


def test_memory_without_nvml_is_one_line_not_a_table(tmp_path):
    cdir = tmp_path / "cmp"
    cdir.mkdir()
    reason = "NVML unavailable: NVMLError_LibraryNotFound"
    (cdir / "compare.json").write_text(json.dumps({
        "baseline": {"run": "x"}, "candidate": {"run": "y"}, "tasks": {},
        "memory": {"available": False, "reason": {"baseline": reason, "candidate": reason}},
        "energy": {"available": False, "reason": {"baseline": reason, "candidate": reason}}}))
    html = render(cdir).read_text()
    memory = _section(html, 'id="memory"', 'id="energy"')
    assert "<table" not in memory and f"No figures: {reason} (both runs)." in memory
    assert f"No figures: {reason} (both runs)." in html[html.index('id="energy"'):]


def test_verdict_says_which_way_is_better_shows_the_overall_test_and_whether_a_gate_ran(tmp_path):
    cdir, cmp = _rig_compare(tmp_path)
    html = render(cdir).read_text()
    verdict = _section(html, 'id="verdict"', "</table>\n<p")
    text = " ".join(re.sub(r"<[^>]+>", " ", verdict).split())
    assert f"No gate ran on this compare (moebench gate {cdir} --rules GATES.toml" in text
    rows = _rows(_section(html, 'class="verdict verdict-figures"', "</table>"))
    assert rows[0] == ["figure", "baseline", "candidate", "candidate / baseline", "which way"]
    by = {r[0]: r for r in rows[1:]}
    assert by["decode speed (tok/s, geomean ratio)"][3:] == ["0.833", "▼ 16.7% slower (worse)"], by
    assert by["peak GPU memory used (GiB)"][1:] == ["22.00", "17.00", "0.773", "▼ 22.7% less (better)"], by
    assert by["decode energy (J/token, net of idle)"][4] == "▼ 21.2% less (better)"
    (cdir / "gate.json").write_text(json.dumps({"verdict": "pass", "exit_code": 0, "rules_file": "r.toml",
                                                "checks": [{"section": "memory", "rule": "max_peak_used_gib",
                                                            "value": 17, "limit": 20, "verdict": "pass",
                                                            "message": "ok"}]}))
    html = render(cdir).read_text()
    assert "No gate ran" not in html and "Gate: PASS" in html


def test_verdict_task_table_has_the_overall_mcnemar_row(tmp_path):
    from test_report import gsm8k_items, write_run
    items = gsm8k_items(12)
    write_run(tmp_path / "base", "base", set(), set(), items)
    write_run(tmp_path / "cand", "cand", {1, 2, 3, 4, 5}, set(), items)
    cdir = tmp_path / "cmp"
    cdir.mkdir()
    cmp = build_compare(tmp_path / "base", tmp_path / "cand")
    (cdir / "compare.json").write_text(json.dumps(cmp, default=str))
    html = render(cdir).read_text()
    rows = _rows(_section(html, '<table class="verdict">', "</table>"))
    overall = [r for r in rows if r[0] == "overall (all tasks)"]
    assert len(overall) == 1 and overall[0][-1] == "0.062", rows      # 5 losses, 0 wins: 2 * 0.5^5


def _texts(svg: str, cls: str) -> list[ET.Element]:
    return [t for t in ET.fromstring(svg).iter(f"{SVG}text") if t.get("class") == cls]


def test_charts_use_units_percent_axes_and_keep_the_top_tick_in_the_frame():
    acc = plots.interval_plot([{"label": "gsm8k · baseline", "value": 0.5, "lo": 0.2, "hi": 0.8}])
    assert [t.text for t in _texts(acc, "tick")] == ["0%", "20%", "40%", "60%", "80%", "100%"]
    assert "accuracy (%)" in [t.text for t in _texts(acc, "label")]
    bars = plots.bar_plot(["0", "1"], [140_000, 100_000], "expert picks", xlabel="MoE layer")
    ys = [float(t.get("y")) for t in _texts(bars, "tick") if t.get("text-anchor") == "end"]
    assert min(ys) - plots.TICK_FONT_PX >= 0, ys                 # the top tick ("150k") inside the svg
    share = plots.bar_plot(["0", "1"], [0.9, 0.8], "top-k experts shared (%)", y_max=1.0,
                           yfmt=plots.fmt_percent_tick)
    assert [t.text for t in _texts(share, "tick") if t.get("text-anchor") == "end"][-1] == "100%"
    # a last x label at the right edge is anchored at the edge, not cut
    line = plots.line_plot([("c", [512, 300_000], [1.0, 2.0])], "prompt tokens", "tok/s", log_x=True,
                           xfmt=lambda v: f"{v:g} tokens")
    last = [t for t in _texts(line, "tick") if t.text == "300000 tokens"][0]
    assert last.get("text-anchor") == "end" and float(last.get("x")) <= plots.WIDTH


def test_one_point_sits_in_the_middle_and_phases_get_their_own_colours():
    one = plots.line_plot([("b", [128], [10.0]), ("c", [128], [12.0])], "prompt tokens", "tok/s", log_x=True)
    cx = {float(c.get("cx")) for c in ET.fromstring(one).iter(f"{SVG}circle")}
    mid = (plots.MARGIN_L + plots.WIDTH - plots.MARGIN_R) / 2
    assert len(cx) == 1 and abs(cx.pop() - mid) < 1
    phases = ["load", "warmup", "baseline_idle", "prefill", "decode", "speed", "needle", "idle"]
    bands = [(i, i + 1, ph) for i, ph in enumerate(phases)]
    svg = plots.timeline([("used GiB", [0, 8], [1, 2])], bands, "seconds", "GPU memory used (GiB)")
    rects = [r for r in ET.fromstring(svg).iter(f"{SVG}rect") if r.find(f"{SVG}title") is not None]
    fills = {r.find(f"{SVG}title").text.split(":")[0]: r.get("fill") for r in rects}
    assert len(set(fills.values())) == len(phases), fills
    legend = [t.text for t in _texts(svg, "tick")]
    assert all(ph in legend for ph in phases)                          # wrapped, not cut off


def test_kld_axes_name_units_not_internal_keys(tmp_path):
    cdir = tmp_path / "cmp"
    cdir.mkdir()
    (cdir / "compare.json").write_text(json.dumps({
        "baseline": {"run": "x"}, "candidate": {"run": "y"}, "tasks": {},
        "kld": {"mean": 0.03, "histogram": {"edges": [0.0, 0.01, 0.1, 1.0], "counts": [5, 3, 1]},
                "per_chunk": [0.02, 0.04], "per_layer": {"router_agreement": [1.0, 0.9],
                                                         "identical_set_share": [1.0, 0.8], "kld": [0.01, 0.02]}}}))
    html = render(cdir).read_text()
    kld = html[html.index('id="kld"'):]
    assert "KLD (nats)" in kld and "mean KLD (nats)" in kld
    assert "router_agreement" not in kld and "identical_set_share" not in kld
    assert "top-k experts shared (%)" in kld and "tokens, same expert set (%)" in kld


def test_trend_puts_each_run_at_one_x_and_shares_within_100_percent(tmp_path):
    from moebench.report.trend import write_trend
    runs = []
    for i, (acc_right, kld) in enumerate(((4, None), (4, 0.02), (3, 0.05))):
        d = tmp_path / f"run{i}"
        d.mkdir()
        summary = {"kld": {"kld": {"mean": kld, "same_top_p": 1.0}}} if kld is not None else {}
        (d / "manifest.json").write_text(json.dumps({"label": f"a-rather-long-run-label-{i}", "status": "complete",
                                                     "started_at": f"2026-01-0{i + 1}T00:00:00", "summary": summary}))
        (d / "items.jsonl").write_text("".join(json.dumps({"task": "gsm8k", "item_id": f"g/{k}", "status": "ok",
                                                           "correct": k < acc_right}) + "\n" for k in range(4)))
        runs.append(d)
    out = write_trend(runs, tmp_path / "trend")
    html = (out / "trend.html").read_text()
    svgs = re.findall(r"<svg class=\"plot\".*?</svg>", html, re.S)
    assert len(svgs) == 3
    shares = 0
    positions = []
    for svg in svgs:
        root = ET.fromstring(svg)
        xs = [t for t in root.iter(f"{SVG}text") if t.get("class") == "tick" and t.get("text-anchor") in
              ("middle", "start", "end") and t.text and t.text.startswith("a-")]
        positions.append([round(float(t.get("x")), 1) for t in xs])
        label = root.get("aria-label")
        if label.endswith("accuracy") or label.endswith("same top p"):
            yticks = [t.text for t in root.iter(f"{SVG}text") if t.get("class") == "tick" and t.text.endswith("%")]
            assert yticks[-1] == "100%" and all(float(v[:-1]) <= 100 for v in yticks), yticks
            shares += 1
    assert shares == 2                                                   # gsm8k accuracy, kld KLD same top p
    assert positions[0] == positions[1] == positions[2] and len(positions[0]) == 3, positions


def test_code_keeps_its_whitespace_cjk_fonts_are_named_and_filters_need_javascript(tmp_path):
    from test_report import write_run
    run = tmp_path / "run"
    code = "    for op in operations:\n        balance += op\n        if balance < 0:\n            return True"
    write_run(run, "r", set(), set(), [{"question": "def f(x):\n    return x", "reference": "1"}])
    records = [json.loads(line) for line in (run / "items.jsonl").read_text().splitlines()]
    for r in records:
        r.update(task="humaneval", reference=code)
    (run / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    html = render(run).read_text()
    assert f'<pre class="code">{escape(code)}</pre>' in html
    assert '<pre class="code">def f(x):\n    return x</pre>' in html
    css = html[html.index("<style>"):html.index("</style>")]
    for font in ("Noto Sans CJK SC", "PingFang SC", "Microsoft YaHei", "WenQuanYi Micro Hei"):
        assert f'"{font}"' in css
    assert ".filters { display: none; }" in css and "html.js .filters { display: block; }" in css
    assert 'class="active"' not in html and "data-default" in html
    assert "<tr hidden" not in html and " hidden>" not in html                # rows all show without JS
