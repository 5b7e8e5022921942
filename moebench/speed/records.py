"""The speed task's items.jsonl records, typed: a measured request (`SpeedRecord`: its `Measurement`
with its `Sampling`, `Timing` and speculative-decoding counters `DraftFigures`, where it stood,
`ClosedPlace` or `OpenPlace`, the SLOs it met, and the summary of the group it ran in, `ClosedGroup` or `RateGroup` with
`Goodput` and a sweep step's `SweepStep`) and a request of a sweep step not sent (`SkippedStep`). Each
`to_json` gives the record's JSON exactly as items.jsonl holds it (keys, order, values);
docs/schema.md and docs/serving-load.md name the keys. The parts a reader of stored records needs
(`Sampling`, `DraftFigures`, the group summaries) read themselves back with `from_json`, refusing bad
input by source and key; speed/stored.py reads a whole record.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from moebench.json_types import JsonObject
from moebench.runners.base import GenerateResult, RunnerError, ServerTimings
from moebench.runners.metrics import ServingSummary, SpecDecodeDelta
from moebench.json_fields import Fields
from moebench.speed.latency import RequestTimes
from moebench.speed.open_loop import SloCheck, SweepFigures


@dataclass(frozen=True)
class Timing:
    """One streamed request's timing, from its token arrival times (seconds from the request start)."""

    ttft_s: float
    prefill_tok_s: float | None      # prompt tokens / ttft_s; None without a token count
    decode_tok_s: float | None       # (n_out - 1) / decode_window_s; None for one token
    decode_window_s: float           # first token to last
    e2e_s: float
    n_chunks: int                    # streamed chunks that carried tokens

    @staticmethod
    def of(token_times: list[float] | None, prompt_tokens: int | None, output_tokens: int | None) -> Timing:
        if not token_times:
            raise RunnerError("the runner returned no token_times: streaming is needed to time a request")
        n_out = int(output_tokens or len(token_times))
        ttft = float(token_times[0])
        window = float(token_times[-1]) - ttft
        return Timing(ttft_s=ttft,
                      prefill_tok_s=(prompt_tokens / ttft) if prompt_tokens and ttft > 0 else None,
                      decode_tok_s=((n_out - 1) / window) if n_out > 1 and window > 0 else None,
                      decode_window_s=window, e2e_s=float(token_times[-1]), n_chunks=len(token_times))

    def to_json(self) -> JsonObject:
        return {"ttft_s": self.ttft_s, "prefill_tok_s": self.prefill_tok_s, "decode_tok_s": self.decode_tok_s,
                "decode_window_s": self.decode_window_s, "e2e_s": self.e2e_s, "n_chunks": self.n_chunks}


@dataclass(frozen=True)
class DraftFigures:
    """Speculative decoding of one request, from the backend's draft counters (llama-server's timings)."""

    draft_n: int
    draft_n_accepted: int
    acceptance_rate: float | None    # accepted / drafted
    tokens_per_step: float | None    # n_out / (n_out - accepted): each step yields its accepted drafts + 1

    @staticmethod
    def of(timings: ServerTimings | None, output_tokens: int | None) -> DraftFigures | None:
        """None where the backend reports no draft counters."""
        t = timings or {}
        drafted, accepted = t.get("draft_n"), t.get("draft_n_accepted")
        if not isinstance(drafted, int) or not isinstance(accepted, int) or isinstance(drafted, bool):
            return None
        n = output_tokens or 0
        return DraftFigures(drafted, accepted, accepted / drafted if drafted > 0 else None,
                            n / (n - accepted) if n > accepted >= 0 else None)

    def to_json(self) -> JsonObject:
        return {"draft_n": self.draft_n, "draft_n_accepted": self.draft_n_accepted,
                "acceptance_rate": self.acceptance_rate, "tokens_per_step": self.tokens_per_step}

    @staticmethod
    def from_json(f: Fields) -> DraftFigures | None:
        """From a stored record's fields; None where it has no draft counters."""
        drafted = f.integer("draft_n")
        if drafted is None:
            return None
        return DraftFigures(drafted, f.integer("draft_n_accepted") or 0, f.num("acceptance_rate"),
                            f.num("tokens_per_step"))


@dataclass(frozen=True)
class Goodput:
    """A group's goodput as measured: requests that finished within every SLO (without SLOs, every
    finished request) per second of its wall time, and the share of requests sent that made it."""

    goodput: float | None
    slo_met_share: float | None

    @staticmethod
    def of(n_met: int, n_sent: int, duration: float) -> Goodput:
        return Goodput(n_met / duration if duration > 0 else None, n_met / n_sent if n_sent else None)

    def to_json(self) -> JsonObject:
        return {"goodput": self.goodput, "slo_met_share": self.slo_met_share}

    @staticmethod
    def from_json(f: Fields) -> Goodput:
        return Goodput(f.num("goodput"), f.num("slo_met_share"))


