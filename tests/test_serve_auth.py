"""`moebench serve` with a bearer key (required beyond loopback) and Retry-After on its 429s; the
HTTP runner honours both (it sends the key from `api_key_env`, waits as Retry-After asks)."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from conftest import moebench_cli
from moebench.runners.base import GenerateRequest, RunnerError
from moebench.runners.http import HttpRunner
from moebench.serve import BackgroundServer, ServeOptions, is_loopback
from test_serve import MarkovRunner

KEY = "serve-test-key-0123456789"


def test_bearer_key_is_required_on_every_endpoint_but_health():
    with BackgroundServer(MarkovRunner(), ServeOptions(port=0, api_key=KEY)) as s:
        base = s.url[: -len("/v1")]
        assert httpx.get(base + "/health").status_code == 200
        for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "hi"}),
                                   ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                                   ("POST", "/tokenize", {"prompt": "hi"})):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                r = httpx.request(method, base + path, json=body, headers=headers, timeout=30)
                assert r.status_code == 401, (path, headers, r.text)
                assert r.headers["WWW-Authenticate"] == "Bearer"
                assert r.json()["error"]["type"] == "authentication_error"
            ok = httpx.request(method, base + path, json=body, headers={"Authorization": f"Bearer {KEY}"},
                               timeout=30)
            assert ok.status_code == 200, (path, ok.text)


def test_http_runner_sends_the_key_from_its_environment_variable(monkeypatch):
    with BackgroundServer(MarkovRunner(), ServeOptions(port=0, api_key=KEY)) as s:
        async def ask(runner):
            await runner.start()
            try:
                return await runner.generate(GenerateRequest(prompt="hello", max_tokens=3))
            finally:
                await runner.close()

        monkeypatch.setenv("SERVE_KEY", KEY)
        res = asyncio.run(ask(HttpRunner({"base_url": s.url, "api_key_env": "SERVE_KEY"}, "t.toml")))
        assert res.output_tokens == 3
        with pytest.raises(RunnerError, match="HTTP 401"):
            asyncio.run(ask(HttpRunner({"base_url": s.url, "retries": 0}, "t.toml")))


def test_429_carries_retry_after_and_the_runner_waits_for_it():
    runner = MarkovRunner(concurrency=8, delay_s=0.6)
    with BackgroundServer(runner, ServeOptions(port=0, max_concurrency=1, max_queue=0, retry_after_s=1)) as s:
        holder = threading.Thread(target=lambda: httpx.post(s.url + "/completions",
                                                             json={"prompt": "a", "max_tokens": 1}, timeout=30))
        holder.start()
        time.sleep(0.2)
        busy = httpx.post(s.url + "/completions", json={"prompt": "b", "max_tokens": 1}, timeout=30)
        assert busy.status_code == 429 and busy.headers["Retry-After"] == "1"
        assert "retry after 1 s" in busy.json()["error"]["message"]
        holder.join()

        # The HTTP runner, asked while the slot is taken, waits the second and then gets its answer.
        holder = threading.Thread(target=lambda: httpx.post(s.url + "/completions",
                                                             json={"prompt": "a", "max_tokens": 1}, timeout=30))
        holder.start()
        time.sleep(0.2)

        async def ask():
            r = HttpRunner({"base_url": s.url, "retries": 2, "backoff_s": 0.01}, "t.toml")
            await r.start()
            try:
                t0 = time.monotonic()
                out = await r.generate(GenerateRequest(prompt="c", max_tokens=1))
                return out, time.monotonic() - t0
            finally:
                await r.close()

        out, waited = asyncio.run(ask())
        holder.join()
        assert out.output_tokens == 1 and waited >= 0.95


def test_loopback_names():
    assert is_loopback("127.0.0.1") and is_loopback("127.3.2.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("192.168.1.4")


def test_cli_refuses_to_serve_beyond_loopback_without_a_key(tmp_path):
    # An engine profile: refused before any model would be loaded (the refusal takes no time).
    profile = "runners/engine-bf16.toml"
    r = moebench_cli("serve", "--runner", profile, "--host", "0.0.0.0", timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "serve --host 0.0.0.0: reachable from other machines, so a key is required" in r.stderr
    assert "--api-key-env NAME" in r.stderr
    r = moebench_cli("serve", "--runner", profile, "--host", "0.0.0.0", "--api-key-env", "NO_SUCH_VAR_X",
                     timeout=120)
    assert r.returncode == 2 and "'NO_SUCH_VAR_X' is not set" in r.stderr
