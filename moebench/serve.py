"""An OpenAI-compatible HTTP server over any moebench runner (`moebench serve --runner PROFILE`).

Endpoints: `GET /health`, `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`, and
the tokenizer endpoints lm-eval's `local-completions` auto-detects (`GET /tokenizer_info`,
`POST /tokenize`, `POST /detokenize`, vLLM-style), and `GET /metrics`, a Prometheus page of the
scheduler's state (METRICS below). Built on aiohttp (installed with lm-eval's API extra).

Safety: binds 127.0.0.1 by default; beyond loopback it requires a bearer key (`api_key`, from the
environment variable `--api-key-env` names), checked on every endpoint but /health; request bodies
over `max_body_bytes` get 413; at most `max_concurrency` requests run at once and `max_queue` more
wait, beyond that 429 with `Retry-After`. Every error is a JSON body
`{"error": {"message", "type", "code"}}` with a 4xx/5xx status.

Abuse: request headers must arrive within `header_timeout_s` (else the connection is closed), a
body whole within `body_timeout_s` (else 408) and nest at most `max_json_depth`
levels; a request holds at most `max_prompts_per_request` prompts and `max_prompt_tokens_per_request`
prompt tokens; every numeric parameter must be finite and in range, token ids within the vocabulary
and prompt + max_tokens within the model's context (each a 400 naming the parameter). A client that
disconnects cancels its request: no further batch item starts, and a runner that generates on a worker
thread (the engine runner) stops at its next token, through GenerateRequest.on_text. That is one INFO
line in the log, not a traceback.

Streaming: `stream: true` sends text as the runner generates it (GenerateRequest.on_text), holding
back only what could still be the start of a stop string; a completions request with several prompts
or `echo` is sent after generation. `stream_options.include_usage` adds a last chunk with empty
choices carrying the usage (every chunk before it has "usage": null), as OpenAI and vLLM do. Limits (the Runner contract's, documented in docs/lm-eval.md):
prompt log-probs (`echo` with
`logprobs`) need a runner with `prompt_logprobs` or `full_logits`; with only `top_logprobs`, a
generated token's own log-prob is null when it is not among the returned alternatives.
"""
from __future__ import annotations

import asyncio
import ctypes
import hmac
import ipaddress
import json
import logging
import math
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from moebench import jsonout
from moebench.json_fields import is_of
from moebench.json_types import JsonObject, JsonValue
from moebench.lmeval.scoring import TokenScore, prompt_scoring_kind, score_tokens
from moebench.runners.base import Capability, CapabilityError, GenerateRequest, Runner, RunnerError
from moebench.scoring.answers import first_stop

log = logging.getLogger(__name__)

MAX_LOGPROBS = 100
MAX_SEED = 2**63 - 1        # a seed every backend takes (int64; numpy and torch refuse more or negatives)
TRIM_AFTER_BYTES = 1 << 20  # bodies this large hand their freed memory back to the OS afterwards


@dataclass
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 4 << 20        # 4 MiB: far above any sane prompt, far below memory trouble
    max_concurrency: int | None = None   # requests running at once; None = the runner's concurrency
    max_queue: int = 64                  # requests waiting for a slot before 429
    max_tokens_limit: int = 32768        # largest max_tokens accepted
    max_logprobs: int = MAX_LOGPROBS     # largest `logprobs` accepted (vLLM's --max-logprobs); the
                                         # vocabulary size gives whole distributions (exact KLD over HTTP)
    model_name: str | None = None        # the id /v1/models reports; None = the runner's name
    api_key: str | None = None           # bearer key every endpoint but /health requires; None = open
    retry_after_s: int = 1               # what a 429 asks the client to wait
    header_timeout_s: float = 30.0       # a connection's request headers must arrive within this of its
                                         # opening or its last response, else it is closed (idle ones too)
    body_timeout_s: float = 30.0         # the whole body must arrive within this after the headers (else 408)
    max_json_depth: int = 64             # nesting levels a body may have (OpenAI bodies use under 10)
    max_prompts_per_request: int = 256   # prompts in one /v1/completions request
    max_prompt_tokens_per_request: int = 262144   # prompt tokens over all prompts of one request


def wire_json(data: Any) -> str:
    """Standard JSON on the wire, as strict clients parse it: a non-finite number a runner produced
    (a -inf log-prob) is sent as null, never as NaN or Infinity."""
    try:
        return jsonout.dumps(data, ensure_ascii=False)
    except jsonout.NonFiniteValue:
        return jsonout.dumps(jsonout.standard(data)[0], ensure_ascii=False)


def _json_response(data: Any, **kwargs: Any) -> web.Response:
    return web.json_response(data, dumps=wire_json, **kwargs)


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.headers = headers or {}


def _error_response(status: int, message: str, type_: str, param: str | None = None,
                    headers: dict[str, str] | None = None) -> web.Response:
    return _json_response({"error": {"message": message, "type": type_, "param": param, "code": status}},
                             status=status, headers=headers)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _bearer_auth(api_key: str | None):
    """Middleware: without the right `Authorization: Bearer KEY`, 401 (constant-time comparison)."""
    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        if api_key is not None and request.path != "/health":
            given = request.headers.get("Authorization", "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
                return _error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                       "authentication_error", headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)
    return check


# GET /metrics: name -> (type, help). A load test reads the queue and running counts as it does vLLM's
# vllm:num_requests_waiting / vllm:num_requests_running (moebench/runners/metrics.py).
METRICS = {
    "moebench:num_requests_running": ("gauge", "Requests holding a slot (generating)."),
    "moebench:num_requests_waiting": ("gauge", "Requests waiting for a slot."),
    "moebench:requests_admitted_total": ("counter", "Requests that got a slot."),
    "moebench:requests_rejected_total": ("counter", "Requests refused with 429 (queue full)."),
}