@dataclass(frozen=True)
class ClosedGroup:
    """The summary of one closed-loop group (a prompt length and client count), in each of its records
    as `group`."""

    clients: int
    duration_s: float
    n_sent: int
    goodput: Goodput
    server: ServingSummary | None    # runners.metrics.serving_summary of the group's /metrics readings

    def to_json(self) -> JsonObject:
        return {"arrival": "closed", "clients": self.clients, "duration_s": self.duration_s, "n_sent": self.n_sent,
                **self.goodput.to_json(), "server": server_json(self.server)}

    @staticmethod
    def from_json(f: Fields) -> ClosedGroup:
        return ClosedGroup(f.need_int("clients"), f.need_num("duration_s"), f.need_int("n_sent"),
                           Goodput.from_json(f), server_from_json(f))


def server_json(server: ServingSummary | None) -> JsonObject | None:
    """A group's `server` as JSON (a TypedDict is its JSON; the cast says so to the type checker)."""
    return cast("JsonObject | None", server)


def server_from_json(f: Fields) -> ServingSummary | None:
    """A group's stored `server` (runners.metrics.ServingSummary), checked for its figures' keys."""
    obj = f.object("server")
    if obj is None:
        return None
    missing = [k for k in ServingSummary.__annotations__ if k not in obj]
    if missing:
        raise ValueError(f"{f.source}: key 'server' lacks {', '.join(missing)}")
    return cast(ServingSummary, obj)


@dataclass(frozen=True)
class SweepStep:
    """One step of a rate sweep: where it stood, what the stop rule judged, why it stopped (or None)."""

    step: int
    figures: SweepFigures
    stop: str | None
    rule: dict[str, float]           # {"max_error_rate", "max_queue_delay_s"}

    def to_json(self) -> JsonObject:
        return {"step": self.step, **self.figures.to_json(), "stop": self.stop, "rule": dict(self.rule)}

    @staticmethod
    def from_json(f: Fields) -> SweepStep:
        return SweepStep(f.need_int("step"), SweepFigures.from_json(f), f.text("stop"), f.numbers("rule") or {})


@dataclass(frozen=True)
class RateGroup:
    """The summary of one open-loop group (a prompt length and request rate), in each of its records as
    `group`."""

    arrival: str
    rate: float
    burstiness: float | None         # gamma arrivals only
    duration_s: float
    n_sent: int
    last_send_s: float
    max_in_flight: int
    client_concurrency: int | None   # the runner's connection limit, where it has one
    slos: dict[str, float]
    goodput: Goodput
    server: ServingSummary | None
    sweep: SweepStep | None = None

    def to_json(self) -> JsonObject:
        out: JsonObject = {
            "arrival": self.arrival, "rate": self.rate, "burstiness": self.burstiness,
            "duration_s": self.duration_s, "n_sent": self.n_sent, "last_send_s": self.last_send_s,
            "max_in_flight": self.max_in_flight, "client_concurrency": self.client_concurrency,
            "slos": dict(self.slos), **self.goodput.to_json(), "server": server_json(self.server)}
        if self.sweep is not None:
            out["sweep"] = self.sweep.to_json()
        return out

    @staticmethod
    def from_json(f: Fields) -> RateGroup:
        sweep = f.at("sweep")
        return RateGroup(f.need_str("arrival"), f.need_num("rate"), f.num("burstiness"), f.need_num("duration_s"),
                         f.need_int("n_sent"), f.need_num("last_send_s"), f.need_int("max_in_flight"),
                         f.integer("client_concurrency"), f.numbers("slos") or {}, Goodput.from_json(f),
                         server_from_json(f), SweepStep.from_json(sweep) if sweep is not None else None)


def group_from_json(f: Fields) -> ClosedGroup | RateGroup:
    """A record's stored `group`: a closed-loop group's summary, or an open-loop one's."""
    return ClosedGroup.from_json(f) if f.text("arrival") == "closed" else RateGroup.from_json(f)


@dataclass(frozen=True)
class Sampling:
    """The task's sampler settings, in every record and the summary as `sampling`."""

    temperature: float               # 0 = greedy
    top_p: float | None              # None: the backend's default
    top_k: int | None
    seed: int

    def to_json(self) -> JsonObject:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed}

    @staticmethod
    def from_json(f: Fields) -> Sampling:
        return Sampling(f.need_num("temperature"), f.num("top_p"), f.integer("top_k"), f.need_int("seed"))


