"""moebench runners inside lm-evaluation-harness: an `lm_eval.api.model.LM` over any runner, and
`run_lm_eval` which evaluates lm-eval tasks and stores the samples as a moebench run.

Runners are async; lm-eval calls the model synchronously, so the runner lives on an event loop in a
background thread (`LoopThread`) and each lm-eval call waits for its batch of coroutines.

Loglikelihood, by what the runner offers (best first):
1. `prompt_logprobs` / `full_logits` (scoring.py): one teacher-forced pass over context+continuation.
2. `top_logprobs` + `token_prompts` + `tokenize` (llama-server, most HTTP servers): for each
   continuation token, a 1-token greedy generation on the token-id prompt context+prefix asking for
   the top `top_n` alternatives; the continuation token's log-prob is read from them. A single-token
   continuation (CMMLU's " A") costs one request per context, shared by all choices. A token outside
   the top `top_n` gets a floor: the smallest listed log-prob (an upper bound of the true value) and
   is counted in `stats["floored_tokens"]`; with `missing="error"` it is an error instead.
A request that fails (`RunnerError`) does not stop the evaluation: its sample becomes an `error`
record (never a wrong answer).
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Awaitable, Iterable, TypedDict, TypeVar

from lm_eval.api.model import LM

from moebench import jsonout
from moebench.json_types import JsonObject
from moebench.lmeval.importer import records_from_samples, summarize
from moebench.lmeval.local_tasks import materialize, shipped_task_names
from moebench.lmeval.scoring import prompt_scoring_kind, score_tokens
from moebench.runners.base import Capability, CapabilityError, GenerateRequest, Runner, RunnerError
from moebench.store.session import finish_run, new_manifest, open_store, record_runner_identity

log = logging.getLogger(__name__)
T = TypeVar("T")


class GenKwargs(TypedDict, total=False):
    """The generation keys of an lm-eval `generate_until` request this adapter reads (others are
    ignored)."""

    until: str | list[str]
    max_gen_toks: int
    max_tokens: int
    do_sample: bool
    temperature: float


class ModelInfo(TypedDict):
    """What `get_model_info` tells lm-eval about the model: the runner kind and the scoring used."""

    moebench_runner: str
    moebench_scoring: str | None

class LoopThread:
    """An asyncio event loop running in a daemon thread; `run` blocks until a coroutine is done."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="moebench-lmeval-loop", daemon=True)
        self._thread.start()

    def run(self, coro: Awaitable[T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        if not self.loop.is_running():
            self.loop.close()


@dataclass
class AdapterOptions:
    """How the adapter scores and generates."""

    top_n: int = 100               # alternatives asked per position on the top_logprobs path
    missing: str = "floor"         # continuation token not in the top_n: "floor" or "error"
    prefix_token_id: int | None = None   # prepended to every context (a BOS); also the empty-context token
    max_length: int = 4096         # window for loglikelihood_rolling
    seed: int = 0

    def __post_init__(self) -> None:
        if self.missing not in ("floor", "error"):
            raise ValueError(f"AdapterOptions.missing must be 'floor' or 'error', got {self.missing!r}")
        if self.top_n < 1:
            raise ValueError(f"AdapterOptions.top_n must be at least 1, got {self.top_n}")


class RunnerLM(LM):
    """lm-eval's model interface over a started moebench runner."""

    def __init__(self, runner: Runner, loop: LoopThread, options: AdapterOptions | None = None):
        super().__init__()
        self.runner = runner
        self.loop = loop
        self.options = options or AdapterOptions()
        self.scoring = prompt_scoring_kind(runner) or self._top_logprobs_path()
        self.stats = {"requests": 0, "floored_tokens": 0, "errors": 0, "scoring": self.scoring}
        # Contexts whose request failed: their samples become error records.
        self.failed_contexts: dict[str, str] = {}
        # Contexts whose continuation tokens were outside the top_n (floored): context -> count.
        self.floored_contexts: dict[str, int] = {}
        self._piece_cache: dict[int, str] = {}

    def _top_logprobs_path(self) -> str | None:
        need = {Capability.TOP_LOGPROBS, Capability.TOKEN_PROMPTS, Capability.TOKENIZE}
        return "top_logprobs" if need <= set(self.runner.capabilities) else None

    # -- helpers ----------------------------------------------------------------------------------
    def _gather(self, coros: Iterable[Awaitable[T]]) -> list[T]:
        sem = asyncio.Semaphore(max(1, int(getattr(self.runner, "concurrency", 1))))

        async def bounded(c: Awaitable[T]) -> T:
            async with sem:
                return await c

        async def all_of() -> list[T]:
            return await asyncio.gather(*(bounded(c) for c in coros))

        return self.loop.run(all_of())

    async def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids as lm-eval's TemplateLM splits them: trailing context spaces move to the
        continuation; the continuation is what tokenizing the whole adds after the context."""
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            continuation = context[-n_spaces:] + continuation
            context = context[:-n_spaces]
        prefix = [self.options.prefix_token_id] if self.options.prefix_token_id is not None else []
        if not context:
            if not prefix:
                raise RunnerError("loglikelihood with an empty context needs AdapterOptions.prefix_token_id "
                                  "(a BOS/EOS id to condition on)")
            return prefix, await self.runner.tokenize(continuation)
        whole = await self.runner.tokenize(context + continuation)
        ctx = await self.runner.tokenize(context)
        if whole[: len(ctx)] != ctx:
            # The context's tokens change when the continuation follows (a merge across the
            # boundary): score the continuation tokenized on its own instead.
            return prefix + ctx, await self.runner.tokenize(continuation)
        return prefix + ctx, whole[len(ctx):]

    async def _piece(self, token_id: int) -> str:
        if token_id not in self._piece_cache:
            self._piece_cache[token_id] = await self.runner.detokenize([token_id])
        return self._piece_cache[token_id]

    # -- loglikelihood ----------------------------------------------------------------------------
    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        if self.scoring is None:
            raise CapabilityError(
                f"runner kind {self.runner.kind!r} cannot compute log-likelihoods: it needs "
                f"prompt_logprobs or full_logits, or top_logprobs + token_prompts + tokenize "
                f"(it offers: {', '.join(sorted(self.runner.capabilities)) or 'nothing'})")
        next_token_cache: dict[tuple[int, ...], asyncio.Future] = {}

        async def one(context: str, continuation: str) -> tuple[float, bool]:
            try:
                ctx, cont = await self._encode_pair(context, continuation)
                if not cont:
                    raise RunnerError(f"continuation {continuation!r} tokenizes to nothing")
                if self.scoring == "top_logprobs":
                    before = self.stats["floored_tokens"]
                    result = await self._ll_by_top_logprobs(ctx, cont, next_token_cache)
                    if self.stats["floored_tokens"] > before:
                        self.floored_contexts[context] = (self.floored_contexts.get(context, 0)
                                                          + self.stats["floored_tokens"] - before)
                    return result
                scores = await score_tokens(self.runner, ctx + cont, top_k=1)
                self.stats["requests"] += 1
                tail = scores[len(ctx):]
                total = sum(s.logprob for s in tail)
                greedy = all(max(s.top, key=s.top.get) == tok for s, tok in zip(tail, cont) if s.top)
                return total, greedy
            except (RunnerError, CapabilityError) as e:
                self.stats["errors"] += 1
                self.failed_contexts[context] = f"{type(e).__name__}: {e}"
                return float("-inf"), False

        return self._gather(one(*r.args) for r in requests)

    async def _next_token(self, prompt: list[int], cache: dict[tuple[int, ...], asyncio.Future]) -> Any:
        """The runner's greedy next token and its top_n alternatives after `prompt` (memoized)."""
        key = tuple(prompt)
        if key not in cache:
            req = GenerateRequest(prompt=list(prompt), max_tokens=1, temperature=0.0, seed=self.options.seed,
                                  top_logprobs=self.options.top_n)
            cache[key] = asyncio.ensure_future(self.runner.generate(req))
            self.stats["requests"] += 1
        return await asyncio.shield(cache[key])

    async def _ll_by_top_logprobs(self, ctx: list[int], cont: list[int],
                                  cache: dict[tuple[int, ...], asyncio.Future]) -> tuple[float, bool]:
        total, greedy = 0.0, True
        for j, tok in enumerate(cont):
            res = await self._next_token(ctx + cont[:j], cache)
            if not res.top_logprobs:
                raise RunnerError("runner returned no top_logprobs for a 1-token scoring request")
            top = res.top_logprobs[0]
            piece = await self._piece(tok)
            if piece in top:
                total += top[piece]
            elif self.options.missing == "error":
                raise RunnerError(f"continuation token {tok} ({piece!r}) is not among the top {self.options.top_n} "
                                  f"next tokens; raise top_n or use missing='floor'")
            else:
                total += min(top.values())
                self.stats["floored_tokens"] += 1
            if res.token_ids:
                greedy = greedy and res.token_ids[0] == tok
            else:
                greedy = greedy and piece == max(top, key=top.get)
        return total, greedy

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Whole-text log-likelihood in disjoint windows (perplexity tasks); needs one-pass scoring."""
        from lm_eval import utils as lm_utils

        if prompt_scoring_kind(self.runner) is None:
            raise CapabilityError(
                f"loglikelihood_rolling needs a runner with prompt_logprobs or full_logits; runner kind "
                f"{self.runner.kind!r} offers {', '.join(sorted(self.runner.capabilities)) or 'nothing'} "
                f"(scoring every token through top-n generations would be both slow and floored)")
        prefix = self.options.prefix_token_id
        if prefix is None:
            raise CapabilityError("loglikelihood_rolling needs AdapterOptions.prefix_token_id (BOS/EOS id)")

        async def one(text: str) -> float:
            try:
                ids = await self.runner.tokenize(text)
                total = 0.0
                for ctx, pred in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                        token_list=ids, prefix_token=prefix, max_seq_len=self.options.max_length, context_len=1)):
                    seq = list(ctx) + list(pred)
                    scores = await score_tokens(self.runner, seq, top_k=1)
                    self.stats["requests"] += 1
                    total += sum(s.logprob for s in scores[len(seq) - len(pred):])
                return total
            except RunnerError as e:
                self.stats["errors"] += 1
                self.failed_contexts[text] = f"{type(e).__name__}: {e}"
                return float("nan")

        return self._gather(one(r.args[0]) for r in requests)

    # -- generation -------------------------------------------------------------------------------
    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        if Capability.GENERATE not in self.runner.capabilities:
            raise CapabilityError(f"runner kind {self.runner.kind!r} cannot generate")

        async def one(context: str, gen_kwargs: GenKwargs | None) -> str:
            kw = dict(gen_kwargs or {})
            until = kw.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_tokens = int(kw.pop("max_gen_toks", kw.pop("max_tokens", 256)))
            do_sample = bool(kw.pop("do_sample", False))
            temperature = float(kw.pop("temperature", 0.0)) if do_sample else 0.0
            req = GenerateRequest(prompt=context, max_tokens=max_tokens, stop=until,
                                  temperature=temperature, seed=self.options.seed)
            try:
                res = await self.runner.generate(req)
                self.stats["requests"] += 1
            except RunnerError as e:
                self.stats["errors"] += 1
                self.failed_contexts[context] = f"{type(e).__name__}: {e}"
                return ""
            text = res.text
            for s in until:               # a runner may return the stop string; lm-eval expects it cut
                if s and s in text:
                    text = text[: text.index(s)]
            return text

        return self._gather(one(*r.args) for r in requests)

    def get_model_info(self) -> ModelInfo:
        return {"moebench_runner": self.runner.kind, "moebench_scoring": self.scoring}


# -- run_lm_eval ----------------------------------------------------------------------------------

def _context_of(sample: JsonObject) -> str | None:
    """The first request's context of an lm-eval sample row as simple_evaluate gives it."""
    args = sample.get("arguments") or []
    first = args[0] if args else None
    return first[0] if isinstance(first, (list, tuple)) and first else None


def evaluate_runner(runner: Runner, tasks: list[str], limit: int | None, out_dir: Path,
                    runner_profile: Any = None, options: AdapterOptions | None = None,
                    label: str | None = None) -> Path:
    """Run lm-eval `tasks` on an (unstarted) runner and store the samples as a moebench run."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from moebench.datasets import data_dir

    if not tasks:
        raise ValueError("lm-eval: no tasks given")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    root = data_dir()
    include = materialize(out_dir / "lm_eval_tasks", root)   # kept with the run: the exact YAMLs used
    # Indexing lm-eval's ~15k built-in YAMLs takes many seconds; skip it when ours cover the request.
    include_defaults = not set(tasks) <= shipped_task_names(root)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")    # local files only: never reach for the hub

    manifest = new_manifest(
        label or (runner_profile.name if runner_profile is not None else runner.kind),
        {"name": "lm-eval", "tasks": [{"task": t} for t in tasks]},
        runner_profile.redacted() if runner_profile is not None else {"kind": runner.kind}, root,
        source="moebench lm-eval", limit=limit,
        lm_eval={"version": getattr(lm_eval, "__version__", None), "tasks": tasks,
                 "include_path": str(include), "include_defaults": include_defaults},
        adapter=asdict(options or AdapterOptions()))
    store = open_store(out_dir, manifest, runner_profile.settings.to_json() if runner_profile is not None else None)
    loop = LoopThread()
    lm = None
    status = "failed"
    try:
        loop.run(runner.start(str(out_dir)))
        record_runner_identity(store, runner)
        lm = RunnerLM(runner, loop, options)
        tm = TaskManager(include_path=str(include), include_defaults=include_defaults)
        results = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), limit=limit, log_samples=True,
                                          task_manager=tm)
        samples = results.get("samples", {}) if results else {}
        ready = []
        for task_name, rows in samples.items():
            for row, rec in zip(rows, records_from_samples(task_name, rows)):   # one record per row
                ctx = _context_of(row)
                if ctx in lm.floored_contexts:     # a score is a bound, not a value: say so per item
                    rec.floored_tokens = lm.floored_contexts[ctx]
                if ctx in lm.failed_contexts:
                    rec.fail(lm.failed_contexts[ctx])
                ready.append(rec)
        store.append_many(ready)
        aggregate = {k: v for k, v in (results or {}).items() if k != "samples"}
        (out_dir / "lm_eval_results.json").write_text(
            jsonout.document_text(aggregate, indent=2, ensure_ascii=False, default=str), encoding="utf-8")
        status = "complete"
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    except Exception as e:
        store.add_event("failed", message=f"{type(e).__name__}: {e}")
        raise
    finally:
        try:
            loop.run(runner.close())
        finally:
            loop.stop()
            records = list(store.records().values())
            finish_run(store, status, runner, summarize(records), adapter_stats=lm.stats if lm else None)
            store.close()
    return out_dir


def run_lm_eval(runner_profile_path: str | os.PathLike[str], tasks: list[str], limit: int | None,
                out_dir: Path, options: AdapterOptions | None = None, label: str | None = None) -> Path:
    """Evaluate lm-eval `tasks` with the runner of a moebench profile; returns the run directory.

    The shipped gsm8k and cmmlu tasks read the local data mirror; any other lm-eval task name works
    where its data can be loaded (see docs/lm-eval.md).
    """
    from moebench.runners import load_runner_profile, make_runner

    profile = load_runner_profile(runner_profile_path)
    return evaluate_runner(make_runner(profile), tasks, limit, Path(out_dir), runner_profile=profile,
                           options=options, label=label)
