"""KLD versus a baseline run: teacher-forced next-token distributions over a corpus, chunked as
llama.cpp's `llama-perplexity` does, with its statistics (moebench.kld.stats).

Chunking: the corpus (CRLF -> LF) is tokenized once; chunk j is tokens[j*c : (j+1)*c]; if the model
adds BOS, the chunk's first token is replaced by BOS (the stream also starts with BOS, as
llama-perplexity tokenizes with add_special); positions c/2 ... c-2 are scored (each predicts the next
token). Items are chunks, `kld/<corpus stem>/<chunk>`.

Two roles, chosen by `--baseline`:
- BASELINE run (no --baseline) writes, under <run>/kld/<task name>/ (layout: moebench.kld.runs):
  meta.json, tokens.npy [n_chunk, c] (the exact ids every candidate must use), and per chunk
  base/chunk_NNNNN.npz with, per scored position, the top-K token ids and float16 log-probs, the
  float32 log of the remaining mass, the float32 log-prob of the actual next token, and for the first
  `full_chunks` chunks the whole distribution as llama.cpp base-file rows (where the runner gives whole
  distributions); plus the router's top-k expert ids of every position where traced.
- CANDIDATE run (--baseline BASE) uses the baseline's tokens, computes per-token KLD, same-top, dp,
  nll against it and stores them in cand/chunk_NNNNN.npz with its own router ids.

How the log-probs are obtained is chosen from the runner's capabilities, never its kind:
- `llama_perplexity`: the runner's own llama-perplexity (its build, its placement and numerics flags:
  `runner.perplexity_plan()`) on its GGUF: `--kl-divergence-base` into base.kld for a baseline,
  `--kl-divergence` against the baseline's base.kld for a candidate (converted from an npz baseline
  when needed). No server is needed for it.
- `full_logits`: the whole distribution at every position (the engine): exact KLD.
- `prompt_logprobs`: a server's top-K prompt log-probs (`runner.prompt_logprobs`), K from the runner
  (`prompt_logprobs_k`); exact when K covers the vocabulary on both sides, otherwise a lower bound
  (stats.sparse_kld). Where the runner can score fixed ids (`prompt_logprob_ids`), a candidate
  asks for the baseline's top-K ids too, which tightens the bound.

`method = "sampled"` (a Monte Carlo estimate on the baseline's own samples from one log-prob per token)
is another class, moebench.kld.sampled_task.SampledKldTask, which KldTask(opts) returns for it.
"""
from __future__ import annotations

import asyncio
import io
import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np

from moebench.config import MAX_NEW_TOKENS, MAX_PROMPT_TOKENS, MAX_SEED, MAX_VOCAB, Field, non_negative, positive
from moebench.datasets import KLD_DEFAULT_CORPUS, data_file, read_text
from moebench.kld import stats as ks
from moebench.json_types import JsonObject
from moebench.kld.chunk_records import (BaselineChunk, CandidateChunk, ChunkHead, ChunkRecord, HeadedChunk, KldEstimate,
                                        LlamaBaselineChunk, LlamaCandidateChunk, read_items)
from moebench.kld.runs import (TOPK_LADDER, KldError, KldFolders, KldMeta, chunk_file, id_dtype, kld_section,
                               read_meta, router_agreement, save_npz, section_or_error, task_dir, write_json)
from moebench.kld.perplexity_tool import PrintedKld
from moebench.kld.sections import KldSection
from moebench.runners.base import Capability, Runner, RunnerError
from moebench.store.records import ItemRecord
from moebench.store import write_bytes_atomic
from moebench.tasks.base import Item, Task, prompt_hash

DEFAULT_CORPUS = KLD_DEFAULT_CORPUS

# How the task gets log-probs, by capability (first match wins).
BY_TOOL, BY_LOGITS, BY_PROMPT_LOGPROBS = "llama-perplexity", "full-logits", "prompt-logprobs"


def backend(runner: Runner) -> str:
    caps = runner.capabilities
    if Capability.LLAMA_PERPLEXITY in caps:
        return BY_TOOL
    if Capability.FULL_LOGITS in caps:
        return BY_LOGITS
    return BY_PROMPT_LOGPROBS


