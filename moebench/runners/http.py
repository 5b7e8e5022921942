"""`kind = "http"`: any OpenAI-compatible server (vLLM, SGLang, llama-server, TGI, `moebench serve`).

- `/v1/completions` or `/v1/chat/completions` (`api`), through one aiohttp session: its connection pool
  hands out a free connection without walking the whole pool, so a request costs the same CPU at any
  concurrency.
- Several endpoints (`base_urls`) share the work: each request goes to the least busy one.
- Retries with exponential backoff on connection errors, timeouts and 5xx; never on 4xx but 429, whose
  `Retry-After` is honoured (up to `max_retry_wait_s`).
- Every response is read through a byte bound derived from `max_tokens` (and `max_response_bytes`, a hard
  cap): a runaway reply fails the request naming its size instead of filling memory and the run.
- An error event or error object inside a stream fails the request (never a short `ok` answer).
- Chat reasoning (`reasoning_content`, `reasoning`) counts toward first-token time and is kept apart
  from the answer text.
- Both log-prob formats: legacy completions (`logprobs.top_logprobs` = list of dicts) and chat-style
  (`logprobs.content[].top_logprobs` = list of {token, logprob}), which vLLM and llama-server return.
- Streaming (SSE) records each token's arrival time for the speed task.
- Each request, its retries and waits included, ends by `request_deadline_s` (DeadlineExceeded), so a
  server that drips a byte at a time, each inside the per-read `timeout_s`, cannot hold an item.
- Only a 2xx reply is an answer; redirects are not followed (the error names the Location).
- Counts, timings and log-probs are checked before they reach a record, and the output count is
  checked against the client's own (moebench.runners.reply_checks).
A response that is not what the protocol promises raises RunnerError with the reason.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import aiohttp
import httpx

from moebench.json_types import JsonObject
from moebench.config import (MAX_RESPONSE_BYTES, MAX_SECONDS, MAX_VOCAB, ProfileError, RunnerSettings, positive,
                             setting)
from moebench.runners import prompt_logprobs as prompt_lp
from moebench.runners import sampled_logprobs as sampled_lp
from moebench.runners import reply_checks
from moebench.runners.base import (DEFAULT_REQUEST_DEADLINE_S, Capability, DeadlineExceeded, GenerateRequest,
                                   GenerateResult, Runner, RunnerError, ServerTimings, Unreachable)
from moebench.scoring.answers import first_stop
from moebench.runners.metrics import parse_prometheus
from moebench.runners.identity import RunnerIdentity
from moebench.runners.wire import CompletionBody, LlamaTokenizeBody, VllmTokenizeBody, WireBody
from moebench.runners.responses import (DEFAULT_MAX_RESPONSE_BYTES, ConnectError, ConnectTimeout, TransportError,
                                        bounded_lines, describe, read_bounded, response_limit, retry_after_s,
                                        transport_error)


# asyncio.timeout (Python 3.11+): a deadline on the running task; None on 3.10
_TIMEOUT = getattr(asyncio, "timeout", None)


def finite_positive(value: Any) -> str | None:
    return None if math.isfinite(value) and value > 0 else "must be a finite number of seconds above 0"


def url_problem(value: Any) -> str | None:
    """Why a base URL cannot work (checked when the profile loads, not on every item)."""
    urls = value if isinstance(value, list) else [value]
    for u in urls:
        which = f" ({u!r})" if isinstance(value, list) else ""      # a single value is quoted by the caller
        try:
            parsed = httpx.URL(u)
            port = parsed.port
        except (httpx.InvalidURL, ValueError, TypeError) as e:
            return f"must be an http(s) URL{which}: {e}"
        if parsed.scheme not in ("http", "https") or not parsed.host:
            return f"must be an http(s) URL with a host, like http://127.0.0.1:8080/v1{which}"
        if port is not None and not 1 <= port <= 65535:
            return f"has port {port}, outside 1-65535{which}"
    return None


@dataclass(frozen=True)
class HttpSettings(RunnerSettings):
    """A `kind = "http"` profile's keys (docs/profiles.md), each with its one default."""

    base_url: str | None = setting(str, check=url_problem, doc="e.g. http://127.0.0.1:8080/v1")
    base_urls: list[str] | None = setting(list, item_type=str, check=url_problem,
                                          doc="several servers sharing the items")
    model: str = setting(str, default="default")
    api: str = setting(str, default="completions", choices=("completions", "chat"))
    api_key_env: str | None = setting(str, doc="name of the environment variable holding the API key")
    timeout_s: float = setting(float, default=600.0, check=positive, low=0, low_open=True, high=MAX_SECONDS)
    connect_timeout_s: float = setting(float, default=10.0, check=positive, low=0, low_open=True, high=MAX_SECONDS)
    retries: int = setting(int, default=3, low=0, high=100)
    backoff_s: float = setting(float, default=0.5, low=0, high=MAX_SECONDS)
    request_deadline_s: float = setting(float, default=DEFAULT_REQUEST_DEADLINE_S, check=finite_positive, low=0,
                                        low_open=True, high=MAX_SECONDS,
                                        doc="longest one request may take, every retry and wait included; "
                                            "timeout_s bounds each read only")
    max_retry_wait_s: float = setting(float, default=120.0, check=positive, low=0, low_open=True, high=MAX_SECONDS,
                                      doc="longest wait a 429/503 Retry-After may ask for before the next attempt")
    max_response_bytes: int = setting(int, default=DEFAULT_MAX_RESPONSE_BYTES, check=positive, low=1,
                                      high=MAX_RESPONSE_BYTES,
                                      doc="hard cap on one response's size (the bound from max_tokens is "
                                          "usually lower)")
    tokenize: str = setting(str, default="none", choices=("none", "llama-server", "vllm"),
                            doc="the server's own /tokenize beside /v1: llama-server's {content} or vLLM's "
                                "{prompt} form")
    tokenizer: str | None = setting(str, path="tokenizer",
                                    doc="a local tokenizer (HF folder, tokenizer.json or GGUF) where the server "
                                        "has no usable /tokenize; also maps echoed token text to ids")
    prompt_logprobs: str = setting(str, default="none", choices=prompt_lp.MODES,
                                   doc="how the server returns prompt log-probs (KLD): vLLM's prompt_logprobs "
                                       "field, legacy echo + logprobs, or SGLang's /generate")
    prompt_logprobs_k: int = setting(int, default=20, check=positive, low=1, high=MAX_VOCAB,
                                     doc="top K prompt log-probs asked per position")
    prompt_logprob_ids: bool = setting(bool, default=False,
                                       doc="the server also scores given token ids at each position (SGLang's "
                                           "token_ids_logprob): a candidate asks for the baseline's top-K ids")
    token_prompts: bool = setting(bool, default=False, doc="the server accepts token-id prompts")
    extra_body: JsonObject = setting(dict, default=dict, doc="extra JSON fields sent with every request")
    max_stop: int = setting(int, default=4, check=positive, low=1, high=1_024,
                            doc="stop strings the server accepts per request (OpenAI and vLLM: 4); the rest "
                                "are applied to the returned text")


