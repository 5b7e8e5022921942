"""Speed versus context: TTFT, prefill and decode throughput per prompt length, by streaming; and
serving load: requests arriving at a rate, goodput under SLOs, the server's own state.

Closed loop (`arrival = "closed"`, the default): for each prompt length and client count, N clients
(each sends its next request when the previous one finishes) make `repeats` requests each.
Open loop (`arrival = "poisson"` or `"gamma"`): for each prompt length and each rate in `rates` (or
`rate`, or the geometric steps of `sweep`), `requests` requests are sent on a random schedule at that
rate (moebench/speed/open_loop.py), whether or not earlier ones finished; a sweep stops after the first
step that breaks its stop rule. With SLOs set (`slo_ttft_s`, `slo_tpot_s`, `slo_e2e_s`), every record
says which it met. While a group runs, the server's Prometheus /metrics page (where it has one) is read
every `metrics_interval_s`; the group's summary (KV-cache usage, queue length, prefix-cache hit rate,
preemptions) goes into each of its records as `group.server`. Every request has a UNIQUE prompt (a random
prefix, then haystack text) and `cache_prompt=False`, so no prompt cache hides prefill; generation
goes on past EOS where the backend allows (`ignore_eos`), for a fixed number of output tokens.
Before a group's clock starts, `warmup` untimed requests run for each distinct prompt token count
among its prompts (SpeedTask.warm_up), so no timed request is a backend's first of its shape.

Per measurement (docs/design.md section 6):
  ttft_s        = arrival of the first output token (from the runner's `token_times`)
  prefill_tok_s = prompt tokens / ttft_s
  decode_tok_s  = (n_out - 1) / (t_last - t_first)

Sampling: greedy by default; `temperature`, `top_p`, `top_k` and `seed` (which also seeds the unique
prompt prefixes) set it, and every record carries them as `sampling`. Speculative decoding: where the
backend reports draft counters (llama-server's `timings.draft_n`, `draft_n_accepted`), a record adds
them, `acceptance_rate` = accepted / drafted and `tokens_per_step` = n_out / (n_out - accepted) (each
verification step yields its accepted drafts plus one token of its own). Where the backend keeps them
on its Prometheus /metrics page instead (vLLM), the counters are read before and after each group and
every record of the group carries the difference as `group_spec_decode`.

A/B mode (two runner profiles interleaved, each pass in a fresh process) is moebench/speed/ab.py.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from moebench import jsonout
from moebench.config import (MAX_CLIENTS, MAX_NEW_TOKENS, MAX_PROMPT_TOKENS, MAX_SEED, MAX_VOCAB, Field,
                             ProfileError, positive)
from moebench.datasets import data_file, register
from moebench.json_fields import is_of
from moebench.runners.base import Capability, GenerateRequest, Runner, RunnerError
from moebench.runners.metrics import serving_summary, spec_decode_delta
from moebench.json_types import JsonObject
from moebench.speed.compare import read_token_times, speed_summary, summary_json
from moebench.speed.load_compare import summarize_load
from moebench.speed.open_loop import (ARRIVALS, MetricsSampler, SloCheck, arrival_offsets, slo_fields,
                                      sweep_rates, sweep_stop)
from moebench.speed.records import (ClosedGroup, ClosedPlace, DraftFigures, Goodput, Measurement, OpenPlace,
                                    RateGroup, Sampling, SkippedStep, SpeedRecord, SweepStep, Timing)
from moebench.speed.stored import read_records
from moebench.store import open_append
from moebench.tasks.base import Item, Task, TaskContext, TaskOptions, count_flagged, prompt_hash, prompt_tokens_check
from moebench.tasks.needle import HAYSTACK_FILE, HaystackIndex, build_index, fit_haystack, load_haystack

DEFAULT_PROMPT_LENGTHS = [128, 512, 2048, 8192, 16384]
SERVER_METRICS_FILE = "speed_server_metrics.jsonl"
CHARS_PER_TOKEN_GUESS = 4.0       # only where the runner cannot tokenize; the real count is then the server's


def _clients_ok(v: Any) -> str | None:
    vals = v if isinstance(v, list) else [v]
    if not vals:
        return "must name at least one client count"
    return None if all(is_of(x, (int,)) and x > 0 for x in vals) \
        else "must be a positive integer or a list of them"


def _lengths_ok(v: list[int]) -> str | None:
    if not v:
        return "must list at least one prompt length"
    return None if all(x > 0 for x in v) else "must hold positive token counts"


def _non_negative(v: Any) -> str | None:
    return None if v >= 0 else "must not be negative"


def _unit_interval(v: Any) -> str | None:
    return None if 0 < v <= 1 else "must be in (0, 1]"


def _rates_ok(v: list[float]) -> str | None:
    if not v:
        return "must list at least one rate"
    return None if all(x > 0 for x in v) else "must hold positive request rates (requests per second)"


MAX_RATE = 100_000            # requests per second
MAX_LOAD_REQUESTS = 100_000   # requests per rate


def measurement_prefix(seed: int, prompt_len: int, clients: int, repeat: int, client: int) -> str:
    """A unique, reproducible opening: differs per measurement, identical across processes (A/B)."""
    rng = random.Random(f"speed:{seed}:{prompt_len}:{clients}:{repeat}:{client}")
    words = " ".join(f"{rng.getrandbits(32):08x}" for _ in range(2))
    return f"Request {words}. Continue the story.\n\n"


def load_prefix(seed: int, prompt_len: int, rate: float, request: int) -> str:
    """A unique opening per open-loop request (differs across rates too: no prefix cache between steps)."""
    rng = random.Random(f"load:{seed}:{prompt_len}:{rate!r}:{request}")
    return f"Request {rng.getrandbits(32):08x} {rng.getrandbits(32):08x}. Continue the story.\n\n"


class SpeedOptions(TaskOptions, total=False):
    """The speed task's `options` keys (SpeedTask.options gives each its type, bounds and default)."""

    prompt_lengths: list[int]
    output_tokens: int
    repeats: int
    clients: int | list[int]
    warmup: int
    seed: int
    temperature: float
    top_p: float | None
    top_k: int | None
    arrival: str
    rate: float | None
    rates: list[float] | None
    burstiness: float
    requests: int
    sweep: bool
    sweep_start_rate: float
    sweep_factor: float
    sweep_steps: int
    sweep_max_error_rate: float
    sweep_max_queue_delay_s: float
    slo_ttft_s: float | None
    slo_tpot_s: float | None
    slo_e2e_s: float | None
    metrics_interval_s: float


