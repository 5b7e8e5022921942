"""The reports in a real browser (issue 44): headless Chromium from the distribution's packages opens the
demo's compare report, the trend page over its two runs, a several-candidates report over them, and a
rig report with NVML memory and energy
(per-card figures the real code computed from modelled samples), each at 1,400 and 700 px. Measured
from the DOM: no verdict, memory or energy table overflows its container; every chart's text lies inside
its chart's box and no two tick labels of a chart overlap. Without JavaScript every row shows and the
filter buttons are hidden. Screenshots go to the test's folder (and to $MOEBENCH_SCREENSHOTS, when set,
for a look by eye). $MOEBENCH_REPORTS adds any report (os.pathsep-separated paths), e.g. a smoke run
on a GPU."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import struct
from pathlib import Path

import pytest

from browser_cdp import check_report, find_chromium, problems
from conftest import CHECKOUT_TIERED_GROUP, moebench_cli

CHROMIUM = find_chromium()
pytestmark = [pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (setup.sh installs the "
                                                           "distribution's chromium package where it can: apt and "
                                                           "root)"),
              pytest.mark.xdist_group(CHECKOUT_TIERED_GROUP)]    # the demo repacks the checkout's tiered model


@pytest.fixture(scope="module")
def reports(tmp_path_factory, zoo) -> list[Path]:
    root = tmp_path_factory.mktemp("reports")
    moebench_cli("demo", "--out", str(root / "demo"), check=True, timeout=900)
    moebench_cli("trend", str(root / "demo" / "engine-bf16"), str(root / "demo" / "engine-tiered"),
                 "--out", str(root / "trend"), check=True)
    # several candidates (the tiered one, and the baseline against itself): the matrix report and its
    # one-point scatter
    moebench_cli("compare", str(root / "demo" / "engine-bf16"), str(root / "demo" / "engine-tiered"),
                 str(root / "demo" / "engine-bf16"), "--out", str(root / "matrix"), check=True)
    from test_rig_report import _layer, _run
    from moebench.compare.build import build_compare
    from moebench.report.render import render
    base = _run(root / "rig" / "bf16", "bf16", [70.0, 60.0, 60.0], [400.0, 60.0, 60.0], [20, 1, 1], None, 1800.0)
    layers = [_layer(600, 150, 50), _layer(500, 100, 50, prefetch=150)]
    total = {k: sum(layer[k] for layer in layers) for k in layers[0]}
    cand = _run(root / "rig" / "tiered", "tiered", [70.0, 60.0, 60.0], [300.0, 90.0, 60.0], [12, 4, 1],
                {"layers": layers, "total": total}, 1500.0)
    (root / "rig" / "cmp").mkdir()
    (root / "rig" / "cmp" / "compare.json").write_text(json.dumps(build_compare(base, cand)))
    found = [root / "demo" / "compare" / "report.html", root / "trend" / "trend.html", render(root / "rig" / "cmp"),
             root / "matrix" / "report.html"]
    extra = [Path(p) for p in os.environ.get("MOEBENCH_REPORTS", "").split(os.pathsep) if p]
    missing = [p for p in extra if not p.is_file()]
    assert not missing, f"MOEBENCH_REPORTS names files that do not exist: {missing}"
    return found + extra


def _png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", path
    return struct.unpack(">II", head[16:24])


def test_reports_read_at_1400_and_700_px_in_chromium(reports, tmp_path):
    keep = os.environ.get("MOEBENCH_SCREENSHOTS")
    for i, report in enumerate(reports):
        out = tmp_path / f"{i}-{report.parent.name}"
        results = asyncio.run(check_report(CHROMIUM, report, out))
        found = [f"{report} at {w} px: {p}" for w, m in results.items() for p in problems(m)]
        assert not found, "\n".join(found)
        for width in ("1400", "700"):
            m = results[width]
            assert m["charts"], f"{report}: no chart measured at {width} px"
            assert m["page"]["scrollWidth"] <= m["page"]["innerWidth"], (report, width, m["page"])
            shots = [Path(p) for p in m["screenshots"]]
            assert shots and all(_png_size(p)[0] == int(width) for p in shots), shots
            if keep:
                dest = Path(keep) / out.name
                dest.mkdir(parents=True, exist_ok=True)
                for p in shots:
                    shutil.copy(p, dest / p.name)
        if report.name == "report.html" and results["1400"]["filters"]:
            # with JavaScript the filters show and pick the flips; without it every row shows
            assert all(f["display"] != "none" for f in results["1400"]["filters"])
            assert results["1400"]["hiddenRows"] > 0
            assert all(f["display"] == "none" for f in results["nojs"]["filters"])
            assert results["nojs"]["hiddenRows"] == 0 and results["nojs"]["rows"] == results["1400"]["rows"]


def test_the_measurements_catch_a_clipped_label_and_an_overflowing_table(tmp_path):
    """The check can fail: a chart whose tick label is drawn past its box and a verdict table wider
    than a 700 px window are both reported."""
    page = tmp_path / "bad.html"
    cells = "".join(f"<td>{'x' * 30}</td>" for _ in range(6))
    page.write_text('<!DOCTYPE html><html><body style="margin:0">'
                    '<svg class="plot" xmlns="http://www.w3.org/2000/svg" width="200" height="100">'
                    '<text class="tick" x="190" y="50">150k-clipped</text>'
                    '<text class="tick" x="20" y="80">0.1</text><text class="tick" x="24" y="80">0.2</text></svg>'
                    f'<div style="width:600px"><table class="verdict" style="display:block;overflow-x:auto">'
                    f'<tr>{cells}</tr></table></div></body></html>')
    results = asyncio.run(check_report(CHROMIUM, page, tmp_path / "shots"))
    found = problems(results["700"])
    assert any("'150k-clipped' outside its box" in p for p in found), found
    assert any("tick labels '0.1' and '0.2' overlap" in p for p in found), found
    assert any("(verdict) overflows" in p for p in found), found
