"""The HTTP runners take nothing the server says on trust: only a 2xx reply is an answer, every
count and log-prob is checked before it reaches a record, and every request has a total deadline.
Each server is a few lines on 127.0.0.1 scripted per request (helpers from test_http_faults)."""
from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, moebench_cli, read_items
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
    msg = str(e.value)
    assert str(p) in msg and "key 'request_deadline_s' must be a" in msg, msg
    expected = {"inf": "must be a finite number, got inf", "nan": "must be a finite number, got nan",
                '"soon"': "must be a number"}.get(value, "finite number of seconds above 0")
    assert expected in msg, msg


def test_request_deadline_default_is_documented_and_loaded(tmp_path: Path):
    p = tmp_path / "r.toml"
    p.write_text('kind = "http"\nbase_url = "http://127.0.0.1:8080/v1"\n')
    prof = load_runner(p, runner_schemas())
    assert prof.settings.request_deadline_s == 1800.0
    assert HttpRunner(prof.settings, str(p)).request_deadline_s == 1800.0
    assert "request_deadline_s" in (REPO / "docs" / "robustness.md").read_text()


# -- counts and log-probs: checked, never stored as they come -----------------------------------------

def _pieces_stream(h, n_pieces: int, usage: dict, gap_s: float = 0.0, extra: dict | None = None) -> None:
    events = [_data({"choices": [{"index": 0, "text": f" w{i}"}]}) for i in range(n_pieces)]
    events.append(_data({"choices": [{"index": 0, "text": "", "finish_reason": "length"}], **(extra or {})}))
    events.append(_data({"choices": [], "usage": usage}))
    events.append(b"data: [DONE]\n\n")
    _sse(h, events, gap_s)


def test_server_count_far_above_the_streamed_pieces_is_flagged_and_not_used():
    with _Scripted(lambda h, n, b: _pieces_stream(h, 8, {"prompt_tokens": 3, "completion_tokens": 100000})) as srv:
        res = _ask(srv.url, GenerateRequest(prompt="q", max_tokens=128, stream=True))
        assert not isinstance(res, Exception), res
        assert res.output_tokens == 8 and len(res.token_times) == 8
        flag = res.to_record_fields()["server_count_mismatch"]
        assert flag["field"] == "usage.completion_tokens" and flag["server"] == 100000 and flag["client"] == 8
        assert flag["client_source"] == "stream-pieces"
        assert res.to_record_fields()["output_tokens_source"] == "stream-pieces"


@pytest.mark.parametrize("reported", [8, 12])
def test_server_count_within_the_bounds_is_used_without_a_flag(reported):
    # 12 tokens in 8 pieces: a piece may carry several tokens (speculative decoding), never fewer than one
    with _Scripted(lambda h, n, b: _pieces_stream(h, 8, {"prompt_tokens": 3, "completion_tokens": reported})) as srv:
        res = _ask(srv.url, GenerateRequest(prompt="q", max_tokens=128, stream=True))
        assert not isinstance(res, Exception), res
        fields = res.to_record_fields()
        assert res.output_tokens == reported and "server_count_mismatch" not in fields
        assert fields["output_tokens_source"] == "server"


def test_server_count_above_max_tokens_is_flagged_non_streamed():
    def script(h, n, body):
        _send(h, 200, json.dumps({"choices": [{"text": "fine", "finish_reason": "length"}],
                                  "usage": {"prompt_tokens": 2, "completion_tokens": 500}}).encode())

    with _Scripted(script) as srv:
        res = _ask(srv.url, GenerateRequest(prompt="q", max_tokens=16))
        assert not isinstance(res, Exception), res
        flag = res.to_record_fields()["server_count_mismatch"]
        assert flag["server"] == 500 and flag["client"] is None and flag["allowed"][1] <= 16
        assert res.output_tokens is None          # no count this client could check: none at all


_BAD_COUNTS = {"negative": "-3", "string": '"8"', "fraction": "8.5", "bool": "true", "nan": "NaN",
               "infinity": "Infinity"}