class SpeedTask(Task):
    kind = "speed"
    phase = None
    options = {
        "prompt_lengths": Field(list, item_type=int, default=lambda: list(DEFAULT_PROMPT_LENGTHS),
                                check=_lengths_ok, low=1, high=MAX_PROMPT_TOKENS, doc="prompt lengths in tokens"),
        "output_tokens": Field(int, default=128, check=positive, low=1, high=MAX_NEW_TOKENS,
                               doc="tokens generated per request"),
        "repeats": Field(int, default=3, check=positive, low=1, high=10_000,
                         doc="requests per client per prompt length"),
        "clients": Field((int, list), default=1, check=_clients_ok, low=1, high=MAX_CLIENTS,
                         doc="closed-loop clients: one count or a list of counts"),
        "warmup": Field(int, default=1, low=0, high=1_000,
                        doc="untimed requests before each group, for each distinct prompt token count of its prompts"),
        "seed": Field(int, default=1234, low=0, high=MAX_SEED, doc="seeds the unique prompt prefixes and the sampler"),
        "temperature": Field(float, default=0.0, check=_non_negative, low=0.0, high=10.0,
                             doc="0 = greedy (the default)"),
        "top_p": Field(float, check=_unit_interval, low=0.0, low_open=True, high=1.0,
                       doc="nucleus sampling; unset = the backend's default"),
        "top_k": Field(int, check=_non_negative, low=0, high=MAX_VOCAB,
                       doc="top-k sampling; unset = the backend's default"),
        # serving load (moebench/speed/open_loop.py; docs/serving-load.md)
        "arrival": Field(str, default="closed", choices=ARRIVALS,
                         doc="closed: `clients` closed-loop clients; poisson or gamma: requests at `rate`"),
        "rate": Field(float, check=positive, low=0.0, low_open=True, high=MAX_RATE,
                      doc="requests per second (open loop); or `rates`"),
        "rates": Field(list, item_type=float, check=_rates_ok, low=0.0, low_open=True, high=MAX_RATE,
                       doc="several request rates, one group each"),
        "burstiness": Field(float, default=1.0, check=positive, low=0.0, low_open=True, high=1_000,
                            doc="gamma arrivals: the gamma shape (1 = Poisson, < 1 burstier)"),
        "requests": Field(int, default=20, check=positive, low=1, high=MAX_LOAD_REQUESTS,
                          doc="requests sent per rate and prompt length (open loop)"),
        "sweep": Field(bool, default=False, doc="open loop: step the rate up until the stop rule holds"),
        "sweep_start_rate": Field(float, default=1.0, check=positive, low=0.0, low_open=True, high=MAX_RATE,
                                  doc="the sweep's first rate"),
        "sweep_factor": Field(float, default=2.0, low=1, low_open=True, high=100,
                              doc="each step's rate is the last one's times this"),
        "sweep_steps": Field(int, default=6, low=1, high=100, doc="the most steps a sweep takes"),
        "sweep_max_error_rate": Field(float, default=0.05, low=0.0, high=1.0,
                                      doc="stop after a step whose error rate passes this"),
        "sweep_max_queue_delay_s": Field(float, default=1.0, low=0.0, low_open=True, high=86_400,
                                         doc="stop after a step whose median TTFT exceeds the first step's by this"),
        "slo_ttft_s": Field(float, check=positive, low=0.0, low_open=True, high=86_400,
                            doc="SLO: time to first token, seconds"),
        "slo_tpot_s": Field(float, check=positive, low=0.0, low_open=True, high=86_400,
                            doc="SLO: time per output token after the first, seconds"),
        "slo_e2e_s": Field(float, check=positive, low=0.0, low_open=True, high=86_400,
                           doc="SLO: end-to-end latency, seconds"),
        "metrics_interval_s": Field(float, default=1.0, low=0.0, high=3_600,
                                    doc="seconds between readings of the server's /metrics during a group; 0 = off"),
    }

    def __init__(self, opts: SpeedOptions, ctx: TaskContext):
        opts = SpeedOptions(**{**{k: (f.default() if callable(f.default) else f.default)
                                  for k, f in self.options.items()}, **opts})
        super().__init__(opts, ctx)
        self.prompt_lengths = [int(x) for x in dict.fromkeys(opts["prompt_lengths"])]
        c = opts["clients"]
        self.clients = [int(x) for x in dict.fromkeys(c if isinstance(c, list) else [c])]
        self.output_tokens = int(opts["output_tokens"])
        self.repeats = int(opts["repeats"])
        self.warmup = int(opts["warmup"])
        self.seed = int(opts["seed"])
        self.sampling = Sampling(float(opts["temperature"]), opts.get("top_p"), opts.get("top_k"), self.seed)
        self.arrival = str(opts["arrival"])
        self.burstiness = float(opts["burstiness"])
        self.requests = int(opts["requests"])
        self.sweep = bool(opts["sweep"])
        self.sweep_rule = {"max_error_rate": float(opts["sweep_max_error_rate"]),
                           "max_queue_delay_s": float(opts["sweep_max_queue_delay_s"])}
        self.rates = self._rates(opts.get("rate"), opts.get("rates"), float(opts["sweep_start_rate"]),
                                 float(opts["sweep_factor"]), int(opts["sweep_steps"]))
        self.slos = {k: float(opts[f"slo_{k}"]) for k in ("ttft_s", "tpot_s", "e2e_s")
                     if opts.get(f"slo_{k}") is not None}
        self.metrics_interval_s = float(opts["metrics_interval_s"])
        self._sweep_state: dict[int, _SweepState] = {}      # per prompt length
        self.index: HaystackIndex | None = None
        self._text: str | None = None
        self._groups: dict[tuple, asyncio.Task] = {}
        self._group_lock: asyncio.Lock | None = None

    def _rates(self, rate: float | None, rates: list[float] | None, sweep_start_rate: float, sweep_factor: float,
               sweep_steps: int) -> list[float]:
        """The request rates of an open-loop task; [] for closed loop. Keys that do not fit the arrival
        are refused naming the key, never ignored."""
        given = ([k for k, v in (("rate", rate), ("rates", rates)) if v is not None]
                 + (["sweep"] if self.sweep else []))
        if self.arrival == "closed":
            if given:
                raise ProfileError(f"speed: key {given[0]!r} needs arrival = \"poisson\" or \"gamma\" "
                                   f"(arrival \"closed\" runs `clients` closed-loop clients)")
            return []
        if len(given) != 1:
            raise ProfileError(f"speed: arrival {self.arrival!r} needs exactly one of 'rate', 'rates' or "
                               f"sweep = true, got {', '.join(map(repr, given)) or 'none'}")
        if self.sweep:
            return sweep_rates(sweep_start_rate, sweep_factor, sweep_steps)
        chosen = rates if rates is not None else ([rate] if rate is not None else [])
        return [float(x) for x in dict.fromkeys(chosen)]

    def needs(self, runner: Runner) -> set[str]:
        needs = {Capability.GENERATE, Capability.STREAM}
        if self.sampling.top_p is not None or self.sampling.top_k is not None:
            needs.add(Capability.SAMPLING)
        return needs

    def items(self) -> list[Item]:
        out = []
        if self.rates:
            for length in self.prompt_lengths:
                for rate in self.rates:
                    for i in range(self.requests):
                        out.append(Item(f"speed/{length}/r{rate:g}/{i}",
                                        {"prompt_length": length, "rate": rate, "request": i}))
            return self._cut(out)
        for length in self.prompt_lengths:
            for n in self.clients:
                for rep in range(self.repeats):
                    for client in range(n):
                        out.append(Item(f"speed/{length}/{n}/{rep}/{client}",
                                        {"prompt_length": length, "clients": n, "repeat": rep, "client": client}))
        return self._cut(out)

    async def prepare(self, runner: Runner) -> None:
        path = data_file(self.ctx.data_dir, HAYSTACK_FILE)
        register(self.ctx.data_files, Path(self.ctx.data_dir), path)
        self._text = load_haystack(path)
        if Capability.TOKENIZE in runner.capabilities:
            longest = max((it.data["prompt_length"] for it in self.items()), default=0)
            self.index = await build_index(runner, self._text, int(longest * 1.05) + 256)

    # -- prompts ---------------------------------------------------------------------------------
    async def build_prompt(self, runner: Runner, prefix: str, length: int,
                           allowed: int | None = None) -> tuple[str, int | None]:
        """(prompt, exact token count or None where the runner cannot tokenize). allowed: how many
        tokens off `length` the fit may stop at (default 1%, at least 1); 0 asks for `length` itself,
        and the closest fit found is returned when none has it."""
        if self._text is None:
            await self.prepare(runner)
        assert self._text is not None
        if self.index is None:      # no tokenizer: a character estimate; the server reports the truth
            cut = int(max(1, length - 16) * CHARS_PER_TOKEN_GUESS)
            return prefix + self._text[:cut], None
        index = self.index
        fixed = len(await runner.tokenize(prefix))
        fit = await fit_haystack(runner.tokenize, index, length, lambda cut: prefix + index.text[:cut],
                                 fixed, allowed=max(1, length // 100) if allowed is None else allowed)
        return fit.prompt, len(fit.ids)

    async def warm_up(self, runner: Runner, counts: list[int | None], length: int,
                      prefix_of: Callable[[int, int, int], str]) -> None:
        """`warmup` untimed requests for each distinct prompt token count among a group's prompts
        (`counts`; one lot at `length` where the runner cannot tokenize): a backend pays for a new
        shape's first request (kernels compiled or loaded for it, graphs captured, memory taken),
        and the group's prompts may be a token or more off `length`. Each warm-up prompt has its own
        opening, `prefix_of(warmup, count index, attempt)`, and that count of tokens where a fit with
        up to 4 openings finds it (the closest found otherwise)."""
        targets: list[int | None] = sorted({n for n in counts if n is not None}) or [None]
        for w in range(self.warmup):
            for j, n in enumerate(targets):
                if n is None:
                    best = await self.build_prompt(runner, prefix_of(w, j, 0), length)
                else:
                    fits = []
                    for attempt in range(4):
                        fits.append(await self.build_prompt(runner, prefix_of(w, j, attempt), n, allowed=0))
                        if fits[-1][1] == n:
                            break
                    best = min(fits, key=lambda f: abs((f[1] or 0) - n))
                try:
                    await self.measure(runner, best[0], best[1], concurrent=True)
                except Exception:
                    pass               # a failed warm-up shows up in the measurements themselves

    # -- measuring -------------------------------------------------------------------------------
    async def measure(self, runner: Runner, prompt: str, prompt_tokens: int | None,
                      concurrent: bool) -> Measurement:
        request = GenerateRequest(prompt=prompt, max_tokens=self.output_tokens,
                                  temperature=self.sampling.temperature, seed=self.seed,
                                  top_p=self.sampling.top_p, top_k=self.sampling.top_k,
                                  stream=True, ignore_eos=True, cache_prompt=False)
        t_start = time.perf_counter()
        result = await runner.generate(request)
        t_end = time.perf_counter()
        real_prompt_tokens = prompt_tokens or result.prompt_tokens
        fields = Timing.of(result.token_times, real_prompt_tokens, result.output_tokens)
        if not concurrent:          # phases are only meaningful with one request in flight
            # The phases are the answering request's: from when it was sent (a runner that sent it
            # again after a dropped connection waited before) to its last token (after it, the
            # client reads the stream's end and checks counts while the backend idles).
            sent = result.sent_at if result.sent_at is not None else t_start
            _mark(self.ctx, "prefill", sent)
            _mark(self.ctx, "decode", sent + fields.ttft_s)
            _mark(self.ctx, "idle", min(t_end, sent + fields.e2e_s))
            _count_tokens(self.ctx, real_prompt_tokens or 0, result.output_tokens or len(result.token_times or []))
        n_out = result.output_tokens or len(result.token_times or [])
        return Measurement(
            result=result,
            prompt_hash=prompt_hash(prompt),
            prompt_tokens=real_prompt_tokens,
            prompt_tokens_source="tokenizer" if prompt_tokens else ("server" if result.prompt_tokens else None),
            runner_prompt_tokens=result.prompt_tokens,
            prompt_tokens_check=prompt_tokens_check(prompt_tokens, result.prompt_tokens),
            output_tokens=n_out,
            output_tokens_requested=self.output_tokens,
            stopped_early=(result.output_tokens or 0) < self.output_tokens,
            sampling=self.sampling,
            draft=DraftFigures.of(result.timings, n_out),
            timing=fields,
            token_times=list(result.token_times or []))

    def _slo_check(self, m: Measurement) -> SloCheck | None:
        """The SLOs the request met, judged on its record's timing fields; None where the suite sets none."""
        return slo_fields(m.times, self.slos) if self.slos else None

    async def run_group(self, runner: Runner, length: int, clients: int,
                        wanted: set[str] | None = None) -> dict[str, SpeedRecord | BaseException]:
        """All measurements of one (prompt length, clients) group: N closed-loop clients x repeats.

        Prompts are built (tokenized) before the clock starts. Returns item id -> record, or the
        exception that measurement raised.
        """
        _mark(self.ctx, "prepare", time.perf_counter())     # tokenizing prompts: host work, not idle
        prompts: dict[tuple[int, int], tuple[str, int | None]] = {}
        for rep in range(self.repeats):
            for c in range(clients):
                prefix = measurement_prefix(self.seed, length, clients, rep, c)
                prompts[(rep, c)] = await self.build_prompt(runner, prefix, length)
        _mark(self.ctx, "warmup", time.perf_counter())
        await self.warm_up(runner, [n for _, n in prompts.values()], length,
                           lambda w, j, a: measurement_prefix(self.seed + 1_000_003 + w, length, clients, a, j))
        results: dict[str, SpeedRecord | BaseException] = {}

        async def client_loop(c: int) -> None:
            for rep in range(self.repeats):
                item_id = f"speed/{length}/{clients}/{rep}/{c}"
                prompt, n = prompts[(rep, c)]
                try:
                    m = await self.measure(runner, prompt, n, concurrent=clients > 1)
                    place = ClosedPlace(length, clients, rep, c)
                    results[item_id] = SpeedRecord(m, place, self._slo_check(m))
                except Exception as e:
                    results[item_id] = e

        before = await runner.server_metrics()      # server-side draft counters (vLLM), where kept
        _mark(self.ctx, "mixed" if clients > 1 else "idle", time.perf_counter())
        t0 = time.perf_counter()
        async with MetricsSampler(runner.server_metrics, self.metrics_interval_s if before else 0) as sampler:
            await asyncio.gather(*(client_loop(c) for c in range(clients)))
        duration = time.perf_counter() - t0
        _mark(self.ctx, "idle", time.perf_counter())
        group_spec = spec_decode_delta(before, await runner.server_metrics() if before else None)
        group = ClosedGroup(clients, duration, len(results), _goodput(results, duration),
                            serving_summary(sampler.samples, self.metrics_interval_s))
        for rec in results.values():
            if isinstance(rec, SpeedRecord):
                rec.group, rec.group_spec_decode = group, group_spec
        self._write_token_times(results)
        self._write_samples(f"{length}/{clients}", sampler.samples)
        return results

    async def run_rate_group(self, runner: Runner, length: int,
                             rate: float) -> dict[str, SpeedRecord | SkippedStep | BaseException]:
        """`requests` requests sent at `rate` per second on the arrival schedule, each as its own task.

        The clock of the schedule starts after the prompts are built and the warm-up is done. A sweep
        step after the one that met the stop rule is not sent: its records say `sweep_skipped`."""
        ids = [f"speed/{length}/r{rate:g}/{i}" for i in range(self.requests)]
        state = self._sweep_state.setdefault(length, _SweepState())
        step = self.rates.index(rate)
        if self.sweep and state.stopped:
            return {i: SkippedStep(length, self.arrival, rate, step, state.stopped, n) for n, i in enumerate(ids)}
        _mark(self.ctx, "prepare", time.perf_counter())
        prompts = [await self.build_prompt(runner, load_prefix(self.seed, length, rate, i), length)
                   for i in range(self.requests)]
        _mark(self.ctx, "warmup", time.perf_counter())
        await self.warm_up(runner, [n for _, n in prompts], length,
                           lambda w, j, a: load_prefix(self.seed + 1_000_003 + a, length, rate, w + 1_000 * j))
        offsets = arrival_offsets(self.arrival, rate, self.requests, self.burstiness, self.seed)
        results: dict[str, SpeedRecord | SkippedStep | BaseException] = {}
        flight = {"now": 0, "max": 0}
        t0 = 0.0

        async def one(i: int) -> None:
            await asyncio.sleep(max(0.0, t0 + offsets[i] - time.perf_counter()))
            sent = time.perf_counter() - t0
            flight["now"] += 1
            flight["max"] = max(flight["max"], flight["now"])
            in_flight = flight["now"]
            try:
                prompt, n = prompts[i]
                m = await self.measure(runner, prompt, n, concurrent=True)
                place = OpenPlace(length, self.arrival, rate, i, offsets[i], sent, in_flight,
                                  step if self.sweep else None)
                results[ids[i]] = SpeedRecord(m, place, self._slo_check(m))
            except Exception as e:
                results[ids[i]] = e
            finally:
                flight["now"] -= 1

        _mark(self.ctx, "mixed", time.perf_counter())
        async with MetricsSampler(runner.server_metrics, self.metrics_interval_s) as sampler:
            t0 = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(self.requests)))
            duration = time.perf_counter() - t0
        _mark(self.ctx, "idle", time.perf_counter())
        sweep = None
        if self.sweep:
            ttfts = [r.measurement.timing.ttft_s for r in results.values() if isinstance(r, SpeedRecord)]
            reason, figures = sweep_stop(ttfts, self.requests, state.first_ttft_median, **self.sweep_rule)
            if step == 0:
                state.first_ttft_median = figures.ttft_median_s
            if reason:
                state.stopped = f"rate {rate:g}: {reason}"
            sweep = SweepStep(step, figures, reason, self.sweep_rule)
        group = RateGroup(
            arrival=self.arrival, rate=rate, burstiness=self.burstiness if self.arrival == "gamma" else None,
            duration_s=duration, n_sent=self.requests, last_send_s=offsets[-1], max_in_flight=flight["max"],
            client_concurrency=getattr(runner, "concurrency", None), slos=self.slos,
            goodput=_goodput(results, duration), server=serving_summary(sampler.samples, self.metrics_interval_s),
            sweep=sweep)
        for rec in results.values():
            if isinstance(rec, SpeedRecord):
                rec.group = group
        self._write_token_times(results)
        self._write_samples(f"{length}/r{rate:g}", sampler.samples)
        return results

    def _write_samples(self, group: str, samples: list[tuple[float, dict[str, float]]]) -> None:
        """Every /metrics reading of a group (the names the summary reads), beside items.jsonl."""
        if self.ctx.run_dir is None or not samples:
            return
        from moebench.runners.metrics import GAUGES, HIT_COUNTERS, HIT_GAUGES, PREEMPTION_COUNTERS
        wanted = {n for names in GAUGES.values() for n in names} | {n for h, d, _ in HIT_COUNTERS for n in (h, d)} \
            | set(HIT_GAUGES) | set(PREEMPTION_COUNTERS)
        path = Path(self.ctx.run_dir) / SERVER_METRICS_FILE
        with open_append(path) as f:
            for t, reading in samples:
                row = {"group": group, "t_s": t, "values": {k: v for k, v in reading.items() if k in wanted}}
                f.write((jsonout.dumps(row) + "\n").encode("utf-8"))

    def _write_token_times(self, results: dict[str, SpeedRecord | SkippedStep | BaseException]) -> None:
        """Per-token arrival times go beside items.jsonl (bulk data), not into the records."""
        rows = []
        for item_id, rec in results.items():
            if isinstance(rec, SpeedRecord):
                rows.append({"item_id": item_id, "token_times": rec.measurement.token_times})
        if self.ctx.run_dir is not None and rows:
            path = Path(self.ctx.run_dir) / "speed_token_times.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with open_append(path) as f:           # never through a link planted in the run
                for row in rows:
                    f.write((jsonout.dumps(row) + "\n").encode("utf-8"))

    async def evaluate(self, item: Item, runner: Runner) -> JsonObject:
        """One measurement; the first item of a group runs the whole group (closed-loop clients).

        Groups run one at a time whatever the executor's concurrency, so lengths never overlap.
        """
        open_loop = "rate" in item.data
        key = (item.data["prompt_length"], item.data["rate"] if open_loop else item.data["clients"], open_loop)
        if self._group_lock is None:
            self._group_lock = asyncio.Lock()
        if key not in self._groups:
            async def guarded() -> dict[str, SpeedRecord | SkippedStep | BaseException]:
                assert self._group_lock is not None
                async with self._group_lock:
                    if open_loop:
                        return await self.run_rate_group(runner, key[0], key[1])
                    return await self.run_group(runner, key[0], key[1])
            self._groups[key] = asyncio.ensure_future(guarded())
        results = await self._groups[key]
        rec = results.get(item.item_id)
        if rec is None:
            raise RunnerError(f"{item.item_id}: no measurement was made")
        if isinstance(rec, BaseException):
            raise rec
        return {"correct": None, "answer": None, "reference": None, **rec.to_json()}

    def summarize(self, records: list[JsonObject]) -> JsonObject:
        run_dir = self.ctx.run_dir
        stored = read_records(records, f"{run_dir / 'items.jsonl'}" if run_dir is not None else "speed records")
        ok = [r for r in stored if r.status == "ok"]
        times = read_token_times(run_dir) if run_dir is not None else None
        return {"n": len(records), "n_ok": len(ok),
                "n_errors": sum(1 for r in stored if r.status == "error"),
                "n_prompt_tokens_flagged": count_flagged(records),
                # requests a runner sent more than once (their phases and timings are the last send's)
                "n_resent": sum(1 for r in records if r.get("status") == "ok" and r.get("resends")),
                "sampling": self.sampling.to_json(),
                "by_prompt_length": summary_json(speed_summary(ok, times)),
                **({"load": summarize_load(stored).to_json()} if self.rates else {})}


@dataclass
class _SweepState:
    """A sweep's progress at one prompt length: the first step's median TTFT (the queueing delay's zero)
    and, once a step met the stop rule, why (later steps are not sent)."""

    first_ttft_median: float | None = None
    stopped: str | None = None


def _goodput(results: dict[str, SpeedRecord | SkippedStep | BaseException], duration: float) -> Goodput:
    """Requests that finished within every SLO (without SLOs every finished request counts)."""
    met = sum(1 for r in results.values() if isinstance(r, SpeedRecord) and (r.slo is None or r.slo.all_met))
    return Goodput.of(met, len(results), duration)


# --- probe plumbing -------------------------------------------------------------------------------

def _mark(ctx: TaskContext, phase: str, at: float) -> None:
    """A phase mark at a past instant (perf_counter): the phases of a request are known after it ends."""
    probe = ctx.probe
    if probe is None:
        return
    try:
        probe.mark(phase, at=at)
    except TypeError:            # a probe without timestamps: mark now
        probe.mark(phase)


def _count_tokens(ctx: TaskContext, prefill: int, decode: int) -> None:
    count = getattr(ctx.probe, "count_tokens", None)
    if count is not None:
        count(prefill=prefill, decode=decode)
