"""KLD arrays in a run directory: where they live, how to read them, and the statistics
compare.json["kld"] is made of. The KLD task (moebench.kld.task) writes them; compare and the
task's own summary read them through this module, so neither imports the other.

Layout under <run>/kld/<task name>/: meta.json, tokens.npy [n_chunk, c], base/chunk_NNNNN.npz (a
baseline's top-K and, for some chunks, full distributions), cand/chunk_NNNNN.npz (a candidate's
per-token statistics), base.kld (a llama-perplexity baseline), llama_stats.json and
llama_perplexity.json (a llama-perplexity candidate's printed statistics, binary, version and commands).
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moebench.kld import stats as ks
from moebench.datasets import data_file, register
from moebench.store import write_bytes_atomic, write_json_atomic

TOPK_LADDER = (5, 16, 20, 64, 100, 256)   # K values at which the top-K estimate is checked against exact


class KldError(RuntimeError):
    """The baseline and candidate cannot be compared (different tokens, vocabulary, context...)."""


def task_dir(run_dir: Path, name: str) -> Path:
    return Path(run_dir) / "kld" / name


class KldFolders:
    """The role, folders and corpus of a KLD task, shared by both KLD task classes: a run made with
    --baseline is a candidate; its arrays go under <run>/kld/<task>/, the baseline's are read from
    the same place in the baseline run. Mixed into a tasks.base.Task, whose `ctx`, `name` and `corpus`
    it reads."""

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

    def register_corpus(self) -> None:
        """Record the corpus file among the run's data files (its hash goes into the manifest)."""
        register(self.ctx.data_files, self.ctx.data_dir, data_file(self.ctx.data_dir, self.corpus))

    def baseline_meta(self) -> KldMeta:
        """The baseline run's meta.json for this task (a candidate's)."""
        return read_meta(self.ctx.baseline_run, self.name)


def chunk_file(folder: Path, chunk: int) -> Path:
    return folder / f"chunk_{chunk:05d}.npz"


def seq_file(folder: Path, seq: int) -> Path:
    """A sampled KLD item's arrays (method = "sampled")."""
    return folder / f"seq_{seq:05d}.npz"


# meta.json's keys per format, in the order they are written.
META_KEYS = {
    "npz": ("format", "corpus", "context", "n_chunk", "n_vocab", "add_bos", "bos_token_id", "top_k", "full_chunks",
            "first", "n_scored", "num_experts", "runner_kind", "how"),
    "llama": ("format", "corpus", "context", "n_chunk", "n_vocab", "top_k", "full_chunks", "first", "n_scored",
              "runner_kind", "how", "base_file", "bytes_per_token"),
    "sampled": ("format", "method", "corpus", "prompts", "prompt_tokens", "continuations", "tokens", "seed",
                "n_vocab", "add_bos", "bos_token_id", "runner_kind", "sampling"),
}
# Keys a reader indexes for the format; the rest may be absent (None) in a meta.json of an older run.
_META_NEEDED = {"npz": ("context", "n_chunk"), "llama": ("context", "n_chunk"), "sampled": ("method",)}
_META_INTS = ("context", "n_chunk", "n_vocab", "bos_token_id", "top_k", "full_chunks", "first", "n_scored",
              "num_experts", "prompts", "prompt_tokens", "continuations", "tokens", "seed")


@dataclass(frozen=True)
class KldMeta:
    """A KLD baseline's <run>/kld/<task>/meta.json: what a candidate must match (corpus, context,
    vocabulary, BOS, sampled keys) and how the baseline stored its log-probs. `format` is "npz" (the
    task's own arrays), "llama" (a llama-perplexity base file) or "sampled" (method = "sampled");
    a field the format does not write stays None."""

    format: str
    corpus: str | None = None
    n_vocab: int | None = None
    runner_kind: str | None = None
    # teacher-forced ("npz", "llama")
    context: int | None = None
    n_chunk: int | None = None
    top_k: int | None = None
    full_chunks: int = 0
    first: int | None = None
    n_scored: int | None = None
    num_experts: int | None = None
    how: str | None = None
    base_file: str | None = None
    bytes_per_token: float | None = None
    # tokenizing ("npz", "sampled")
    add_bos: bool | None = None
    bos_token_id: int | None = None
    # sampled
    method: str | None = None
    prompts: int | None = None
    prompt_tokens: int | None = None
    continuations: int | None = None
    tokens: int | None = None
    seed: int | None = None
    sampling: str | None = None

    def to_json(self) -> dict[str, Any]:
        """meta.json as the format writes it: its keys, in order."""
        return {k: getattr(self, k) for k in META_KEYS[self.format]}

    @staticmethod
    def from_json(doc: Any, where: str) -> KldMeta:
        """meta.json read back; bad input is refused naming the file (`where`) and the key."""
        if not isinstance(doc, dict):
            raise KldError(f"{where}: not a JSON object")
        fmt = doc.get("format")
        if fmt not in META_KEYS:
            raise KldError(f"{where}: key 'format' is {fmt!r}, expected one of {', '.join(META_KEYS)}")
        for key in _META_NEEDED[fmt]:
            if doc.get(key) is None:
                raise KldError(f"{where}: key {key!r} is missing (format {fmt!r})")
        for key in _META_INTS:
            v = doc.get(key)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
                raise KldError(f"{where}: key {key!r} must be an integer, got {v!r}")
        known = {k: doc[k] for k in META_KEYS[fmt] if k in doc and doc[k] is not None}
        return KldMeta(**known)