def _corpus_problem(value: str) -> str | None:
    """The corpus is read from the mirror: a relative path that stays inside it."""
    p = PurePosixPath(value)
    if not value or p.is_absolute() or ".." in p.parts or "\\" in value:
        return "must be a path inside the data mirror, like 'wikitext2/wiki.test.raw' (no leading '/', no '..')"
    return None


class KldTask(KldFolders, Task):
    kind = "kld"
    phase = "score"
    options = {
        "corpus": Field(str, default=DEFAULT_CORPUS, check=_corpus_problem,
                        doc="text file in the data mirror (CRLF normalised)"),
        "context": Field(int, default=512, check=positive, low=4, high=MAX_PROMPT_TOKENS,
                         doc="tokens per chunk (llama-perplexity -c)"),
        "chunks": Field(int, default=32, check=positive, low=1, high=1_000_000,
                        doc="chunks to score (llama-perplexity --chunks)"),
        "top_k": Field(int, default=64, check=positive, low=1, high=MAX_VOCAB,
                       doc="baseline tokens kept per scored position"),
        "full_chunks": Field(int, default=1, check=non_negative, low=0, high=1_000_000,
                             doc="baseline chunks that also keep the whole distribution (exact KLD, llama.cpp export)"),
        "router": Field(bool, default=True, doc="store router traces where the runner offers them"),
        "threads": Field(int, check=positive, low=1, high=1_024, doc="llama-perplexity -t"),
        "method": Field(str, default="teacher-forced", choices=("teacher-forced", "sampled"),
                        doc="teacher-forced over the corpus, or sampled: Monte Carlo on the baseline's own "
                            "samples from one log-prob per token (moebench.kld.sampled_task)"),
        # method = "sampled" only (defaults in moebench.kld.sampled_task.DEFAULTS)
        "prompts": Field(int, check=positive, low=1, high=1_000_000, doc="sampled: prompts taken from the corpus"),
        "prompt_tokens": Field(int, check=positive, low=1, high=MAX_PROMPT_TOKENS, doc="sampled: tokens per prompt"),
        "continuations": Field(int, check=positive, low=1, high=100_000,
                               doc="sampled: continuations sampled per prompt"),
        "tokens": Field(int, check=positive, low=1, high=MAX_NEW_TOKENS, doc="sampled: tokens per continuation"),
        "seed": Field(int, check=non_negative, low=0, high=MAX_SEED,
                      doc="sampled: continuation (prompt j, c) is sampled with seed + j * continuations + c"),
        "estimator": Field(str, choices=("low-variance", "plain"),
                           doc="sampled: the headline estimator, (r - 1) - log r or log p - log q"),
    }
    SAMPLED_KEYS = ("prompts", "prompt_tokens", "continuations", "tokens", "seed", "estimator")

    def __new__(cls, opts: JsonObject, ctx=None):
        # One task kind, two methods: method = "sampled" is its own class (moebench.kld.sampled_task),
        # which is not a KldTask, so KldTask.__init__ does not run on it.
        if cls is KldTask and (opts or {}).get("method") == "sampled":
            from moebench.kld.sampled_task import SampledKldTask
            return SampledKldTask(opts, ctx)
        return super().__new__(cls)

    def __init__(self, opts: JsonObject, ctx):
        """`opts`: the suite's task table as read, checked against `options` by the suite loader."""
        super().__init__(opts, ctx)
        given = [k for k in self.SAMPLED_KEYS if opts.get(k) is not None]
        if given:
            raise ValueError(f"kld: key {given[0]!r} is for method = \"sampled\"; this task is teacher-forced "
                             "(set method = \"sampled\" or drop the key)")
        self.context: int = opts.get("context", 512)
        if self.context < 4 or self.context % 2:
            raise ValueError(f"kld: context must be an even number >= 4, got {self.context}")
        self.n_chunks: int = opts.get("chunks", 32)
        if self.limit:
            self.n_chunks = min(self.n_chunks, self.limit)
        self.top_k: int = opts.get("top_k", 64)
        self.full_chunks: int = opts.get("full_chunks", 1)
        self.corpus: str = opts.get("corpus", DEFAULT_CORPUS)
        self.first = self.context // 2
        self.n_scored = self.context - 1 - self.first
        self.base_meta: KldMeta | None = None
        self.tokens: np.ndarray | None = None
        self._llama_stats: PrintedKld | None = None    # what llama-perplexity printed (llama_stats.json)
        self._bf = None                     # llama base file of the baseline, when it is one
        self.how: str | None = None         # BY_TOOL | BY_LOGITS | BY_PROMPT_LOGPROBS, set in prepare

    # ---- contract ------------------------------------------------------------------------------
    def needs(self, runner: Runner) -> set[str]:
        how = backend(runner)
        if how == BY_TOOL:
            return {Capability.LLAMA_PERPLEXITY}   # llama-perplexity does the work on the profile's GGUF
        if how == BY_LOGITS:
            return {Capability.FULL_LOGITS, Capability.TOKENIZE}
        # A baseline tokenizes the corpus; a candidate uses the baseline's ids.
        return {Capability.PROMPT_LOGPROBS} | (set() if self.is_candidate else {Capability.TOKENIZE})

    def check(self, runner: Runner) -> None:
        if backend(runner) == BY_TOOL:
            runner.perplexity_plan()                # refuses unknown flags, a build without the tool
        elif self.is_candidate:                     # before any work, not after the other tasks
            self._check_vocab(self.baseline_meta(), runner.declared_vocab_size(), runner)

    def _check_vocab(self, base_meta: KldMeta, vocab: int | None, runner: Runner) -> None:
        """KLD compares two distributions over one vocabulary: refuse sizes that differ, or a baseline
        that recorded none while this runner knows its own (nothing would vouch they match)."""
        base = base_meta.n_vocab
        if vocab is None:
            return
        if base is None:
            kind = base_meta.runner_kind or "its"
            raise KldError(f"baseline {self.ctx.baseline_run} recorded no vocabulary size (its {kind} runner "
                           f"knew none; for an http runner give its profile tokenizer = \"PATH\" and run the "
                           f"baseline again); this {runner.kind} runner's model has {vocab:,} tokens, and KLD "
                           "needs the same vocabulary on both sides")
        if vocab != base:
            raise KldError(f"vocabularies differ: baseline {self.ctx.baseline_run} has {base:,} tokens, this "
                           f"runner's model {vocab:,}; KLD needs the same vocabulary")

    def items(self) -> list[Item]:
        self.register_corpus()
        n = self.n_chunks
        if self.is_candidate:
            meta = self.baseline_meta()
            if meta.context != self.context:
                raise KldError(f"baseline {self.ctx.baseline_run} used context {meta.context}, this suite "
                               f"{self.context}: the chunks would differ")
            if meta.corpus != self.corpus:
                raise KldError(f"baseline corpus {meta.corpus!r} differs from this suite's {self.corpus!r}")
            n = min(n, meta.n_chunk)
        stem = Path(self.corpus).stem
        return [Item(f"kld/{stem}/{j}", {"chunk": j}) for j in range(n)]

    async def prepare(self, runner: Runner) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.how = backend(runner)
        if self.how == BY_TOOL:
            await asyncio.to_thread(self._prepare_llama, runner)
            return
        if self.is_candidate:
            self._load_baseline()
            self._check_vocab(self.base_meta, runner.vocab_size(), runner)
            return
        text = read_text(data_file(self.ctx.data_dir, self.corpus))
        ids = await runner.tokenize(text)
        add_bos, bos = runner.bos_policy()
        if add_bos:
            ids = [bos] + list(ids)      # llama-perplexity tokenizes the whole text with add_special
        need = self.n_chunks * self.context
        if len(ids) < max(need, 2 * self.context):
            raise KldError(f"{self.corpus}: {len(ids)} tokens, need {max(need, 2 * self.context)} for "
                           f"{self.n_chunks} chunks of {self.context}")
        self.tokens = np.asarray(ids[:need], dtype=np.int32).reshape(self.n_chunks, self.context)
        buf = io.BytesIO()
        np.save(buf, self.tokens)
        write_bytes_atomic(self.out_dir / "tokens.npy", buf.getvalue())
        write_json(self.out_dir / "meta.json", KldMeta(
            format="npz", corpus=self.corpus, context=self.context, n_chunk=self.n_chunks,
            n_vocab=runner.vocab_size(), add_bos=add_bos, bos_token_id=bos,
            top_k=self.top_k if self.how == BY_LOGITS else _runner_k(runner, self.top_k),
            full_chunks=min(self.full_chunks, self.n_chunks), first=self.first, n_scored=self.n_scored,
            num_experts=runner.num_experts(), runner_kind=runner.kind, how=self.how).to_json())

    def _load_baseline(self) -> None:
        self.base_meta = self.baseline_meta()
        if self.base_meta.format == "llama":
            from moebench.kld.perplexity_tool import read_base_file
            self._bf = read_base_file(self.base_dir / "base.kld")
            self.tokens = self._bf.tokens
        else:
            self.tokens = np.load(self.base_dir / "tokens.npy")
        if self.tokens.shape[1] != self.context:
            raise KldError(f"baseline tokens have context {self.tokens.shape[1]}, suite says {self.context}")

    async def evaluate(self, item: Item, runner: Runner) -> ItemRecord:
        return ItemRecord.from_fields(self.name, item.item_id, (await self._chunk(item, runner)).to_json())

    async def _chunk(self, item: Item, runner: Runner) -> ChunkRecord:
        j = item.data["chunk"]
        if self.how == BY_TOOL:
            return self._llama_record(j)
        ids = [int(t) for t in self.tokens[j]]
        add_bos, bos = runner.bos_policy()
        if self.base_meta and self.base_meta.add_bos is not None:   # the baseline's choice rules
            add_bos, bos = self.base_meta.add_bos, self.base_meta.bos_token_id
        if add_bos:
            ids[0] = bos                 # as llama-perplexity: the chunk's first token becomes BOS
        if self.how == BY_PROMPT_LOGPROBS:
            return await self._evaluate_prompt_logprobs(j, ids, runner)
        logits, routes = await self._forward(runner, ids)
        scored = logits[self.first:self.context - 1].numpy()
        nxt = self.tokens[j][self.first + 1:self.context].astype(np.int64)
        base = ChunkHead(j, prompt_hash(ids), int(nxt.size))
        if self.is_candidate:
            return await asyncio.to_thread(self._candidate_chunk, j, scored, nxt, routes, base)
        return await asyncio.to_thread(self._baseline_chunk, j, scored, nxt, routes, base)

    async def _forward(self, runner: Runner, ids: list[int]):
        if self.opts.get("router", True) and Capability.ROUTER_TRACE in runner.capabilities:
            tr = await runner.trace(ids, with_logits=True)
            routes = np.stack([t.numpy() for t in tr.topk_ids])          # [L, T, k]
            return tr.logits, routes
        return await runner.logits(ids), None

    # ---- baseline -------------------------------------------------------------------------------
    def _baseline_chunk(self, j, scored, nxt, routes, rec: ChunkHead) -> HeadedChunk:
        import torch
        lp = torch.log_softmax(torch.from_numpy(scored).double(), dim=-1)
        k = min(self.top_k, lp.shape[1])
        top_lp, top_ids = torch.topk(lp, k, dim=-1)
        rest = lp.scatter(1, top_ids, float("-inf"))
        tail = torch.logsumexp(rest, dim=-1)
        rows = np.arange(nxt.size)
        next_lp = lp.numpy()[rows, nxt]
        arrays = {"top_ids": top_ids.numpy().astype(id_dtype(lp.shape[1])),
                  "top_logp": top_lp.numpy().astype(np.float16), "tail_logp": tail.numpy().astype(np.float32),
                  "next_logp": next_lp.astype(np.float32)}
        full_rows = ks.encode_logprobs(scored) if j < self.full_chunks else None
        return HeadedChunk(rec, self._save_baseline(j, arrays, next_lp, full_rows, routes))

    def _save_baseline(self, j: int, arrays: dict[str, np.ndarray], next_lp: np.ndarray,
                       full_rows: np.ndarray | None, routes: np.ndarray | None) -> BaselineChunk:
        """A baseline chunk's top-K arrays, with its whole distributions and router ids where given."""
        topk_bytes = sum(a.nbytes for a in arrays.values()) / next_lp.size
        if full_rows is not None:
            arrays["full_rows"] = full_rows
        if routes is not None:
            arrays["routes"] = _route_ids(routes)
        path = chunk_file(self.out_dir / "base", j)
        save_npz(path, **arrays)
        return BaselineChunk(file=str(path.relative_to(self.ctx.run_dir)), next_logp=next_lp,
                             topk_bytes_per_token=topk_bytes, has_full=full_rows is not None)

    # ---- candidate ------------------------------------------------------------------------------
    def _candidate_chunk(self, j, scored, nxt, routes, rec: ChunkHead) -> HeadedChunk:
        meta = self.base_meta
        extra: dict[str, np.ndarray] = {}
        if meta.format == "llama":
            ts = ks.full_kld(self._bf.logprobs(j), scored, nxt)
            method = "exact"
            b_routes = None
        else:
            b = np.load(chunk_file(self.base_dir / "base", j))
            topk = ks.topk_kld(b["top_ids"].astype(np.int64), b["top_logp"], b["tail_logp"], scored, nxt, b["next_logp"])
            exact = None
            if "full_rows" in b.files:
                exact = ks.full_kld(ks.decode_logprobs(b["full_rows"], meta.n_vocab), scored, nxt)
                extra["kld_exact"] = exact.kld.astype(np.float32)
                extra["kld_topk"] = topk.kld.astype(np.float32)
                for kk in TOPK_LADDER:
                    if kk <= b["top_ids"].shape[1]:
                        extra[f"kld_top{kk}"] = ks.topk_kld(b["top_ids"].astype(np.int64), b["top_logp"], b["tail_logp"],
                                                            scored, nxt, b["next_logp"], k=kk).kld.astype(np.float32)
            all_full = meta.full_chunks >= meta.n_chunk
            ts, method = (exact, "exact") if (all_full and exact is not None) else (topk, "topk-lower-bound")
            b_routes = b["routes"] if "routes" in b.files else None
        file = self._save_candidate(j, ts, extra, routes)
        base_k = int(meta.top_k or 0)
        estimate = None if method == "exact" else KldEstimate(k=base_k, baseline_k=base_k, fixed_ids=False,
                                                              lower_bound=True, candidate="full distribution")
        topk_vs_exact = None
        if "kld_exact" in extra:
            topk_vs_exact = {"exact_mean": float(extra["kld_exact"].mean()),
                             **{f"top{kk}_mean": float(extra[f"kld_top{kk}"].mean())
                                for kk in TOPK_LADDER if f"kld_top{kk}" in extra}}
        agreement = None
        if routes is not None and b_routes is not None:
            agreement = router_agreement(b_routes, routes)[0]
        return HeadedChunk(rec, CandidateChunk(method, file, ts, estimate, topk_vs_exact, agreement))

    def _save_candidate(self, j: int, ts: ks.TokenStats, extra: dict[str, np.ndarray],
                        routes: np.ndarray | None) -> str:
        """A candidate chunk's per-token statistics (and its router ids) into cand/; the file, run-relative."""
        arrays = {**ts.arrays(), **extra}
        if routes is not None:
            arrays["routes"] = _route_ids(routes)
        path = chunk_file(self.out_dir / "cand", j)
        save_npz(path, **arrays)
        return str(path.relative_to(self.ctx.run_dir))

    # ---- prompt log-probs from a server --------------------------------------------------------
    async def _evaluate_prompt_logprobs(self, j: int, ids: list[int], runner: Runner) -> HeadedChunk:
        k = _runner_k(runner, self.top_k)
        score_ids = None
        if self.is_candidate and Capability.PROMPT_LOGPROB_IDS in runner.capabilities:
            b_ids = self._base_topk(j)[0]
            score_ids = sorted({int(t) for t in np.asarray(b_ids[:, :k]).ravel()})
        rows = await runner.prompt_logprobs(ids, k, score_ids=score_ids)
        if len(rows) != len(ids):
            raise RunnerError(f"prompt log-probs for {len(rows)} positions, the chunk has {len(ids)} tokens")
        # Row t+1 holds the distribution after tokens[:t+1], i.e. scored position t's prediction.
        picked = rows[self.first + 1:self.context]
        nxt = np.asarray(ids[self.first + 1:self.context], dtype=np.int64)
        dists: list[dict[int, float]] = []
        next_lp = np.empty(len(picked))
        for i, row in enumerate(picked):
            if row is None:
                raise RunnerError(f"chunk {j}: no prompt log-probs at position {self.first + 1 + i}")
            lp_tok, top = row
            d = {int(t): float(v) for t, v in (top or {}).items()}
            d.setdefault(int(nxt[i]), float(lp_tok))
            dists.append(d)
            next_lp[i] = float(lp_tok)
        n_vocab = (self.base_meta.n_vocab if self.base_meta else None) or runner.vocab_size()
        complete = bool(n_vocab) and all(len(d) >= n_vocab for d in dists)
        rec = ChunkHead(j, prompt_hash(ids), self.n_scored, k=k, complete=complete, fixed_ids=score_ids is not None)
        if self.is_candidate:
            return await asyncio.to_thread(self._candidate_sparse, j, dists, next_lp, nxt, n_vocab, complete, rec)
        return await asyncio.to_thread(self._baseline_sparse, j, dists, next_lp, nxt, n_vocab, complete, k, rec)

    @staticmethod
    def _dense(dists: list[dict[int, float]], n_vocab: int) -> np.ndarray:
        out = np.full((len(dists), n_vocab), -np.inf)
        for i, d in enumerate(dists):
            ids = np.fromiter(d.keys(), dtype=np.int64, count=len(d))
            if ids.size and (ids.min() < 0 or ids.max() >= n_vocab):
                raise KldError(f"a token id outside the vocabulary of {n_vocab} came back: {int(ids.max())}")
            out[i, ids] = np.fromiter(d.values(), dtype=np.float64, count=len(d))
        return out

    def _baseline_sparse(self, j, dists, next_lp, nxt, n_vocab, complete, k, rec: ChunkHead) -> HeadedChunk:
        n = len(dists)
        top_ids = np.zeros((n, k), dtype=np.int64)
        top_lp = np.full((n, k), -np.inf)
        tail = np.empty(n)
        for i, d in enumerate(dists):
            best = sorted(d.items(), key=lambda kv: -kv[1])[:k]
            if len(best) < k:
                raise RunnerError(f"chunk {j}: the server gave {len(best)} log-probs at a position, asked for {k}")
            top_ids[i] = [t for t, _ in best]
            top_lp[i] = [v for _, v in best]
            tail[i] = np.log(max(1.0 - float(np.exp(top_lp[i]).sum()), 1e-30))
        arrays = {"top_ids": top_ids.astype(id_dtype(int(n_vocab or top_ids.max() + 1))),
                  "top_logp": top_lp.astype(np.float16), "tail_logp": tail.astype(np.float32),
                  "next_logp": next_lp.astype(np.float32)}
        full_rows = ks.encode_logprobs(self._dense(dists, n_vocab)) if complete and j < self.full_chunks else None
        return HeadedChunk(rec, self._save_baseline(j, arrays, next_lp, full_rows, None))

    def _base_topk(self, j: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The baseline's (top ids, top log-probs, log rest mass, log-prob of the actual token) of chunk j."""
        if self.base_meta.format == "llama":
            full = self._bf.logprobs(j).astype(np.float64)
            kk = min(256, full.shape[1])
            ids = np.argsort(-full, axis=1)[:, :kk]
            lp = np.take_along_axis(full, ids, axis=1)
            tail = np.log(np.clip(1.0 - np.exp(lp).sum(axis=1), 1e-30, None))
            nxt = self.tokens[j][self.first + 1:self.context].astype(np.int64)
            return ids, lp, tail, full[np.arange(nxt.size), nxt]
        b = np.load(chunk_file(self.base_dir / "base", j))
        return b["top_ids"].astype(np.int64), b["top_logp"], b["tail_logp"], b["next_logp"]

    def _base_full(self, j: int) -> np.ndarray | None:
        if self.base_meta.format == "llama":
            return self._bf.logprobs(j)
        b = np.load(chunk_file(self.base_dir / "base", j))
        return ks.decode_logprobs(b["full_rows"], self.base_meta.n_vocab) if "full_rows" in b.files else None

    def _candidate_sparse(self, j, dists, next_lp, nxt, n_vocab, complete, rec: ChunkHead) -> HeadedChunk:
        base_full = self._base_full(j)
        all_full = self.base_meta.format == "llama" or self.base_meta.full_chunks >= self.base_meta.n_chunk
        extra: dict[str, np.ndarray] = {}
        b_ids, b_lp, b_tail, b_next = self._base_topk(j)
        bound = ks.sparse_kld(b_ids, b_lp, b_tail, b_next, dists, next_lp)
        if complete and base_full is not None:
            exact = ks.full_kld(base_full, self._dense(dists, n_vocab), nxt)
            extra["kld_exact"] = exact.kld.astype(np.float32)
            extra["kld_topk"] = bound.kld.astype(np.float32)
            ts, method = (exact, "exact") if all_full else (bound, "topk-lower-bound")
        else:
            ts, method = bound, "topk-lower-bound"
        file = self._save_candidate(j, ts, extra, None)
        k = rec.k
        assert k is not None              # a prompt log-probs head always carries its K
        estimate = KldEstimate(k=k, baseline_k=int(b_ids.shape[1]), fixed_ids=rec.fixed_ids,
                               lower_bound=method != "exact")
        topk_vs_exact = None
        if "kld_exact" in extra:
            topk_vs_exact = {"exact_mean": float(extra["kld_exact"].mean()),
                             f"top{k}_mean": float(extra["kld_topk"].mean())}
        return HeadedChunk(rec, CandidateChunk(method, file, ts, estimate, topk_vs_exact))

    # ---- llama-server: llama-perplexity does the forward passes -----------------------------------
    def _prepare_llama(self, runner: Runner) -> None:
        from moebench.kld import perplexity_tool as lp
        plan = runner.perplexity_plan()
        model = plan.model
        threads = self.opts.get("threads")
        log = self.out_dir / "llama-perplexity.log"
        commands: list[list[str]] = []
        try:
            self._prepare_llama_runs(lp, model, threads, log, plan.binary, plan.args, commands)
        finally:                         # what ran, even when it failed: binary, version, command lines
            write_json(self.out_dir / "llama_perplexity.json", {**plan.as_record(), "commands": commands})

    def _prepare_llama_runs(self, lp, model: str, threads: int | None, log: Path, binary: str, extra: list[str],
                            commands: list[list[str]]) -> None:
        """Write the base file (a baseline) or score against the baseline's (a candidate) with the runner's
        llama-perplexity `binary` and its `extra` flags; every command line run is added to `commands`."""
        if not self.is_candidate:
            text = read_text(data_file(self.ctx.data_dir, self.corpus))
            corpus = self.out_dir / "corpus.txt"
            write_bytes_atomic(corpus, text.encode("utf-8"))     # LF-normalised copy: what llama.cpp reads
            bf = lp.write_base(model, corpus, self.out_dir / "base.kld", self.context, self.n_chunks, threads, log,
                               extra=extra, binary=binary, commands=commands)
            if bf.n_chunk < self.n_chunks:
                raise KldError(f"{self.corpus}: llama-perplexity produced only {bf.n_chunk} chunks of {self.context}")
            self._bf, self.tokens = bf, bf.tokens
            write_json(self.out_dir / "meta.json", KldMeta(
                format="llama", corpus=self.corpus, context=self.context, n_chunk=bf.n_chunk,
                n_vocab=bf.n_vocab, top_k=None, full_chunks=bf.n_chunk, first=self.first,
                n_scored=self.n_scored, runner_kind="llama-server", how=BY_TOOL, base_file="base.kld",
                bytes_per_token=bf.bytes_per_token).to_json())
            return
        meta = self.baseline_meta()
        base_file = self.base_dir / "base.kld"
        if meta.format != "llama":
            base_file = self.out_dir / "baseline-converted.kld"
            export_base_file(self.ctx.baseline_run, self.name, base_file)
        self._llama_stats = lp.kl_divergence(model, base_file, self.context, threads, log, extra=extra, binary=binary,
                                             commands=commands)
        write_json(self.out_dir / "llama_stats.json", self._llama_stats.to_json())

    def _llama_record(self, j: int) -> LlamaBaselineChunk | LlamaCandidateChunk:
        if not self.is_candidate:
            lpr = self._bf.logprobs(j)
            nxt = self._bf.tokens[j][self.first + 1:self.context]
            nll = -lpr[np.arange(nxt.size), nxt].astype(np.float64)
            return LlamaBaselineChunk(chunk=j, n_tokens=int(nxt.size), nll_sum=float(nll.sum()),
                                      ppl_base=float(np.exp(nll.mean())),
                                      file=str((self.out_dir / "base.kld").relative_to(self.ctx.run_dir)),
                                      prompt_hash=prompt_hash([int(t) for t in self._bf.tokens[j]]))
        per = self._llama_stats.per_chunk if self._llama_stats is not None else []
        if j >= len(per):
            raise KldError(f"llama-perplexity printed no line for chunk {j}")
        return LlamaCandidateChunk(chunk=j, n_tokens=self.n_scored, kld_mean=per[j])

    # ---- run summary ----------------------------------------------------------------------------
    def summarize(self, records: list[JsonObject]) -> JsonObject:
        """The manifest's summary of this task from its items.jsonl records."""
        items = read_items(records, f"items.jsonl of task {self.name!r}")
        ok = sorted((r for r in items if r.status == "ok"), key=lambda r: r.chunk or 0)
        out = KldRunSummary(n=len(items), n_errors=sum(1 for r in items if r.status == "error"),
                            role="candidate" if self.is_candidate else "baseline", n_chunks=len(ok))
        if self.ctx.run_dir is not None and (self.out_dir / "llama_perplexity.json").is_file():
            # the build that measured: binary, --version line, flags passed and dropped, command lines
            out.llama_perplexity = json.loads((self.out_dir / "llama_perplexity.json").read_text())
        if not ok or self.ctx.run_dir is None:
            return out.to_json()
        if not self.is_candidate:
            n = sum(r.n_tokens or 0 for r in ok)
            out.n_tokens = n
            out.ppl = float(np.exp(sum(r.nll_sum or 0.0 for r in ok) / n))
            out.topk_bytes_per_token = ok[0].topk_bytes_per_token
            return out.to_json()
        run_dir = self.ctx.run_dir
        out.kld = section_or_error(lambda: kld_section(run_dir, ok))
        return out.to_json()


@dataclass
class KldRunSummary:
    """A teacher-forced KLD task's summary in manifest.json: counts, the role, the build that measured
    where llama-perplexity did (its llama_perplexity.json as written), a baseline's perplexity, and a
    candidate's KLD figures (without the histogram) or what stopped them (`kld` a message)."""

    n: int
    n_errors: int
    role: str
    n_chunks: int
    llama_perplexity: JsonObject | None = None
    n_tokens: int | None = None               # a baseline's
    ppl: float | None = None
    topk_bytes_per_token: float | None = None
    kld: KldSection | str | None = None       # a candidate's

    def to_json(self) -> JsonObject:
        out: JsonObject = {"n": self.n, "n_scored": 0, "n_correct": 0, "accuracy": None, "n_errors": self.n_errors,
                           "role": self.role, "n_chunks": self.n_chunks}
        if self.llama_perplexity is not None:
            out["llama_perplexity"] = self.llama_perplexity
        if self.n_tokens is not None:
            out.update(n_tokens=self.n_tokens, ppl=self.ppl)
            if self.topk_bytes_per_token is not None:
                out["topk_bytes_per_token"] = self.topk_bytes_per_token
        if isinstance(self.kld, str):
            out["kld"] = {"error": self.kld}
        elif self.kld is not None:
            out["kld"] = {k: v for k, v in self.kld.to_json().items() if k not in ("histogram",)}
        return out


def export_base_file(base_run: Path, name: str, out: Path) -> Path:
    """Write a llama-perplexity base file from an engine baseline that kept full distributions."""
    from moebench.kld.perplexity_tool import BaseFileWriter
    meta = read_meta(base_run, name)
    folder = task_dir(base_run, name)
    if meta.full_chunks < meta.n_chunk:
        raise KldError(f"{base_run}: the baseline kept full distributions for {meta.full_chunks} of "
                       f"{meta.n_chunk} chunks; rerun it with full_chunks >= {meta.n_chunk} to compare a "
                       "llama.cpp candidate against it")
    tokens = np.load(folder / "tokens.npy")
    w = BaseFileWriter(out, meta.context, meta.n_vocab, tokens)
    for j in range(meta.n_chunk):
        w.append_chunk(np.load(chunk_file(folder / "base", j))["full_rows"])
    return out


def _route_ids(routes: np.ndarray) -> np.ndarray:
    """Router expert ids stored in the narrowest type that holds them."""
    return routes.astype(np.uint8 if routes.max() < 256 else np.int16)


def _runner_k(runner: Runner, default: int) -> int:
    """The K a prompt-logprobs runner asks its server for (its profile's prompt_logprobs_k)."""
    return int(runner.prompt_logprobs_top_k() or default)
