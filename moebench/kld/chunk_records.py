"""The item records of the teacher-forced KLD task, one per chunk and role, as they go to items.jsonl.

Every record starts with the chunk's own fields (`ChunkHead`: chunk, prompt_hash, n_tokens, and for
prompt log-probs k, complete, fixed_ids), then the role and what the role measured. kld/runs.py
reads the candidate's back (method, file, estimate, topk_vs_exact) to build compare.json["kld"].
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from moebench.kld.stats import TokenStats


@dataclass(frozen=True)
class ChunkHead:
    """The fields every chunk record starts with: which chunk, the hash of its ids, the tokens scored,
    and for prompt log-probs from a server how many per position (`k`), whether they covered the whole
    vocabulary (`complete`) and whether the candidate scored the baseline's top-K ids (`fixed_ids`)."""

    chunk: int
    prompt_hash: str
    n_tokens: int
    k: int | None = None            # None: whole distributions (logits), no prompt log-probs fields
    complete: bool = False
    fixed_ids: bool = False

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"chunk": self.chunk, "prompt_hash": self.prompt_hash, "n_tokens": self.n_tokens}
        if self.k is not None:
            out.update(k=self.k, complete=self.complete, fixed_ids=self.fixed_ids)
        return out


@dataclass(frozen=True)
class BaselineChunk:
    """A baseline chunk: where its top-K arrays are and the actual tokens' NLL under the baseline."""

    file: str                       # the chunk's npz, relative to the run directory
    next_logp: np.ndarray           # the baseline's log-prob of each actual next token
    topk_bytes_per_token: float     # what the stored top-K costs per token (the whole distribution not counted)
    has_full: bool                  # whether the chunk also keeps whole distributions

    def to_json(self, head: ChunkHead) -> dict[str, Any]:
        nll = -self.next_logp
        return {**head.to_json(), "role": "baseline", "file": self.file, "nll_sum": float(nll.sum()),
                "ppl_base": float(np.exp(nll.mean())), "topk_bytes_per_token": self.topk_bytes_per_token,
                "has_full": self.has_full}


@dataclass(frozen=True)
class KldEstimate:
    """How a candidate's KLD was estimated where it is not exact from whole distributions on both sides."""

    k: int                          # log-probs per position the candidate gave
    baseline_k: int                 # log-probs per position the baseline kept
    fixed_ids: bool                 # whether the candidate scored the baseline's top-K ids
    lower_bound: bool               # a lumped estimate: never above the full KLD
    candidate: str | None = None    # what the candidate gave, where it is not K log-probs

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"k": self.k, "baseline_k": self.baseline_k, "fixed_ids": self.fixed_ids,
                               "lower_bound": self.lower_bound}
        if self.candidate is not None:
            out["candidate"] = self.candidate
        return out


@dataclass(frozen=True)
class CandidateChunk:
    """A candidate chunk: its per-token statistics against the baseline (arrays in `file`)."""

    method: str                                 # "exact" or "topk-lower-bound"
    file: str
    stats: TokenStats
    estimate: KldEstimate | None = None
    topk_vs_exact: dict[str, float] | None = None   # mean KLD exact and per top-K bound, where both exist
    router_agreement: list[float] | None = None     # per layer, where both runs traced their routers

    def to_json(self, head: ChunkHead) -> dict[str, Any]:
        ts = self.stats
        out = {**head.to_json(), "role": "candidate", "method": self.method, "file": self.file,
               "kld_mean": float(ts.kld.mean()), "same_top_p": float(ts.same_top.mean()),
               "ln_ppl_ratio": float(ts.nll.mean() - ts.nll_base.mean()), "sums": ts.sums().to_json()}
        if self.estimate is not None:
            out["estimate"] = self.estimate.to_json()
        if self.topk_vs_exact is not None:
            out["topk_vs_exact"] = self.topk_vs_exact
        if self.router_agreement is not None:
            out["router_agreement"] = self.router_agreement
        return out
