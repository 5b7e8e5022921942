"""`moebench serve` under abuse: bad numbers, deep or huge bodies, slow clients and clients that leave.

Every bad request is a 400 (408 for a body that does not arrive in time) naming what was wrong; a client
that disconnects stops its work (between batch items, and between tokens for a runner that generates on
a worker thread, as the engine runner does) and leaves one short log line, no traceback.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest

from moebench.runners.base import Capability, GenerateRequest, GenerateResult, Runner
from moebench.serve import BackgroundServer, ServeOptions
from test_serve import MarkovRunner


class VocabMarkovRunner(MarkovRunner):
    """MarkovRunner that tells its vocabulary size and context length (as the engine runner does)."""

    max_seq_len = 64

    def vocab_size(self) -> int:
        return self.vocab


class ThreadedTokenRunner(Runner):
    """Generates the way the engine runner does: a blocking token loop on a worker thread that passes
    each token's text to on_text as it is made. Counts the calls and the tokens it made."""

    kind = "threaded"
    capabilities = frozenset({Capability.GENERATE})

    def __init__(self, token_s: float):
        super().__init__({"name": "threaded", "concurrency": 1})
        self.token_s = token_s
        self.calls = self.tokens_made = 0

    async def start(self, run_dir=None):
        pass

    async def close(self):
        pass

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.calls += 1

        def loop() -> str:
            out = []
            for _ in range(request.max_tokens):
                time.sleep(self.token_s)
                self.tokens_made += 1
                out.append("x")
                if request.on_text is not None:
                    request.on_text("x")
            return "".join(out)
        text = await asyncio.to_thread(loop)
        return GenerateResult(text=text, output_tokens=len(text), finish_reason="length")


@pytest.fixture(scope="module")
def vocab_server():
    runner = VocabMarkovRunner()
    with BackgroundServer(runner, ServeOptions(port=0, max_prompts_per_request=4,
                                               max_prompt_tokens_per_request=100)) as s:
        yield s, runner


def post_raw(url: str, raw: bytes) -> httpx.Response:
    return httpx.post(url, content=raw, headers={"Content-Type": "application/json"}, timeout=30)


def _error(r: httpx.Response) -> str:
    return r.json()["error"]["message"]