def read_meta(run_dir: Path, name: str) -> KldMeta:
    path = task_dir(run_dir, name) / "meta.json"
    if not path.is_file():
        raise KldError(f"{path}: missing; is {run_dir} a KLD baseline run of task {name!r} "
                       "(made without --baseline)?")
    try:
        doc = json.loads(path.read_text())
    except ValueError as e:
        raise KldError(f"{path}: not JSON ({e})") from None
    return KldMeta.from_json(doc, str(path))


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Written atomically, never through a link (moebench.store.write_json_atomic)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, doc)


def save_npz(path: Path, **arrays: Any) -> None:
    """Uncompressed (so bytes per token are what the arrays say), written atomically, never through a link."""
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    write_bytes_atomic(path, buf.getvalue())


def id_dtype(n: int) -> Any:
    return np.uint16 if n <= 65536 else np.int32


def load_token_stats(run_dir: Path, records: list[dict[str, Any]]) -> list[ks.TokenStats]:
    return [ks.TokenStats.from_arrays(np.load(Path(run_dir) / r["file"])) for r in records]


def kld_section(cand_dir: Path, cand_records: list[dict[str, Any]]) -> dict[str, Any]:
    """compare.json["kld"] statistics from a candidate run's records and arrays."""
    recs = sorted((r for r in cand_records if r.get("status") == "ok" and r.get("role") == "candidate"),
                  key=lambda r: r["chunk"])
    if not recs:
        return {"n_tokens": 0}
    folder = task_dir(cand_dir, recs[0].get("task", "kld"))
    if recs[0].get("method") == "llama-perplexity":
        stats = json.loads((folder / "llama_stats.json").read_text())
        out = {"method": "llama-perplexity", "n_tokens": sum(r["n_tokens"] for r in recs),
               **{k: v for k, v in stats.items() if k != "per_chunk_cumulative"}}
        tool = folder / "llama_perplexity.json"
        if tool.is_file():               # the candidate's own binary, version and command lines
            out["llama_perplexity"] = json.loads(tool.read_text())
        return out
    parts = load_token_stats(cand_dir, recs)
    out = ks.summarize(ks.TokenStats.concat(parts), per_chunk=parts)
    methods = sorted({r.get("method") for r in recs})
    out["method"] = methods[0] if len(methods) == 1 else "mixed: " + ", ".join(map(str, methods))
    if recs[0].get("estimate"):
        est = dict(recs[0]["estimate"])
        est["lower_bound"] = any(r.get("estimate", {}).get("lower_bound") for r in recs)
        est["note"] = ("exact: both sides gave whole distributions" if not est["lower_bound"] else
                       f"top-{est['k']} prompt log-probs: a lower bound of the full KLD (the vocabulary beyond "
                       "the known tokens is lumped into one bin); same top p and delta-p are exact")
        out["estimate"] = est
    tve = [r["topk_vs_exact"] for r in recs if r.get("topk_vs_exact")]
    if tve:
        files = [np.load(Path(cand_dir) / r["file"]) for r in recs if r.get("topk_vs_exact")]
        exact = np.concatenate([f["kld_exact"] for f in files]).astype(np.float64)
        table = {"n_tokens": int(exact.size), "exact_mean": float(exact.mean()), "by_k": {}}
        ladder = list(TOPK_LADDER)
        k_req = recs[0].get("estimate", {}).get("k")
        if k_req and k_req not in ladder:
            ladder.append(k_req)
        for kk in ladder:
            key = f"kld_top{kk}"
            if not all(key in f.files for f in files) and kk == k_req and all("kld_topk" in f.files for f in files):
                key = "kld_topk"           # a prompt-logprobs candidate: its own top-K bound
            if all(key in f.files for f in files):
                est = np.concatenate([f[key] for f in files]).astype(np.float64)
                table["by_k"][str(kk)] = {"mean": float(est.mean()), "abs_err": float(est.mean() - exact.mean()),
                                          "rel_err": float((est.mean() - exact.mean()) / exact.mean()) if exact.mean() else None,
                                          "max_token_abs_err": float(np.abs(est - exact).max())}
        out["topk_vs_exact"] = table
    return out


def sampled_section(cand_dir: Path, cand_records: list[dict[str, Any]]) -> dict[str, Any]:
    """compare.json["kld"] of a sampled KLD (method = "sampled"): the estimate, its interval and counts."""
    from moebench.kld import sampled_stats as sk
    recs = sorted((r for r in cand_records if r.get("status") == "ok" and r.get("role") == "candidate"
                   and r.get("method") == "sampled"), key=lambda r: (r["prompt"], r["cont"]))
    if not recs:
        return {"method": "sampled", "n_tokens": 0}
    seqs = []
    for r in recs:
        d = np.load(Path(cand_dir) / r["file"])
        seqs.append((d["logp"], d["logq"]))
    out = sk.estimate(seqs, estimator=recs[0].get("estimator", "low-variance"))
    out["n_prompts"] = len({r["prompt"] for r in recs})
    out["note"] = (f"sampled: mean {out['estimator']} estimate of KL(baseline || candidate) per token over "
                   f"{out['n_sequences']} continuations sampled from the baseline (temperature 1, no truncation), "
                   f"{out['confidence']:.0%} bootstrap interval over sequences; unbiased, but on the baseline's "
                   "own generated contexts, not the teacher-forced corpus text, so it measures other contexts "
                   "than a teacher-forced KLD")
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
