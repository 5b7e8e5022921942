"""Typed runner settings (moebench.config.RunnerSettings) and the typed request bodies (runners/wire.py):
a profile's settings keep the manifest's JSON, a hand-written table takes the schema's defaults, and
a body is serialized as the server expects."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conftest import REPO
from moebench.config import (COMMON_RUNNER_SCHEMA, RunnerSettings, load_runner, load_toml, resolve_profile_paths,
                             validate)
from moebench.runners import runner_schemas
from moebench.runners.base import GenerateRequest, RunnerError
from moebench.runners.prompt_logprobs import PromptLogprobsBody
from moebench.runners.sampled_logprobs import UNTRUNCATED, SampledLogprobsBody
from moebench.runners.wire import (CompletionBody, DetokenizeBody, LlamaChoiceBody, LlamaCompletionBody,
                                   LlamaTokenizeBody, VllmTokenizeBody)


def _shipped() -> list[Path]:
    return sorted((REPO / "runners").glob("*.toml"))


@pytest.mark.parametrize("profile", _shipped(), ids=lambda p: p.stem)
def test_settings_json_is_the_validated_table_key_for_key_in_order(profile, zoo_tiered):
    """The manifest's runner keys (docs/schema.md) come from to_json: the table validation returns,
    with its keys in the same order, no key added or lost. (zoo_tiered: the shipped profiles name the
    zoo's models, engine-tiered.toml the tiered pack, which must exist to load.)"""
    schemas = runner_schemas()
    raw = load_toml(profile)
    if raw["kind"] not in schemas:
        pytest.skip(f"kind {raw['kind']!r} is not installed here")
    schema = {**COMMON_RUNNER_SCHEMA, **schemas[raw["kind"]]}
    table = validate(resolve_profile_paths(raw, schema, profile), schema, str(profile))
    table.pop("kind")
    table.pop("name", None)
    settings = load_runner(profile, schemas).settings
    assert type(settings) is schemas[raw["kind"]].settings_class
    assert list(settings.to_json().items()) == list(table.items())


def test_a_hand_written_table_takes_every_default_of_its_schema():
    checked = 0
    for kind, schema in runner_schemas().items():
        settings = schema.settings_class.of({"kind": kind, "name": "x"})     # keys it does not know: ignored
        for key, spec in {**schema, "concurrency": COMMON_RUNNER_SCHEMA["concurrency"]}.items():
            want = spec.default() if callable(spec.default) else spec.default
            assert getattr(settings, key) == want, (kind, key)
            checked += 1
    assert checked >= 40


def test_settings_are_frozen_and_keep_a_given_value():
    settings = runner_schemas()["http"].settings_class.of({"base_url": "http://127.0.0.1:1/v1", "retries": 0})
    assert settings.retries == 0 and settings.base_url == "http://127.0.0.1:1/v1"
    assert settings.given == frozenset({"base_url", "retries"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.retries = 5                                             # type: ignore[misc]
    assert isinstance(settings, RunnerSettings)


def test_completion_body_streams_whatever_extra_body_says_and_cuts_stops():
    req = GenerateRequest(prompt="hi", max_tokens=5, stop=["a", "b", "c"], stream=True, cache_prompt=False)
    body = CompletionBody.of(req, model="m", api="completions", max_stop=2,
                             extra_body={"stream": False, "min_p": 0.1}).to_json()
    assert body == {"model": "m", "max_tokens": 5, "temperature": 0.0, "seed": 0, "stop": ["a", "b"],
                    "prompt": "hi", "cache_prompt": False, "min_p": 0.1, "stream": True,
                    "stream_options": {"include_usage": True}}
    chat = CompletionBody.of(GenerateRequest(prompt="hi", top_logprobs=3, seed=None), model="m", api="chat",
                             max_stop=4, extra_body={})
    assert chat.path == "/chat/completions"
    assert chat.to_json() == {"model": "m", "max_tokens": 256, "temperature": 0.0,
                              "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 3}
    with pytest.raises(RunnerError, match="the chat API takes text prompts only"):
        CompletionBody.of(GenerateRequest(prompt=[1, 2]), model="m", api="chat", max_stop=4, extra_body={})


def test_llama_completion_body_always_sends_temperature_and_asks_for_token_ids():
    body = LlamaCompletionBody.of(GenerateRequest(prompt=[1, 2, 3], max_tokens=7, top_logprobs=2, top_k=40,
                                                  stream=True)).to_json()
    assert body == {"prompt": [1, 2, 3], "n_predict": 7, "temperature": 0.0, "stop": [], "cache_prompt": True,
                    "return_tokens": True, "ignore_eos": False, "stream": True, "seed": 0, "top_k": 40,
                    "n_probs": 2, "timings_per_token": True}


def test_greedy_llama_requests_name_the_argmax_alone_where_the_server_is_known():
    greedy = GenerateRequest(prompt=[1, 2], max_tokens=3, top_k=40, top_p=0.9)
    assert "samplers" not in LlamaCompletionBody.of(greedy).to_json()          # not known: as asked
    in_graph = LlamaCompletionBody.of(greedy, backend_sampling=True).to_json()
    assert in_graph["samplers"] == ["temperature"] and in_graph["temperature"] == 0.0
    assert "top_k" not in in_graph and "top_p" not in in_graph
    on_cpu = LlamaCompletionBody.of(greedy, backend_sampling=False).to_json()
    assert on_cpu["samplers"] == ["top_k"] and on_cpu["top_k"] == 1 and "top_p" not in on_cpu
    # Pre-sampling log-probs take the request off the graph (the server samples on the CPU then).
    probs = LlamaCompletionBody.of(dataclasses.replace(greedy, top_logprobs=3), backend_sampling=True).to_json()
    assert probs["samplers"] == ["top_k"] and probs["top_k"] == 1 and probs["n_probs"] == 3
    sampled = LlamaCompletionBody.of(dataclasses.replace(greedy, temperature=0.7), backend_sampling=True).to_json()
    assert "samplers" not in sampled and sampled["top_k"] == 40 and sampled["top_p"] == 0.9


def test_log_prob_bodies_name_their_path_and_send_their_keys_in_order():
    vllm = PromptLogprobsBody("vllm", "m", [5, 6], 3)
    assert vllm.path == "/v1/completions"
    assert list(vllm.to_json().items()) == [("model", "m"), ("prompt", [5, 6]), ("max_tokens", 1),
                                            ("temperature", 0.0), ("prompt_logprobs", 3)]
    assert PromptLogprobsBody("echo", "m", "ab", 2).to_json() == {
        "model": "m", "prompt": "ab", "max_tokens": 0, "temperature": 0.0, "echo": True, "logprobs": 2,
        "return_tokens_as_token_ids": True}
    sglang = PromptLogprobsBody("sglang", "m", [1], 4, score_ids=(7, 8))
    assert sglang.path == "/generate"
    assert sglang.to_json() == {"input_ids": [1], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                                "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 4,
                                "return_text_in_logprobs": False, "token_ids_logprob": [7, 8]}
    assert "token_ids_logprob" not in PromptLogprobsBody("sglang", "m", [1], 4).to_json()
    with pytest.raises(RunnerError, match="sglang prompt log-probs take token ids"):
        PromptLogprobsBody("sglang", "m", "text", 4)
    with pytest.raises(ValueError, match="prompt_logprobs mode 'none'"):
        PromptLogprobsBody("none", "m", [1], 4)
    sampled = SampledLogprobsBody("m", (1, 2), 3, 9, extra_body={"top_k": 0, "min_tokens": 3}).to_json()
    assert list(sampled)[:7] == ["model", "prompt", "max_tokens", "seed", "logprobs",
                                 "return_tokens_as_token_ids", "ignore_eos"]
    assert sampled == {"model": "m", "prompt": [1, 2], "max_tokens": 3, "seed": 9, "logprobs": 1,
                       "return_tokens_as_token_ids": True, "ignore_eos": True,
                       **UNTRUNCATED, "top_k": 0, "min_tokens": 3}     # the profile's extra_body wins


def test_tokenizer_and_choice_bodies_are_what_the_servers_read():
    assert VllmTokenizeBody("m", "hi").to_json() == {"model": "m", "prompt": "hi", "add_special_tokens": False}
    assert LlamaTokenizeBody("hi").to_json() == {"content": "hi", "add_special": False}
    assert LlamaTokenizeBody("hi", True, parse_special=False).to_json() == {
        "content": "hi", "add_special": True, "parse_special": False}
    assert DetokenizeBody((3, 4)).to_json() == {"tokens": [3, 4]}
    choice = LlamaChoiceBody("Q:", ("A", "\"")).to_json()
    assert choice["grammar"] == 'root ::= "A" | "\\""'
    assert choice["n_probs"] == 8 and choice["temperature"] == 1.0 and choice["top_k"] == 0
