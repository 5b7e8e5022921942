"""The completion requests the HTTP runners send, typed: each is built from a `GenerateRequest` and
the runner's settings, and becomes JSON once, at the wire (`to_json`).

- `CompletionBody`: OpenAI's `/v1/completions` and `/v1/chat/completions` (runners/http.py).
- `LlamaCompletionBody`: llama-server's native `/completion` (runners/llama_server.py).
- `LlamaChoiceBody`: a one-token `/completion` constrained by a grammar to given choices.
- `VllmTokenizeBody`, `LlamaTokenizeBody`, `DetokenizeBody`: the tokenizer endpoints.
- The prompt and sampled log-prob requests live beside their parsers (runners/prompt_logprobs.py,
  runners/sampled_logprobs.py).

Every body satisfies `WireBody`: the runners' POST helpers take it and call `to_json` at the send.

An optional field left None is not sent, so the server's own default applies.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Protocol

from moebench.json_types import JsonObject, JsonValue
from moebench.runners.base import GenerateRequest, RunnerError


class WireBody(Protocol):
    """A request body: a typed object that becomes JSON once, when it is sent."""

    def to_json(self) -> JsonObject: ...


def _put_set(body: JsonObject, **fields: JsonValue) -> None:
    """Add each field that is set, in order: one left None is not sent (the server's default applies)."""
    for key, value in fields.items():
        if value is not None:
            body[key] = value


@dataclass(frozen=True, slots=True)
class CompletionBody:
    """One OpenAI-style completion request: `api` "completions" sends `prompt`, "chat" one user message."""

    model: str
    api: str
    prompt: str | list[int]
    max_tokens: int
    temperature: float
    seed: int | None = None
    top_p: float | None = None
    top_k: int | None = None               # vLLM, SGLang and llama-server accept it
    stop: tuple[str, ...] = ()             # at most the server's max_stop; the rest is cut client-side
    top_logprobs: int = 0
    ignore_eos: bool = False               # vLLM and llama-server both accept it
    cache_prompt: bool = True              # False is sent (llama-server's key; others ignore unknown keys)
    stream: bool = False
    extra_body: JsonObject = field(default_factory=dict)   # the profile's free-form keys, sent with every request

    @classmethod
    def of(cls, req: GenerateRequest, *, model: str, api: str, max_stop: int,
           extra_body: JsonObject) -> "CompletionBody":
        if api == "chat" and not isinstance(req.prompt, str):
            raise RunnerError("the chat API takes text prompts only")
        return cls(model=model, api=api, prompt=req.prompt, max_tokens=req.max_tokens,
                   temperature=req.temperature, seed=req.seed, top_p=req.top_p, top_k=req.top_k,
                   stop=tuple(req.stop[:max_stop]), top_logprobs=req.top_logprobs, ignore_eos=req.ignore_eos,
                   cache_prompt=req.cache_prompt, stream=req.stream, extra_body=extra_body)

    @property
    def path(self) -> str:
        """The endpoint below the base URL's /v1."""
        return "/chat/completions" if self.api == "chat" else "/completions"

    def to_json(self) -> JsonObject:
        body: JsonObject = {"model": self.model, "max_tokens": self.max_tokens, "temperature": self.temperature}
        _put_set(body, seed=self.seed, top_p=self.top_p, top_k=self.top_k)
        if self.stop:
            body["stop"] = list(self.stop)
        if self.api == "chat":
            body["messages"] = [{"role": "user", "content": self.prompt}]
            if self.top_logprobs:
                body["logprobs"] = True
                body["top_logprobs"] = self.top_logprobs
        else:
            body["prompt"] = self.prompt
            if self.top_logprobs:
                body["logprobs"] = self.top_logprobs
        if self.ignore_eos:
            body["ignore_eos"] = True
        if not self.cache_prompt:
            body["cache_prompt"] = False
        body.update(self.extra_body)
        if self.stream:                        # after extra_body: the runner reads the stream it asked for
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body


@dataclass(frozen=True, slots=True)
class LlamaCompletionBody:
    """One llama-server `/completion` request (a list of ints as `prompt` is sent as token ids, no BOS
    added). Temperature is always sent: the server's default is 0.8."""

    prompt: str | list[int]
    n_predict: int
    temperature: float
    stop: tuple[str, ...] = ()
    cache_prompt: bool = True
    ignore_eos: bool = False
    stream: bool = False
    seed: int | None = None
    top_p: float | None = None
    top_k: int | None = None
    n_probs: int = 0                       # top log-probs per generated token (0: none asked)
    samplers: tuple[str, ...] = ()         # the sampler chain by name; empty: the server's default chain

    @classmethod
    def of(cls, req: GenerateRequest, backend_sampling: bool | None = None) -> "LlamaCompletionBody":
        """`backend_sampling` None sends the request's sampling as it is; True or False (the server's
        backend sampling, when known) makes a greedy request name its argmax alone (`greedy_chain`)."""
        body = cls(prompt=req.prompt, n_predict=req.max_tokens, temperature=req.temperature, stop=tuple(req.stop),
                   cache_prompt=req.cache_prompt, ignore_eos=req.ignore_eos, stream=req.stream, seed=req.seed,
                   top_p=req.top_p, top_k=req.top_k, n_probs=req.top_logprobs)
        if backend_sampling is None or req.temperature != 0:
            return body
        samplers, top_k = greedy_chain(backend_sampling and not req.top_logprobs)
        return dataclasses.replace(body, samplers=samplers, top_k=top_k, top_p=None)

    def to_json(self) -> JsonObject:
        payload: JsonObject = {
            "prompt": self.prompt,
            "n_predict": self.n_predict,
            "temperature": self.temperature,
            "stop": list(self.stop),
            "cache_prompt": self.cache_prompt,
            "return_tokens": True,
            "ignore_eos": self.ignore_eos,
            "stream": self.stream,
        }
        _put_set(payload, seed=self.seed, top_p=self.top_p, top_k=self.top_k)
        if self.samplers:
            payload["samplers"] = list(self.samplers)
        if self.n_probs:
            payload["n_probs"] = self.n_probs
        if self.stream:
            payload["timings_per_token"] = True
        return payload


def greedy_chain(in_graph: bool) -> tuple[tuple[str, ...], int | None]:
    """The sampler chain (names, top_k) of a greedy llama-server request: the argmax alone, the token
    the server's default chain picks at temperature 0 (penalties, DRY, top-n-sigma, top-k 40, typical,
    top-p, min-p, XTC, temperature: each a no-op or a cut that keeps the largest logit), without its
    cost per token. llama.cpp b11434 (`common/sampling.cpp`, `src/llama-sampler.cpp`):
    - backend sampling on (`in_graph`): "temperature" at 0 is a `ggml_argmax` in the model's graph, and
      the host reads one token id. The default chain leaves the graph at DRY (no backend version), so
      the whole vocabulary's logits are copied out and sorted on the CPU every token; top-k's graph
      version sorts the vocabulary on the GPU.
    - otherwise: top-k 1 is one CPU pass over the logits (the chain's dist then has one candidate);
      "temperature" alone would write every logit and take a softmax of the vocabulary."""
    return (("temperature",), None) if in_graph else (("top_k",), 1)


@dataclass(frozen=True, slots=True)
class LlamaChoiceBody:
    """A one-token llama-server `/completion` whose grammar allows only `choices`, at temperature 1 without
    truncation, asking the post-sampling probabilities of 4 alternatives per choice: the model's
    probabilities renormalised over the choices."""

    prompt: str | list[int]
    choices: tuple[str, ...]

    def to_json(self) -> JsonObject:
        grammar = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choices)
        return {"prompt": self.prompt, "n_predict": 1, "n_probs": 4 * len(self.choices), "post_sampling_probs": True,
                "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "typical_p": 1.0,
                "seed": 0, "cache_prompt": True, "grammar": grammar}


@dataclass(frozen=True, slots=True)
class VllmTokenizeBody:
    """vLLM's `/tokenize` (at the server root): the text's ids without special tokens."""

    model: str
    prompt: str

    def to_json(self) -> JsonObject:
        return {"model": self.model, "prompt": self.prompt, "add_special_tokens": False}


@dataclass(frozen=True, slots=True)
class LlamaTokenizeBody:
    """llama-server's `/tokenize`; `parse_special` None is not sent (the server's default applies)."""

    content: str
    add_special: bool = False
    parse_special: bool | None = None

    def to_json(self) -> JsonObject:
        body: JsonObject = {"content": self.content, "add_special": self.add_special}
        _put_set(body, parse_special=self.parse_special)
        return body


@dataclass(frozen=True, slots=True)
class DetokenizeBody:
    """llama-server's `/detokenize`: token ids back to text."""

    tokens: tuple[int, ...]

    def to_json(self) -> JsonObject:
        return {"tokens": list(self.tokens)}
