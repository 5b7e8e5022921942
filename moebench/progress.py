"""Progress for long work: a bar on a terminal, plain periodic lines otherwise (CI logs)."""
from __future__ import annotations

import sys
import time
from typing import TextIO

TTY_REDRAW_S = 0.1          # the bar on a terminal is redrawn at most this often (and at the end)


class Progress:
    def __init__(self, label: str, total: int, stream: TextIO | None = None, every_s: float = 10.0):
        self.label = label
        self.total = total
        self.done = 0
        self.errors = 0
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every_s = every_s
        self.t0 = time.monotonic()
        self._last = 0.0
        self._last_pct = -1
        self._printed_done = -1

    def advance(self, error: bool = False) -> None:
        self.done += 1
        self.errors += int(error)
        self._show()

    def _show(self, final: bool = False) -> None:
        # Called once per item: whether to print is decided first, the line is built only when it is.
        now = time.monotonic()
        if self.tty:
            if not final and now - self._last < TTY_REDRAW_S and self.done != self.total:
                return                  # a redraw per item would cost more than the item itself
            self._last = now
            elapsed, eta, err = self._figures(now)
            width = 30
            filled = int(width * self.done / self.total) if self.total else width
            bar = "#" * filled + "." * (width - filled)
            self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total}{err} "
                              f"{elapsed:5.0f}s eta {eta:5.0f}s")
            if final:
                self.stream.write("\n")
            self.stream.flush()
            return
        pct = int(100 * self.done / self.total) if self.total else 100
        if final and self._printed_done == self.done:
            return                     # the last line already said it
        if final or now - self._last >= self.every_s or (pct // 25 != self._last_pct // 25):
            self._last, self._last_pct, self._printed_done = now, pct, self.done
            elapsed, _, err = self._figures(now)
            self.stream.write(f"{self.label}: {self.done}/{self.total} ({pct}%){err} in {elapsed:.0f}s\n")
            self.stream.flush()

    def _figures(self, now: float) -> tuple[float, float, str]:
        """(seconds elapsed, seconds left at the rate so far, the errors note) for a line."""
        elapsed = now - self.t0
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else float("nan")
        return elapsed, eta, f" errors={self.errors}" if self.errors else ""

    def close(self) -> None:
        self._show(final=True)


class StartupLog:
    """Lines on stderr while a run starts (loading a model, a server starting and its log, warm-up,
    the idle window), each with the seconds since the run began: a start-up that takes tens of seconds
    is never silent. Plain lines on a terminal and in CI logs alike."""

    def __init__(self, quiet: bool = False, stream: TextIO | None = None):
        self.t0 = time.monotonic()
        self.quiet = quiet
        self.stream = stream

    def __call__(self, text: str) -> None:
        if self.quiet:
            return
        stream = self.stream or sys.stderr
        stream.write(f"[{time.monotonic() - self.t0:6.1f}s] {text}\n")
        stream.flush()
