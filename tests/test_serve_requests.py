"""`moebench serve`'s request bodies parsed into CompletionsRequest and ChatRequest: the fields a
handler generates from, and a 400 naming the parameter for a body that is not what OpenAI's API
allows (the same messages the server answers with: tests/test_serve_abuse.py)."""
from __future__ import annotations

import pytest

from moebench.serve import ApiError, ChatRequest, CompletionsRequest


def test_a_completions_body_becomes_its_fields():
    asked = CompletionsRequest.from_json({"prompt": ["a", "b"], "max_tokens": 5, "temperature": 0, "stop": "x",
                                          "logprobs": 2, "echo": True, "stream": True,
                                          "stream_options": {"include_usage": True}, "top_k": -1, "seed": 3},
                                         max_tokens_limit=100, max_logprobs=5)
    assert asked.prompts == ["a", "b"] and asked.several and asked.max_tokens == 5 and asked.stop == ["x"]
    assert asked.n_logprobs == 2 and asked.echo and not asked.as_ids and asked.stream and asked.include_usage
    assert (asked.sampling.temperature, asked.sampling.top_k, asked.sampling.seed) == (0.0, None, 3)
    ids = CompletionsRequest.from_json({"prompt": [1, 2]}, max_tokens_limit=100, max_logprobs=5)
    assert ids.prompts == [[1, 2]] and not ids.several and ids.max_tokens == 16 and ids.n_logprobs is None


@pytest.mark.parametrize("body,param,message", [
    ({}, "prompt", "missing 'prompt'"),
    ({"prompt": "a", "max_tokens": "9"}, "max_tokens", "'max_tokens' must be an integer, got \"9\""),
    ({"prompt": "a", "max_tokens": 101}, "max_tokens", "'max_tokens' must be between 0 and 100, got 101"),
    ({"prompt": "a", "logprobs": 6}, "logprobs", "'logprobs' must be between 0 and 5, got 6"),
    ({"prompt": "a", "n": 2}, "n", "only n = 1 is supported"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options",
     "'stream_options' is only allowed with 'stream': true"),
])
def test_a_bad_completions_body_is_refused_naming_the_parameter(body, param, message):
    with pytest.raises(ApiError) as e:
        CompletionsRequest.from_json(body, max_tokens_limit=100, max_logprobs=5)
    assert (e.value.status, e.value.param, e.value.message) == (400, param, message)


def test_a_chat_body_becomes_a_chatml_prompt_and_its_fields():
    asked = ChatRequest.from_json({"messages": [{"role": "developer", "content": [{"type": "text", "text": "be"}]},
                                                {"role": "user", "content": "hi"}],
                                   "max_tokens": 9, "max_completion_tokens": 7, "logprobs": True, "top_logprobs": 2,
                                   "stop": ["z"]}, max_tokens_limit=100)
    assert asked.prompt == ("<|im_start|>system\nbe<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                            "<|im_start|>assistant\n")
    assert asked.max_tokens == 7 and asked.n_logprobs == 2 and asked.stop == ["z", "<|im_end|>"]
    assert not asked.stream and not asked.include_usage
    plain = ChatRequest.from_json({"messages": [{"role": "user", "content": "hi"}]}, max_tokens_limit=100)
    assert plain.max_tokens == 256 and plain.n_logprobs is None and plain.stop == ["<|im_end|>"]


@pytest.mark.parametrize("body,param,message", [
    ({}, "messages", "'messages' must be a non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages",
     "messages[0] must be an object with role system|user|assistant"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages", "messages[0].content must be a string"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
     "'top_logprobs' needs 'logprobs': true"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature",
     "'temperature' must be an integer or a number, got \"hot\""),
])
def test_a_bad_chat_body_is_refused_naming_the_parameter(body, param, message):
    with pytest.raises(ApiError) as e:
        ChatRequest.from_json(body, max_tokens_limit=100)
    assert (e.value.status, e.value.param, e.value.message) == (400, param, message)