SCHEMA = HttpSettings.schema()


class HttpRunner(Runner):
    kind = "http"
    capability_keys = {
        Capability.PROMPT_LOGPROBS: 'prompt_logprobs = "vllm" | "echo" | "sglang" (the server\'s form; '
                                    '`moebench serve` takes "echo")',
        Capability.TOKENIZE: 'tokenize = "vllm" | "llama-server" (the server\'s /tokenize; `moebench serve` '
                             'has the vllm form) or tokenizer = "PATH" (a local HF folder, tokenizer.json or GGUF)',
        Capability.TOKEN_PROMPTS: "token_prompts = true (the server takes token-id prompts)",
        Capability.PROMPT_LOGPROB_IDS: 'prompt_logprob_ids = true (with prompt_logprobs = "sglang")',
    }

    settings_class = HttpSettings
    settings: HttpSettings

    def __init__(self, settings: HttpSettings | JsonObject, profile_path: str | None = None,
                 name: str | None = None):
        super().__init__(settings, profile_path, name)
        s = self.settings
        where = profile_path or "runner profile"
        urls = list(s.base_urls or [])
        if s.base_url:
            urls.insert(0, s.base_url)
        if not urls:
            raise ProfileError(f"{where}: needs key 'base_url' or 'base_urls' (e.g. \"http://127.0.0.1:8080/v1\")")
        problem = url_problem(urls)
        if problem:
            key = "base_url" if s.base_url else "base_urls"
            raise ProfileError(f"{where}: key {key!r} {problem}, got {urls!r}")
        self.base_urls = [u.rstrip("/") for u in urls]
        self.api = s.api
        self.model = s.model
        self.per_endpoint = s.concurrency
        self.concurrency = self.per_endpoint * len(self.base_urls)
        self.retries = s.retries
        self.backoff_s = float(s.backoff_s)
        self.max_retry_wait_s = float(s.max_retry_wait_s)
        self.request_deadline_s = float(s.request_deadline_s)
        self.max_response_bytes = s.max_response_bytes
        self.extra_body = dict(s.extra_body)
        self.max_stop = s.max_stop
        self.in_flight = {u: 0 for u in self.base_urls}
        self.headers = {}
        if s.api_key_env:
            key = os.environ.get(s.api_key_env)
            if not key:
                raise ProfileError(f"{where}: key 'api_key_env' names {s.api_key_env!r}, which is not set in the "
                                   "environment")
            self.headers["Authorization"] = f"Bearer {key}"
        caps = {Capability.GENERATE, Capability.STREAM, Capability.TOP_LOGPROBS, Capability.SAMPLING}
        self.tokenize_form = s.tokenize
        self.local_tokenizer = None
        if s.tokenizer:
            from moebench.runners.local_tokenizer import load_tokenizer
            self.local_tokenizer = load_tokenizer(s.tokenizer, where)
        if self.tokenize_form != "none" or self.local_tokenizer is not None:
            caps.add(Capability.TOKENIZE)
        self.prompt_logprobs_mode = s.prompt_logprobs
        self.prompt_logprobs_k = s.prompt_logprobs_k
        if self.prompt_logprobs_mode != "none":
            caps.add(Capability.PROMPT_LOGPROBS)
            if s.prompt_logprob_ids:
                if self.prompt_logprobs_mode != "sglang":
                    raise ProfileError(f"{where}: key 'prompt_logprob_ids' needs prompt_logprobs = \"sglang\" "
                                       "(vLLM's OpenAI server does not take prompt_logprob_token_ids; "
                                       "docs/kld.md)")
                caps.add(Capability.PROMPT_LOGPROB_IDS)
        if s.token_prompts:
            caps.add(Capability.TOKEN_PROMPTS)
            if self.api == "completions":
                caps.add(Capability.SAMPLED_LOGPROBS)   # ids in, ids and log-probs out
        self.capabilities = frozenset(caps)
        self.read_timeout_s = float(s.timeout_s)          # TOML may give an integer
        self.connect_timeout_s = float(s.connect_timeout_s)
        # timeout_s bounds the wait for each read and connect_timeout_s the socket connect;
        # request_deadline_s bounds the whole request, retries included.
        self.timeout = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=self.connect_timeout_s,
                                             sock_read=self.read_timeout_s)
        self.client: aiohttp.ClientSession | None = None
        self._client_loop: asyncio.AbstractEventLoop | None = None
        self._proxies: dict[str, tuple[Any, Any]] = {}      # origin -> (proxy URL, proxy auth) or (None, None)

    async def start(self, run_dir: str | None = None) -> None:
        # A pool of concurrency + 4 connections over all endpoints. The proxy variables (HTTP_PROXY,
        # HTTPS_PROXY, NO_PROXY) are read here, once per endpoint: aiohttp's trust_env would read them
        # (and ~/.netrc) in a worker thread on every request.
        connector = aiohttp.TCPConnector(limit=self.concurrency + 4, limit_per_host=0)
        self.client = aiohttp.ClientSession(connector=connector, timeout=self.timeout, headers=self.headers)
        self._client_loop = asyncio.get_running_loop()
        self._proxies = {}

    async def close(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            if self._client_loop is asyncio.get_running_loop():
                await client.close()
            # a session of an event loop that has ended went with it: nothing left to close here

    async def _session(self) -> aiohttp.ClientSession:
        """The session, started on first use and again on a new event loop (aiohttp's sessions are
        bound to the loop that made them)."""
        if self.client is None or self._client_loop is not asyncio.get_running_loop():
            await self.start()
        assert self.client is not None
        return self.client

    def _proxy(self, url: str) -> tuple[Any, Any]:
        """The proxy the environment names for `url`'s origin (None where none or NO_PROXY covers it)."""
        origin = url.split("/", 3)[:3]
        key = "/".join(origin)
        found = self._proxies.get(key)
        if found is None:
            from aiohttp.helpers import get_env_proxy_for_url
            from yarl import URL
            try:
                found = get_env_proxy_for_url(URL(key))
            except LookupError:
                found = (None, None)
            self._proxies[key] = found
        return found

    @contextlib.asynccontextmanager
    async def _open(self, method: str, url: str, body: WireBody | None = None) -> AsyncIterator[Any]:
        """An open response to `method url`, redirects not followed; aiohttp's failures while asking or
        reading come out as TransportError subclasses (ConnectError, ReadTimeout...)."""
        client = await self._session()
        proxy, proxy_auth = self._proxy(url)
        try:
            async with client.request(method, url, json=body.to_json() if body is not None else None,
                                      allow_redirects=False, proxy=proxy,
                                      proxy_auth=proxy_auth) as resp:
                yield resp
        except aiohttp.ClientError as e:
            raise transport_error(e, method, url, self.connect_timeout_s, self.read_timeout_s) from None

    def identity(self) -> RunnerIdentity:
        return {"model": {"name": self.model, "endpoints": self.base_urls, "api": self.api}, "build": {}}

    # -- plumbing --------------------------------------------------------------------------------
    def _pick(self) -> str:
        return min(self.base_urls, key=lambda u: self.in_flight[u])

    def _wait_s(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:             # the server said when: honour it (within reason)
            return min(retry_after, self.max_retry_wait_s)
        return self.backoff_s * (2 ** attempt) * (0.5 + random.random())

    async def _with_retries(self, call, target: Callable[[str], str] = lambda url: url):
        """Run `call(base_url)` with retries on connection errors, timeouts, 5xx and 429 (never other 4xx),
        all within `request_deadline_s`; `target(base_url)` names the URL asked, for the deadline's error."""
        await self._session()
        asked: list[str] = []
        timeout = _TIMEOUT
        if timeout is None:             # Python 3.10: wait_for runs the attempts as a task of their own
            try:
                return await asyncio.wait_for(self._attempts(call, asked), self.request_deadline_s)
            except asyncio.TimeoutError:
                raise self._deadline_exceeded(target, asked) from None
        # 3.11+: a deadline on this task itself, without a task per request
        deadline = timeout(self.request_deadline_s)
        try:
            async with deadline:
                return await self._attempts(call, asked)
        except TimeoutError:
            if not deadline.expired():
                raise
            raise self._deadline_exceeded(target, asked) from None

    def _deadline_exceeded(self, target: Callable[[str], str], asked: list[str]) -> DeadlineExceeded:
        url = target(asked[-1] if asked else self.base_urls[0])
        return DeadlineExceeded(f"POST {url}: no complete reply after {self.request_deadline_s:g} s "
                                "(request_deadline_s, retries included)")

    async def _attempts(self, call, asked: list[str]):
        last: Exception | None = None
        never_connected = True          # every attempt failed to connect: Unreachable, not RunnerError
        for attempt in range(self.retries + 1):
            url = self._pick()
            asked.append(url)
            self.in_flight[url] += 1
            retry_after = None
            try:
                return await call(url)
            except HttpStatus as e:
                if e.status < 500 and e.status != 429:     # a redirect or a refusal: asking again changes nothing
                    raise RunnerError(str(e)) from None
                last = RunnerError(str(e))
                never_connected = False
                retry_after = retry_after_s(e.retry_after)
            except TransportError as e:
                last = RunnerError(f"{url}: {describe(e)}")
                never_connected = never_connected and isinstance(e, (ConnectError, ConnectTimeout))
            finally:
                self.in_flight[url] -= 1
            if attempt < self.retries:
                await asyncio.sleep(self._wait_s(attempt, retry_after))
        assert last is not None
        error = Unreachable if never_connected else RunnerError
        raise error(f"gave up after {self.retries + 1} attempts: {last}")

    async def _post(self, url: str, body: WireBody, limit: int) -> bytes:
        """POST and read the whole reply within `limit` bytes; HttpStatus for an HTTP error status.
        What `_open` does, written out: this is every non-streamed request's path, and the context
        manager's generator would cost more than the rest of this function."""
        client = await self._session()
        proxy, proxy_auth = self._proxy(url)
        try:
            async with client.request("POST", url, json=body.to_json(), allow_redirects=False, proxy=proxy,
                                      proxy_auth=proxy_auth) as resp:
                raw = await read_bounded(resp, limit, url)
                if not 200 <= resp.status < 300:            # only a 2xx reply is an answer
                    raise HttpStatus.of(url, resp, raw)
        except aiohttp.ClientError as e:
            raise transport_error(e, "POST", url, self.connect_timeout_s, self.read_timeout_s) from None
        return raw

    # -- requests --------------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        body = CompletionBody.of(request, model=self.model, api=self.api, max_stop=self.max_stop,
                                 extra_body=self.extra_body)
        path = body.path
        limit = response_limit(request.max_tokens, request.top_logprobs, self.max_response_bytes)

        sends = 0

        async def call(url: str) -> GenerateResult:
            nonlocal sends
            sends += 1
            if request.stream:
                return await self._stream(url + path, body, url, request.on_text, limit)
            t0 = time.perf_counter()
            raw = await self._post(url + path, body, limit)
            result = parse_response(_json(raw, url + path), self.api, url + path)
            result.endpoint, result.sent_at = url, t0
            result.timings.setdefault("wall_s", time.perf_counter() - t0)
            return result

        result = await self._with_retries(call, lambda url: url + path)
        result.resends = sends - 1
        await self._check_output_count(result, request)       # on the whole text, before client-side stops
        return _apply_stops(result, request.stop[self.max_stop:])

    async def _check_output_count(self, result: GenerateResult, request: GenerateRequest) -> None:
        """Compare the server's output count with one counted here; keep the checked one and flag a
        disagreement (moebench.runners.reply_checks)."""
        text = (result.reasoning or "") + result.text
        if self.local_tokenizer is not None:
            client = reply_checks.OutputCount(len(self.local_tokenizer.encode(text)), "tokenizer")
        elif self.tokenize_form != "none":
            client = reply_checks.OutputCount(len(await self.tokenize(text)) if text else 0, "server-tokenize")
        elif result.token_times is not None:
            client = reply_checks.OutputCount(len(result.token_times), "stream-pieces")
        else:
            client = reply_checks.OutputCount(None, "none")
        server = result.output_tokens
        result.output_tokens, result.server_count_mismatch = reply_checks.reconcile(
            server, "usage.completion_tokens", client, text, request.max_tokens)
        if result.output_tokens is None:
            result.output_tokens_source = None
        elif server is not None and result.server_count_mismatch is None:
            result.output_tokens_source = "server"
        else:
            result.output_tokens_source = client.source

    async def _stream(self, url: str, body: CompletionBody, base: str,
                      on_text: Callable[[str], None] | None, limit: int) -> GenerateResult:
        t0 = time.perf_counter()
        texts: list[str] = []
        reasoning: list[str] = []
        times: list[float] = []                 # every generated piece, reasoning included
        first: dict[str, float] = {}
        top: list[dict[str, float]] = []
        finish = None
        ended = False
        usage = reply_checks.Usage()
        server_timings: ServerTimings = {}
        event = "message"
        async with self._open("POST", url, body) as resp:
            if not 200 <= resp.status < 300:
                raw = await read_bounded(resp, min(limit, 1 << 20), url)
                raise HttpStatus.of(url, resp, raw)
            async for line in bounded_lines(resp, limit, url):
                if not line:
                    event = "message"           # a blank line ends one SSE event
                    continue
                if line.startswith("event:"):
                    event = line[6:].strip()
                    continue
                if not line.startswith(("data:", "error:")):
                    continue
                payload = line.split(":", 1)[1].strip()
                if payload == "[DONE]":
                    ended = True
                    break
                try:
                    chunk = json.loads(payload)
                except json.JSONDecodeError:
                    if event == "error" or line.startswith("error:"):
                        raise RunnerError(f"{url}: error event in the stream after {len(times)} pieces: "
                                          f"{payload[:300]}") from None
                    raise RunnerError(f"{url}: stream chunk is not JSON: {payload[:200]!r}") from None
                if event == "error" or line.startswith("error:") or (isinstance(chunk, dict) and "error" in chunk):
                    err = chunk.get("error", chunk) if isinstance(chunk, dict) else chunk
                    detail = err.get("message", err) if isinstance(err, dict) else err
                    raise RunnerError(f"{url}: error event in the stream after {len(times)} pieces: "
                                      f"{str(detail)[:300]}")
                if not isinstance(chunk, dict):
                    raise RunnerError(f"{url}: stream chunk is not a JSON object: {payload[:200]!r}")
                if chunk.get("usage") not in (None, {}):    # an empty usage on a middle chunk says nothing
                    usage = reply_checks.usage(chunk["usage"], url)
                if chunk.get("timings") is not None:        # llama-server's (draft counters among them)
                    server_timings = reply_checks.timings(chunk["timings"], url)
                choices = chunk.get("choices") or []
                if not choices:
                    continue
                c = choices[0]
                now = time.perf_counter() - t0
                if self.api == "chat":
                    delta = c.get("delta") or {}
                    piece = delta.get("content")
                    thought = delta.get("reasoning_content") or delta.get("reasoning")
                    if thought:
                        reasoning.append(thought)
                        first.setdefault("first_reasoning_s", now)
                        if not piece:
                            times.append(now)
                else:
                    piece = c.get("text")
                if piece:
                    texts.append(piece)
                    times.append(now)
                    first.setdefault("first_content_s", now)
                    if on_text is not None:
                        on_text(piece)
                    top.extend(_top_logprobs(c.get("logprobs"), url) or [])
                finish = c.get("finish_reason") or finish
        if not ended and finish is None:
            raise RunnerError(f"{url}: the stream ended after {len(times)} pieces without [DONE] or a "
                              f"finish_reason (the server stopped mid-answer)")
        timings: ServerTimings = {**server_timings, "wall_s": time.perf_counter() - t0, **first}
        if reasoning:
            timings["reasoning_pieces"] = len(reasoning)
        return GenerateResult(
            text="".join(texts), output_tokens=usage.completion_tokens,
            prompt_tokens=usage.prompt_tokens, finish_reason=finish,
            top_logprobs=top or None, token_times=times, endpoint=base, sent_at=t0,
            reasoning="".join(reasoning) or None,
            reasoning_tokens=usage.reasoning_tokens if reasoning else None,
            timings=timings)

    # -- tokens and prompt log-probs (KLD, fitted prompt lengths) ----------------------------------
    def prompt_logprobs_top_k(self) -> int | None:
        return self.prompt_logprobs_k

    def vocab_size(self) -> int | None:
        return self.local_tokenizer.vocab_size if self.local_tokenizer is not None else None

    def startup_note(self, run_dir: str | None) -> str:
        return f"connecting to {', '.join(self.base_urls)}"

    def declared_vocab_size(self) -> int | None:
        return self.vocab_size()

    def bos_policy(self) -> tuple[bool, int | None]:
        tok = self.local_tokenizer
        return (tok.add_bos, tok.bos_token_id) if tok is not None else (False, None)

    async def detokenize(self, token_ids: list[int]) -> str:
        if self.local_tokenizer is None:
            return await super().detokenize(token_ids)
        return self.local_tokenizer.decode(token_ids)

    async def prompt_logprobs(self, token_ids: list[int], top_k: int | None = None,
                              score_ids: list[int] | None = None) -> list[Any]:
        """Rows as moebench.lmeval.scoring describes (entry 0 None; entry i: log-prob of token i and
        {id: log-prob} of the top K, plus `score_ids` where the server scores fixed ids)."""
        mode = self.prompt_logprobs_mode
        if mode == "none":
            raise RunnerError("this http runner's profile sets no prompt_logprobs mode")
        ids = [int(t) for t in token_ids]
        prompt: list[int] | str = ids
        if Capability.TOKEN_PROMPTS not in self.capabilities and mode != "sglang":
            if self.local_tokenizer is None:
                raise RunnerError("prompt log-probs of fixed tokens need `token_prompts = true` or a local "
                                  "`tokenizer` to send them as text")
            prompt = self.local_tokenizer.decode(ids)
        k = int(top_k or self.prompt_logprobs_k)
        body = prompt_lp.PromptLogprobsBody(
            mode, self.model, prompt, k,
            tuple(score_ids or ()) if Capability.PROMPT_LOGPROB_IDS in self.capabilities else ())
        path = body.path
        piece_map = self.local_tokenizer.id_of_piece if self.local_tokenizer is not None else None

        # Bounded like any reply: K alternatives at every prompt position (K = the vocabulary needs
        # max_response_bytes raised: about 25 bytes per alternative in the echo form).
        limit = response_limit(len(ids), k + 1, self.max_response_bytes)

        async def call(url: str) -> list[Any]:
            root = url[:-3] if url.endswith("/v1") else url
            data = _json(await self._post(root + path, body, limit), root + path)
            where = f"{root}{path} ({mode})"
            if mode == "vllm":
                return prompt_lp.parse_vllm(data, ids, where)
            if mode == "echo":
                return prompt_lp.parse_echo(data, ids, where, piece_map)
            return prompt_lp.parse_sglang(data, ids, where)

        return await self._with_retries(call, lambda url: (url[:-3] if url.endswith("/v1") else url) + path)

    async def sampled_logprobs(self, prompt_ids: list[int], max_tokens: int, seed: int) -> tuple[list[int], list[float]]:
        """A seeded temperature-1 sample without truncation and its log-probs (moebench.runners.sampled_logprobs)."""
        if Capability.SAMPLED_LOGPROBS not in self.capabilities:
            raise RunnerError("sampling with log-probs needs `token_prompts = true` and api = \"completions\"")
        body = sampled_lp.SampledLogprobsBody(self.model, tuple(prompt_ids), max_tokens, seed, self.extra_body)
        limit = response_limit(max_tokens, 1, self.max_response_bytes)

        async def call(url: str) -> tuple[list[int], list[float]]:
            data = _json(await self._post(url + "/completions", body, limit), url + "/completions")
            return sampled_lp.parse(data, max_tokens, url + "/completions")

        return await self._with_retries(call, lambda url: url + "/completions")

    async def tokenize(self, text: str) -> list[int]:
        if Capability.TOKENIZE not in self.capabilities:
            return await super().tokenize(text)
        if self.tokenize_form == "none":
            assert self.local_tokenizer is not None
            return self.local_tokenizer.encode(text)
        form: WireBody = (VllmTokenizeBody(self.model, text) if self.tokenize_form == "vllm"
                          else LlamaTokenizeBody(text))

        async def call(url: str) -> list[int]:
            root = url[:-3] if url.endswith("/v1") else url
            raw = await self._post(root + "/tokenize", form, self.max_response_bytes)
            data = _json(raw, root + "/tokenize")
            tokens = data.get("tokens") if isinstance(data, dict) else None
            if not isinstance(tokens, list):
                raise RunnerError(f"{root}/tokenize: no 'tokens' list in the response")
            return [_token_id(t, f"tokens[{i}]", f"{root}/tokenize") for i, t in enumerate(tokens)]

        return await self._with_retries(call, lambda url: (url[:-3] if url.endswith("/v1") else url) + "/tokenize")

    async def server_metrics(self) -> dict[str, float] | None:
        """Counters of every endpoint's Prometheus /metrics page, summed; None where any has none."""
        total: dict[str, float] = {}
        for url in self.base_urls:
            root = url[:-3] if url.endswith("/v1") else url
            try:
                async with self._open("GET", root + "/metrics") as resp:
                    raw = await read_bounded(resp, 16 << 20, root + "/metrics")
                    if resp.status != 200:
                        return None
            except (TransportError, RunnerError):
                return None           # no metrics page: no server-side counters, not an error
            for name, value in parse_prometheus(raw.decode("utf-8", "replace")).items():
                total[name] = total.get(name, 0.0) + value
        return total


def _apply_stops(result: GenerateResult, stops: list[str]) -> GenerateResult:
    """Stop strings beyond what the server accepts: cut the text at the first one, as a server would."""
    cut = first_stop(result.text, stops)
    if cut is not None:
        result.text, result.finish_reason = result.text[:cut], "stop"
        result.token_ids = None             # the server's ids cover the uncut text
    return result


class HttpStatus(Exception):
    """A status other than 2xx, with what `_with_retries` needs to decide on a retry."""

    def __init__(self, url: str, status: int, body: bytes, retry_after: str | None, location: str | None = None):
        self.status = status
        self.retry_after = retry_after
        text = body[:300].decode("utf-8", "replace")
        # Redirects are not followed: the profile should name the final address, not lean on a hop.
        moved = (f" redirect to {location or '(no Location header)'}, not followed: point base_url there"
                 if 300 <= status < 400 else "")
        super().__init__(f"{url}: HTTP {status}{moved}: {text}"
                         + (f" (Retry-After: {retry_after})" if retry_after else ""))

    @classmethod
    def of(cls, url: str, resp: aiohttp.ClientResponse, body: bytes) -> "HttpStatus":
        return cls(url, resp.status, body, resp.headers.get("retry-after"), resp.headers.get("location"))


def _token_id(entry: Any, field: str, where: str) -> int:
    """A token id from /tokenize: a bare id (llama-server, vLLM) or {"id": ...} (llama-server with pieces)."""
    tid = reply_checks.count(entry.get("id") if isinstance(entry, dict) else entry, field, where)
    if tid is None:
        raise RunnerError(f"{where}: field {field!r} is null, expected a token id")
    return tid


def _json(raw: bytes, where: str) -> Any:
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RunnerError(f"{where}: response is not JSON: {raw[:200].decode('utf-8', 'replace')!r}") from None


def _top_logprobs(lp: Any, where: str) -> list[dict[str, float]] | None:
    """Per-position top log-probs from either format, each checked; None when absent."""
    if not lp:
        return None
    if isinstance(lp, dict) and isinstance(lp.get("content"), list):        # chat style
        out = []
        for i, pos in enumerate(lp["content"]):
            alts = (pos.get("top_logprobs") if isinstance(pos, dict) else None) or []
            out.append({a["token"]: reply_checks.logprob(a["logprob"], f"logprobs.content[{i}].top_logprobs", where)
                        for a in alts if isinstance(a, dict) and "token" in a and "logprob" in a})
        return out
    if isinstance(lp, dict) and isinstance(lp.get("top_logprobs"), list):   # legacy completions
        return [{str(k): reply_checks.logprob(v, f"logprobs.top_logprobs[{i}][{k!r}]", where)
                 for k, v in (pos or {}).items()} for i, pos in enumerate(lp["top_logprobs"])]
    raise RunnerError(f"{where}: unrecognised logprobs format: {str(lp)[:200]}")


def parse_response(data: Any, api: str, where: str = "response") -> GenerateResult:
    """Parse a non-streamed completions/chat response from `where`, or raise RunnerError saying what is wrong."""
    if not isinstance(data, dict):
        raise RunnerError(f"response is not a JSON object: {str(data)[:200]}")
    if data.get("error"):                # an error object is an error, whatever else came with it
        raise RunnerError(f"server error: {str(data['error'])[:300]}")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise RunnerError(f"response has no choices: {str(data)[:200]}")
    c = choices[0]
    reasoning = None
    if api == "chat":
        msg = c.get("message")
        text = msg.get("content") if isinstance(msg, dict) else None
        if isinstance(msg, dict):
            reasoning = msg.get("reasoning_content") or msg.get("reasoning") or None
            if text is None and reasoning:
                text = ""                   # the budget ran out while the model was still reasoning
    else:
        text = c.get("text")
    if not isinstance(text, str):
        raise RunnerError(f"response choice has no text: {str(c)[:200]}")
    usage = reply_checks.usage(data.get("usage"), where)
    timings = reply_checks.timings(data.get("timings"), where)     # llama-server adds its own timings
    return GenerateResult(text=text, prompt_tokens=usage.prompt_tokens,
                          output_tokens=usage.completion_tokens, finish_reason=c.get("finish_reason"),
                          top_logprobs=_top_logprobs(c.get("logprobs"), where), timings=timings,
                          reasoning=reasoning if isinstance(reasoning, str) else None,
                          reasoning_tokens=usage.reasoning_tokens if reasoning else None)
