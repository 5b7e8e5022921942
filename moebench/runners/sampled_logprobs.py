"""Sampling a continuation over HTTP with the log-prob of every sampled token (the sampled KLD's baseline).

One request per continuation: POST /v1/completions with the prompt as token ids, `max_tokens` tokens,
`ignore_eos` (every continuation has exactly that many tokens, so no sampled token is dropped for
being EOS), `logprobs: 1` (the sampled token's own log-prob comes with it), `seed`, and the
distribution left as the model gives it: temperature 1, top_p 1, top_k -1, min_p 0, no penalties.
How each server reads those (the sampled token's log-prob must be of the distribution it was drawn
from):
- vLLM 0.32.0 (`vllm/sampling_params.py`): top_k -1 or 0 disables it, min_p 0 and
  repetition_penalty 1 are its defaults; log-probs are `raw_logprobs` (the model's, before any
  processing: the same distribution at temperature 1 without truncation); `seed` seeds the request's
  own generator. `return_tokens_as_token_ids` names tokens "token_id:N".
- `moebench serve`: top_k <= 0 is no truncation; `seed` seeds the engine's generator; the log-probs
  are a teacher-forced pass over prompt + output; `return_tokens_as_token_ids` as vLLM.
- llama-server (b11434, `tools/server/server-context.cpp` populate_token_probs): with
  `post_sampling_probs` false the sampled token's probability is the softmax of the raw logits over
  the whole vocabulary; top_k <= 0 disables it; it also needs min_p 0 (its default is 0.05),
  typical_p 1, repeat_penalty 1, dry_multiplier 0, xtc_probability 0, and answers `logprobs.content`
  entries with an `id`. It leaves out the entry of a sampled token that ends inside a multi-byte
  UTF-8 character (process_token adds probabilities only once the text is whole UTF-8): such a reply
  is refused with that reason.
Keys a server does not know are ignored by vLLM and llama-server.

Parsing takes either shape: the legacy `logprobs.tokens` ("token_id:N") + `token_logprobs`, or
`logprobs.content` [{id, logprob}]. A reply with another number of tokens than asked, or tokens as
text without ids, is an error saying which.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from moebench.json_types import JsonObject
from moebench.runners import reply_checks
from moebench.runners.base import RunnerError

_TOKEN_ID = re.compile(r"^token_id:(-?\d+)$")

# The untruncated, unpenalised distribution, in every spelling the known servers read.
UNTRUNCATED = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "typical_p": 1.0,
               "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
               "repeat_penalty": 1.0, "dry_multiplier": 0.0, "xtc_probability": 0.0}


@dataclass(frozen=True, slots=True)
class SampledLogprobsBody:
    """The /v1/completions body sampling `max_tokens` tokens after `prompt` with their log-probs; the
    profile's `extra_body` keys come last and win, as with every request."""

    model: str
    prompt: tuple[int, ...]
    max_tokens: int
    seed: int
    extra_body: JsonObject = field(default_factory=dict)

    def to_json(self) -> JsonObject:
        return {"model": self.model, "prompt": list(self.prompt), "max_tokens": int(self.max_tokens),
                "seed": int(self.seed), "logprobs": 1, "return_tokens_as_token_ids": True, "ignore_eos": True,
                **UNTRUNCATED, **self.extra_body}


def request(model: str, prompt: list[int], max_tokens: int, seed: int) -> JsonObject:
    """The body without profile keys, as sent (SampledLogprobsBody's JSON)."""
    return SampledLogprobsBody(model, tuple(prompt), max_tokens, seed).to_json()


def _lp(v: Any, where: str) -> float:
    return reply_checks.logprob(v, "log-prob", where)


def parse(data: Any, max_tokens: int, where: str) -> tuple[list[int], list[float]]:
    """(sampled token ids, their log-probs) from a /v1/completions reply."""
    if not isinstance(data, dict):
        raise RunnerError(f"{where}: response is not a JSON object")
    if data.get("error"):
        raise RunnerError(f"{where}: server error: {str(data['error'])[:300]}")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise RunnerError(f"{where}: response has no choices")
    lp = choices[0].get("logprobs")
    if not isinstance(lp, dict):
        raise RunnerError(f"{where}: no 'logprobs' object in choices[0]: the server ignored logprobs = 1")
    ids: list[int] = []
    lps: list[float] = []
    if isinstance(lp.get("content"), list):              # llama-server's (chat-style) shape
        for i, e in enumerate(lp["content"]):
            if not isinstance(e, dict) or not isinstance(e.get("id"), int):
                raise RunnerError(f"{where}: logprobs.content[{i}] has no integer 'id': the sampled token "
                                  "must come back as an id")
            ids.append(e["id"])
            lps.append(_lp(e.get("logprob"), f"{where} logprobs.content[{i}]"))
    elif isinstance(lp.get("tokens"), list) and isinstance(lp.get("token_logprobs"), list):
        for i, (tok, v) in enumerate(zip(lp["tokens"], lp["token_logprobs"])):
            m = _TOKEN_ID.match(tok) if isinstance(tok, str) else None
            if m is None:
                raise RunnerError(f"{where}: logprobs.tokens[{i}] is {tok!r}, not 'token_id:N': the server "
                                  "ignored return_tokens_as_token_ids, and text cannot name the sampled id")
            ids.append(int(m.group(1)))
            lps.append(_lp(v, f"{where} logprobs.token_logprobs[{i}]"))
    else:
        raise RunnerError(f"{where}: logprobs has neither 'content' nor 'tokens' + 'token_logprobs'")
    if len(ids) < max_tokens and isinstance(lp.get("content"), list):
        raise RunnerError(f"{where}: log-probs for {len(ids)} of {max_tokens} sampled tokens: llama-server "
                          "leaves out the log-prob of a sampled token that ends inside a multi-byte UTF-8 "
                          "character (b11434 tools/server/server-context.cpp process_token adds a token's "
                          "probabilities only once the text is whole UTF-8), so it cannot give one log-prob "
                          "per sampled token (docs/kld.md)")
    if len(ids) != max_tokens:
        raise RunnerError(f"{where}: {len(ids)} sampled tokens came back, asked for {max_tokens} with "
                          f"ignore_eos (finish_reason {choices[0].get('finish_reason')!r}): does the server "
                          "honour ignore_eos and max_tokens?")
    return ids, lps
