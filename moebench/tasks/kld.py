"""KLD versus a baseline run: teacher-forced next-token distributions over a corpus, chunked as
llama.cpp's `llama-perplexity` does, with its statistics (moebench.scoring.kld_stats).

Chunking: the corpus (CRLF -> LF) is tokenized once; chunk j is tokens[j*c : (j+1)*c]; if the model
adds BOS, the chunk's first token is replaced by BOS (the stream also starts with BOS, as
llama-perplexity tokenizes with add_special); positions c/2 ... c-2 are scored (each predicts the next
token). Items are chunks, `kld/<corpus stem>/<chunk>`.

Two roles, chosen by `--baseline`:
- BASELINE run (no --baseline) writes, under <run>/kld/<task name>/: meta.json, tokens.npy [n_chunk, c]
  (the exact ids every candidate must use), and per chunk base/chunk_NNNNN.npz with, per scored
  position, the top-K token ids and float16 log-probs, the float32 log of the remaining mass, the
  float32 log-prob of the actual next token, and for the first `full_chunks` chunks the whole
  distribution as llama.cpp base-file rows (uint16; exact KLD and conversion to a llama.cpp base file);
  plus the router's top-k expert ids of every position (uint8/int16 [layers, c, k]) where traced.
- CANDIDATE run (--baseline BASE) uses the baseline's tokens, computes per-token KLD, same-top, dp,
  nll against it and stores them in cand/chunk_NNNNN.npz with its own router ids.

Backends: the engine (full logits, router traces); llama-server profiles drive `llama-perplexity` on
the profile's GGUF (baseline: `--kl-divergence-base` into kld/<name>/base.kld; candidate:
`--kl-divergence` against the baseline's base.kld, converted from an engine baseline when needed);
an engine candidate also measures against a llama.cpp baseline's base.kld. Other runners need
`prompt_logprobs`, which no runner here offers yet: a CapabilityError before any work.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np

from moebench.config import Field, non_negative, positive
from moebench.datasets import data_file, read_text, register
from moebench.runners.base import Capability, CapabilityError, Runner, RunnerError
from moebench.scoring import kld_stats as ks
from moebench.tasks.base import Item, Task, prompt_hash

DEFAULT_CORPUS = "wikitext2/wiki.test.raw"
TOPK_LADDER = (16, 64, 256)          # K values for which the top-K estimate is checked against exact


class KldError(RuntimeError):
    """The baseline and candidate cannot be compared (different tokens, vocabulary, context...)."""


def task_dir(run_dir: Path, name: str) -> Path:
    return Path(run_dir) / "kld" / name


def chunk_file(folder: Path, chunk: int) -> Path:
    return folder / f"chunk_{chunk:05d}.npz"


def read_meta(run_dir: Path, name: str) -> dict[str, Any]:
    path = task_dir(run_dir, name) / "meta.json"
    if not path.is_file():
        raise KldError(f"{path}: missing; is {run_dir} a KLD baseline run of task {name!r} "
                       "(made without --baseline)?")
    return json.loads(path.read_text())


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)


def _save_npz(path: Path, **arrays: Any) -> None:
    """Uncompressed (so bytes per token are what the arrays say), written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)


def _id_dtype(n: int) -> Any:
    return np.uint16 if n <= 65536 else np.int32


