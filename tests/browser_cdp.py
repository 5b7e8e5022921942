"""Headless Chromium driven over the DevTools protocol (a websocket through aiohttp): open a report at
a given window width, measure its layout from the DOM, take a full-page screenshot.

No browser-automation package: Chromium comes from the distribution (`apt-get install chromium`, which
setup.sh does where it can). Also a command for a look by eye at any report:

    python tests/browser_cdp.py results/demo/compare/report.html --out /tmp/shots [--width 1400 --width 700]
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")

# Measured in the page: every verdict/memory/energy table against its container (no horizontal
# overflow: nothing hidden behind a scroll bar), and every chart's text inside the chart's own box;
# tick labels of one chart that overlap each other (a crammed axis).
MEASURE_JS = r"""
(() => {
  const out = {page: {scrollWidth: document.documentElement.scrollWidth, innerWidth: window.innerWidth},
               tables: [], charts: [], filters: []};
  document.querySelectorAll("table").forEach((t, i) => {
    const c = t.parentElement.getBoundingClientRect(), r = t.getBoundingClientRect();
    out.tables.push({index: i, cls: t.className, section: (t.closest("section") || {}).id || "",
                     scrollWidth: t.scrollWidth, clientWidth: t.clientWidth,
                     right: r.right, containerRight: c.right});
  });
  document.querySelectorAll("svg.plot").forEach((svg, i) => {
    const box = svg.getBoundingClientRect();
    const fig = svg.closest("div") && svg.closest("div").querySelector("h3");
    const title = (fig && fig.textContent) || svg.getAttribute("aria-label") || "";
    const outside = [], overlaps = [];
    const ticks = [];
    svg.querySelectorAll("text").forEach(t => {
      const r = t.getBoundingClientRect();
      if (r.width === 0 && r.height === 0) return;
      if (r.left < box.left - 0.5 || r.right > box.right + 0.5 || r.top < box.top - 0.5 || r.bottom > box.bottom + 0.5)
        outside.push({text: t.textContent, left: r.left - box.left, right: r.right - box.left,
                      top: r.top - box.top, bottom: r.bottom - box.top, width: box.width, height: box.height});
      if (t.classList.contains("tick")) ticks.push({text: t.textContent, r: r});
    });
    for (let a = 0; a < ticks.length; a++) for (let b = a + 1; b < ticks.length; b++) {
      const p = ticks[a].r, q = ticks[b].r;
      const w = Math.min(p.right, q.right) - Math.max(p.left, q.left);
      const h = Math.min(p.bottom, q.bottom) - Math.max(p.top, q.top);
      if (w > 1 && h > 1) overlaps.push([ticks[a].text, ticks[b].text]);
    }
    out.charts.push({index: i, title: title, width: box.width, height: box.height, outside: outside,
                     overlaps: overlaps});
  });
  document.querySelectorAll(".filters").forEach(f => {
    const st = getComputedStyle(f);
    out.filters.push({display: st.display});
  });
  out.hiddenRows = document.querySelectorAll("tbody tr[hidden]").length;
  out.rows = document.querySelectorAll("tbody tr").length;
  return out;
})()
"""


def find_chromium() -> str | None:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """One headless Chromium with one page; `async with Browser(path) as b:`."""

    def __init__(self, binary: str):
        self.binary = binary
        self.proc: subprocess.Popen | None = None
        self.profile = tempfile.mkdtemp(prefix="moebench-chromium-")
        self._ids = itertools.count(1)
        self.ws = None
        self.session = None
        self.events: list[dict[str, Any]] = []

    async def __aenter__(self) -> "Browser":
        args = [self.binary, "--headless=new", "--remote-debugging-port=0", f"--user-data-dir={self.profile}",
                "--no-first-run", "--no-default-browser-check", "--disable-gpu", "--hide-scrollbars",
                "--disable-extensions", "--mute-audio", "about:blank"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            args.insert(1, "--no-sandbox")      # Chromium refuses to run as root with its sandbox
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        endpoint = await asyncio.to_thread(self._devtools_endpoint)
        self.session = aiohttp.ClientSession()
        port = re.search(r":(\d+)/", endpoint).group(1)
        async with self.session.get(f"http://127.0.0.1:{port}/json/list") as r:
            pages = [t for t in await r.json() if t.get("type") == "page"]
        self.ws = await self.session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0)
        await self.send("Page.enable")
        return self

    def _devtools_endpoint(self, timeout_s: float = 60) -> str:
        deadline = time.monotonic() + timeout_s
        seen = []
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                break
            seen.append(line)
            m = re.search(r"DevTools listening on (ws://\S+)", line)
            if m:
                return m.group(1)
        raise RuntimeError(f"{self.binary} gave no DevTools endpoint: {''.join(seen)[-2000:]}")

    async def __aexit__(self, *exc: Any) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self.session is not None:
            await self.session.close()
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.profile, ignore_errors=True)

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        msg_id = next(self._ids)
        await self.ws.send_str(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            msg = json.loads((await asyncio.wait_for(self.ws.receive(), 120)).data)
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    async def _wait_event(self, name: str, timeout_s: float = 120) -> None:
        for i, ev in enumerate(self.events):
            if ev.get("method") == name:
                del self.events[: i + 1]
                return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            msg = json.loads((await asyncio.wait_for(self.ws.receive(), timeout_s)).data)
            if msg.get("method") == name:
                return
        raise TimeoutError(name)

    async def open(self, url: str, width: int, height: int = 900, javascript: bool = True) -> None:
        await self.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                        mobile=False)
        await self.send("Emulation.setScriptExecutionDisabled", value=not javascript)
        self.events.clear()
        await self.send("Page.navigate", url=url)
        await self._wait_event("Page.loadEventFired")

    async def evaluate(self, expression: str) -> Any:
        res = await self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"page script failed: {res['exceptionDetails']}")
        return res["result"].get("value")

    async def screenshot(self, stem: Path, part_height: int = 2400, max_height: int = 24000) -> list[Path]:
        """The whole page (up to max_height pixels) as PNGs of part_height each: stem-1.png, stem-2.png..."""
        size = await self.evaluate("[document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
        height = min(int(size[1]), max_height)
        stem.parent.mkdir(parents=True, exist_ok=True)
        paths = []
        for k, y in enumerate(range(0, height, part_height), start=1):
            shot = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                                   clip={"x": 0, "y": y, "width": int(size[0]),
                                         "height": min(part_height, height - y), "scale": 1})
            path = stem.with_name(f"{stem.name}-{k}.png")
            path.write_bytes(base64.b64decode(shot["data"]))
            paths.append(path)
        return paths


async def check_report(binary: str, report: Path, out_dir: Path, widths=(1400, 700)) -> dict[str, Any]:
    """{width: measurements} for the report at each width (and without JavaScript at the first), with a
    screenshot per width in out_dir."""
    results: dict[str, Any] = {}
    async with Browser(binary) as b:
        for w in widths:
            await b.open(report.resolve().as_uri(), w)
            results[str(w)] = await b.evaluate(MEASURE_JS)
            results[str(w)]["screenshots"] = [str(p) for p in await b.screenshot(out_dir / f"{report.stem}-{w}")]
        await b.open(report.resolve().as_uri(), widths[0], javascript=False)
        results["nojs"] = await b.evaluate(MEASURE_JS)
        await b.send("Emulation.setScriptExecutionDisabled", value=False)
    return results


def problems(measure: dict[str, Any]) -> list[str]:
    """What a reader would trip over at one width: a verdict, memory or energy table that overflows its
    container, chart text outside its chart's box, tick labels of one chart on top of each other."""
    out = []
    for t in measure["tables"]:
        readable = any(c in t["cls"].split() for c in ("verdict", "readable"))
        if readable and (t["scrollWidth"] > t["clientWidth"] + 1 or t["right"] > t["containerRight"] + 1):
            out.append(f"table #{t['index']} ({t['cls']}) overflows: scrollWidth {t['scrollWidth']} > clientWidth "
                       f"{t['clientWidth']} or right {t['right']:.0f} > container {t['containerRight']:.0f}")
    for c in measure["charts"]:
        for o in c["outside"]:
            out.append(f"chart #{c['index']} {c['title']!r}: label {o['text']!r} outside its box "
                       f"(left {o['left']:.1f}, right {o['right']:.1f} of {o['width']:.0f}; top {o['top']:.1f}, "
                       f"bottom {o['bottom']:.1f} of {o['height']:.0f})")
        for a, b in c["overlaps"]:
            out.append(f"chart #{c['index']} {c['title']!r}: tick labels {a!r} and {b!r} overlap")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("reports", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True, help="folder for the screenshots and measure.json")
    ap.add_argument("--width", type=int, action="append", help="window widths (default: 1400 and 700)")
    args = ap.parse_args()
    binary = find_chromium()
    if binary is None:
        print("no Chromium found (apt-get install chromium)")
        return 2
    bad = 0
    for report in args.reports:
        res = asyncio.run(check_report(binary, report, args.out, tuple(args.width or (1400, 700))))
        (args.out / f"{report.stem}-measure.json").write_text(json.dumps(res, indent=1))
        for width, m in res.items():
            for p in problems(m):
                bad += 1
                print(f"{report} at {width}: {p}")
            if "screenshots" in m:
                print(f"{report} at {width} px: {', '.join(m['screenshots'])}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
