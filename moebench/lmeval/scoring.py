"""Teacher-forced token scoring over a runner (used by the lm-eval adapter and `moebench serve`).

The Runner contract has no scoring request, so runners that can score a whole sequence in one pass
offer one of two optional coroutines, advertised by a capability:

- `Capability.PROMPT_LOGPROBS`: `await runner.prompt_logprobs(token_ids, top_k)` -> a list as long as
  `token_ids`; entry 0 is None, entry i is `(logprob of token_ids[i] given token_ids[:i],
  {token_id: logprob} of the top_k alternatives at i)`.
- `Capability.FULL_LOGITS`: `await runner.logits(token_ids)` -> `[len, vocab]` next-token logits
  (row i predicts token i+1), a numpy array or torch tensor.

Runners with only `top_logprobs` cannot score a prompt in one pass; the adapter then asks one
1-token generation per continuation token (see adapter.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from moebench.runners.base import Capability, CapabilityError, RunnerError


@dataclass
class TokenScore:
    """One scored position: the log-prob of the token that is there, and the best alternatives."""

    logprob: float
    top: dict[int, float] = field(default_factory=dict)


def prompt_scoring_kind(runner: Any) -> str | None:
    """"prompt_logprobs" or "full_logits" where the runner can score a sequence in one pass, else None."""
    caps = getattr(runner, "capabilities", frozenset())
    if Capability.PROMPT_LOGPROBS in caps and callable(getattr(runner, "prompt_logprobs", None)):
        return "prompt_logprobs"
    if Capability.FULL_LOGITS in caps and callable(getattr(runner, "logits", None)):
        return "full_logits"
    return None


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):              # a torch tensor; avoid importing torch here
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    m = logits.max(axis=-1, keepdims=True)
    z = logits - m
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


async def score_tokens(runner: Any, token_ids: list[int], top_k: int = 1) -> list[TokenScore | None]:
    """Score every position of `token_ids` (position 0 has no context: None)."""
    kind = prompt_scoring_kind(runner)
    if kind is None:
        raise CapabilityError(
            f"runner kind {getattr(runner, 'kind', '?')!r} cannot score prompts: it needs the "
            f"{Capability.PROMPT_LOGPROBS} or {Capability.FULL_LOGITS} capability "
            f"(it offers: {', '.join(sorted(getattr(runner, 'capabilities', ()))) or 'nothing'})")
    n = len(token_ids)
    if kind == "prompt_logprobs":
        rows = await runner.prompt_logprobs(list(token_ids), top_k)
        if len(rows) != n:
            raise RunnerError(f"prompt_logprobs returned {len(rows)} positions for {n} tokens")
        out: list[TokenScore | None] = [None]
        for row in rows[1:]:
            lp, top = row
            out.append(TokenScore(float(lp), {int(k): float(v) for k, v in (top or {}).items()}))
        return out
    logits = _to_numpy(await runner.logits(list(token_ids)))
    if logits.ndim != 2 or logits.shape[0] != n:
        raise RunnerError(f"logits returned shape {tuple(logits.shape)} for {n} tokens; expected ({n}, vocab)")
    lsm = log_softmax(logits[:-1]) if n > 1 else np.zeros((0, logits.shape[1]))
    out = [None]
    k = max(1, min(int(top_k), logits.shape[1]))
    for i in range(1, n):
        row = lsm[i - 1]
        best = np.argpartition(-row, k - 1)[:k]
        best = best[np.argsort(-row[best], kind="stable")]
        out.append(TokenScore(float(row[token_ids[i]]), {int(t): float(row[t]) for t in best}))
    return out
