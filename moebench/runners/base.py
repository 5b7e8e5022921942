"""The runner contract: one backend that tasks ask for completions, log-probs and token counts.

A runner declares its capabilities up front; a task declares what it needs; `check_capabilities`
reports a mismatch before any work starts (never mid-run).

All request methods are async so HTTP runners can keep several requests in flight; in-process
runners (the engine) run their blocking work in a worker thread. Concurrency is bounded by the
task executor through `Runner.concurrency`.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, TypedDict

if sys.version_info >= (3, 11):
    from typing import NotRequired
else:                                   # pyproject installs typing_extensions there
    from typing_extensions import NotRequired

from moebench.config import RunnerSettings
from moebench.json_types import JsonObject
from moebench.runners.identity import EngineTelemetry, RunnerIdentity


class Capability:
    """Names of the things a runner can do (a task lists the ones it needs)."""

    GENERATE = "generate"              # text completion from a prompt
    STREAM = "stream"                  # per-token arrival times (speed task)
    TOP_LOGPROBS = "top_logprobs"      # top-k log-probs of each generated token's distribution
    PROMPT_LOGPROBS = "prompt_logprobs"  # top-k log-probs at every prompt position (teacher forcing)
    PROMPT_LOGPROB_IDS = "prompt_logprob_ids"  # also log-probs of given token ids at every prompt position
    FULL_LOGITS = "full_logits"        # the whole next-token distribution at every position
    TOKENIZE = "tokenize"              # text -> token ids with the runner's own tokenizer
    TOKEN_PROMPTS = "token_prompts"    # prompts given as token ids
    ROUTER_TRACE = "router_trace"      # per-layer top-k expert ids and weights per token
    CHOICE_LOGPROBS = "choice_logprobs"  # next-token log-probs of given choice strings, none missed
    SAMPLING = "sampling"              # top_p and top_k truncation when sampling (temperature > 0)
    # a seeded, untruncated temperature-1 sample after token ids with the log-prob of each sampled
    # token (`runner.sampled_logprobs`): the sampled KLD's baseline
    SAMPLED_LOGPROBS = "sampled_logprobs"
    # KLD by llama.cpp's llama-perplexity on the runner's own model, build and flags
    # (`runner.perplexity_plan()`); needs no server running.
    LLAMA_PERPLEXITY = "llama_perplexity"


# Capabilities a runner serves without its server process: a suite that needs only these starts none.
SERVERLESS = frozenset({Capability.LLAMA_PERPLEXITY})


class RunnerError(Exception):
    """A request failed for a reason worth recording (bad response, server died, timeout).

    Tasks turn it into an `error` record; it is never counted as a wrong answer.
    """


class Unreachable(RunnerError):
    """Every attempt of a request failed to connect to the server (refused, no route, connect timeout):
    nothing answered, so the run can tell a server that is down from one that answers badly."""



class DeadlineExceeded(RunnerError):
    """A request got no complete reply within its runner's `request_deadline_s`."""


# A slow server may answer a long generation in minutes; one that drips a byte now and then, each
# inside the per-read timeout, must still not hold an item for hours.
DEFAULT_REQUEST_DEADLINE_S = 1800.0

class CapabilityError(Exception):
    """The runner lacks something the suite needs; raised before any item is asked."""


@dataclass
class GenerateRequest:
    """One completion request.

    prompt: text, or token ids where the runner has `token_prompts`.
    top_logprobs: how many alternatives to return per generated position (0 = none).
    """

    prompt: str | list[int]
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    temperature: float = 0.0
    seed: int | None = 0
    top_p: float | None = None    # nucleus sampling; None leaves the backend's default
    top_k: int | None = None      # top-k sampling; None leaves the backend's default
    top_logprobs: int = 0
    stream: bool = False          # ask for per-token arrival times
    ignore_eos: bool = False      # keep generating past EOS (speed measurements)
    cache_prompt: bool = True     # False where a measurement must not reuse a cached prefix
    # Called with each new piece of output text as it is generated (runners that stream: engine,
    # llama-server and http with `stream`), before stop strings are applied, so the pieces may run
    # past the final text's end; possibly from a worker thread. `moebench serve` streams with it.
    on_text: Callable[[str], None] | None = field(default=None, repr=False, compare=False)


# A server's `timings` object as checked (moebench.runners.reply_checks.timings): its own keys
# (llama-server's prompt_n, predicted_ms, draft_n, ... and whatever else a server adds), each a
# finite number or null; runners add their clock figures (wall_s, first_content_s, ...), and the
# llama-server runner the reply's stop_type (text).
ServerTimings = dict[str, float | str | None]


