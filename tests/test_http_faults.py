"""The HTTP runner against servers that misbehave on purpose (429s, error events mid-stream, runaway
replies, silent reads, reasoning before the answer). Each server is a few lines on 127.0.0.1 scripted
per request; the real integration tests against llama-server live in test_llama_e2e.py."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

import pytest

from moebench.config import ProfileError, load_runner
from moebench.runners import runner_schemas
from moebench.runners.base import GenerateRequest, RunnerError
from moebench.runners.http import HttpRunner
from moebench.runners.responses import ResponseTooLarge

Script = Callable[[BaseHTTPRequestHandler, int, dict], None]


class _Scripted:
    """A server whose every POST is answered by `script(handler, n, body)`; arrivals are timed."""

    def __init__(self, script: Script):
        self.arrivals: list[float] = []
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
                outer.arrivals.append(time.monotonic())
                try:
                    script(self, len(outer.arrivals), body)
                except (BrokenPipeError, ConnectionResetError):
                    pass            # the client hung up on purpose (a reply cut off)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def _send(h: BaseHTTPRequestHandler, code: int, body: bytes, headers: dict | None = None,
          ctype: str = "application/json") -> None:
    h.send_response(code)
    h.send_header("Content-Type", ctype)
    h.send_header("Content-Length", str(len(body)))
    for k, v in (headers or {}).items():
        h.send_header(k, v)
    h.end_headers()
    h.wfile.write(body)


def _ok(text: str = "fine") -> bytes:
    return json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 1, "completion_tokens": 1}}).encode()


def _sse(h: BaseHTTPRequestHandler, events: list[bytes], gap_s: float = 0.0) -> None:
    h.send_response(200)
    h.send_header("Content-Type", "text/event-stream")
    h.end_headers()
    for e in events:
        if gap_s:
            time.sleep(gap_s)
        h.wfile.write(e)
        h.wfile.flush()


def _data(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _ask(url: str, req: GenerateRequest, **profile):
    runner = HttpRunner({"base_url": url, "model": "m", "retries": 3, "backoff_s": 0.01, **profile}, "test.toml")

    async def go():
        await runner.start()
        try:
            return await runner.generate(req)
        finally:
            await runner.close()

    try:
        return asyncio.run(go())
    except RunnerError as e:
        return e


def test_429_is_retried_honouring_retry_after():
    def script(h, n, body):
        if n == 1:
            _send(h, 429, b'{"error":"slow down"}', {"Retry-After": "1"})
        elif n == 2:
            _send(h, 429, b'{"error":"slow down"}')          # no header: ordinary backoff
        else:
            _send(h, 200, _ok())

    with _Scripted(script) as srv:
        res = _ask(srv.url, GenerateRequest(prompt="q"))
        assert not isinstance(res, Exception), res
        assert res.text == "fine"
        assert len(srv.arrivals) == 3
        assert srv.arrivals[1] - srv.arrivals[0] >= 0.95       # waited as Retry-After asked
        assert srv.arrivals[2] - srv.arrivals[1] < 0.9         # backoff_s, not a second


def test_429_retry_after_is_capped_and_reported_when_retries_run_out():
    def script(h, n, body):
        _send(h, 429, b'{"error":"quota"}', {"Retry-After": "3600"})

    with _Scripted(script) as srv:
        t0 = time.monotonic()
        res = _ask(srv.url, GenerateRequest(prompt="q"), retries=1, max_retry_wait_s=0.2)
        assert time.monotonic() - t0 < 5
        assert isinstance(res, RunnerError)
        assert "gave up after 2 attempts" in str(res) and "HTTP 429" in str(res) and "Retry-After: 3600" in str(res)
        assert len(srv.arrivals) == 2


@pytest.mark.parametrize("form", ["data", "event", "error-line"])
def test_error_event_mid_stream_is_an_error(form):
    def script(h, n, body):
        err = {"error": {"message": "engine overloaded", "code": 503}}
        tail = {"data": _data(err),
                "event": b"event: error\n" + _data({"message": "engine overloaded"}),
                "error-line": b"error: " + json.dumps(err).encode() + b"\n\n"}[form]
        _sse(h, [_data({"choices": [{"index": 0, "text": "one"}]}),
                 _data({"choices": [{"index": 0, "text": " two"}]}), tail,
                 _data({"choices": [], "usage": {"completion_tokens": 2}}), b"data: [DONE]\n\n"])

    with _Scripted(script) as srv:
        res = _ask(srv.url, GenerateRequest(prompt="q", stream=True))
        assert isinstance(res, RunnerError), res
        assert "error event in the stream after 2 pieces" in str(res) and "engine overloaded" in str(res)


def test_stream_cut_without_end_marker_is_an_error():
    def script(h, n, body):
        _sse(h, [_data({"choices": [{"index": 0, "text": "one"}]})])

    with _Scripted(script) as srv:
        res = _ask(srv.url, GenerateRequest(prompt="q", stream=True))
        assert isinstance(res, RunnerError) and "without [DONE]" in str(res)


def test_error_object_beside_choices_is_an_error():
    def script(h, n, body):
        _send(h, 200, json.dumps({"choices": [{"text": "partial"}], "error": {"message": "oom"}}).encode())

    with _Scripted(script) as srv:
        res = _ask(srv.url, GenerateRequest(prompt="q"))
        assert isinstance(res, RunnerError) and "oom" in str(res)


@pytest.mark.parametrize("how", ["content-length", "chunked", "stream"])
def test_runaway_reply_is_cut_off_naming_its_size(how):
    big = 50 * 1024 * 1024

    def script(h, n, body):
        if how == "content-length":
            _send(h, 200, b'{"choices":[{"text":"' + b"x" * big + b'"}]}')
        elif how == "chunked":       # no length announced: the bound must hold while reading
            h.send_response(200)
            h.send_header("Content-Type", "application/json")
            h.end_headers()
            h.wfile.write(b'{"choices":[{"text":"')
            for _ in range(big // 65536):
                h.wfile.write(b"x" * 65536)
        else:
            _sse(h, [_data({"choices": [{"index": 0, "text": "x" * 65536}]})] * (big // 65536))

    with _Scripted(script) as srv:
        res = _ask(srv.url, GenerateRequest(prompt="q", max_tokens=32, stream=how == "stream"))
        assert isinstance(res, ResponseTooLarge), res
        assert "bytes, over the bound of 131,072 bytes" in str(res)
        assert len(srv.arrivals) == 1                          # a runaway reply is not asked again


def test_hard_byte_cap_is_configurable():
    def script(h, n, body):
        _send(h, 200, _ok("y" * 5000))

    with _Scripted(script) as srv:
        res = _ask(srv.url, GenerateRequest(prompt="q", max_tokens=4096), max_response_bytes=4096)
        assert isinstance(res, ResponseTooLarge) and "over the bound of 4,096 bytes" in str(res)


def test_reasoning_counts_toward_first_token_and_is_kept_apart():
    def script(h, n, body):
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.end_headers()
        for piece in ("Let me", " think."):
            h.wfile.write(_data({"choices": [{"index": 0, "delta": {"reasoning_content": piece}}]}))
            h.wfile.flush()
        time.sleep(0.4)
        for piece in ("4", "2"):
            h.wfile.write(_data({"choices": [{"index": 0, "delta": {"content": piece}}]}))
            h.wfile.flush()
        h.wfile.write(_data({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                             "usage": {"prompt_tokens": 3, "completion_tokens": 4,
                                       "completion_tokens_details": {"reasoning_tokens": 2}}}))
        h.wfile.write(b"data: [DONE]\n\n")

    with _Scripted(script) as srv:
        res = _ask(srv.url, GenerateRequest(prompt="q", stream=True), api="chat")
        assert not isinstance(res, Exception), res
        assert res.text == "42" and res.reasoning == "Let me think." and res.reasoning_tokens == 2
        assert len(res.token_times) == 4 and res.output_tokens == 4
        assert res.token_times[0] < 0.3                        # first token = first reasoning token
        assert res.timings["first_content_s"] - res.timings["first_reasoning_s"] >= 0.35
        fields = res.to_record_fields()
        assert fields["output"] == "42" and fields["reasoning"] == "Let me think."


def test_timeout_message_carries_type_and_detail():
    def script(h, n, body):
        time.sleep(1.5)
        _send(h, 200, _ok())

    with _Scripted(script) as srv:
        res = _ask(srv.url, GenerateRequest(prompt="q"), retries=0, timeout_s=0.3)
        assert isinstance(res, RunnerError)
        msg = str(res)
        assert "ReadTimeout: " in msg and not msg.rstrip().endswith(":")
        assert "no read progress after 0.3 s" in msg


@pytest.mark.parametrize("url,why", [("http://127.0.0.1:99999/v1", "port 99999, outside 1-65535"),
                                     ("ftp://127.0.0.1:21/v1", "http(s) URL"),
                                     ("127.0.0.1:8080/v1", "http(s) URL")])
def test_impossible_base_url_is_refused_at_profile_check(tmp_path: Path, url, why):
    p = tmp_path / "bad.toml"
    p.write_text(f'kind = "http"\nbase_url = "{url}"\n')
    with pytest.raises(ProfileError) as e:
        load_runner(p, runner_schemas())
    assert str(p) in str(e.value) and "'base_url'" in str(e.value) and why in str(e.value)
    p.write_text(f'kind = "http"\nbase_urls = ["http://127.0.0.1:8080/v1", "{url}"]\n')
    with pytest.raises(ProfileError, match="'base_urls'"):
        load_runner(p, runner_schemas())