@pytest.mark.parametrize("field", ["prompt_tokens", "completion_tokens", "total_tokens"])
@pytest.mark.parametrize("bad", sorted(_BAD_COUNTS))
@pytest.mark.parametrize("stream", [False, True])
def test_impossible_usage_count_is_an_error_naming_field_and_url(field, bad, stream):
    usage = '{"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3, "%s": %s}' % (field, _BAD_COUNTS[bad])

    def script(h, n, body):
        if stream:
            _sse(h, [_data({"choices": [{"index": 0, "text": "one", "finish_reason": "stop"}]}),
                     b'data: {"choices": [], "usage": ' + usage.encode() + b"}\n\n", b"data: [DONE]\n\n"])
        else:
            _send(h, 200, b'{"choices": [{"text": "one", "finish_reason": "stop"}], "usage": ' + usage.encode() + b"}")

    with _Scripted(script) as srv:
        res = _ask(srv.url, GenerateRequest(prompt="q", stream=stream))
        assert isinstance(res, RunnerError), res
        msg = str(res)
        assert f"'usage.{field}'" in msg and "non-negative integer" in msg and f"{srv.url}/completions" in msg, msg
        assert len(srv.arrivals) == 1                  # a malformed reply is not asked again


@pytest.mark.parametrize("key,value,why", [("predicted_per_second", "NaN", "finite number"),
                                           ("predicted_ms", "-Infinity", "finite number"),
                                           ("prompt_ms", "-4.0", ">= 0"),
                                           ("predicted_n", '"8"', "non-negative integer"),
                                           ("draft_n_accepted", "-1", "non-negative integer")])
@pytest.mark.parametrize("stream", [False, True])
def test_impossible_timings_value_is_an_error_naming_field_and_url(key, value, why, stream):
    timings = ('{"predicted_n": 1, "predicted_ms": 5.0, "%s": %s}' % (key, value)).encode()

    def script(h, n, body):
        if stream:
            _sse(h, [_data({"choices": [{"index": 0, "text": "one"}]}),
                     b'data: {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}], "timings": '
                     + timings + b"}\n\n", b"data: [DONE]\n\n"])
        else:
            _send(h, 200, b'{"choices": [{"text": "one", "finish_reason": "stop"}], "timings": ' + timings + b"}")

    with _Scripted(script) as srv:
        res = _ask(srv.url, GenerateRequest(prompt="q", stream=stream))
        assert isinstance(res, RunnerError), res
        msg = str(res)
        assert f"'timings.{key}'" in msg and why in msg and f"{srv.url}/completions" in msg, msg


def _with_logprobs(api: str, value: str) -> bytes:
    if api == "chat":
        lp = ('{"content": [{"token": "A", "logprob": -0.1, "top_logprobs": [{"token": "A", "logprob": -0.1}, '
              '{"token": "B", "logprob": %s}]}]}' % value)
        return ('{"choices": [{"message": {"role": "assistant", "content": "A"}, "finish_reason": "stop", '
                '"logprobs": %s}]}' % lp).encode()
    lp = '{"tokens": ["A"], "token_logprobs": [-0.1], "top_logprobs": [{"A": -0.1, "B": %s}]}' % value
    return ('{"choices": [{"text": "A", "finish_reason": "stop", "logprobs": %s}]}' % lp).encode()


@pytest.mark.parametrize("value", ["0.5", "NaN", "Infinity", "-Infinity", '"-1"'])
@pytest.mark.parametrize("api", ["completions", "chat"])
def test_impossible_top_logprob_is_an_error_naming_field_and_url(api, value):
    with _Scripted(lambda h, n, b: _send(h, 200, _with_logprobs(api, value))) as srv:
        res = _ask(srv.url, GenerateRequest(prompt="q", top_logprobs=2), api=api)
        assert isinstance(res, RunnerError), res
        msg = str(res)
        path = "/chat/completions" if api == "chat" else "/completions"
        assert "top_logprobs" in msg and "log-prob" in msg and f"{srv.url}{path}" in msg, msg


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_top_logprob_within_rounding_of_zero_is_accepted(api):
    with _Scripted(lambda h, n, b: _send(h, 200, _with_logprobs(api, "0.00005"))) as srv:
        res = _ask(srv.url, GenerateRequest(prompt="q", top_logprobs=2), api=api)
        assert not isinstance(res, Exception), res
        assert res.top_logprobs == [{"A": -0.1, "B": 0.00005}]


