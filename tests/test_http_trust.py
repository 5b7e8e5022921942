"""The HTTP runners take nothing the server says on trust: only a 2xx reply is an answer, every
count and log-prob is checked before it reaches a record, and every request has a total deadline.
Each server is a few lines on 127.0.0.1 scripted per request (helpers from test_http_faults)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from conftest import REPO
from moebench.config import ProfileError, load_runner
from moebench.runners import runner_schemas
from moebench.runners.base import GenerateRequest, RunnerError
from moebench.runners.http import HttpRunner
from moebench.runners.responses import describe
from test_http_faults import _Scripted, _ask, _data, _ok, _send, _sse


# -- only a 2xx reply is an answer; a redirect says where it points ------------------------------------

def test_redirect_error_names_status_and_location():
    def script(h, n, body):
        _send(h, 302, b"", {"Location": "http://127.0.0.1:9/elsewhere/v1/completions"})

    with _Scripted(script) as srv:
        res = _ask(srv.url, GenerateRequest(prompt="q"))
        assert isinstance(res, RunnerError), res
        msg = str(res)
        assert "HTTP 302" in msg and "http://127.0.0.1:9/elsewhere/v1/completions" in msg, msg
        assert "not JSON" not in msg
        assert srv.url in msg
        assert len(srv.arrivals) == 1                  # a redirect is not asked again


@pytest.mark.parametrize("stream", [False, True])
def test_non_2xx_with_a_json_answer_is_not_an_answer(stream):
    def script(h, n, body):
        _send(h, 302, _ok("looks like an answer"), {"Location": "/v1/other"})

    with _Scripted(script) as srv:
        res = _ask(srv.url, GenerateRequest(prompt="q", stream=stream))
        assert isinstance(res, RunnerError), res
        assert "HTTP 302" in str(res) and "/v1/other" in str(res)


@pytest.mark.parametrize("timings", [[1, 2], "fast", 3])
@pytest.mark.parametrize("stream", [False, True])
def test_timings_of_the_wrong_type_name_the_field_and_url(timings, stream):
    def script(h, n, body):
        if stream:
            _sse(h, [_data({"choices": [{"index": 0, "text": "one"}]}),
                     _data({"choices": [{"index": 0, "text": "", "finish_reason": "stop"}], "timings": timings}),
                     b"data: [DONE]\n\n"])
        else:
            _send(h, 200, json.dumps({"choices": [{"text": "fine", "finish_reason": "stop"}],
                                      "timings": timings}).encode())

    with _Scripted(script) as srv:
        res = _ask(srv.url, GenerateRequest(prompt="q", stream=stream))
        assert isinstance(res, RunnerError), res
        msg = str(res)
        assert "'timings'" in msg and "expected an object" in msg and srv.url + "/completions" in msg, msg


# -- a total deadline per request, retries included ---------------------------------------------------

def _drip(h, how: str) -> None:
    """One byte every 0.2 s, each well inside the per-read timeout, for up to 12 s."""
    h.send_response(200)
    h.send_header("Content-Type", "text/event-stream" if how == "sse-comments" else "application/json")
    if how == "content-length":
        h.send_header("Content-Length", "100000")
    h.end_headers()
    for _ in range(60):
        h.wfile.write(b": keep-alive\n\n" if how == "sse-comments" else b" ")
        h.wfile.flush()
        time.sleep(0.2)


@pytest.mark.parametrize("how", ["no-length", "content-length", "sse-comments"])
def test_slow_drip_reply_ends_at_the_request_deadline(how):
    with _Scripted(lambda h, n, body: _drip(h, how)) as srv:
        t0 = time.monotonic()
        res = _ask(srv.url, GenerateRequest(prompt="q", stream=how == "sse-comments"),
                   timeout_s=1.0, request_deadline_s=1.5)
        took = time.monotonic() - t0
        assert isinstance(res, RunnerError), res
        assert describe(res) == (f"DeadlineExceeded: POST {srv.url}/completions: no complete reply after 1.5 s "
                                 "(request_deadline_s, retries included)")
        assert 1.4 <= took < 4.0, took


def test_request_deadline_covers_all_retries():
    def script(h, n, body):
        time.sleep(0.5)
        _send(h, 503, b'{"error":"busy"}')

    with _Scripted(script) as srv:
        t0 = time.monotonic()
        res = _ask(srv.url, GenerateRequest(prompt="q"), retries=20, backoff_s=0.05, request_deadline_s=1.6)
        took = time.monotonic() - t0
        assert isinstance(res, RunnerError) and type(res).__name__ == "DeadlineExceeded", res
        assert "no complete reply after 1.6 s" in str(res)
        assert took < 3.5 and 2 <= len(srv.arrivals) <= 4, (took, len(srv.arrivals))


@pytest.mark.parametrize("value", ["0", "-5", "inf", "nan", '"soon"'])
def test_request_deadline_must_be_a_finite_positive_number(tmp_path: Path, value):
    p = tmp_path / "r.toml"
    p.write_text(f'kind = "http"\nbase_url = "http://127.0.0.1:8080/v1"\nrequest_deadline_s = {value}\n')
    with pytest.raises(ProfileError) as e:
        load_runner(p, runner_schemas())
    assert str(p) in str(e.value) and "request_deadline_s" in str(e.value)


def test_request_deadline_default_is_documented_and_loaded(tmp_path: Path):
    p = tmp_path / "r.toml"
    p.write_text('kind = "http"\nbase_url = "http://127.0.0.1:8080/v1"\n')
    prof = load_runner(p, runner_schemas())
    assert prof.settings["request_deadline_s"] == 1800.0
    assert HttpRunner(prof.settings, str(p)).request_deadline_s == 1800.0
    assert "request_deadline_s" in (REPO / "docs" / "robustness.md").read_text()