class KldTask(Task):
    kind = "kld"
    phase = "score"
    options = {
        "corpus": Field(str, default=DEFAULT_CORPUS, doc="text file in the data mirror (CRLF normalised)"),
        "context": Field(int, default=512, check=positive, doc="tokens per chunk (llama-perplexity -c)"),
        "chunks": Field(int, default=32, check=positive, doc="chunks to score (llama-perplexity --chunks)"),
        "top_k": Field(int, default=64, check=positive, doc="baseline tokens kept per scored position"),
        "full_chunks": Field(int, default=1, check=non_negative,
                             doc="baseline chunks that also keep the whole distribution (exact KLD, llama.cpp export)"),
        "router": Field(bool, default=True, doc="store router traces where the runner offers them"),
        "threads": Field(int, check=positive, doc="llama-perplexity -t"),
    }

    def __init__(self, opts: dict[str, Any], ctx):
        super().__init__(opts, ctx)
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
        self.base_meta: dict[str, Any] | None = None
        self.tokens: np.ndarray | None = None
        self._llama_stats: dict[str, Any] | None = None
        self._bf = None                     # llama base file of the baseline, when it is one

    # ---- folders -------------------------------------------------------------------------------
    @property
    def is_candidate(self) -> bool:
        return self.ctx.baseline_run is not None

    @property
    def out_dir(self) -> Path:
        if self.ctx.run_dir is None:
            raise KldError("kld needs a run directory for its arrays")
        return task_dir(self.ctx.run_dir, self.name)

    @property
    def base_dir(self) -> Path:
        return task_dir(self.ctx.baseline_run, self.name)

    # ---- contract ------------------------------------------------------------------------------
    def needs(self, runner: Runner) -> set[str]:
        if runner.kind == "llama-server":
            return set()            # llama-perplexity does the work on the profile's GGUF
        if runner.kind == "engine":
            return {Capability.FULL_LOGITS, Capability.TOKENIZE}
        return {Capability.PROMPT_LOGPROBS, Capability.TOKENIZE, Capability.TOKEN_PROMPTS}

    def items(self) -> list[Item]:
        path = data_file(self.ctx.data_dir, self.corpus)
        register(self.ctx.data_files, self.ctx.data_dir, path)
        n = self.n_chunks
        if self.is_candidate:
            meta = read_meta(self.ctx.baseline_run, self.name)
            if meta["context"] != self.context:
                raise KldError(f"baseline {self.ctx.baseline_run} used context {meta['context']}, this suite "
                               f"{self.context}: the chunks would differ")
            if meta.get("corpus") != self.corpus:
                raise KldError(f"baseline corpus {meta.get('corpus')!r} differs from this suite's {self.corpus!r}")
            n = min(n, meta["n_chunk"])
        stem = Path(self.corpus).stem
        return [Item(f"kld/{stem}/{j}", {"chunk": j}) for j in range(n)]

    async def prepare(self, runner: Runner) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if runner.kind == "llama-server":
            await asyncio.to_thread(self._prepare_llama, runner)
            return
        if self.is_candidate:
            self._load_baseline()
            vocab = _runner_vocab(runner)
            if vocab is not None and vocab != self.base_meta["n_vocab"]:
                raise KldError(f"vocabularies differ: baseline {self.ctx.baseline_run} has {self.base_meta['n_vocab']} "
                               f"tokens, this runner's model {vocab}; KLD needs the same vocabulary")
            return
        text = read_text(data_file(self.ctx.data_dir, self.corpus))
        ids = await runner.tokenize(text)
        add_bos, bos = _bos(runner)
        if add_bos:
            ids = [bos] + list(ids)      # llama-perplexity tokenizes the whole text with add_special
        need = self.n_chunks * self.context
        if len(ids) < max(need, 2 * self.context):
            raise KldError(f"{self.corpus}: {len(ids)} tokens, need {max(need, 2 * self.context)} for "
                           f"{self.n_chunks} chunks of {self.context}")
        self.tokens = np.asarray(ids[:need], dtype=np.int32).reshape(self.n_chunks, self.context)
        np.save(self.out_dir / "tokens.npy", self.tokens)
        cfg = _engine_config(runner)
        _write_json(self.out_dir / "meta.json", {
            "format": "npz", "corpus": self.corpus, "context": self.context, "n_chunk": self.n_chunks,
            "n_vocab": _runner_vocab(runner), "add_bos": add_bos, "bos_token_id": bos, "top_k": self.top_k,
            "full_chunks": min(self.full_chunks, self.n_chunks), "first": self.first, "n_scored": self.n_scored,
            "num_experts": getattr(cfg, "num_experts", None), "runner_kind": runner.kind})

    def _load_baseline(self) -> None:
        self.base_meta = read_meta(self.ctx.baseline_run, self.name)
        if self.base_meta["format"] == "llama":
            from moebench.tools.llama_perplexity import read_base_file
            self._bf = read_base_file(self.base_dir / "base.kld")
            self.tokens = self._bf.tokens
        else:
            self.tokens = np.load(self.base_dir / "tokens.npy")
        if self.tokens.shape[1] != self.context:
            raise KldError(f"baseline tokens have context {self.tokens.shape[1]}, suite says {self.context}")

    async def evaluate(self, item: Item, runner: Runner) -> dict[str, Any]:
        j = item.data["chunk"]
        if runner.kind == "llama-server":
            return self._llama_record(j)
        if runner.kind != "engine":
            raise RunnerError(f"kld on runner kind {runner.kind!r}: prompt log-probs are not wired up yet")
        ids = [int(t) for t in self.tokens[j]]
        add_bos, bos = _bos(runner)
        if self.base_meta and self.base_meta.get("add_bos") is not None:   # the baseline's choice rules
            add_bos, bos = self.base_meta["add_bos"], self.base_meta["bos_token_id"]
        if add_bos:
            ids[0] = bos                 # as llama-perplexity: the chunk's first token becomes BOS
        logits, routes = await self._forward(runner, ids)
        scored = logits[self.first:self.context - 1].numpy()
        nxt = self.tokens[j][self.first + 1:self.context].astype(np.int64)
        base = {"chunk": j, "prompt_hash": prompt_hash(ids), "n_tokens": int(nxt.size)}
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
    def _baseline_chunk(self, j, scored, nxt, routes, rec) -> dict[str, Any]:
        import torch
        lp = torch.log_softmax(torch.from_numpy(scored).double(), dim=-1)
        k = min(self.top_k, lp.shape[1])
        top_lp, top_ids = torch.topk(lp, k, dim=-1)
        rest = lp.scatter(1, top_ids, float("-inf"))
        tail = torch.logsumexp(rest, dim=-1)
        rows = np.arange(nxt.size)
        next_lp = lp.numpy()[rows, nxt]
        arrays = {"top_ids": top_ids.numpy().astype(_id_dtype(lp.shape[1])),
                  "top_logp": top_lp.numpy().astype(np.float16), "tail_logp": tail.numpy().astype(np.float32),
                  "next_logp": next_lp.astype(np.float32)}
        topk_bytes = sum(a.nbytes for a in arrays.values()) / nxt.size
        if j < self.full_chunks:
            arrays["full_rows"] = ks.encode_logprobs(scored)
        if routes is not None:
            arrays["routes"] = routes.astype(np.uint8 if routes.max() < 256 else np.int16)
        path = chunk_file(self.out_dir / "base", j)
        _save_npz(path, **arrays)
        nll = -next_lp
        return {**rec, "role": "baseline", "file": str(path.relative_to(self.ctx.run_dir)),
                "nll_sum": float(nll.sum()), "ppl_base": float(np.exp(nll.mean())),
                "topk_bytes_per_token": topk_bytes, "has_full": j < self.full_chunks}

    # ---- candidate ------------------------------------------------------------------------------
    def _candidate_chunk(self, j, scored, nxt, routes, rec) -> dict[str, Any]:
        meta = self.base_meta
        extra: dict[str, Any] = {}
        if meta["format"] == "llama":
            ts = ks.full_kld(self._bf.logprobs(j), scored, nxt)
            method = "exact"
            b_routes = None
        else:
            b = np.load(chunk_file(self.base_dir / "base", j))
            topk = ks.topk_kld(b["top_ids"].astype(np.int64), b["top_logp"], b["tail_logp"], scored, nxt, b["next_logp"])
            exact = None
            if "full_rows" in b.files:
                exact = ks.full_kld(ks.decode_logprobs(b["full_rows"], meta["n_vocab"]), scored, nxt)
                extra["kld_exact"] = exact.kld.astype(np.float32)
                extra["kld_topk"] = topk.kld.astype(np.float32)
                for kk in TOPK_LADDER:
                    if kk <= b["top_ids"].shape[1]:
                        extra[f"kld_top{kk}"] = ks.topk_kld(b["top_ids"].astype(np.int64), b["top_logp"], b["tail_logp"],
                                                            scored, nxt, b["next_logp"], k=kk).kld.astype(np.float32)
            all_full = meta.get("full_chunks", 0) >= meta["n_chunk"]
            ts, method = (exact, "exact") if (all_full and exact is not None) else (topk, "topk")
            b_routes = b["routes"] if "routes" in b.files else None
        arrays = {**ts.arrays(), **extra}
        if routes is not None:
            arrays["routes"] = routes.astype(np.uint8 if routes.max() < 256 else np.int16)
        path = chunk_file(self.out_dir / "cand", j)
        _save_npz(path, **arrays)
        out = {**rec, "role": "candidate", "method": method, "file": str(path.relative_to(self.ctx.run_dir)),
               "kld_mean": float(ts.kld.mean()), "same_top_p": float(ts.same_top.mean()),
               "ln_ppl_ratio": float(ts.nll.mean() - ts.nll_base.mean()), "sums": ts.sums()}
        if "kld_exact" in extra:
            out["topk_vs_exact"] = {"exact_mean": float(extra["kld_exact"].mean()),
                                    **{f"top{kk}_mean": float(extra[f"kld_top{kk}"].mean())
                                       for kk in TOPK_LADDER if f"kld_top{kk}" in extra}}
        if routes is not None and b_routes is not None:
            out["router_agreement"] = router_agreement(b_routes, routes)["router_agreement"]
        return out

    # ---- llama-server: llama-perplexity does the forward passes -----------------------------------
    def _prepare_llama(self, runner: Runner) -> None:
        from moebench.tools import llama_perplexity as lp
        model = runner.profile.get("model")
        if not model or not Path(model).is_file():
            raise KldError(f"kld on llama-server: the runner profile's model {model!r} is not a GGUF file")
        threads = self.opts.get("threads")
        log = self.out_dir / "llama-perplexity.log"
        if not self.is_candidate:
            text = read_text(data_file(self.ctx.data_dir, self.corpus))
            corpus = self.out_dir / "corpus.txt"
            corpus.write_text(text, encoding="utf-8")       # LF-normalised copy: what llama.cpp reads
            bf = lp.write_base(model, corpus, self.out_dir / "base.kld", self.context, self.n_chunks, threads, log)
            if bf.n_chunk < self.n_chunks:
                raise KldError(f"{self.corpus}: llama-perplexity produced only {bf.n_chunk} chunks of {self.context}")
            self._bf, self.tokens = bf, bf.tokens
            _write_json(self.out_dir / "meta.json", {
                "format": "llama", "corpus": self.corpus, "context": self.context, "n_chunk": bf.n_chunk,
                "n_vocab": bf.n_vocab, "top_k": None, "full_chunks": bf.n_chunk, "first": self.first,
                "n_scored": self.n_scored, "runner_kind": runner.kind, "base_file": "base.kld",
                "bytes_per_token": bf.bytes_per_token})
            return
        meta = read_meta(self.ctx.baseline_run, self.name)
        base_file = self.base_dir / "base.kld"
        if meta["format"] != "llama":
            base_file = self.out_dir / "baseline-converted.kld"
            export_base_file(self.ctx.baseline_run, self.name, base_file)
        self._llama_stats = lp.kl_divergence(model, base_file, self.context, threads, log)
        _write_json(self.out_dir / "llama_stats.json", self._llama_stats)

    def _llama_record(self, j: int) -> dict[str, Any]:
        if not self.is_candidate:
            lpr = self._bf.logprobs(j)
            nxt = self._bf.tokens[j][self.first + 1:self.context]
            nll = -lpr[np.arange(nxt.size), nxt].astype(np.float64)
            return {"chunk": j, "role": "baseline", "n_tokens": int(nxt.size), "nll_sum": float(nll.sum()),
                    "ppl_base": float(np.exp(nll.mean())), "file": str((self.out_dir / "base.kld").relative_to(self.ctx.run_dir)),
                    "prompt_hash": prompt_hash([int(t) for t in self._bf.tokens[j]])}
        per = (self._llama_stats or {}).get("per_chunk") or []
        if j >= len(per):
            raise KldError(f"llama-perplexity printed no line for chunk {j}")
        return {"chunk": j, "role": "candidate", "method": "llama-perplexity", "n_tokens": self.n_scored,
                "kld_mean": per[j]}

    # ---- run summary ----------------------------------------------------------------------------
    def summarize(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        ok = sorted((r for r in records if r.get("status") == "ok"), key=lambda r: r.get("chunk", 0))
        out: dict[str, Any] = {"n": len(records), "n_scored": 0, "n_correct": 0, "accuracy": None,
                               "n_errors": sum(1 for r in records if r.get("status") == "error"),
                               "role": "candidate" if self.is_candidate else "baseline", "n_chunks": len(ok)}
        if not ok or self.ctx.run_dir is None:
            return out
        if not self.is_candidate:
            n = sum(r["n_tokens"] for r in ok)
            out.update(n_tokens=n, ppl=float(np.exp(sum(r["nll_sum"] for r in ok) / n)))
            if ok[0].get("topk_bytes_per_token") is not None:
                out["topk_bytes_per_token"] = ok[0]["topk_bytes_per_token"]
            return out
        try:
            section = kld_section(self.ctx.run_dir, ok)
        except (OSError, KeyError, ValueError) as e:
            section = {"error": f"{type(e).__name__}: {e}"}
        out["kld"] = {k: v for k, v in section.items() if k not in ("histogram",)}
        return out


# ---- shared by the task's summary and compare -------------------------------------------------------

def load_token_stats(run_dir: Path, records: list[dict[str, Any]]) -> list[ks.TokenStats]:
    return [ks.TokenStats.from_arrays(np.load(Path(run_dir) / r["file"])) for r in records]


def kld_section(cand_dir: Path, cand_records: list[dict[str, Any]]) -> dict[str, Any]:
    """compare.json["kld"] statistics from a candidate run's records and arrays."""
    recs = sorted((r for r in cand_records if r.get("status") == "ok" and r.get("role") == "candidate"),
                  key=lambda r: r["chunk"])
    if not recs:
        return {"n_tokens": 0}
    if recs[0].get("method") == "llama-perplexity":
        stats_path = Path(cand_dir) / "kld" / recs[0].get("task", "kld") / "llama_stats.json"
        stats = json.loads(stats_path.read_text())
        return {"method": "llama-perplexity", "n_tokens": sum(r["n_tokens"] for r in recs),
                **{k: v for k, v in stats.items() if k != "per_chunk_cumulative"}}
    parts = load_token_stats(cand_dir, recs)
    out = ks.summarize(ks.TokenStats.concat(parts), per_chunk=parts)
    out["method"] = recs[0].get("method")
    tve = [r["topk_vs_exact"] for r in recs if r.get("topk_vs_exact")]
    if tve:
        files = [np.load(Path(cand_dir) / r["file"]) for r in recs if r.get("topk_vs_exact")]
        exact = np.concatenate([f["kld_exact"] for f in files]).astype(np.float64)
        table = {"n_tokens": int(exact.size), "exact_mean": float(exact.mean()), "by_k": {}}
        for kk in TOPK_LADDER:
            key = f"kld_top{kk}"
            if all(key in f.files for f in files):
                est = np.concatenate([f[key] for f in files]).astype(np.float64)
                table["by_k"][str(kk)] = {"mean": float(est.mean()), "abs_err": float(est.mean() - exact.mean()),
                                          "rel_err": float((est.mean() - exact.mean()) / exact.mean()) if exact.mean() else None,
                                          "max_token_abs_err": float(np.abs(est - exact).max())}
        out["topk_vs_exact"] = table
    return out


def router_agreement(base_routes: np.ndarray, cand_routes: np.ndarray) -> dict[str, list[float]]:
    """Per layer: mean |A ∩ B| / k of the top-k expert sets, and the share of tokens with identical sets."""
    b, c = np.asarray(base_routes, np.int64), np.asarray(cand_routes, np.int64)
    if b.shape != c.shape:
        raise KldError(f"router traces differ in shape: baseline {b.shape}, candidate {c.shape}")
    k = b.shape[-1]
    inter = (b[..., :, None] == c[..., None, :]).any(-1).sum(-1)      # [L, T]
    return {"router_agreement": [float(x) for x in (inter / k).mean(axis=1)],
            "identical_set_share": [float(x) for x in (inter == k).mean(axis=1)]}


def expert_usage(routes: list[np.ndarray], n_experts: int) -> np.ndarray:
    """[layers, experts] counts of routed (token, slot) pairs."""
    r = np.concatenate([np.asarray(x, np.int64) for x in routes], axis=1)       # [L, T, k]
    return np.stack([np.bincount(r[l].ravel(), minlength=n_experts) for l in range(r.shape[0])])


def load_skew(usage: np.ndarray) -> list[float]:
    """Per layer: share of routed tokens taken by the busiest 25% of experts (0.25 = flat)."""
    out = []
    for row in np.asarray(usage, np.float64):
        top = max(1, int(round(0.25 * row.size)))
        out.append(float(np.sort(row)[::-1][:top].sum() / row.sum()) if row.sum() else 0.0)
    return out


def export_base_file(base_run: Path, name: str, out: Path) -> Path:
    """Write a llama-perplexity base file from an engine baseline that kept full distributions."""
    from moebench.tools.llama_perplexity import BaseFileWriter
    meta = read_meta(base_run, name)
    folder = task_dir(base_run, name)
    if meta.get("full_chunks", 0) < meta["n_chunk"]:
        raise KldError(f"{base_run}: the baseline kept full distributions for {meta.get('full_chunks', 0)} of "
                       f"{meta['n_chunk']} chunks; rerun it with full_chunks >= {meta['n_chunk']} to compare a "
                       "llama.cpp candidate against it")
    tokens = np.load(folder / "tokens.npy")
    w = BaseFileWriter(out, meta["context"], meta["n_vocab"], tokens)
    for j in range(meta["n_chunk"]):
        w.append_chunk(np.load(chunk_file(folder / "base", j))["full_rows"])
    return out


def _runner_vocab(runner: Runner) -> int | None:
    eng = getattr(runner, "engine", None)
    return getattr(eng, "vocab_size", None)


def _engine_config(runner: Runner):
    return getattr(getattr(runner, "engine", None), "config", None)


def _bos(runner: Runner) -> tuple[bool, int | None]:
    """(adds BOS?, BOS id) from the engine's tokenizer (tokenizer_config's add_bos_token)."""
    tok = getattr(getattr(runner, "engine", None), "tokenizer", None)
    if tok is None:
        return False, None
    return bool(getattr(tok, "add_bos", False)), getattr(tok, "bos_token_id", None)


__all__ = ["KldTask", "KldError", "kld_section", "router_agreement", "expert_usage", "load_skew",
           "export_base_file", "read_meta", "task_dir", "CapabilityError"]
