"""The HTTP runner's protocol handling against small OpenAI-compatible servers on 127.0.0.1."""
from __future__ import annotations

import asyncio
import json

import pytest

from moebench.runners.base import GenerateRequest, RunnerError
from moebench.runners.http import HttpRunner
from openai_fake import serve


def _runner(*urls: str, **extra) -> HttpRunner:
    profile = {"base_urls": list(urls), "model": "m", "concurrency": 2, "retries": 3, "backoff_s": 0.01, **extra}
    return HttpRunner(profile, "test.toml")


async def _ask(runner: HttpRunner, reqs: list[GenerateRequest]):
    await runner.start()
    try:
        return await asyncio.gather(*(runner.generate(r) for r in reqs), return_exceptions=True)
    finally:
        await runner.close()


def _asked(log) -> list[dict]:
    return [json.loads(x) for x in log.read_text().splitlines()]


def test_5xx_is_retried_4xx_is_not(tmp_path):
    log = tmp_path / "log.jsonl"
    srv = serve({"fail_first": 2, "default": "fine", "bad_request_for": ["BAD"], "log": str(log)})
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/v1"
        ok = asyncio.run(_ask(_runner(url), [GenerateRequest(prompt="Question: hello")]))[0]
        assert ok.text == "fine"
        assert len(_asked(log)) == 3                       # two 500s, then the answer
        bad = asyncio.run(_ask(_runner(url), [GenerateRequest(prompt="Question: BAD")]))[0]
        assert isinstance(bad, RunnerError) and "HTTP 400" in str(bad)
        assert len(_asked(log)) == 4                       # asked once: no retry on 4xx
    finally:
        srv.shutdown()


def test_connection_refused_gives_up_with_the_reason():
    res = asyncio.run(_ask(_runner("http://127.0.0.1:9/v1", retries=1), [GenerateRequest(prompt="x")]))[0]
    assert isinstance(res, RunnerError) and "gave up after 2 attempts" in str(res)


def test_several_endpoints_share_the_work(tmp_path):
    logs = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    servers = [serve({"default": "x", "delay_s": 0.05, "log": str(p)}) for p in logs]
    try:
        urls = [f"http://127.0.0.1:{s.server_address[1]}/v1" for s in servers]
        runner = _runner(*urls)
        assert runner.concurrency == 4
        results = asyncio.run(_ask(runner, [GenerateRequest(prompt=f"Question: {i}") for i in range(12)]))
        assert all(r.text == "x" for r in results)
        counts = [len(_asked(p)) for p in logs]
        assert sum(counts) == 12 and min(counts) >= 3, counts
    finally:
        for s in servers:
            s.shutdown()


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_both_logprob_formats_and_streaming(api):
    top = {" A": -0.2, " B": -1.9, " C": -3.0}
    srv = serve({"default": "the answer is here", "top_logprobs": {"pick": top},
                 "first_token_ms": 80, "token_ms": 20})
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/v1"
        res = asyncio.run(_ask(_runner(url, api=api), [GenerateRequest(prompt="Question: pick", top_logprobs=3)]))[0]
        assert res.top_logprobs[0] == pytest.approx(top)
        pieces: list[str] = []
        streamed = asyncio.run(_ask(_runner(url, api=api), [GenerateRequest(prompt="Question: x", stream=True,
                                                                            on_text=pieces.append)]))[0]
        assert streamed.text == "the answer is here" and len(streamed.token_times) == 4
        assert len(pieces) == 4 and "".join(pieces) == streamed.text
        assert streamed.token_times[0] >= 0.07 and streamed.token_times[-1] - streamed.token_times[0] >= 0.05
    finally:
        srv.shutdown()


def test_missing_api_key_variable_is_a_profile_error(monkeypatch):
    from moebench.config import ProfileError
    monkeypatch.delenv("MOEBENCH_TEST_KEY", raising=False)
    with pytest.raises(ProfileError, match="MOEBENCH_TEST_KEY"):
        _runner("http://127.0.0.1:9/v1", api_key_env="MOEBENCH_TEST_KEY")