class RunnerEvent(TypedDict):
    """Something that happened to the backend during the run: the llama-server runner's "restart",
    "restart_failed" and "gave_up" (why, the exit code, when, restarts so far, the pids) and
    "reconnect" (a live server's dropped connection, the request sent again: why, when, how many so
    far), the engine runner's "fallback" (`what` it gave up and the error)."""

    event: str
    reason: NotRequired[str]
    exit_code: NotRequired[int | None]
    time: NotRequired[str]
    restarts: NotRequired[int]
    reconnects: NotRequired[int]
    old_pid: NotRequired[int]
    new_pid: NotRequired[int | None]
    what: NotRequired[str]
    error: NotRequired[str]


@dataclass(frozen=True)
class CountMismatch:
    """A server's output count beyond the tolerance around the client's: the record's
    `server_count_mismatch`."""

    field: str                      # the reply field the server's count came from
    server: int
    client: int | None
    client_source: str              # OutputCount.source
    allowed: tuple[int, int]        # the range the server's count had to lie in

    def to_json(self) -> dict[str, str | int | list[int] | None]:
        return {"field": self.field, "server": self.server, "client": self.client,
                "client_source": self.client_source, "allowed": list(self.allowed)}


class RecordFields(TypedDict):
    """GenerateResult.to_record_fields(): the reply's fields every task copies into its record
    (docs/schema.md items.jsonl), the optional ones present only where the reply had them."""

    output: str
    output_token_ids: list[int] | None
    prompt_tokens: int | None
    output_tokens: int | None
    finish_reason: str | None
    timings: NotRequired[ServerTimings]
    endpoint: NotRequired[str]
    reasoning: NotRequired[str]
    reasoning_tokens: NotRequired[int | None]
    output_tokens_source: NotRequired[str]
    server_count_mismatch: NotRequired[dict[str, str | int | list[int] | None]]
    resends: NotRequired[int]


@dataclass
class GenerateResult:
    """What came back for one request.

    top_logprobs: one dict per generated position, token text -> log-prob (as the server spells it).
    token_times: host clock (time.perf_counter seconds) at which each output token arrived,
    relative to the request start (`sent_at` where the runner sets it); filled where the runner streams.
    sent_at: the host clock (time.perf_counter) at which the request that answered was sent; later than
    the call where the runner sent it again (`resends` times: a dropped connection, a retried
    status), so a caller that times the call itself can tell the request's own span from the wait.
    """

    text: str
    token_ids: list[int] | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    finish_reason: str | None = None
    top_logprobs: list[dict[str, float]] | None = None
    token_times: list[float] | None = None
    timings: ServerTimings = field(default_factory=dict)
    endpoint: str | None = None
    # Chat models that think first: their reasoning text, kept apart from `text` (the answer), and
    # its token count where the server reports one.
    reasoning: str | None = None
    reasoning_tokens: int | None = None
    # How `output_tokens` was obtained: "server" (the server's count, checked against the client's),
    # or the client's own count where the server gave none or one beyond the tolerance
    # (moebench.runners.reply_checks); None where the runner does not say.
    output_tokens_source: str | None = None
    # The server's output count and the client's, where they disagree beyond the tolerance.
    server_count_mismatch: CountMismatch | None = None
    sent_at: float | None = None
    resends: int = 0

    def to_record_fields(self) -> RecordFields:
        """The fields every task copies into its record."""
        out: RecordFields = {
            "output": self.text,
            "output_token_ids": self.token_ids,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "finish_reason": self.finish_reason,
        }
        if self.timings:
            out["timings"] = self.timings
        if self.endpoint:
            out["endpoint"] = self.endpoint
        if self.reasoning is not None:
            out["reasoning"] = self.reasoning
            out["reasoning_tokens"] = self.reasoning_tokens
        if self.output_tokens_source is not None:
            out["output_tokens_source"] = self.output_tokens_source
        if self.server_count_mismatch is not None:
            out["server_count_mismatch"] = self.server_count_mismatch.to_json()
        if self.resends:
            out["resends"] = self.resends
        return out