# -- numbers --------------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, param, words", [
    (b'{"prompt": "x", "temperature": NaN}', "temperature", "finite"),
    (b'{"prompt": "x", "temperature": Infinity}', "temperature", "finite"),
    (b'{"prompt": "x", "temperature": 1e999}', "temperature", "finite"),
    (b'{"prompt": "x", "top_p": NaN}', "top_p", "finite"),
    (b'{"prompt": "x", "top_p": 1.5}', "top_p", "between"),
    (b'{"prompt": "x", "top_p": 0}', "top_p", "above 0"),
    (b'{"prompt": "x", "presence_penalty": -Infinity}', "presence_penalty", "finite"),
    (b'{"prompt": "x", "frequency_penalty": 7}', "frequency_penalty", "between"),
    (b'{"prompt": "x", "seed": 100000000000000000000000}', "seed", "between 0 and 9223372036854775807"),
    (b'{"prompt": "x", "seed": -5}', "seed", "between 0 and"),
    (b'{"prompt": "x", "seed": 1e23}', "seed", "an integer"),
    (b'{"prompt": "x", "max_tokens": 100000000000000000000}', "max_tokens", "between"),
    (b'{"prompt": "x", "logprobs": -1}', "logprobs", "between"),
])
def test_every_numeric_parameter_is_checked_and_named(vocab_server, raw, param, words):
    s, _ = vocab_server
    r = post_raw(s.url + "/completions", raw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and f"'{param}'" in err["message"] and words in err["message"], err


def test_chat_numbers_are_checked_too(vocab_server):
    s, _ = vocab_server
    msgs = json.dumps([{"role": "user", "content": "hi"}])
    for raw, param in ((f'{{"messages": {msgs}, "temperature": NaN}}', "temperature"),
                       (f'{{"messages": {msgs}, "seed": 18446744073709551616}}', "seed"),
                       (f'{{"messages": {msgs}, "top_logprobs": 21, "logprobs": true}}', "top_logprobs")):
        r = post_raw(s.url + "/chat/completions", raw.encode())
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_an_integer_of_thousands_of_digits_is_400_not_500(vocab_server):
    s, _ = vocab_server
    r = post_raw(s.url + "/completions", b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}")
    assert r.status_code == 400 and "not valid JSON" in _error(r), r.text


@pytest.mark.parametrize("depth", [65, 5000, 1_000_000])
def test_deeply_nested_json_is_400(vocab_server, depth):
    s, _ = vocab_server
    raw = b'{"prompt": "x", "stop": ' + b"[" * depth + b"]" * depth + b"}"
    r = post_raw(s.url + "/completions", raw)
    assert r.status_code == 400 and "nested deeper than 64 levels" in _error(r), r.text


def test_nesting_within_the_limit_still_parses(vocab_server):
    s, _ = vocab_server
    # 64 levels: the body object, then 63 lists; only 'stop' is wrong, and it is named
    raw = b'{"prompt": "x", "max_tokens": 1, "stop": ' + b"[" * 63 + b"]" * 63 + b"}"
    r = post_raw(s.url + "/completions", raw)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop", r.text


# -- prompts --------------------------------------------------------------------------------------

def test_token_ids_beyond_the_vocabulary_are_400(vocab_server):
    s, runner = vocab_server
    r = httpx.post(s.url + "/completions", json={"prompt": [[5, 6], [7, 999999999]], "max_tokens": 1}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and "999999999" in err["message"] and f"{runner.vocab}" in err["message"]
    assert "prompt[1][1]" in err["message"]
    ok = httpx.post(s.url + "/completions", json={"prompt": [5, runner.vocab - 1], "max_tokens": 1}, timeout=30)
    assert ok.status_code == 200, ok.text


def test_prompt_over_the_context_length_is_400(vocab_server):
    s, runner = vocab_server
    ids = [5] * 60
    r = httpx.post(s.url + "/completions", json={"prompt": ids, "max_tokens": 5}, timeout=30)
    assert r.status_code == 400, r.text
    assert "60 prompt tokens + 5" in _error(r) and "context length of 64" in _error(r)
    r = httpx.post(s.url + "/completions", json={"prompt": "seven " * 40, "max_tokens": 1}, timeout=30)
    assert r.status_code == 400 and "context length of 64" in _error(r), r.text
    ok = httpx.post(s.url + "/completions", json={"prompt": ids, "max_tokens": 4}, timeout=30)
    assert ok.status_code == 200, ok.text


def test_prompts_per_request_and_prompt_tokens_per_request_are_capped(vocab_server):
    s, _ = vocab_server
    r = httpx.post(s.url + "/completions", json={"prompt": ["a"] * 5, "max_tokens": 1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "5 prompts" in _error(r) and "at most 4" in _error(r)
    assert httpx.post(s.url + "/completions", json={"prompt": ["a"] * 4, "max_tokens": 1},
                      timeout=30).status_code == 200
    r = httpx.post(s.url + "/completions", json={"prompt": [[5] * 30] * 4, "max_tokens": 1}, timeout=30)
    assert r.status_code == 400 and "120 prompt tokens" in _error(r) and "at most 100" in _error(r), r.text


def test_default_caps_refuse_a_body_of_400k_prompts():
    with BackgroundServer(VocabMarkovRunner()) as s:         # the default 4 MiB body limit
        r = httpx.post(s.url + "/completions", json={"prompt": ["a"] * 400_000, "max_tokens": 1}, timeout=60)
        assert r.status_code == 400, r.text
        assert "400000 prompts" in _error(r) and f"at most {ServeOptions.max_prompts_per_request}" in _error(r)


# -- slow clients ---------------------------------------------------------------------------------

def _connect(url: str) -> tuple[socket.socket, str]:
    u = urlsplit(url)
    return socket.create_connection((u.hostname, u.port), timeout=10), u.path


def test_a_body_that_trickles_in_is_cut_off_with_408():
    with BackgroundServer(VocabMarkovRunner(), ServeOptions(port=0, body_timeout_s=0.5)) as s:
        sock, path = _connect(s.url + "/completions")
        with sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: 100\r\n\r\n{{\"prompt\":".encode())
            t0 = time.monotonic()
            reply = sock.recv(65536).decode()
            waited = time.monotonic() - t0
        assert reply.startswith("HTTP/1.1 408"), reply
        assert "within 0.5 s" in reply and waited < 5, (waited, reply)


def test_headers_that_trickle_in_are_cut_off():
    with BackgroundServer(VocabMarkovRunner(), ServeOptions(port=0, header_timeout_s=0.5)) as s:
        sock, path = _connect(s.url + "/completions")
        with sock:
            t0 = time.monotonic()
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n".encode())
            for _ in range(4):                   # a byte every 0.25 s: never a whole header
                time.sleep(0.25)
                try:
                    sock.sendall(b"X")
                except OSError:
                    break
            try:
                reply = sock.recv(65536)
            except ConnectionResetError:
                reply = b""
            waited = time.monotonic() - t0
        assert reply == b"" and waited < 5, (waited, reply)
        assert httpx.post(s.url + "/completions", json={"prompt": "a", "max_tokens": 1}, timeout=30).status_code == 200


# -- clients that leave ---------------------------------------------------------------------------

def _send_and_leave(url: str, body: dict, stay_s: float, read_first: bool = False) -> str:
    sock, path = _connect(url)
    raw = json.dumps(body).encode()
    with sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
        got = sock.recv(65536).decode() if read_first else ""
        time.sleep(stay_s)
    return got


def _wait_until_still(read, settle_s: float = 0.6, limit_s: float = 10.0):
    """The counter once it has not changed for settle_s (or after limit_s)."""
    end = time.monotonic() + limit_s
    last = read()
    while time.monotonic() < end:
        time.sleep(settle_s)
        now = read()
        if now == last:
            return now
        last = now
    return last


def test_a_batch_whose_client_left_stops_between_items_and_frees_the_slot():
    runner = ThreadedTokenRunner(token_s=0.05)
    with BackgroundServer(runner, ServeOptions(port=0, max_concurrency=1)) as s:
        _send_and_leave(s.url + "/completions", {"prompt": ["a"] * 20, "max_tokens": 5}, stay_s=0.4)
        calls = _wait_until_still(lambda: runner.calls)
        assert calls <= 5, f"{calls} of 20 batch items generated after the client left"
        t0 = time.monotonic()
        r = httpx.post(s.url + "/completions", json={"prompt": "b", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and time.monotonic() - t0 < 2.0


@pytest.mark.parametrize("stream", [False, True])
def test_a_long_generation_whose_client_left_stops_between_tokens(stream):
    runner = ThreadedTokenRunner(token_s=0.02)
    with BackgroundServer(runner, ServeOptions(port=0, max_concurrency=1)) as s:
        _send_and_leave(s.url + "/completions", {"prompt": "a", "max_tokens": 400, "stream": stream},
                        stay_s=0.4, read_first=stream)
        made = _wait_until_still(lambda: runner.tokens_made)
        assert made < 100, f"{made} of 400 tokens generated after the client left at about 20"
        t0 = time.monotonic()
        r = httpx.post(s.url + "/completions", json={"prompt": "b", "max_tokens": 2}, timeout=30)
        assert r.status_code == 200 and time.monotonic() - t0 < 2.0


@pytest.mark.parametrize("stream", [False, True])
def test_a_disconnect_reaches_the_backend_through_the_http_runner(stream):
    """serve over the HTTP runner over serve: the front's client leaves, the front drops its backend
    request, and the backend stops generating."""
    from moebench.runners.http import HttpRunner
    backend = ThreadedTokenRunner(token_s=0.02)
    with BackgroundServer(backend, ServeOptions(port=0, max_concurrency=1)) as b:
        front = HttpRunner({"base_url": b.url, "retries": 0}, "t.toml")
        with BackgroundServer(front, ServeOptions(port=0, max_concurrency=1)) as s:
            _send_and_leave(s.url + "/completions", {"prompt": "a", "max_tokens": 400, "stream": stream},
                            stay_s=0.5, read_first=stream)
            made = _wait_until_still(lambda: backend.tokens_made)
            assert made < 100, f"the backend made {made} of 400 tokens after the front's client left"
            r = httpx.post(s.url + "/completions", json={"prompt": "b", "max_tokens": 2}, timeout=30)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == "xx", r.text


def test_a_client_that_leaves_during_its_body_logs_one_short_line(caplog):
    caplog.set_level(logging.INFO)
    with BackgroundServer(VocabMarkovRunner()) as s:
        sock, path = _connect(s.url + "/completions")
        with sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: 100\r\n\r\n{{\"prompt\":".encode())
            time.sleep(0.3)
        time.sleep(0.5)
        assert httpx.post(s.url + "/completions", json={"prompt": "b", "max_tokens": 1}, timeout=30).status_code == 200
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING], \
        [(r.name, r.getMessage()) for r in caplog.records]
    gone = [r for r in caplog.records if "disconnected" in r.getMessage()]
    assert len(gone) == 1 and gone[0].levelno == logging.INFO, [(r.name, r.getMessage()) for r in caplog.records]


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_disconnect_logs_one_short_line_and_no_traceback(caplog, stream):
    caplog.set_level(logging.INFO)
    runner = ThreadedTokenRunner(token_s=0.02)
    with BackgroundServer(runner, ServeOptions(port=0, max_concurrency=1)) as s:
        _send_and_leave(s.url + "/completions", {"prompt": "a", "max_tokens": 100, "stream": stream},
                        stay_s=0.3, read_first=stream)
        _wait_until_still(lambda: runner.tokens_made)
        assert httpx.post(s.url + "/completions", json={"prompt": "b", "max_tokens": 1}, timeout=30).status_code == 200
    with_trace = [r for r in caplog.records if r.exc_info or r.stack_info]
    assert not with_trace, [(r.name, r.getMessage()) for r in with_trace]
    gone = [r for r in caplog.records if "disconnected" in r.getMessage()]
    assert len(gone) == 1 and gone[0].levelno == logging.INFO, [(r.name, r.getMessage()) for r in caplog.records]
    assert "POST /v1/completions" in gone[0].getMessage() and "\n" not in gone[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


# -- over the real engine runner (the zoo's tiny MoE on the CPU) -----------------------------------

@pytest.fixture(scope="module")
def engine_server(zoo):
    from moebench.runners.engine import EngineRunner
    runner = EngineRunner({"model": str(zoo / "tiny-moe"), "dtype": "float32", "max_seq_len": 512}, "test")
    with BackgroundServer(runner, ServeOptions(port=0)) as s:
        yield s, runner


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": [5, 999999999], "max_tokens": 2}, "prompt", "below its vocabulary size of 50257"),
    ({"prompt": [5] * 600, "max_tokens": 2}, "prompt", "600 prompt tokens + 2 max_tokens exceed the model's "
                                                       "context length of 512"),
    ({"prompt": [5] * 500, "max_tokens": 20}, "max_tokens", "context length of 512"),
    ({"prompt": "hi", "seed": 10**23}, "seed", "between 0 and"),
])
def test_engine_refusals_are_400_not_502(engine_server, body, param, words):
    s, _ = engine_server
    r = httpx.post(s.url + "/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and words in _error(r), r.text


def test_engine_stops_decoding_when_its_client_leaves(engine_server):
    """A 400-token answer (about 16 s on a shared CPU core) whose client leaves once decoding has
    begun: the engine stops within a few decode steps of the disconnect, and the next request runs."""
    s, runner = engine_server
    steps0 = runner.engine.decode_steps
    raw = json.dumps({"messages": [{"role": "user", "content": "Who was Pierre Bezukhov, and what did he do in "
                                                                "Moscow?"}], "max_tokens": 400, "temperature": 0})
    sock, path = _connect(s.url + "/chat/completions")
    with sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(raw)}\r\n\r\n{raw}".encode())
        end = time.monotonic() + 60
        while runner.engine.decode_steps - steps0 < 5 and time.monotonic() < end:
            time.sleep(0.05)
        at_leave = runner.engine.decode_steps - steps0
    assert at_leave >= 5, "decoding never began"
    steps = _wait_until_still(lambda: runner.engine.decode_steps, settle_s=1.0, limit_s=30) - steps0
    assert steps - at_leave <= 5, f"{steps - at_leave} decode steps after the client left at step {at_leave}"
    r = httpx.post(s.url + "/completions", json={"prompt": "The", "max_tokens": 2, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text


# -- memory after a huge prompt --------------------------------------------------------------------

def _rss_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM: the peak) of a process, in MiB."""
    status = open(f"/proc/{pid}/status").read()
    return tuple(int(status.split(f"{k}:")[1].split()[0]) / 1024 for k in ("VmRSS", "VmHWM"))


def test_memory_after_a_huge_prompt_goes_back(zoo, tmp_path):
    """`moebench serve --runner engine-bf16` (the real CLI): one 3.9 MB prompt is tokenized (866,666
    tokens) and refused with 400; the process's RSS afterwards is back within 150 MB of before (it
    stayed about 455 MB higher when glibc kept the tokenizer's freed memory)."""
    import subprocess
    import sys

    from conftest import REPO
    # stdout's first line is the address; start-up progress goes to stderr, kept in a log.
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "moebench.cli", "serve", "--runner", "engine-bf16", "--port", "0"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        line = proc.stdout.readline()
        assert " on http://127.0.0.1:" in line, (line, (tmp_path / "serve.log").read_text()[-2000:])
        url = line.split(" on ")[1].split()[0]
        assert httpx.post(url + "/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=120).status_code == 200
        time.sleep(0.5)
        before, _ = _rss_mb(proc.pid)
        text = ("The quick brown fox jumps over the lazy dog. " * 100_000)[:3_900_000]
        r = httpx.post(url + "/completions", json={"prompt": text, "max_tokens": 4}, timeout=300)
        assert r.status_code == 400 and "866666 prompt tokens" in _error(r), r.text
        time.sleep(0.5)
        after, peak = _rss_mb(proc.pid)
        assert after < before + 150, f"RSS {before:.0f} MB before the 3.9 MB prompt, {after:.0f} MB after (peak {peak:.0f})"
    finally:
        proc.terminate()
        proc.wait(30)
        proc.stdout.close()
        log.close()
