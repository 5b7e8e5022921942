"""The http runner's client: the proxy variables are honoured, and requests reuse the pooled
connections (about one connection per concurrent request, not one per item)."""
from __future__ import annotations

import asyncio

from moebench.runners.base import GenerateRequest
from moebench.runners.http import HttpRunner
from openai_fake import serve


def _runner(url: str, **extra) -> HttpRunner:
    return HttpRunner({"base_url": url, "model": "m", "retries": 0, "backoff_s": 0.01, **extra}, "test.toml")


def test_http_proxy_variable_is_honoured_and_no_proxy_bypasses_it(tmp_path, monkeypatch):
    log = tmp_path / "asked.jsonl"
    proxy = serve({"default": "via the proxy", "log": str(log)})
    try:
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{proxy.server_address[1]}")
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        # a host that resolves nowhere: only the proxy can answer
        res = asyncio.run(_runner("http://upstream.invalid/v1").generate(GenerateRequest(prompt="Question: q")))
        assert res.text == "via the proxy" and len(log.read_text().splitlines()) == 1
        monkeypatch.setenv("NO_PROXY", "upstream.invalid")
        runner = _runner("http://upstream.invalid/v1", connect_timeout_s=2)
        try:
            asyncio.run(runner.generate(GenerateRequest(prompt="Question: q")))
            raise AssertionError("NO_PROXY was not honoured")
        except Exception as e:          # Unreachable: the name does not resolve, the proxy was bypassed
            assert "ConnectError" in str(e), e
        assert len(log.read_text().splitlines()) == 1
    finally:
        proxy.shutdown()


def test_connections_are_reused_across_items(tmp_path):
    srv = serve({"default": "hi"})
    ports: set[int] = set()
    handler = srv.RequestHandlerClass
    handler.protocol_version = "HTTP/1.1"      # keep-alive: the fake's replies carry Content-Length
    real = handler.do_POST

    def do_post(self):
        ports.add(self.client_address[1])
        real(self)

    handler.do_POST = do_post
    try:
        runner = _runner(f"http://127.0.0.1:{srv.server_address[1]}/v1", concurrency=4)

        async def go():
            await runner.start()
            try:
                sem = asyncio.Semaphore(4)

                async def one(i):
                    async with sem:
                        return await runner.generate(GenerateRequest(prompt=f"Question: {i}"))
                return await asyncio.gather(*(one(i) for i in range(60)))
            finally:
                await runner.close()

        assert all(r.text == "hi" for r in asyncio.run(go()))
        assert len(ports) <= 8, ports         # the pool's connections, not one per request
    finally:
        srv.shutdown()