@pytest.mark.parametrize("value", ["0.5", "NaN", "-Infinity"])
def test_impossible_prompt_logprob_is_an_error_naming_position_and_url(value):
    def script(h, n, body):
        plp = '[null, {"2": {"logprob": -0.3}}, {"3": {"logprob": %s}, "7": {"logprob": -2.0}}]' % value
        _send(h, 200, ('{"choices": [{"text": "", "prompt_logprobs": %s}]}' % plp).encode())

    with _Scripted(script) as srv:
        runner = HttpRunner({"base_url": srv.url, "model": "m", "retries": 0, "prompt_logprobs": "vllm",
                             "token_prompts": True}, "test.toml")

        async def go():
            try:
                return await runner.prompt_logprobs([1, 2, 3], top_k=2)
            finally:
                await runner.close()

        with pytest.raises(RunnerError) as e:
            asyncio.run(go())
        root = srv.url[:-3]
        assert f"{root}/v1/completions" in str(e.value) and "position 2" in str(e.value)
        assert "log-prob" in str(e.value)


def test_speed_run_uses_the_checked_count_not_the_servers_word(tmp_path: Path, data_dir):
    """The real CLI: a speed record keeps `ok`, flags the server's 100000-token claim for 8 streamed
    pieces, and its decode tok/s comes from the 8 pieces (not ~1e6 tok/s)."""
    def script(h, n, body):
        if body.get("stream"):
            _pieces_stream(h, 8, {"prompt_tokens": 30, "completion_tokens": 100000}, gap_s=0.05)
        else:
            _send(h, 200, _ok())

    with _Scripted(script) as srv:
        suite = tmp_path / "s.toml"
        suite.write_text('name = "s"\n[[tasks]]\ntask = "speed"\nprompt_lengths = [32]\noutput_tokens = 8\n'
                         'repeats = 1\nwarmup = 0\n[probes]\nnvml = false\n')
        runner = tmp_path / "r.toml"
        runner.write_text(f'kind = "http"\nbase_url = "{srv.url}"\nmodel = "m"\nretries = 0\n')
        out = tmp_path / "run"
        proc = moebench_cli("run", str(suite), "--runner", str(runner), "--out", str(out), timeout=300)
        assert proc.returncode == 0, proc.stderr
        [rec] = [r for r in read_items(out) if r.get("task") == "speed"]
        assert rec["status"] == "ok", rec
        assert rec["output_tokens"] == 8 and rec["output_tokens_source"] == "stream-pieces"
        assert rec["server_count_mismatch"]["server"] == 100000 and rec["server_count_mismatch"]["client"] == 8
        assert 0 < rec["decode_tok_s"] < 100, rec["decode_tok_s"]      # 7 gaps of ~0.05 s: ~20 tok/s


# -- the llama-server runner checks its server's replies the same way ---------------------------------

def _llama(tmp_path: Path, req: GenerateRequest | None, completion: str = "{}", stream: list[str] | None = None,
           ask=None, env: dict | None = None, **profile):
    """Ask a llama-server runner whose binary is tests/llama_server_fake.py answering as planted
    (`req`, or `ask(runner)` for another request than generate)."""
    from moebench.runners.llama_server import LlamaServerRunner
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!{sys.executable}\n" + (REPO / "tests" / "llama_server_fake.py").read_text())
    binary.chmod(0o755)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + bytes(64))
    runner = LlamaServerRunner({"binary": str(binary), "model": str(model), "startup_timeout_s": 30.0,
                                "max_restarts": 0, **profile,
                                "env": {"FAKE_COMPLETION": completion, "FAKE_STREAM": json.dumps(stream or []),
                                        **(env or {})}}, "test.toml")

    async def go():
        await runner.start(str(tmp_path))
        try:
            return await (ask(runner) if ask is not None else runner.generate(req))
        finally:
            await runner.close()

    try:
        return asyncio.run(go())
    except RunnerError as e:
        return e


def _llama_reply(**fields) -> str:
    reply = {"content": "one two", "tokens": [11, 12], "tokens_predicted": 2, "tokens_evaluated": 3,
             "tokens_cached": 0, "stop_type": "limit", "stop": True,
             "timings": {"prompt_n": 3, "prompt_ms": 1.5, "predicted_n": 2, "predicted_ms": 4.0,
                         "predicted_per_second": 500.0}}
    reply.update(fields)
    return json.dumps(reply)


def test_llama_server_count_beyond_its_token_ids_is_flagged(tmp_path: Path):
    res = _llama(tmp_path, GenerateRequest(prompt="q", max_tokens=64), _llama_reply(tokens_predicted=100000))
    assert not isinstance(res, Exception), res
    fields = res.to_record_fields()
    assert res.output_tokens == 2 and fields["output_tokens_source"] == "token-ids"
    assert fields["server_count_mismatch"]["field"] == "tokens_predicted"
    assert fields["server_count_mismatch"]["server"] == 100000 and fields["server_count_mismatch"]["client"] == 2


