"""`kind = "http"`: any OpenAI-compatible server (vLLM, SGLang, llama-server, TGI, `moebench serve`).

- `/v1/completions` or `/v1/chat/completions` (`api`), through httpx, async.
- Several endpoints (`base_urls`) share the work: each request goes to the least busy one.
- Retries with exponential backoff on connection errors, timeouts and 5xx; never on 4xx.
- Both log-prob formats: legacy completions (`logprobs.top_logprobs` = list of dicts) and chat-style
  (`logprobs.content[].top_logprobs` = list of {token, logprob}), which vLLM and llama-server return.
- Streaming (SSE) records each token's arrival time for the speed task.
A response that is not what the protocol promises raises RunnerError with the reason.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import time
from typing import Any, Callable

import httpx

from moebench.config import Field, ProfileError, positive
from moebench.runners import prompt_logprobs as prompt_lp
from moebench.runners.base import Capability, GenerateRequest, GenerateResult, Runner, RunnerError
from moebench.scoring.answers import first_stop

SCHEMA: dict[str, Field] = {
    "base_url": Field(str, doc="e.g. http://127.0.0.1:8080/v1"),
    "base_urls": Field(list, item_type=str, doc="several servers sharing the items"),
    "model": Field(str, default="default"),
    "api": Field(str, default="completions", choices=("completions", "chat")),
    "api_key_env": Field(str, doc="name of the environment variable holding the API key"),
    "timeout_s": Field(float, default=600.0, check=positive),
    "connect_timeout_s": Field(float, default=10.0, check=positive),
    "retries": Field(int, default=3),
    "backoff_s": Field(float, default=0.5),
    "tokenize": Field(str, default="none", choices=("none", "llama-server", "vllm"),
                      doc="the server's own /tokenize beside /v1: llama-server's {content} or vLLM's {prompt} form"),
    "tokenizer": Field(str, doc="a local tokenizer (HF folder, tokenizer.json or GGUF) where the server has no "
                                "usable /tokenize; also maps echoed token text to ids"),
    "prompt_logprobs": Field(str, default="none", choices=prompt_lp.MODES,
                             doc="how the server returns prompt log-probs (KLD): vLLM's prompt_logprobs field, "
                                 "legacy echo + logprobs, or SGLang's /generate"),
    "prompt_logprobs_k": Field(int, default=20, check=positive, doc="top K prompt log-probs asked per position"),
    "prompt_logprob_ids": Field(bool, default=False,
                                doc="the server also scores given token ids at each position (SGLang's "
                                    "token_ids_logprob): a candidate asks for the baseline's top-K ids"),
    "token_prompts": Field(bool, default=False, doc="the server accepts token-id prompts"),
    "extra_body": Field(dict, default=dict, doc="extra JSON fields sent with every request"),
    "max_stop": Field(int, default=4, check=positive,
                      doc="stop strings the server accepts per request (OpenAI and vLLM: 4); the rest "
                          "are applied to the returned text"),
}


class HttpRunner(Runner):
    kind = "http"

    def __init__(self, profile: dict[str, Any], profile_path: str | None = None):
        super().__init__(profile, profile_path)
        where = profile_path or "runner profile"
        urls = list(profile.get("base_urls") or [])
        if profile.get("base_url"):
            urls.insert(0, profile["base_url"])
        if not urls:
            raise ProfileError(f"{where}: needs key 'base_url' or 'base_urls' (e.g. \"http://127.0.0.1:8080/v1\")")
        self.base_urls = [u.rstrip("/") for u in urls]
        self.api = profile.get("api", "completions")
        self.model = profile.get("model", "default")
        self.per_endpoint = int(profile.get("concurrency", 1))
        self.concurrency = self.per_endpoint * len(self.base_urls)
        self.retries = int(profile.get("retries", 3))
        self.backoff_s = float(profile.get("backoff_s", 0.5))
        self.extra_body = dict(profile.get("extra_body") or {})
        self.max_stop = int(profile.get("max_stop", 4))
        self.in_flight = {u: 0 for u in self.base_urls}
        key_env = profile.get("api_key_env")
        self.headers = {}
        if key_env:
            key = os.environ.get(key_env)
            if not key:
                raise ProfileError(f"{where}: key 'api_key_env' names {key_env!r}, which is not set in the environment")
            self.headers["Authorization"] = f"Bearer {key}"
        caps = {Capability.GENERATE, Capability.STREAM, Capability.TOP_LOGPROBS}
        self.tokenize_form = profile.get("tokenize", "none")
        self.local_tokenizer = None
        if profile.get("tokenizer"):
            from moebench.runners.local_tokenizer import load_tokenizer
            self.local_tokenizer = load_tokenizer(profile["tokenizer"], where)
        if self.tokenize_form != "none" or self.local_tokenizer is not None:
            caps.add(Capability.TOKENIZE)
        self.prompt_logprobs_mode = profile.get("prompt_logprobs", "none")
        self.prompt_logprobs_k = int(profile.get("prompt_logprobs_k", 20))
        if self.prompt_logprobs_mode != "none":
            caps.add(Capability.PROMPT_LOGPROBS)
            if profile.get("prompt_logprob_ids"):
                if self.prompt_logprobs_mode != "sglang":
                    raise ProfileError(f"{where}: key 'prompt_logprob_ids' needs prompt_logprobs = \"sglang\" "
                                       "(vLLM's OpenAI server does not take prompt_logprob_token_ids; "
                                       "docs/kld.md)")
                caps.add(Capability.PROMPT_LOGPROB_IDS)
        if profile.get("token_prompts"):
            caps.add(Capability.TOKEN_PROMPTS)
        self.capabilities = frozenset(caps)
        self.timeout = httpx.Timeout(float(profile.get("timeout_s", 600.0)),
                                     connect=float(profile.get("connect_timeout_s", 10.0)))
        self.client: httpx.AsyncClient | None = None

    async def start(self, run_dir: str | None = None) -> None:
        limits = httpx.Limits(max_connections=self.concurrency + 4, max_keepalive_connections=self.concurrency + 4)
        self.client = httpx.AsyncClient(timeout=self.timeout, limits=limits, headers=self.headers)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            self.client = None

    def identity(self) -> dict[str, Any]:
        return {"model": {"name": self.model, "endpoints": self.base_urls, "api": self.api}, "build": {}}

    # -- plumbing --------------------------------------------------------------------------------
    def _pick(self) -> str:
        return min(self.base_urls, key=lambda u: self.in_flight[u])

    async def _with_retries(self, call):
        """Run `call(base_url)` with retries on connection errors, timeouts and 5xx (never 4xx)."""
        if self.client is None:
            await self.start()
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            url = self._pick()
            self.in_flight[url] += 1
            try:
                return await call(url)
            except httpx.HTTPStatusError as e:
                status = e.response.status_code
                body = e.response.text[:300]
                if 400 <= status < 500:
                    raise RunnerError(f"{url}: HTTP {status}: {body}") from None
                last = RunnerError(f"{url}: HTTP {status}: {body}")
            except (httpx.TransportError, httpx.TimeoutException) as e:
                last = RunnerError(f"{url}: {type(e).__name__}: {e}")
            finally:
                self.in_flight[url] -= 1
            if attempt < self.retries:
                await asyncio.sleep(self.backoff_s * (2 ** attempt) * (0.5 + random.random()))
        assert last is not None
        raise RunnerError(f"gave up after {self.retries + 1} attempts: {last}")

    def _body(self, req: GenerateRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "max_tokens": req.max_tokens, "temperature": req.temperature}
        if req.seed is not None:
            body["seed"] = req.seed
        if req.stop:
            body["stop"] = req.stop[: self.max_stop]    # the rest: cut client-side (_apply_stops)
        if self.api == "chat":
            if not isinstance(req.prompt, str):
                raise RunnerError("the chat API takes text prompts only")
            body["messages"] = [{"role": "user", "content": req.prompt}]
            if req.top_logprobs:
                body["logprobs"] = True
                body["top_logprobs"] = req.top_logprobs
        else:
            body["prompt"] = req.prompt
            if req.top_logprobs:
                body["logprobs"] = req.top_logprobs
        if req.ignore_eos:
            body["ignore_eos"] = True          # vLLM and llama-server both accept it
        if not req.cache_prompt:
            body["cache_prompt"] = False        # llama-server; others ignore unknown keys
        body.update(self.extra_body)
        return body

    # -- requests --------------------------------------------------------------------------------
    async def generate(self, request: GenerateRequest) -> GenerateResult:
        path = "/chat/completions" if self.api == "chat" else "/completions"
        body = self._body(request)

        async def call(url: str) -> GenerateResult:
            assert self.client is not None
            if request.stream:
                return _apply_stops(await self._stream(url + path, {**body, "stream": True,
                                                                   "stream_options": {"include_usage": True}},
                                                       url, request.on_text), request.stop[self.max_stop:])
            t0 = time.perf_counter()
            resp = await self.client.post(url + path, json=body)
            resp.raise_for_status()
            data = _json(resp, url + path)
            result = _apply_stops(parse_response(data, self.api), request.stop[self.max_stop:])
            result.endpoint = url
            result.timings.setdefault("wall_s", time.perf_counter() - t0)
            return result

        return await self._with_retries(call)

    async def _stream(self, url: str, body: dict[str, Any], base: str,
                      on_text: Callable[[str], None] | None = None) -> GenerateResult:
        assert self.client is not None
        t0 = time.perf_counter()
        texts: list[str] = []
        times: list[float] = []
        top: list[dict[str, float]] = []
        finish = None
        usage: dict[str, Any] = {}
        async with self.client.stream("POST", url, json=body) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                try:
                    chunk = json.loads(payload)
                except json.JSONDecodeError:
                    raise RunnerError(f"{url}: stream chunk is not JSON: {payload[:200]!r}") from None
                if chunk.get("usage"):
                    usage = chunk["usage"]
                choices = chunk.get("choices") or []
                if not choices:
                    continue
                c = choices[0]
                piece = (c.get("delta") or {}).get("content") if self.api == "chat" else c.get("text")
                if piece:
                    texts.append(piece)
                    times.append(time.perf_counter() - t0)
                    if on_text is not None:
                        on_text(piece)
                    top.extend(_top_logprobs(c.get("logprobs")) or [])
                finish = c.get("finish_reason") or finish
        return GenerateResult(
            text="".join(texts), output_tokens=usage.get("completion_tokens") or len(times),
            prompt_tokens=usage.get("prompt_tokens"), finish_reason=finish,
            top_logprobs=top or None, token_times=times, endpoint=base,
            timings={"wall_s": time.perf_counter() - t0})

    # -- tokens and prompt log-probs (KLD, fitted prompt lengths) ----------------------------------
    def vocab_size(self) -> int | None:
        return self.local_tokenizer.vocab_size if self.local_tokenizer is not None else None

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
        path, body = prompt_lp.request(mode, self.model, prompt, k,
                                       score_ids if Capability.PROMPT_LOGPROB_IDS in self.capabilities else None)
        piece_map = self.local_tokenizer.id_of_piece if self.local_tokenizer is not None else None

        async def call(url: str) -> list[Any]:
            assert self.client is not None
            root = url[:-3] if url.endswith("/v1") else url
            resp = await self.client.post(root + path, json=body)
            resp.raise_for_status()
            data = _json(resp, root + path)
            where = f"{root}{path} ({mode})"
            if mode == "vllm":
                return prompt_lp.parse_vllm(data, ids, where)
            if mode == "echo":
                return prompt_lp.parse_echo(data, ids, where, piece_map)
            return prompt_lp.parse_sglang(data, ids, where)

        return await self._with_retries(call)

    async def tokenize(self, text: str) -> list[int]:
        if Capability.TOKENIZE not in self.capabilities:
            return await super().tokenize(text)
        if self.tokenize_form == "none":
            assert self.local_tokenizer is not None
            return self.local_tokenizer.encode(text)
        form = ({"model": self.model, "prompt": text, "add_special_tokens": False} if self.tokenize_form == "vllm"
                else {"content": text, "add_special": False})

        async def call(url: str) -> list[int]:
            assert self.client is not None
            root = url[:-3] if url.endswith("/v1") else url
            resp = await self.client.post(root + "/tokenize", json=form)
            resp.raise_for_status()
            data = _json(resp, root + "/tokenize")
            tokens = data.get("tokens") if isinstance(data, dict) else None
            if not isinstance(tokens, list):
                raise RunnerError(f"{root}/tokenize: no 'tokens' list in the response")
            return [t if isinstance(t, int) else t["id"] for t in tokens]

        return await self._with_retries(call)


def _apply_stops(result: GenerateResult, stops: list[str]) -> GenerateResult:
    """Stop strings beyond what the server accepts: cut the text at the first one, as a server would."""
    cut = first_stop(result.text, stops)
    if cut is not None:
        result.text, result.finish_reason = result.text[:cut], "stop"
        result.token_ids = None             # the server's ids cover the uncut text
    return result


def _json(resp: httpx.Response, where: str) -> Any:
    try:
        return resp.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise RunnerError(f"{where}: response is not JSON: {resp.text[:200]!r}") from None


def _top_logprobs(lp: Any) -> list[dict[str, float]] | None:
    """Per-position top log-probs from either format; None when absent."""
    if not lp:
        return None
    if isinstance(lp, dict) and isinstance(lp.get("content"), list):        # chat style
        out = []
        for pos in lp["content"]:
            alts = pos.get("top_logprobs") or []
            out.append({a["token"]: float(a["logprob"]) for a in alts if "token" in a and "logprob" in a})
        return out
    if isinstance(lp, dict) and isinstance(lp.get("top_logprobs"), list):   # legacy completions
        return [{str(k): float(v) for k, v in (pos or {}).items()} for pos in lp["top_logprobs"]]
    raise RunnerError(f"unrecognised logprobs format: {str(lp)[:200]}")


def parse_response(data: Any, api: str) -> GenerateResult:
    """Parse a non-streamed completions/chat response, or raise RunnerError saying what is wrong."""
    if not isinstance(data, dict):
        raise RunnerError(f"response is not a JSON object: {str(data)[:200]}")
    if "error" in data and "choices" not in data:
        raise RunnerError(f"server error: {str(data['error'])[:300]}")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise RunnerError(f"response has no choices: {str(data)[:200]}")
    c = choices[0]
    if api == "chat":
        msg = c.get("message")
        text = msg.get("content") if isinstance(msg, dict) else None
    else:
        text = c.get("text")
    if not isinstance(text, str):
        raise RunnerError(f"response choice has no text: {str(c)[:200]}")
    usage = data.get("usage") or {}
    timings = dict(data.get("timings") or {})       # llama-server adds its own timings
    return GenerateResult(text=text, prompt_tokens=usage.get("prompt_tokens"),
                          output_tokens=usage.get("completion_tokens"), finish_reason=c.get("finish_reason"),
                          top_logprobs=_top_logprobs(c.get("logprobs")), timings=timings)
