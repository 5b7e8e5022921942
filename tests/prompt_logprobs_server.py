"""A small protocol server answering prompt log-probs exactly in vLLM's and SGLang's response shapes,
computed by a real moebench runner (the engine on the zoo model), for the HTTP KLD tests.

It complements, never replaces, the real servers: `moebench serve` (echo) and a real vLLM are tested
too. Shapes, field for field (see moebench/runners/prompt_logprobs.py for the sources):
- vLLM  POST /v1/completions {prompt: [ids], prompt_logprobs: K, max_tokens} ->
  {"id", "object": "text_completion", "created", "model", "choices": [{"index": 0, "text",
   "logprobs": null, "finish_reason", "stop_reason": null, "prompt_logprobs": [null, {"<id>":
   {"logprob", "rank", "decoded_token"}, ...}, ...], "prompt_token_ids": null}], "usage": {...}}
  (vllm/entrypoints/openai/completion/protocol.py CompletionResponse/CompletionResponseChoice,
  vllm/logprobs.py Logprob; the actual prompt token is always present, with its rank).
- SGLang POST /generate {input_ids, sampling_params, return_logprob, logprob_start_len, top_logprobs_num,
  token_ids_logprob} -> {"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
  "completion_tokens", "input_token_logprobs": [[logprob|null, id, null], ...], "input_top_logprobs":
  [null, [[logprob, id, null] x K], ...], "input_token_ids_logprobs": [null, [[logprob, id, null] for the
  asked ids], ...], "output_token_logprobs": [...], "output_top_logprobs": [...]}}
  (sglang/srt/managers/tokenizer_manager.py add_logprob_to_meta_info / detokenize_logprob_tokens).
`tamper_position` makes every answer report a different token there (the mismatch test).
"""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
from aiohttp import web


class PromptLogprobServer:
    def __init__(self, runner: Any, tamper_position: int | None = None):
        self.runner = runner
        self.tamper_position = tamper_position
        self.requests: list[dict[str, Any]] = []
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.url = ""

    async def _logprobs(self, ids: list[int]) -> np.ndarray:
        logits = await self.runner.logits(ids)
        x = np.asarray(logits.float().numpy() if hasattr(logits, "numpy") else logits, dtype=np.float64)
        m = x.max(axis=1, keepdims=True)
        return x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))     # row i predicts token i+1

    def _reported(self, ids: list[int]) -> list[int]:
        out = list(ids)
        if self.tamper_position is not None and self.tamper_position < len(out):
            out[self.tamper_position] = (out[self.tamper_position] + 1) % 50257
        return out

    async def vllm(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        ids, k = body["prompt"], int(body["prompt_logprobs"])
        lp = await self._logprobs(ids)
        reported = self._reported(ids)
        plp: list[Any] = [None]
        for i in range(1, len(ids)):
            row = lp[i - 1]
            order = np.argsort(-row, kind="stable")
            ranks = np.empty_like(order)
            ranks[order] = np.arange(1, row.size + 1)
            entry = {str(int(t)): {"logprob": float(row[t]), "rank": int(ranks[t]), "decoded_token": None}
                     for t in order[:k]}
            tok = reported[i]
            entry.setdefault(str(tok), {"logprob": float(row[tok]), "rank": int(ranks[tok]), "decoded_token": None})
            plp.append(entry)
        return web.json_response({
            "id": "cmpl-test", "object": "text_completion", "created": int(time.time()), "model": body.get("model"),
            "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None,
                         "prompt_logprobs": plp, "prompt_token_ids": None}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1}})

    async def sglang(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        ids, k = body["input_ids"], int(body.get("top_logprobs_num") or 0)
        fixed = body.get("token_ids_logprob") or []
        lp = await self._logprobs(ids)
        reported = self._reported(ids)
        own: list[Any] = [[None, int(reported[0]), None]]
        top: list[Any] = [None]
        fixed_rows: list[Any] = [None]
        for i in range(1, len(ids)):
            row = lp[i - 1]
            best = np.argsort(-row, kind="stable")[:k]
            own.append([float(row[reported[i]]), int(reported[i]), None])
            top.append([[float(row[t]), int(t), None] for t in best])
            fixed_rows.append([[float(row[t]), int(t), None] for t in fixed] if fixed else None)
        return web.json_response({"text": "", "output_ids": [], "meta_info": {
            "id": "test", "finish_reason": {"type": "length", "length": 1}, "prompt_tokens": len(ids),
            "completion_tokens": 1, "input_token_logprobs": own, "input_top_logprobs": top,
            "input_token_ids_logprobs": fixed_rows if fixed else None,
            "output_token_logprobs": [], "output_top_logprobs": []}})

    async def _start(self) -> None:
        await self.runner.start(None)
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self.vllm)
        app.router.add_post("/generate", self.sglang)
        self._app = web.AppRunner(app, access_log=None)
        await self._app.setup()
        site = web.TCPSite(self._app, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]     # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> "PromptLogprobServer":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(timeout=600)
        return self

    def __exit__(self, *exc: Any) -> None:
        async def stop() -> None:
            await self._app.cleanup()
            await self.runner.close()
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