@pytest.mark.parametrize("field,value,expect", [
    ("tokens_predicted", "-2", "'tokens_predicted' is -2"),
    ("tokens_evaluated", '"3"', "'tokens_evaluated' is '3'"),
    ("timings", '{"predicted_per_second": NaN}', "'timings.predicted_per_second' is nan"),
    ("timings", "[1, 2]", "'timings' is list"),
    ("completion_probabilities", '[{"top_logprobs": [{"token": "a", "logprob": 0.7}]}]',
     "'completion_probabilities[0].top_logprobs' is 0.7"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_llama_server_impossible_value_is_an_error_naming_field_and_url(tmp_path: Path, field, value, expect, stream):
    reply = json.loads(_llama_reply())
    raw = json.dumps({k: v for k, v in reply.items() if k != field})[:-1] + f', "{field}": {value}}}'
    req = GenerateRequest(prompt="q", max_tokens=64, top_logprobs=1, stream=stream)
    if stream:
        res = _llama(tmp_path, req, stream=['{"content": "one", "tokens": [11], "stop": false}', raw])
    else:
        res = _llama(tmp_path, req, raw)
    assert isinstance(res, RunnerError), res
    msg = str(res)
    assert expect in msg and "/completion" in msg and "http://127.0.0.1:" in msg, msg


def test_llama_server_reply_within_bounds_is_kept(tmp_path: Path):
    res = _llama(tmp_path, GenerateRequest(prompt="q", max_tokens=64), _llama_reply())
    assert not isinstance(res, Exception), res
    assert res.output_tokens == 2 and res.prompt_tokens == 3 and res.server_count_mismatch is None
    assert res.timings["predicted_per_second"] == 500.0 and res.output_tokens_source == "server"


@pytest.mark.parametrize("prob", ["1.7", "NaN", "-0.2"])
def test_llama_server_impossible_choice_probability_is_an_error(tmp_path: Path, prob):
    reply = ('{"content": "A", "tokens": [5], "stop": true, "completion_probabilities": [{"top_probs": '
             '[{"token": "A", "prob": %s}, {"token": "B", "prob": 0.1}]}]}' % prob)
    res = _llama(tmp_path, None, reply, ask=lambda r: r.choice_logprobs("q", ["A", "B"]))
    assert isinstance(res, RunnerError), res
    msg = str(res)
    assert "'completion_probabilities[0].top_probs'" in msg and "probability in [0, 1]" in msg, msg
    assert "/completion" in msg and "http://127.0.0.1:" in msg


@pytest.mark.parametrize("tokens", ["[1, -2]", '[1, "2"]', "[1, null]", '[{"id": 1.5, "piece": "a"}]'])
def test_impossible_token_id_from_tokenize_names_it_and_the_url(tokens):
    def script(h, n, body):
        _send(h, 200, ('{"tokens": %s}' % tokens).encode())

    with _Scripted(script) as srv:
        runner = HttpRunner({"base_url": srv.url, "model": "m", "retries": 0, "tokenize": "llama-server"}, "t.toml")

        async def go():
            try:
                return await runner.tokenize("a b")
            finally:
                await runner.close()

        with pytest.raises(RunnerError) as e:
            asyncio.run(go())
        assert "'tokens[" in str(e.value) and f"{srv.url[:-3]}/tokenize" in str(e.value), str(e.value)


def _reply(text: str, completion_tokens: int) -> bytes:
    return json.dumps({"choices": [{"text": text, "finish_reason": "length"}],
                       "usage": {"prompt_tokens": 2, "completion_tokens": completion_tokens}}).encode()


@pytest.mark.parametrize("claimed,flagged", [(60, True), (2, True), (None, False)])
def test_output_count_checked_by_the_local_tokenizer(zoo, claimed, flagged):
    from moebench.runners.local_tokenizer import load_tokenizer
    text = " the quick brown fox jumps over the lazy dog" * 3
    real = len(load_tokenizer(str(zoo / "tiny-moe"), "x").encode(text))
    claim = claimed if claimed is not None else real + 1       # within the tolerance: the server's is kept
    with _Scripted(lambda h, n, b: _send(h, 200, _reply(text, claim))) as srv:
        res = _ask(srv.url, GenerateRequest(prompt="q", max_tokens=200), tokenizer=str(zoo / "tiny-moe"))
        assert not isinstance(res, Exception), res
        fields = res.to_record_fields()
        if flagged:
            assert res.output_tokens == real and fields["output_tokens_source"] == "tokenizer"
            assert fields["server_count_mismatch"]["client"] == real
            assert fields["server_count_mismatch"]["server"] == claim
        else:
            assert res.output_tokens == claim and fields["output_tokens_source"] == "server"
            assert "server_count_mismatch" not in fields


def test_output_count_checked_by_the_servers_tokenize():
    text = "one two three four five six seven eight nine ten eleven twelve"

    def script(h, n, body):
        if h.path == "/tokenize":                   # one token per word
            _send(h, 200, json.dumps({"tokens": list(range(len(body["content"].split())))}).encode())
        else:
            _send(h, 200, _reply(text, 40))

    with _Scripted(script) as srv:
        res = _ask(srv.url, GenerateRequest(prompt="q", max_tokens=64), tokenize="llama-server")
        assert not isinstance(res, Exception), res
        fields = res.to_record_fields()
        assert res.output_tokens == 12 and fields["output_tokens_source"] == "server-tokenize"
        assert fields["server_count_mismatch"]["server"] == 40 and fields["server_count_mismatch"]["allowed"] == [4, 20]


def test_run_records_name_the_bad_field_and_the_deadline(tmp_path: Path, data_dir):
    """The real CLI: an impossible count and a slow drip become `error` records in `Type: detail` form,
    never wrong answers, and the drip holds its item no longer than request_deadline_s."""
    def script(h, n, body):
        if n == 1:
            _send(h, 200, b'{"choices": [{"text": "#### 1", "finish_reason": "stop"}], '
                          b'"usage": {"prompt_tokens": 5, "completion_tokens": -3}}')
        else:
            _drip(h, "no-length")

    with _Scripted(script) as srv:
        suite = tmp_path / "g.toml"
        suite.write_text('name = "g"\n[[tasks]]\ntask = "gsm8k"\nlimit = 2\nshots = 0\n[probes]\nnvml = false\n')
        runner = tmp_path / "r.toml"
        runner.write_text(f'kind = "http"\nbase_url = "{srv.url}"\nmodel = "m"\nretries = 0\n'
                          'request_deadline_s = 1.5\n')
        out = tmp_path / "run"
        t0 = time.monotonic()
        proc = moebench_cli("run", str(suite), "--runner", str(runner), "--out", str(out), timeout=120)
        assert time.monotonic() - t0 < 60, proc.stderr
        recs = [r for r in read_items(out) if r.get("task") == "gsm8k"]
        assert len(recs) == 2 and all(r["status"] == "error" and r["correct"] is None for r in recs), recs
        errors = sorted(r["error"] for r in recs)
        assert errors[0] == (f"DeadlineExceeded: POST {srv.url}/completions: no complete reply after 1.5 s "
                             "(request_deadline_s, retries included)"), errors
        assert errors[1].startswith(f"RunnerError: {srv.url}/completions: field 'usage.completion_tokens' is -3 "
                                    "(int), expected a non-negative integer"), errors


def test_llama_server_slow_drip_ends_at_the_request_deadline(tmp_path: Path):
    """The managed llama-server runner has the same total deadline per request as the http runner: a
    server that sends a byte every 0.2 s (each inside the read timeout) ends the item at the deadline."""
    t0 = time.monotonic()
    res = _llama(tmp_path, GenerateRequest(prompt="q", max_tokens=8), env={"FAKE_DRIP": "1"},
                 request_timeout_s=1.0, request_deadline_s=1.5)
    took = time.monotonic() - t0
    assert isinstance(res, RunnerError) and type(res).__name__ == "DeadlineExceeded", res
    assert describe(res).startswith("DeadlineExceeded: POST http://127.0.0.1:"), describe(res)
    assert describe(res).endswith("/completion: no complete reply after 1.5 s (request_deadline_s)"), describe(res)
    assert took < 10.0, took                       # the drip would last 12 s; start-up is the rest


def test_llama_server_request_deadline_is_a_bounded_profile_key(tmp_path: Path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(64))
    p = tmp_path / "r.toml"
    p.write_text(f'kind = "llama-server"\nmodel = "{gguf}"\nrequest_deadline_s = 0\n')
    with pytest.raises(ProfileError) as e:
        load_runner(p, runner_schemas())
    assert str(p) in str(e.value) and "request_deadline_s" in str(e.value), e.value
    p.write_text(f'kind = "llama-server"\nmodel = "{gguf}"\n')
    assert load_runner(p, runner_schemas()).settings.request_deadline_s == 1800.0