@dataclass(frozen=True)
class Measurement:
    """One timed request as the task measured it, before it knows its group."""

    result: GenerateResult           # its to_record_fields(): output, token ids, counts, timings
    prompt_hash: str
    prompt_tokens: int | None        # the fitted count, else the server's
    prompt_tokens_source: str | None  # "tokenizer", "server" or None
    runner_prompt_tokens: int | None
    prompt_tokens_check: dict[str, float | bool]  # tasks.base.prompt_tokens_check: {} or disagreement and flag
    output_tokens: int
    output_tokens_requested: int
    stopped_early: bool
    sampling: Sampling
    draft: DraftFigures | None
    timing: Timing
    token_times: list[float]         # written beside items.jsonl (speed_token_times.jsonl), not in the record

    @property
    def times(self) -> RequestTimes:
        """The timing fields its record will hold (the SLO checks judge these)."""
        t = self.timing
        return RequestTimes(t.ttft_s, t.prefill_tok_s, t.decode_tok_s, t.e2e_s, self.output_tokens)

    def to_json(self) -> JsonObject:
        # the result's fields first: a key it shares (prompt_tokens, output_tokens) keeps its place, takes the new value
        return {
            **self.result.to_record_fields(),
            "prompt_hash": self.prompt_hash,
            "prompt_tokens": self.prompt_tokens,
            "prompt_tokens_source": self.prompt_tokens_source,
            "runner_prompt_tokens": self.runner_prompt_tokens,
            **self.prompt_tokens_check,
            "output_tokens": self.output_tokens,
            "output_tokens_requested": self.output_tokens_requested,
            "stopped_early": self.stopped_early,
            "sampling": self.sampling.to_json(),
            **(self.draft.to_json() if self.draft else {}),
            **self.timing.to_json(),
        }


@dataclass(frozen=True)
class ClosedPlace:
    """Where a closed-loop measurement stood: its group (prompt length, clients) and turn."""

    prompt_length: int
    clients: int
    repeat: int
    client: int

    def to_json(self) -> JsonObject:
        return {"prompt_length": self.prompt_length, "clients": self.clients, "repeat": self.repeat,
                "client": self.client}


@dataclass(frozen=True)
class OpenPlace:
    """Where an open-loop request stood: its group (prompt length, rate), schedule and the load it met."""

    prompt_length: int
    arrival: str
    rate: float
    request: int
    scheduled_s: float               # its send time on the schedule, from the group's start
    sent_s: float                    # when it was sent
    in_flight_at_send: int
    sweep_step: int | None = None    # a sweep's step; None outside a sweep

    def to_json(self) -> JsonObject:
        out: JsonObject = {"prompt_length": self.prompt_length, "arrival": self.arrival, "rate": self.rate,
                               "request": self.request, "scheduled_s": self.scheduled_s, "sent_s": self.sent_s,
                               "in_flight_at_send": self.in_flight_at_send}
        if self.sweep_step is not None:
            out["sweep_step"] = self.sweep_step
        return out


@dataclass
class SpeedRecord:
    """A measured request's item record: the measurement, where it stood, the SLOs it met, its group's
    summary (set once the whole group has run) and the server's draft counters over the group (vLLM)."""

    measurement: Measurement
    place: ClosedPlace | OpenPlace
    slo: SloCheck | None = None
    group: ClosedGroup | RateGroup | None = None
    group_spec_decode: SpecDecodeDelta | None = None

    def to_json(self) -> JsonObject:
        out = {**self.measurement.to_json(), **self.place.to_json(), **(self.slo.to_json() if self.slo else {})}
        if self.group is not None:
            out["group"] = self.group.to_json()
        if self.group_spec_decode is not None:
            out["group_spec_decode"] = cast(JsonObject, self.group_spec_decode)
        return out


@dataclass(frozen=True)
class SkippedStep:
    """The record of a request of a sweep step not sent: an earlier step met the stop rule."""

    prompt_length: int
    arrival: str
    rate: float
    sweep_step: int
    stopped_at: str                  # "rate R: why"
    request: int

    def to_json(self) -> JsonObject:
        return {"prompt_length": self.prompt_length, "arrival": self.arrival, "rate": self.rate,
                "sweep_step": self.sweep_step, "sweep_skipped": True, "sweep_stopped_at": self.stopped_at,
                "request": self.request}