class Runner:
    """Base class for backends. Subclasses set `kind`, `capabilities` and override what they can do."""

    kind: str = "base"
    capabilities: frozenset[str] = frozenset()
    # capability -> the profile keys that add it (named in a CapabilityError); empty where none can
    capability_keys: dict[str, str] = {}
    # the kind's typed profile settings (each kind subclasses RunnerSettings with its keys)
    settings_class: type[RunnerSettings] = RunnerSettings

    def __init__(self, settings: RunnerSettings | JsonObject, profile_path: str | None = None,
                 name: str | None = None):
        """`settings`: the kind's settings, or a table of its keys (missing ones take their defaults);
        `name`: the profile's label (a table may carry it as "name")."""
        self.settings = self.settings_class.of(settings)
        self.name = name or (settings.get("name") if isinstance(settings, Mapping) else None)
        self.profile_path = profile_path
        self.concurrency: int = self.settings.concurrency
        # Things that happened to the backend during the run (restarts, ...). Nothing copies them into the
        # manifest yet: they stay on the runner.
        self.events: list[RunnerEvent] = []
        # What the suite needs, set by the run before start(): a runner may skip starting what no
        # task needs (a llama-server runner starts no server for a KLD-only suite). None = everything.
        self.needed: set[str] | None = None

    # -- life cycle -------------------------------------------------------------------------------
    async def start(self, run_dir: str | None = None) -> None:
        """Bring the backend up (spawn a server, load a model). `run_dir` receives logs."""

    async def close(self) -> None:
        """Release everything; must be safe to call twice and after a failed start."""

    async def warmup(self) -> None:
        """Run a little work before the measured idle window, so the backend is warm (compiled kernels,
        captured graphs, clocks up) when the run measures its idle draw. A no-op by default."""

    def telemetry(self) -> EngineTelemetry | None:
        """What the backend measured about itself over the run (the engine: torch memory per phase,
        tier counters, the decode path it chose), for the manifest's "engine" key; None when nothing."""
        return None

    # -- identity -------------------------------------------------------------------------------
    def identity(self) -> RunnerIdentity:
        """Model and build identity for the manifest: {"model": {...}, "build": {...}}."""
        return {"model": {"name": getattr(self.settings, "model", None)}, "build": {}}

    # -- requests -------------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        raise CapabilityError(f"runner kind {self.kind!r} cannot generate")

    async def tokenize(self, text: str) -> list[int]:
        raise CapabilityError(f"runner kind {self.kind!r} cannot tokenize")

    async def choice_logprobs(self, prompt: str | list[int], choices: list[str]) -> tuple[dict[str, float | None], str]:
        """Next-token log-probs of each choice string (each a single token), and how they were obtained:
        "exact" (the model's log-probs) or "renormalized" (log-probs renormalised over the choices, same
        ranking). A choice that is not one token gets None."""
        raise CapabilityError(f"runner kind {self.kind!r} cannot score choices")

    async def detokenize(self, token_ids: list[int]) -> str:
        raise CapabilityError(f"runner kind {self.kind!r} cannot detokenize")

    async def sampled_logprobs(self, prompt_ids: list[int], max_tokens: int, seed: int) -> tuple[list[int], list[float]]:
        """Exactly `max_tokens` token ids sampled after `prompt_ids` at temperature 1 without truncation
        or penalties (EOS does not stop it), seeded by `seed`, and each sampled token's log-prob under the
        distribution it was drawn from."""
        raise CapabilityError(f"runner kind {self.kind!r} cannot sample with log-probs")

    # -- model facts a task may ask for (None where the runner does not know) --------------------
    def vocab_size(self) -> int | None:
        """Rows of the model's next-token distribution."""
        return None

    def startup_note(self, run_dir: str | None) -> str:
        """One line saying what start() is about to do (printed before it, as it may take a while)."""
        return f"starting the {self.kind} runner"

    def declared_vocab_size(self) -> int | None:
        """The vocabulary size known before start() (from the model's files), for checks before any
        work; None where only the running backend knows it."""
        return None

    def bos_policy(self) -> tuple[bool, int | None]:
        """(whether the model's tokenizer adds BOS to a text, the BOS id)."""
        return False, None

    def num_experts(self) -> int | None:
        """Routed experts per MoE layer (router statistics size their histograms by it)."""
        return None

    def prompt_logprobs_top_k(self) -> int | None:
        """How many log-probs per prompt position the backend returns with `prompt_logprobs`
        (None: as many as asked)."""
        return None

    async def server_metrics(self) -> dict[str, float] | None:
        """The backend's Prometheus counters (name -> value), or None where it exposes none."""
        return None

    async def __aenter__(self) -> "Runner":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


def check_capabilities(runner: Runner, needs: dict[str, set[str]]) -> None:
    """Raise CapabilityError naming every task whose needs the runner does not meet.

    `needs` maps a task name to the set of capabilities it requires.
    """
    problems = []
    for task, required in needs.items():
        missing = sorted(set(required) - set(runner.capabilities))
        if missing:
            problems.append(f"task {task!r} needs {', '.join(missing)}")
    if problems:
        have = ", ".join(sorted(runner.capabilities)) or "nothing"
        missing_all = sorted({c for required in needs.values() for c in set(required) - set(runner.capabilities)})
        hints = [f"{c}: {runner.capability_keys[c]}" for c in missing_all if c in runner.capability_keys]
        where = f" to {runner.profile_path}" if runner.profile_path else ""
        raise CapabilityError(
            f"runner kind {runner.kind!r} cannot serve this suite: " + "; ".join(problems)
            + f" (it offers: {have})"
            + (f". Profile keys that would add them{where}: " + "; ".join(hints) if hints else "")
        )

