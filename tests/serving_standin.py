"""A stand-in serving engine for load tests: an OpenAI-compatible streaming /v1/completions that serves
`slots` requests at a time (the rest wait in its queue), and a Prometheus /metrics page in the names one
real server documents (moebench/runners/metrics.py cites each):

  vllm          vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc,
                vllm:prefix_cache_queries_total, vllm:prefix_cache_hits_total, vllm:num_preemptions_total
  sglang        sglang:num_running_reqs, sglang:num_queue_reqs, sglang:token_usage, sglang:cache_hit_rate
  llama-server  llamacpp:requests_processing, llamacpp:requests_deferred, llamacpp:prompt_tokens_total,
                llamacpp:prompt_tokens_cached_total

Planted values, so a test knows the answer: every request adds 100 queried prompt tokens of which 25
hit the prefix cache (vLLM: hit rate 0.25; llama-server's processed counter excludes cached tokens, so it
adds 75 processed and 25 cached: also 0.25); SGLang's hit-rate gauge reads 0.25; vLLM counts one
preemption per request; KV-cache usage is 0.1 per running request. It never replaces the real runs
against vLLM and `moebench serve`; it exists to serve each server's names with known values.
It runs in its own process, so the client's work never delays its clock.
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing

SERVICE = {"first_s": 0.02, "token_s": 0.005}


def _page(family: str, running: int, waiting: int, served: int) -> str:
    label = '{model_name="standin",engine="0"}'      # labels as vLLM writes them; summed by the parser
    if family == "vllm":
        vals = {"vllm:num_requests_running": running, "vllm:num_requests_waiting": waiting,
                "vllm:kv_cache_usage_perc": 0.1 * running, "vllm:prefix_cache_queries_total": 100 * served,
                "vllm:prefix_cache_hits_total": 25 * served, "vllm:num_preemptions_total": served}
    elif family == "sglang":
        vals = {"sglang:num_running_reqs": running, "sglang:num_queue_reqs": waiting,
                "sglang:token_usage": 0.1 * running, "sglang:cache_hit_rate": 0.25}
    else:
        label = ""
        vals = {"llamacpp:requests_processing": running, "llamacpp:requests_deferred": waiting,
                "llamacpp:prompt_tokens_total": 75 * served, "llamacpp:prompt_tokens_cached_total": 25 * served}
    lines = []
    for name, v in vals.items():
        lines += [f"# HELP {name} planted", f"# TYPE {name} gauge", f"{name}{label} {float(v)}"]
    return "\n".join(lines) + "\n"


def _serve(family: str, slots: int, first_s: float, token_s: float, port_queue) -> None:
    from aiohttp import web

    state = {"running": 0, "waiting": 0, "served": 0}

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        sem: asyncio.Semaphore = request.app["slots"]
        state["waiting"] += 1
        await sem.acquire()
        state["waiting"] -= 1
        state["running"] += 1
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            n = int(body.get("max_tokens") or 4)
            await asyncio.sleep(first_s)
            for i in range(n):
                if i:
                    await asyncio.sleep(token_s)
                chunk = {"choices": [{"index": 0, "text": f" w{i}", "finish_reason": None}]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            usage = {"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": n}}
            await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
            return resp
        finally:
            state["running"] -= 1
            state["served"] += 1
            sem.release()

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=_page(family, state["running"], state["waiting"], state["served"]),
                            content_type="text/plain")

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def main() -> None:
        app = web.Application()
        app["slots"] = asyncio.Semaphore(slots)
        app.router.add_post("/v1/completions", completions)
        app.router.add_get("/metrics", metrics)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port_queue.put(site._server.sockets[0].getsockname()[1])
        await asyncio.Event().wait()

    asyncio.run(main())


class StandIn:
    """`with StandIn("vllm", slots=1) as s:` s.url is the /v1 base URL."""

    def __init__(self, family: str, slots: int = 1, first_s: float = SERVICE["first_s"],
                 token_s: float = SERVICE["token_s"]):
        ctx = multiprocessing.get_context("spawn")
        q = ctx.Queue()
        self.proc = ctx.Process(target=_serve, args=(family, slots, first_s, token_s, q), daemon=True)
        self.proc.start()
        self.url = f"http://127.0.0.1:{q.get(timeout=60)}/v1"

    def __enter__(self) -> "StandIn":
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.join(timeout=10)
