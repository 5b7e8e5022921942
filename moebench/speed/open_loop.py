"""Open-loop load for the speed task: request arrival schedules, SLO checks, the /metrics sampler that
runs beside a group, and the sweep's stop rule.

Arrivals (as vLLM's `bench serve`): "poisson" sends at exponentially distributed gaps with mean
1/rate; "gamma" draws the gaps from a gamma distribution with shape `burstiness` and scale
1/(rate * burstiness), so the mean rate is the same and burstiness < 1 is burstier, > 1 steadier
(burstiness 1 is Poisson). Requests are sent on that schedule whether or not earlier ones finished.
"""
from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from moebench.json_types import JsonObject
from moebench.json_fields import Fields
from moebench.speed.latency import RequestTimes

ARRIVALS = ("closed", "poisson", "gamma")


def arrival_offsets(arrival: str, rate: float, n: int, burstiness: float, seed: int) -> list[float]:
    """Send times (seconds from the group start) of n requests; the first is sent at 0.

    Seeded by (seed, arrival, rate), so a candidate and its baseline get the same schedule."""
    if arrival not in ("poisson", "gamma"):
        raise ValueError(f"arrival {arrival!r} has no schedule (poisson or gamma)")
    rng = random.Random(f"arrivals:{seed}:{arrival}:{rate!r}:{burstiness!r}")
    out, t = [], 0.0
    for i in range(n):
        out.append(t)
        if arrival == "poisson":
            t += rng.expovariate(rate)
        else:
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


@dataclass(frozen=True)
class SloCheck:
    """Which SLOs a measured request met, in the order the suite's SLOs are listed."""

    met: dict[str, bool]             # SLO name ("ttft_s", "tpot_s", "e2e_s") -> met

    @property
    def all_met(self) -> bool:
        return all(self.met.values())

    def to_json(self) -> JsonObject:
        """The record's `slo` ({"<name>_met": bool}) and `slo_met` (every one met)."""
        return {"slo": {f"{k}_met": v for k, v in self.met.items()}, "slo_met": self.all_met}


def slo_fields(times: RequestTimes, slos: dict[str, float]) -> SloCheck:
    """Which SLOs a measured request met: `slo_met` is True only when it met every one that is set.

    slos: {"ttft_s": limit, "tpot_s": limit, "e2e_s": limit} (those set). TPOT is seconds per output
    token after the first, as RequestTimes.tpot_s."""
    def met(name: str, limit: float) -> bool:
        v = times.metric(name)
        return v is not None and v <= limit
    return SloCheck({k: met(k, limit) for k, limit in slos.items()})


class MetricsSampler:
    """Reads the server's /metrics every `interval_s` while a group runs (one reading before the group's
    first request, one after its last reply, and one per interval between)."""

    def __init__(self, read: Callable[[], Awaitable[dict[str, float] | None]], interval_s: float):
        self.read, self.interval_s = read, interval_s
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._task: asyncio.Task | None = None
        self._t0 = 0.0

    async def _take(self) -> bool:
        try:
            reading = await self.read()
        except Exception:            # a metrics page that fails is no measurement failure
            reading = None
        if reading:
            self.samples.append((time.perf_counter() - self._t0, reading))
        return reading is not None

    async def __aenter__(self) -> "MetricsSampler":
        self._t0 = time.perf_counter()
        if self.interval_s > 0 and await self._take():     # a server without /metrics: no sampling loop
            self._task = asyncio.ensure_future(self._loop())
        return self

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self._take()

    async def __aexit__(self, *exc: Any) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            await self._take()


def sweep_rates(start: float, factor: float, steps: int) -> list[float]:
    return [round(start * factor ** k, 6) for k in range(steps)]


@dataclass(frozen=True)
class SweepFigures:
    """What the sweep's stop rule judged of one step."""

    error_rate: float
    ttft_median_s: float | None
    queue_delay_s: float | None      # this step's median TTFT minus the first step's

    def to_json(self) -> JsonObject:
        return {"error_rate": self.error_rate, "ttft_median_s": self.ttft_median_s,
                "queue_delay_s": self.queue_delay_s}

    @staticmethod
    def from_json(f: Fields) -> SweepFigures:
        return SweepFigures(f.need_num("error_rate"), f.num("ttft_median_s"), f.num("queue_delay_s"))


def sweep_stop(ttfts: list[float], n_sent: int, first_ttft_median: float | None,
               max_error_rate: float, max_queue_delay_s: float) -> tuple[str | None, SweepFigures]:
    """The sweep's stop rule for one finished step, from the TTFTs of its requests that were measured (the
    rest of the `n_sent` errored): (reason or None, the figures it judged).

    Stop when the step's error rate (errors / requests sent) passes `max_error_rate`, or when its
    queueing delay, the median TTFT at this rate minus the median TTFT of the sweep's first (lowest)
    rate, passes `max_queue_delay_s`: waiting in the server's queue shows up in TTFT."""
    errors = n_sent - len(ttfts)
    error_rate = errors / n_sent if n_sent else 0.0
    median = statistics.median(ttfts) if ttfts else None
    delay = (median - first_ttft_median) if median is not None and first_ttft_median is not None else None
    figures = SweepFigures(error_rate, median, delay)
    if error_rate > max_error_rate:
        return f"error rate {error_rate:.3g} > sweep_max_error_rate {max_error_rate:g}", figures
    if delay is not None and delay > max_queue_delay_s:
        return f"queueing delay {delay:.3g} s > sweep_max_queue_delay_s {max_queue_delay_s:g}", figures
    return None, figures