class ClientGone(Exception):
    """Raised in the runner's generation (through on_text) once the request's client has disconnected."""


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


_GONE_LOGGED = web.RequestKey("moebench_gone_logged", bool)


def _log_client_gone(request: web.Request, where: str) -> None:
    """One INFO line per request whose client left: an ordinary event, not a server fault."""
    if not request.get(_GONE_LOGGED):
        request[_GONE_LOGGED] = True
        log.info("%s %s: the client disconnected %s; its work was stopped", request.method, request.path, where)


def _trim_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc keeps a large body's and tokenization's freed
    memory otherwise, and the process stays hundreds of MB larger). No-op where there is no glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


@web.middleware
async def _trim_after_large_bodies(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    finally:
        if (request.content_length or 0) >= TRIM_AFTER_BYTES:
            _trim_heap()


@web.middleware
async def _json_errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except asyncio.CancelledError:
        # aiohttp cancels the handler when its client disconnects (handler_cancellation)
        if _client_gone(request):
            _log_client_gone(request, "before its answer was complete")
        raise
    except (ConnectionError, ClientGone) as e:
        if not _client_gone(request):
            log.exception("unhandled error in %s", request.path)
            return _error_response(500, f"internal error: {type(e).__name__}: {e}", "server_error")
        _log_client_gone(request, "while its answer was being sent")
        return web.Response(status=499)       # nginx's "client closed request": nobody reads it
    except ApiError as e:
        return _error_response(e.status, e.message, e.type, e.param, e.headers)
    except web.HTTPRequestEntityTooLarge as e:
        return _error_response(413, f"request body too large: {e.text}", "invalid_request_error")
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error_response(e.status, f"{request.method} {request.path}: {e.reason}",
                               "invalid_request_error" if e.status < 500 else "server_error")
    except CapabilityError as e:
        return _error_response(400, str(e), "invalid_request_error")
    except RunnerError as e:
        return _error_response(502, f"the backend failed: {e}", "server_error")
    except Exception as e:          # a bug must not kill the server; say what happened
        log.exception("unhandled error in %s", request.path)
        return _error_response(500, f"internal error: {type(e).__name__}: {e}", "server_error")


# -- request validation ---------------------------------------------------------------------------

def _get(body: JsonObject, key: str, types: type | tuple[type, ...], default: Any,
         lo: float | None = None, hi: float | None = None) -> Any:
    """body[key] (default when absent or null), checked to be of `types`, finite and within [lo, hi]."""
    if key not in body or body[key] is None:
        return default
    v = body[key]
    if isinstance(v, float) and not math.isfinite(v):     # Python's JSON reads NaN, Infinity, 1e999
        raise ApiError(400, f"'{key}' must be a finite number, got {v}", param=key)
    ts = types if isinstance(types, tuple) else (types,)
    if not is_of(v, ts):
        names = {int: "an integer", float: "a number", bool: "a boolean", str: "a string", list: "a list"}
        raise ApiError(400, f"'{key}' must be {' or '.join(names.get(t, t.__name__) for t in ts)}, "
                            f"got {json.dumps(v)[:80]}", param=key)
    if lo is not None and v < lo or hi is not None and v > hi:
        raise ApiError(400, f"'{key}' must be between {lo} and {hi}, got {v}", param=key)
    return v


def _stream_usage(body: JsonObject, stream: bool) -> bool:
    """`stream_options.include_usage`: a last chunk with empty choices carrying the usage, as OpenAI and
    vLLM send it (serving benchmarks count tokens with it); every chunk before it has "usage": null."""
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    if not stream:
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true", param="stream_options")
    return bool(_get(opts, "include_usage", bool, False))


async def _as_label(token_id: int) -> str:
    return f"token_id:{token_id}"


def _stops(body: JsonObject) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return [s for s in stop if s]
    raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")


def _prompts(body: JsonObject) -> list[str | list[int]]:
    """OpenAI accepts a string, a list of strings, a token list, or a list of token lists."""
    if "prompt" not in body:
        raise ApiError(400, "missing 'prompt'", param="prompt")
    p = body["prompt"]
    is_ids = lambda x: isinstance(x, list) and x and all(is_of(t, (int,)) and t >= 0 for t in x)
    if isinstance(p, str):
        return [p]
    if is_ids(p):
        return [p]
    if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        return list(p)
    if isinstance(p, list) and p and all(is_ids(x) for x in p):
        return list(p)
    raise ApiError(400, "'prompt' must be a string, a list of strings, a list of token ids (non-negative "
                        "integers) or a list of such lists, and not empty", param="prompt")


@dataclass(frozen=True)
class Sampling:
    """How a request asks to sample: checked from its body (`_sampling`), handed to the runner."""

    temperature: float
    top_p: float | None          # None: the runner's default
    top_k: int | None            # None: the runner's default (0 and -1 in a request mean "off")
    seed: int | None
    ignore_eos: bool             # vLLM's and llama-server's extension


@dataclass
class Generation:
    """One prompt's generation, from which the endpoints build their answers."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int | None
    prompt_ids: list[int] | None
    # asked with logprobs: the token id of each scored position, and its (piece, log-prob,
    # {piece: log-prob} of the alternatives)
    entry_ids: list[int] | None = None
    logprob_entries: list[tuple[str, float | None, dict[str, float] | None]] | None = None


def _sampling(body: JsonObject) -> Sampling:
    """temperature, top_p, top_k and seed, checked (a 400 naming the parameter); the OpenAI penalties
    are checked too, though no runner applies them."""
    temperature = float(_get(body, "temperature", (int, float), 1.0, 0, 100))
    top_p = _get(body, "top_p", (int, float), None, 0, 1)
    if top_p is not None and top_p <= 0:
        raise ApiError(400, f"'top_p' must be above 0 and at most 1, got {top_p}", param="top_p")
    top_k = _get(body, "top_k", int, None, -1, 1 << 31)
    for key in ("presence_penalty", "frequency_penalty"):
        _get(body, key, (int, float), None, -2, 2)
    seed = _get(body, "seed", int, None, 0, MAX_SEED)
    ignore_eos = _get(body, "ignore_eos", bool, False)
    return Sampling(temperature=temperature, top_p=None if top_p is None else float(top_p),
                    top_k=top_k if top_k is None or top_k > 0 else None, seed=seed, ignore_eos=ignore_eos)


@dataclass(frozen=True)
class CompletionsRequest:
    """A `/v1/completions` body, checked (a 400 naming the parameter, in the order OpenAI's fields are
    read): what the handler generates from."""

    prompts: list[str | list[int]]
    several: bool                  # a list of prompts, each answered by its own index
    max_tokens: int
    sampling: Sampling
    stop: list[str]
    n_logprobs: int | None         # None: no log-probs asked
    echo: bool
    as_ids: bool                   # return_tokens_as_token_ids
    stream: bool
    include_usage: bool

    @classmethod
    def from_json(cls, body: JsonObject, max_tokens_limit: int, max_logprobs: int) -> "CompletionsRequest":
        prompts = _prompts(body)
        if _get(body, "n", int, 1) != 1:
            raise ApiError(400, "only n = 1 is supported", param="n")
        max_tokens = _get(body, "max_tokens", int, 16, 0, max_tokens_limit)
        sampling = _sampling(body)
        stop = _stops(body)
        n_logprobs = _get(body, "logprobs", int, None, 0, max_logprobs)
        echo = _get(body, "echo", bool, False)
        as_ids = _get(body, "return_tokens_as_token_ids", bool, False)
        stream = _get(body, "stream", bool, False)
        include_usage = _stream_usage(body, stream)
        raw = body["prompt"]
        several = isinstance(raw, list) and not all(isinstance(t, int) for t in raw)
        return cls(prompts=prompts, several=several, max_tokens=max_tokens, sampling=sampling, stop=stop,
                   n_logprobs=n_logprobs, echo=echo, as_ids=as_ids, stream=stream, include_usage=include_usage)


@dataclass(frozen=True)
class ChatRequest:
    """A `/v1/chat/completions` body, checked (a 400 naming the parameter): the ChatML prompt of its
    messages and how to answer it."""

    prompt: str
    max_tokens: int
    sampling: Sampling
    stop: list[str]                # the request's, then the end-of-turn marker
    n_logprobs: int | None         # top_logprobs where logprobs is true, else None
    stream: bool
    include_usage: bool

    @classmethod
    def from_json(cls, body: JsonObject, max_tokens_limit: int) -> "ChatRequest":
        prompt = chat_prompt(body.get("messages"))
        if _get(body, "n", int, 1) != 1:
            raise ApiError(400, "only n = 1 is supported", param="n")
        max_tokens = _get(body, "max_completion_tokens", int, None, 0, max_tokens_limit)
        if max_tokens is None:
            max_tokens = _get(body, "max_tokens", int, 256, 0, max_tokens_limit)
        sampling = _sampling(body)
        stop = _stops(body) + ["<|im_end|>"]
        want_lp = _get(body, "logprobs", bool, False)
        top_n = _get(body, "top_logprobs", int, 0, 0, 20)
        if top_n and not want_lp:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        stream = _get(body, "stream", bool, False)
        return cls(prompt=prompt, max_tokens=max_tokens, sampling=sampling, stop=stop,
                   n_logprobs=top_n if want_lp else None, stream=stream, include_usage=_stream_usage(body, stream))


def chat_prompt(messages: JsonValue) -> str:
    """A ChatML prompt (Qwen-family models know these markers):
    <|im_start|>role\\ncontent<|im_end|>\\n ... <|im_start|>assistant\\n"""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    parts = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise ApiError(400, f"messages[{i}] must be an object with role system|user|assistant",
                           param="messages")
        content = m.get("content")
        if isinstance(content, list):      # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(c, dict) and c.get("type") == "text" and isinstance(c.get("text"), str)
                       for c in content):
                raise ApiError(400, f"messages[{i}].content parts must all be text", param="messages")
            content = "".join(c["text"] for c in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", param="messages")
        role = "system" if m["role"] == "developer" else m["role"]
        parts.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
    return "".join(parts) + "<|im_start|>assistant\n"


def _json_depth_over(value: Any, limit: int) -> bool:
    """Whether a parsed JSON value nests more than `limit` levels (iterative: no recursion limit)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if depth > limit:
            return True
        children = v.values() if isinstance(v, dict) else v
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def _stop_when_gone(gone: threading.Event, forward=None):
    """An on_text callback that raises ClientGone once `gone` is set and otherwise passes the text on
    to `forward` (if any). It runs where the runner calls on_text, often its worker thread."""
    def on_text(piece: str) -> None:
        if gone.is_set():
            raise ClientGone("the client disconnected")
        if forward is not None:
            forward(piece)
    return on_text


class Server:
    """The request handlers over one started runner."""

    def __init__(self, runner: Runner, options: ServeOptions):
        self.runner = runner
        self.options = options
        self.model_name = options.model_name or str(runner.name or runner.kind)
        limit = options.max_concurrency or max(1, int(getattr(runner, "concurrency", 1)))
        self.slots = asyncio.Semaphore(limit)
        self.max_concurrency = limit
        self.waiting = 0
        self.running = 0
        self.admitted = 0
        self.rejected = 0
        self._pieces: dict[int, str] = {}

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.options.max_body_bytes,
                              middlewares=[_trim_after_large_bodies, _json_errors,
                                           _bearer_auth(self.options.api_key)])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/tokenizer_info", self.tokenizer_info)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/metrics", self.metrics)
        return app

    # -- plumbing ---------------------------------------------------------------------------------
    async def _body(self, request: web.Request) -> JsonObject:
        """The request's JSON object as sent, bounded in size, time and depth; the endpoint parses it."""
        if request.content_length is not None and request.content_length > self.options.max_body_bytes:
            raise ApiError(413, f"request body of {request.content_length} bytes exceeds the limit of "
                                f"{self.options.max_body_bytes} bytes")
        limit_s = self.options.body_timeout_s
        try:
            # a client that trickles its body holds a connection
            raw = await asyncio.wait_for(request.read(), limit_s)
        except asyncio.TimeoutError:                  # the builtin TimeoutError from 3.11; its own class on 3.10
            raise ApiError(408, f"request body not received within {limit_s:g} s (body_timeout_s)",
                           headers={"Connection": "close"}) from None
        depth = self.options.max_json_depth
        try:
            body = json.loads(raw or b"null")
        except RecursionError:
            raise ApiError(400, f"request body is nested deeper than {depth} levels") from None
        except (ValueError, UnicodeDecodeError) as e:  # ValueError: also an integer of over 4300 digits
            raise ApiError(400, f"request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        if _json_depth_over(body, depth):
            raise ApiError(400, f"request body is nested deeper than {depth} levels")
        return body

    def _need(self, cap: str, what: str) -> None:
        if cap not in self.runner.capabilities:
            raise ApiError(400, f"{what} needs the runner capability {cap!r}; runner kind {self.runner.kind!r} "
                                f"offers: {', '.join(sorted(self.runner.capabilities)) or 'nothing'}")

    async def _admit(self) -> None:
        """Wait for a slot; refuse with 429 when the queue is full (bounded memory and latency)."""
        if self.slots.locked() and self.waiting >= self.options.max_queue:
            self.rejected += 1
            raise ApiError(429, f"server busy: {self.max_concurrency} requests running and "
                                f"{self.waiting} waiting; retry after {self.options.retry_after_s} s",
                           "rate_limit_error", headers={"Retry-After": str(self.options.retry_after_s)})
        self.waiting += 1
        try:
            await self.slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        self.admitted += 1

    def _release(self) -> None:
        self.running -= 1
        self.slots.release()

    def _context_length(self) -> int | None:
        """The most tokens (prompt + output) one sequence may have, where the runner tells it (the engine
        runner's max_seq_len); None where it does not (the backend then answers for itself)."""
        for obj in (self.runner, getattr(self.runner, "engine", None)):
            v = getattr(obj, "max_seq_len", None) if obj is not None else None
            if is_of(v, (int,)) and v > 0:
                return v
        return None

    async def _check_prompts(self, prompts: list[str | list[int]], param: str, indexed: bool,
                             max_tokens: int) -> None:
        """400 for a request over the per-request caps, a token id outside the vocabulary, or a prompt
        that with max_tokens does not fit the model's context, naming `param` (with each prompt's index
        where `indexed`). Text prompts are tokenized here only where their UTF-8 length could break a
        limit (a token is at least one byte, and a tokenizer may add one marker)."""
        o = self.options
        names = [f"{param}[{i}]" if indexed else param for i in range(len(prompts))]
        if len(prompts) > o.max_prompts_per_request:
            raise ApiError(400, f"'{param}' holds {len(prompts)} prompts; a request may hold at most "
                                f"{o.max_prompts_per_request} (max_prompts_per_request)", param=param)
        vocab = self.runner.vocab_size()
        if vocab is not None:
            for p, name in zip(prompts, names):
                if isinstance(p, list):
                    j = next((j for j, t in enumerate(p) if t >= vocab), None)
                    if j is not None:
                        raise ApiError(400, f"'{name}[{j}]' = {p[j]} is not a token id of this model: ids must be "
                                            f"below its vocabulary size of {vocab}", param=param)
        ctx = self._context_length()
        bounds = [len(p) if isinstance(p, list) else len(p.encode("utf-8")) + 1 for p in prompts]
        may_break = (sum(bounds) > o.max_prompt_tokens_per_request
                     or ctx is not None and max(bounds) + max_tokens > ctx)
        if not may_break:
            return
        if any(isinstance(p, str) for p in prompts) and Capability.TOKENIZE not in self.runner.capabilities:
            return                          # cannot count: the backend answers for itself
        counts = [len(p) if isinstance(p, list) else len(await self.runner.tokenize(p)) for p in prompts]
        total = sum(counts)
        if total > o.max_prompt_tokens_per_request:
            raise ApiError(400, f"'{param}' holds {total} prompt tokens; a request may hold at most "
                                f"{o.max_prompt_tokens_per_request} (max_prompt_tokens_per_request)", param=param)
        for n, name in zip(counts, names):
            if ctx is not None and n + max_tokens > ctx:
                raise ApiError(400, f"'{name}': {n} prompt tokens + {max_tokens} max_tokens exceed the model's "
                                    f"context length of {ctx} tokens; shorten the prompt or lower max_tokens",
                               param="max_tokens" if n < ctx else param)

    async def _piece(self, token_id: int) -> str:
        if token_id not in self._pieces:
            self._pieces[token_id] = await self.runner.detokenize([token_id])
        return self._pieces[token_id]

    # -- simple endpoints -------------------------------------------------------------------------
    async def metrics(self, request: web.Request) -> web.Response:
        values = {"moebench:num_requests_running": self.running, "moebench:num_requests_waiting": self.waiting,
                  "moebench:requests_admitted_total": self.admitted, "moebench:requests_rejected_total": self.rejected}
        lines = []
        for name, (kind, text) in METRICS.items():
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", f"{name} {values[name]}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8")

    async def health(self, request: web.Request) -> web.Response:
        return _json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        return _json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "moebench",
             "runner_kind": self.runner.kind, "capabilities": sorted(self.runner.capabilities)}]})

    def _special_token_id(self, name: str) -> int | None:
        # Runners may expose bos/eos ids directly or through their engine (the engine runner).
        for obj in (self.runner, getattr(self.runner, "engine", None)):
            v = getattr(obj, f"{name}_token_id", None) if obj is not None else None
            if isinstance(v, int):
                return v
        return None

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        self._need(Capability.TOKENIZE, "tokenizer_info")
        info: JsonObject = {"model": self.model_name}           # the reply, as sent
        for name in ("eos", "bos"):
            tid = self._special_token_id(name)
            info[f"{name}_token"] = await self.runner.detokenize([tid]) if tid is not None else None
            info[f"{name}_token_id"] = tid
        return _json_response(info)

    async def tokenize(self, request: web.Request) -> web.Response:
        self._need(Capability.TOKENIZE, "tokenize")
        body = await self._body(request)
        text = body.get("prompt", body.get("content"))
        if not isinstance(text, str):
            raise ApiError(400, "'prompt' (or 'content') must be a string", param="prompt")
        ids = await self.runner.tokenize(text)
        return _json_response({"tokens": ids, "count": len(ids)})

    async def detokenize(self, request: web.Request) -> web.Response:
        self._need(Capability.TOKENIZE, "detokenize")
        body = await self._body(request)
        ids = body.get("tokens")
        if not (isinstance(ids, list) and all(is_of(t, (int,)) for t in ids)):
            raise ApiError(400, "'tokens' must be a list of integers", param="tokens")
        text = await self.runner.detokenize(ids)
        return _json_response({"prompt": text, "content": text})

    # -- generation core --------------------------------------------------------------------------
    async def _generate_one(self, prompt: str | list[int], *, max_tokens: int, sampling: Sampling,
                            stop: list[str], n_logprobs: int | None, echo_scores: bool, gone: threading.Event,
                            on_text=None, as_ids: bool = False) -> Generation:
        """Generate for one prompt; with n_logprobs, per-token log-probs of the output (and, with
        echo_scores, of the prompt) as lists of (piece, logprob, {piece: logprob}). Once `gone` is set
        (the client disconnected), a runner that passes text to on_text as it generates (on its worker
        thread, as the engine runner does) is stopped there by ClientGone."""
        caps = self.runner.capabilities
        scoring = prompt_scoring_kind(self.runner)
        prompt_ids: list[int] | None = prompt if isinstance(prompt, list) else None
        if echo_scores and prompt_ids is None:
            prompt_ids = await self.runner.tokenize(prompt)
        out_text, out_ids, finish, res = "", [], "length", None
        if max_tokens > 0:
            # Without one-pass scoring, the output's log-probs come from the generation's alternatives.
            n_top = max(n_logprobs, 1) if n_logprobs is not None and scoring is None else 0
            res = await self.runner.generate(GenerateRequest(
                prompt=prompt, max_tokens=max_tokens, stop=stop, temperature=sampling.temperature,
                seed=sampling.seed, top_p=sampling.top_p, top_k=sampling.top_k, top_logprobs=n_top,
                stream=on_text is not None, ignore_eos=sampling.ignore_eos, on_text=_stop_when_gone(gone, on_text)))
            out_text, finish = res.text, res.finish_reason or "stop"
            out_ids = list(res.token_ids) if res.token_ids is not None else (
                await self.runner.tokenize(out_text) if Capability.TOKENIZE in caps else [])
        result = Generation(text=out_text, token_ids=out_ids, finish_reason=finish,
                            prompt_tokens=(res.prompt_tokens if res and res.prompt_tokens is not None
                                           else (len(prompt_ids) if prompt_ids is not None else None)),
                            prompt_ids=prompt_ids)
        if n_logprobs is None:
            return result
        k = max(1, n_logprobs)
        entries: list[tuple[str, float | None, dict[str, float] | None]] = []
        # vLLM's return_tokens_as_token_ids: "token_id:N" instead of text, so no two ids collide.
        label = _as_label if as_ids else self._piece
        if scoring is not None:
            # Exact: one teacher-forced pass over prompt + output gives every position's log-probs.
            ids = list(prompt_ids if prompt_ids is not None else await self.runner.tokenize(prompt))
            scores = await score_tokens(self.runner, ids + out_ids, top_k=k)
            first = 0 if echo_scores else len(ids)
            result.entry_ids = (ids + out_ids)[first:]
            for pos in range(first, len(ids) + len(out_ids)):
                s: TokenScore | None = scores[pos]
                piece = await label((ids + out_ids)[pos])
                if s is None:
                    entries.append((piece, None, None))
                else:
                    top = {await label(t): lp for t, lp in s.top.items()} if n_logprobs > 0 else {}
                    entries.append((piece, s.logprob, top))
        else:
            tops = (res.top_logprobs or []) if res else []
            result.entry_ids = list(out_ids)
            for i, tid in enumerate(out_ids):
                piece = await self._piece(tid)
                top = tops[i] if i < len(tops) else {}
                # The chosen token's own log-prob is known only when it is among the alternatives.
                entries.append((piece, top.get(piece), dict(list(top.items())[:n_logprobs]) if n_logprobs else {}))
        result.logprob_entries = entries
        return result

    def _check_logprob_request(self, n_logprobs: int | None, echo: bool) -> None:
        if n_logprobs is None:
            return
        scoring = prompt_scoring_kind(self.runner)
        if echo and scoring is None:
            raise ApiError(400, "echo with logprobs (prompt log-probs) needs a runner with prompt_logprobs or "
                                f"full_logits; runner kind {self.runner.kind!r} offers: "
                                f"{', '.join(sorted(self.runner.capabilities))}", param="echo")
        if scoring is None:
            self._need(Capability.TOP_LOGPROBS, "logprobs")
        self._need(Capability.TOKENIZE, "logprobs")

    # -- /v1/completions --------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        asked = CompletionsRequest.from_json(await self._body(request), self.options.max_tokens_limit,
                                             self.options.max_logprobs)
        prompts, max_tokens, stop, echo = asked.prompts, asked.max_tokens, asked.stop, asked.echo
        n_logprobs, stream, include_usage = asked.n_logprobs, asked.stream, asked.include_usage
        if any(isinstance(p, list) for p in prompts):
            self._need(Capability.TOKEN_PROMPTS, "a token-id prompt")
        self._need(Capability.GENERATE, "completions")
        if echo and any(isinstance(p, list) for p in prompts):
            self._need(Capability.TOKENIZE, "echo of a token-id prompt")
        self._check_logprob_request(n_logprobs, echo)
        await self._check_prompts(prompts, "prompt", asked.several, max_tokens)
        created, cid = int(time.time()), f"cmpl-{uuid.uuid4().hex[:24]}"
        gone = threading.Event()
        gen = dict(max_tokens=max_tokens, stop=stop, n_logprobs=n_logprobs, sampling=asked.sampling,
                   echo_scores=echo and n_logprobs is not None, as_ids=asked.as_ids, gone=gone)
        live = stream and len(prompts) == 1 and not echo     # else the SSE events follow generation

        def chunk(text: str, logprobs: Any = None, finish: str | None = None) -> JsonObject:       # an SSE event
            return {"id": cid, "object": "text_completion", "created": created, "model": self.model_name,
                    "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
                    **({"usage": None} if include_usage else {})}
        await self._admit()
        try:
            outs = []
            if live:
                resp = await self._sse_start(request)

                async def send(piece: str) -> None:
                    await self._sse(resp, chunk(piece))
                try:
                    outs.append(await self._generate_live(prompts[0], send, **gen))
                except Exception as e:  # noqa: BLE001 - the headers are out: report it in the stream
                    return await self._sse_error(resp, e)
            else:
                for p in prompts:           # a disconnect cancels this handler here: no further item starts
                    outs.append(await self._generate_one(p, **gen))
        finally:
            gone.set()                      # a generation still running on a worker thread stops
            self._release()
        choices = []
        for i, (p, o) in enumerate(zip(prompts, outs)):
            prompt_text = p if isinstance(p, str) else await self.runner.detokenize(p)
            text = (prompt_text + o.text) if echo else o.text
            lp = None
            if n_logprobs is not None:
                entries = o.logprob_entries or []
                offset = 0 if echo else len(prompt_text)
                offsets = []
                for tid, (piece, _, _) in zip(o.entry_ids or [None] * len(entries), entries):
                    offsets.append(offset)
                    offset += len(await self._piece(tid) if gen["as_ids"] and tid is not None else piece)
                lp = {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
                      "top_logprobs": [e[2] for e in entries], "text_offset": offsets}
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": o.finish_reason})
        usage = self._usage(outs)
        if live:
            await self._sse(resp, chunk("", choices[0]["logprobs"], choices[0]["finish_reason"]))
            if include_usage:
                await self._sse(resp, {**chunk(""), "choices": [], "usage": usage})
            await self._sse(resp, "[DONE]")
            await resp.write_eof()
            return resp
        if stream:
            return await self._stream_completion(request, cid, created, choices, outs, echo, prompts,
                                                 usage if include_usage else None)
        return _json_response({"id": cid, "object": "text_completion", "created": created,
                                  "model": self.model_name, "choices": choices, "usage": usage})

    def _usage(self, outs: list[Generation]) -> dict[str, int]:
        pt = sum(o.prompt_tokens or 0 for o in outs)
        ct = sum(len(o.token_ids) for o in outs)
        return {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct}

    async def _pieces_of(self, out: Generation) -> list[str]:
        """The output text split at token boundaries (decoded incrementally, so multi-byte
        characters are never split); the pieces join to exactly the output text."""
        ids, text, pieces, prev = out.token_ids, out.text, [], ""
        for n in range(1, len(ids) + 1):
            cur = await self.runner.detokenize(ids[:n]) if Capability.TOKENIZE in self.runner.capabilities else text
            cur = cur[: len(text)]
            if cur.startswith(prev) and len(cur) > len(prev):
                pieces.append(cur[len(prev):])
                prev = cur
        if prev != text:
            pieces = [text] if not pieces else pieces + ([text[len(prev):]] if text.startswith(prev) else [])
            if "".join(pieces) != text:
                pieces = [text]
        return pieces

    async def _generate_live(self, prompt: str | list[int], send, **gen: Any) -> Generation:
        """_generate_one, sending the output text to `send(piece)` (a coroutine function) while it is
        generated. Text that could still be the start of a stop string is held back (at most the
        longest stop string less one character); at the end the rest of the final text is sent, so
        the pieces join to exactly the final text (all of it, in token pieces, for a runner that
        does not call on_text)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[str] = asyncio.Queue()
        stop = gen["stop"]
        hold = max((len(x) for x in stop), default=1) - 1

        def on_text(piece: str) -> None:             # may run on the runner's worker thread
            loop.call_soon_threadsafe(queue.put_nowait, piece)
        task = asyncio.ensure_future(self._generate_one(prompt, on_text=on_text, **gen))
        acc = sent = ""
        stopped = False
        getter: asyncio.Future | None = None
        try:
            while True:
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    break
                if stopped:
                    continue
                acc += getter.result()
                cut = first_stop(acc, stop)
                safe = acc[:cut] if cut is not None else acc[:max(len(sent), len(acc) - hold)]
                stopped = cut is not None
                if len(safe) > len(sent) and safe.startswith(sent):
                    await send(safe[len(sent):])
                    sent = safe
        finally:
            if getter is not None and not getter.done():    # cancelled mid-wait (the client went away)
                getter.cancel()
            if not task.done():                         # the client went away: stop waiting for it
                task.cancel()
        out = task.result()
        if not sent:                                    # a runner that does not stream: token pieces now
            for piece in await self._pieces_of(out):
                await send(piece)
        elif out.text.startswith(sent) and len(out.text) > len(sent):
            await send(out.text[len(sent):])
        elif not out.text.startswith(sent):          # a runner restart re-generated differently
            log.warning("streamed text is not a prefix of the final text (a backend restart?)")
        return out

    async def _sse_error(self, resp: web.StreamResponse, e: Exception) -> web.StreamResponse:
        """After the SSE headers went out an error cannot be a status code: send it as an event."""
        if isinstance(e, (ConnectionError, ClientGone, asyncio.CancelledError)):
            raise e                                     # the client is gone: nobody to tell
        if isinstance(e, RunnerError):
            msg = f"the backend failed: {e}"
        elif isinstance(e, ApiError):
            msg = e.message
        else:
            log.exception("unhandled error while streaming")
            msg = f"internal error: {type(e).__name__}: {e}"
        await self._sse(resp, {"error": {"message": msg, "type": "server_error", "code": None}})
        await self._sse(resp, "[DONE]")
        await resp.write_eof()
        return resp

    async def _sse_start(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        return resp

    @staticmethod
    async def _sse(resp: web.StreamResponse, data: Any) -> None:
        payload = data if isinstance(data, str) else wire_json(data)
        await resp.write(f"data: {payload}\n\n".encode("utf-8"))

    async def _stream_completion(self, request: web.Request, cid: str, created: int, choices: list[dict],
                                 outs: list[Generation], echo: bool, prompts: list,
                                 usage: dict[str, int] | None = None) -> web.StreamResponse:
        """The SSE events of finished generations; `usage` given: every chunk has "usage": null and a
        last chunk with empty choices carries it."""
        resp = await self._sse_start(request)
        nulls = {"usage": None} if usage is not None else {}
        for ch, o, p in zip(choices, outs, prompts):
            head = ch["text"][: len(ch["text"]) - len(o.text)] if echo else ""
            pieces = ([head] if head else []) + await self._pieces_of(o)
            for piece in pieces:
                await self._sse(resp, {"id": cid, "object": "text_completion", "created": created,
                                       "model": self.model_name, "choices": [
                                           {"index": ch["index"], "text": piece, "logprobs": None,
                                            "finish_reason": None}], **nulls})
            await self._sse(resp, {"id": cid, "object": "text_completion", "created": created,
                                   "model": self.model_name, "choices": [
                                       {"index": ch["index"], "text": "", "logprobs": ch["logprobs"],
                                        "finish_reason": ch["finish_reason"]}], **nulls})
        if usage is not None:
            await self._sse(resp, {"id": cid, "object": "text_completion", "created": created,
                                   "model": self.model_name, "choices": [], "usage": usage})
        await self._sse(resp, "[DONE]")
        await resp.write_eof()
        return resp

    # -- /v1/chat/completions ---------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        asked = ChatRequest.from_json(await self._body(request), self.options.max_tokens_limit)
        prompt, max_tokens, n_logprobs = asked.prompt, asked.max_tokens, asked.n_logprobs
        stream, include_usage = asked.stream, asked.include_usage
        self._need(Capability.GENERATE, "chat completions")
        self._check_logprob_request(n_logprobs, echo=False)
        await self._check_prompts([prompt], "messages", False, max_tokens)
        created, cid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex[:24]}"
        gone = threading.Event()
        gen = dict(max_tokens=max_tokens, stop=asked.stop, n_logprobs=n_logprobs, sampling=asked.sampling,
                   echo_scores=False, gone=gone)
        await self._admit()
        try:
            if not stream:
                o = await self._generate_one(prompt, **gen)
            else:
                resp = await self._sse_start(request)
                base = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": self.model_name,
                        **({"usage": None} if include_usage else {})}
                await self._sse(resp, {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                            "logprobs": None, "finish_reason": None}]})

                async def send(piece: str) -> None:
                    await self._sse(resp, {**base, "choices": [{"index": 0, "delta": {"content": piece},
                                                                "logprobs": None, "finish_reason": None}]})
                try:
                    o = await self._generate_live(prompt, send, **gen)
                except Exception as e:  # noqa: BLE001 - the headers are out: report it in the stream
                    return await self._sse_error(resp, e)
        finally:
            gone.set()                      # a generation still running on a worker thread stops
            self._release()
        lp = None
        if n_logprobs is not None:
            lp = {"content": [{"token": piece, "logprob": v, "bytes": list(piece.encode("utf-8")),
                               "top_logprobs": [{"token": t, "logprob": x, "bytes": list(t.encode("utf-8"))}
                                                for t, x in list((top or {}).items())[:n_logprobs]]}
                              for piece, v, top in o.logprob_entries or []]}
        finish = o.finish_reason
        if not stream:
            return _json_response({
                "id": cid, "object": "chat.completion", "created": created, "model": self.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": o.text},
                             "logprobs": lp, "finish_reason": finish}],
                "usage": self._usage([o])})
        await self._sse(resp, {**base, "choices": [{"index": 0, "delta": {}, "logprobs": lp,
                                                    "finish_reason": finish}]})
        if include_usage:
            await self._sse(resp, {**base, "choices": [], "usage": self._usage([o])})
        await self._sse(resp, "[DONE]")
        await resp.write_eof()
        return resp


# -- running it -----------------------------------------------------------------------------------

def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


async def start_server(runner: Runner, options: ServeOptions) -> tuple[web.AppRunner, str]:
    """Start the runner and the HTTP site on the running loop; returns (app runner, base URL ".../v1")."""
    await runner.start(None)
    # handler_cancellation: a client's disconnect cancels its handler, which stops the request's work.
    # keepalive_timeout: aiohttp closes a connection still waiting for a whole request header then
    # (counted from its opening, then from each response), so headers sent a byte at a time are cut off.
    app_runner = web.AppRunner(Server(runner, options).app(), access_log=None, handler_cancellation=True,
                               keepalive_timeout=options.header_timeout_s)
    await app_runner.setup()
    sock = _bind(options.host, options.port)
    site = web.SockSite(app_runner, sock)
    await site.start()
    host, port = sock.getsockname()[:2]
    return app_runner, f"http://{host if ':' not in host else f'[{host}]'}:{port}/v1"


class BackgroundServer:
    """The server on its own event-loop thread (tests, notebooks): `with BackgroundServer(r) as s: s.url`."""

    def __init__(self, runner: Runner, options: ServeOptions | None = None):
        self.runner = runner
        self.options = options or ServeOptions(port=0)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="moebench-serve", daemon=True)
        self.url = ""
        self._app_runner: web.AppRunner | None = None

    def __enter__(self) -> "BackgroundServer":
        self._thread.start()
        self._app_runner, self.url = asyncio.run_coroutine_threadsafe(
            start_server(self.runner, self.options), self.loop).result(timeout=600)
        return self

    def close(self) -> None:
        async def stop() -> None:
            try:
                if self._app_runner is not None:
                    await self._app_runner.cleanup()
            finally:
                await self.runner.close()
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(timeout=60)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)

    def __exit__(self, *exc: Any) -> None:
        self.close()


def api_key_from_env(host: str, api_key_env: str | None) -> str | None:
    """The bearer key to require, from the environment variable `api_key_env` names. Serving beyond
    loopback without one is refused (UsageError), as is naming a variable that is unset or empty."""
    from moebench.errors import UsageError
    if api_key_env is None:
        if not is_loopback(host):
            raise UsageError(f"serve --host {host}: reachable from other machines, so a key is required: "
                             f"put one in an environment variable and pass --api-key-env NAME "
                             f"(or bind 127.0.0.1)")
        return None
    key = os.environ.get(api_key_env, "")
    if not key.strip():
        raise UsageError(f"serve --api-key-env {api_key_env}: the environment variable {api_key_env!r} is "
                         f"{'empty' if api_key_env in os.environ else 'not set'}")
    return key.strip()


def serve(runner_profile_path: str, host: str = "127.0.0.1", port: int = 8000,
          max_body_bytes: int = ServeOptions.max_body_bytes, max_concurrency: int | None = None,
          max_queue: int = ServeOptions.max_queue, api_key_env: str | None = None,
          max_logprobs: int = MAX_LOGPROBS) -> None:
    """Serve a runner profile until interrupted (Ctrl-C / SIGTERM). Prints the base URL when ready."""
    import signal

    from moebench.runners import load_runner_profile, make_runner

    from moebench.progress import StartupLog
    say = StartupLog()
    api_key = api_key_from_env(host, api_key_env)      # refused before any model is loaded
    profile = load_runner_profile(runner_profile_path)
    runner = make_runner(profile)
    options = ServeOptions(host=host, port=port, max_body_bytes=max_body_bytes, max_concurrency=max_concurrency,
                           max_queue=max_queue, model_name=profile.name, api_key=api_key,
                           max_logprobs=max_logprobs)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):    # not the main thread / platform
                pass
        app_runner = None
        try:
            say(runner.startup_note(None))          # a model load takes seconds: not in silence
            app_runner, url = await start_server(runner, options)
            print(f"serving {profile.name} ({profile.kind}) on {url}"
                  + (f" (bearer key from ${api_key_env} required)" if api_key else ""), flush=True)
            await stop.wait()
        finally:
            if app_runner is not None:
                await app_runner.cleanup()
            await runner.close()

    asyncio.run(main())
