"""The item records of the teacher-forced KLD task, one per chunk and role, as they go to items.jsonl.

Every record starts with the chunk's own fields (`ChunkHead`: chunk, prompt_hash, n_tokens, and for
prompt log-probs k, complete, fixed_ids), then the role and what the role measured; a llama-perplexity
run writes its own two (`LlamaBaselineChunk`, `LlamaCandidateChunk`). `KldItem` is any KLD record
(teacher-forced or sampled) read back: kld/runs.py builds compare.json["kld"] from the candidate's
(method, file, estimate, topk_vs_exact) and the tasks summarize from them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any
import numpy as np

from moebench.json_fields import Wording, json_kind
from moebench.json_types import JsonObject, JsonValue
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

    def to_json(self) -> JsonObject:
        out: JsonObject = {"chunk": self.chunk, "prompt_hash": self.prompt_hash, "n_tokens": self.n_tokens}
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

    def to_json(self, head: ChunkHead) -> JsonObject:
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

    def to_json(self) -> JsonObject:
        out: JsonObject = {"k": self.k, "baseline_k": self.baseline_k, "fixed_ids": self.fixed_ids,
                               "lower_bound": self.lower_bound}
        if self.candidate is not None:
            out["candidate"] = self.candidate
        return out

    @staticmethod
    def from_json(doc: JsonValue, where: str) -> KldEstimate:
        """A record's "estimate" read back; bad input is refused naming `where` and the key."""
        if not isinstance(doc, dict):
            raise RecordFormatError(f"{where}: key 'estimate' is {json_kind(doc)}, expected an object")
        return KldEstimate(k=_need(doc, "k", int, f"{where} estimate"),
                           baseline_k=_need(doc, "baseline_k", int, f"{where} estimate"),
                           fixed_ids=_need(doc, "fixed_ids", bool, f"{where} estimate"),
                           lower_bound=_need(doc, "lower_bound", bool, f"{where} estimate"),
                           candidate=_opt(doc, "candidate", str, f"{where} estimate"))


@dataclass(frozen=True)
class CandidateChunk:
    """A candidate chunk: its per-token statistics against the baseline (arrays in `file`)."""

    method: str                                 # "exact" or "topk-lower-bound"
    file: str
    stats: TokenStats
    estimate: KldEstimate | None = None
    topk_vs_exact: dict[str, float] | None = None   # mean KLD exact and per top-K bound, where both exist
    router_agreement: list[float] | None = None     # per layer, where both runs traced their routers

    def to_json(self, head: ChunkHead) -> JsonObject:
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


@dataclass(frozen=True)
class LlamaBaselineChunk:
    """A llama-perplexity baseline chunk: its tokens' NLL under the baseline, read from the base file."""

    chunk: int
    n_tokens: int
    nll_sum: float
    ppl_base: float
    file: str                       # the base file, relative to the run directory
    prompt_hash: str

    def to_json(self) -> JsonObject:
        return {"chunk": self.chunk, "role": "baseline", "n_tokens": self.n_tokens, "nll_sum": self.nll_sum,
                "ppl_base": self.ppl_base, "file": self.file, "prompt_hash": self.prompt_hash}


@dataclass(frozen=True)
class LlamaCandidateChunk:
    """A llama-perplexity candidate chunk: the chunk's own mean KLD, recovered from the printed lines."""

    chunk: int
    n_tokens: int
    kld_mean: float

    def to_json(self) -> JsonObject:
        return {"chunk": self.chunk, "role": "candidate", "method": "llama-perplexity", "n_tokens": self.n_tokens,
                "kld_mean": self.kld_mean}


@dataclass(frozen=True)
class HeadedChunk:
    """A baseline or candidate chunk record with the chunk's own fields in front."""

    head: ChunkHead
    body: BaselineChunk | CandidateChunk

    def to_json(self) -> JsonObject:
        return self.body.to_json(self.head)


# What the teacher-forced task's evaluate makes of one chunk, before it becomes an ItemRecord.
ChunkRecord = HeadedChunk | LlamaBaselineChunk | LlamaCandidateChunk


class RecordFormatError(ValueError):
    """A KLD items.jsonl record whose keys are not what the KLD tasks write; names the record and key."""


# The KLD records' wording of a refusal (tests and users read these messages).
_WORDING = Wording(RecordFormatError, missing="{where}: key {key!r} is missing, expected {expected}")


def _opt(doc: JsonObject, key: str, kind: type, where: str) -> Any:
    """doc[key] checked to be of `kind` (an int counts as a float, a bool never as a number); None where
    absent or null."""
    return _WORDING.value(doc, key, where, (kind,), null_is_absent=True)


def _need(doc: JsonObject, key: str, kind: type, where: str) -> Any:
    return _WORDING.value(doc, key, where, (kind,), required=True, null_is_absent=True)


@dataclass(frozen=True)
class KldItem:
    """A KLD task's items.jsonl record read back (teacher-forced or sampled, either role). Only
    `item_id` and `status` are always there; an errored record holds nothing else of these."""

    item_id: str
    status: str
    task: str = "kld"
    role: str | None = None                 # "baseline" or "candidate"
    method: str | None = None               # a candidate's: "exact", "topk-lower-bound", "llama-perplexity", "sampled"
    chunk: int | None = None                # teacher-forced
    prompt: int | None = None               # sampled: which prompt and continuation
    cont: int | None = None
    file: str | None = None                 # its arrays, relative to the run directory
    n_tokens: int | None = None
    nll_sum: float | None = None            # a baseline's
    prompt_hash: str | None = None
    estimator: str | None = None            # a sampled candidate's
    estimate: KldEstimate | None = None
    has_topk_vs_exact: bool = False         # its arrays also hold the exact KLD and the top-K bounds
    topk_bytes_per_token: float | None = None

    @property
    def is_ok_candidate(self) -> bool:
        return self.status == "ok" and self.role == "candidate"

    @staticmethod
    def from_json(doc: JsonValue, where: str) -> KldItem:
        """One record as items.jsonl holds it; bad input is refused naming `where` (the file and item)
        and the key."""
        if not isinstance(doc, dict):
            raise RecordFormatError(f"{where}: a record is {json_kind(doc)}, expected an object")
        item_id = _need(doc, "item_id", str, where)
        where = f"{where} item {item_id!r}"
        estimate = doc.get("estimate")
        return KldItem(item_id=item_id, status=_need(doc, "status", str, where),
                       task=_opt(doc, "task", str, where) or "kld", role=_opt(doc, "role", str, where),
                       method=_opt(doc, "method", str, where), chunk=_opt(doc, "chunk", int, where),
                       prompt=_opt(doc, "prompt", int, where), cont=_opt(doc, "cont", int, where),
                       file=_opt(doc, "file", str, where), n_tokens=_opt(doc, "n_tokens", int, where),
                       nll_sum=_opt(doc, "nll_sum", float, where), prompt_hash=_opt(doc, "prompt_hash", str, where),
                       estimator=_opt(doc, "estimator", str, where),
                       estimate=KldEstimate.from_json(estimate, where) if estimate else None,
                       has_topk_vs_exact=bool(doc.get("topk_vs_exact")),
                       topk_bytes_per_token=_opt(doc, "topk_bytes_per_token", float, where))


def read_items(docs: list[JsonObject], where: str) -> list[KldItem]:
    """A KLD task's records, as read from `where` (an items.jsonl), in their order."""
    return [KldItem.from_json(d, where) for d in docs]
