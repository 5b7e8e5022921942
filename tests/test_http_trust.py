"""The HTTP runners take nothing the server says on trust: only a 2xx reply is an answer, every
count and log-prob is checked before it reaches a record, and every request has a total deadline.
Each server is a few lines on 127.0.0.1 scripted per request (helpers from test_http_faults)."""
from __future__ import annotations

import json
import time

import pytest

from moebench.runners.base import GenerateRequest, RunnerError
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
