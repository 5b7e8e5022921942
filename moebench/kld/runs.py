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
from typing import Any, Callable, TypeVar

import numpy as np

from moebench.json_types import JsonObject, JsonValue
from moebench.kld import stats as ks
from moebench.kld.chunk_records import KldItem
from moebench.kld.perplexity_tool import PrintedKld
from moebench.kld.sections import (EstimateNote, ForcedSection, KldSection, LlamaSection, SampledSection, TopkError,
                                   TopkVsExact)
from moebench.datasets import data_file, register
from moebench.store import write_bytes_atomic, write_json_atomic

S = TypeVar("S")
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

    def to_json(self) -> JsonObject:
        """meta.json as the format writes it: its keys, in order."""
        return {k: getattr(self, k) for k in META_KEYS[self.format]}

    @staticmethod
    def from_json(doc: JsonValue, where: str) -> KldMeta:
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


def write_json(path: Path, doc: JsonObject) -> None:
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


def load_token_stats(run_dir: Path, records: list[KldItem]) -> list[ks.TokenStats]:
    return [ks.TokenStats.from_arrays(np.load(Path(run_dir) / _file_of(r))) for r in records]


def _file_of(r: KldItem) -> str:
    if r.file is None:
        raise KldError(f"KLD record {r.item_id!r}: key 'file' is missing (where its arrays are)")
    return r.file


def kld_section(cand_dir: Path, cand_records: list[KldItem]) -> KldSection:
    """compare.json["kld"] statistics from a candidate run's records and arrays."""
    recs = sorted((r for r in cand_records if r.is_ok_candidate), key=lambda r: r.chunk or 0)
    if not recs:
        return ForcedSection(ks.KldSummary(n_tokens=0))
    folder = task_dir(cand_dir, recs[0].task)
    if recs[0].method == "llama-perplexity":
        tool = folder / "llama_perplexity.json"
        return LlamaSection(n_tokens=sum(r.n_tokens or 0 for r in recs),
                            printed=PrintedKld.from_json(_json_object(folder / "llama_stats.json"),
                                                         str(folder / "llama_stats.json")),
                            # the candidate's own binary, version and command lines
                            tool=_json_object(tool) if tool.is_file() else None)
    parts = load_token_stats(cand_dir, recs)
    summary = ks.summarize(ks.TokenStats.concat(parts), per_chunk=parts)
    methods = sorted({str(r.method) for r in recs})
    method = methods[0] if len(methods) == 1 else "mixed: " + ", ".join(methods)
    first = recs[0].estimate
    estimate = (EstimateNote.of(first, any(r.estimate is not None and r.estimate.lower_bound for r in recs))
                if first is not None else None)
    checked = [r for r in recs if r.has_topk_vs_exact]
    table = _topk_vs_exact(cand_dir, checked, first.k if first is not None else None) if checked else None
    return ForcedSection(summary, method, estimate, table)


def _topk_vs_exact(cand_dir: Path, recs: list[KldItem], k_req: int | None) -> TopkVsExact:
    """The top-K estimates at each ladder K (and the K the candidate asked for) against the exact KLD."""
    files = [np.load(Path(cand_dir) / _file_of(r)) for r in recs]
    exact = np.concatenate([f["kld_exact"] for f in files]).astype(np.float64)
    by_k: dict[str, TopkError] = {}
    ladder = list(TOPK_LADDER)
    if k_req and k_req not in ladder:
        ladder.append(k_req)
    for kk in ladder:
        key = f"kld_top{kk}"
        if not all(key in f.files for f in files) and kk == k_req and all("kld_topk" in f.files for f in files):
            key = "kld_topk"           # a prompt-logprobs candidate: its own top-K bound
        if all(key in f.files for f in files):
            est = np.concatenate([f[key] for f in files]).astype(np.float64)
            by_k[str(kk)] = TopkError(mean=float(est.mean()), abs_err=float(est.mean() - exact.mean()),
                                      rel_err=float((est.mean() - exact.mean()) / exact.mean()) if exact.mean() else None,
                                      max_token_abs_err=float(np.abs(est - exact).max()))
    return TopkVsExact(n_tokens=int(exact.size), exact_mean=float(exact.mean()), by_k=by_k)


def _json_object(path: Path) -> JsonObject:
    """A JSON object file this wing wrote, read back whole."""
    doc = json.loads(path.read_text())
    if not isinstance(doc, dict):
        raise KldError(f"{path}: not a JSON object")
    return doc


def sampled_section(cand_dir: Path, cand_records: list[KldItem]) -> SampledSection:
    """compare.json["kld"] of a sampled KLD (method = "sampled"): the estimate, its interval and counts."""
    from moebench.kld import sampled_stats as sk
    recs = sorted((r for r in cand_records if r.is_ok_candidate and r.method == "sampled"),
                  key=lambda r: (r.prompt or 0, r.cont or 0))
    if not recs:
        return SampledSection(None)
    seqs = []
    for r in recs:
        d = np.load(Path(cand_dir) / _file_of(r))
        seqs.append((d["logp"], d["logq"]))
    return SampledSection(sk.estimate(seqs, estimator=recs[0].estimator or "low-variance"),
                          n_prompts=len({r.prompt for r in recs}))


def section_or_error(build: Callable[[], S]) -> S | str:
    """A run summary's KLD section, or what stopped it (`Type: message`): the summary is written even
    when the arrays cannot be read back."""
    try:
        return build()
    except (OSError, KeyError, ValueError, KldError) as e:
        return f"{type(e).__name__}: {e}"


def router_agreement(base_routes: np.ndarray, cand_routes: np.ndarray) -> tuple[list[float], list[float]]:
    """Per layer: (mean |A ∩ B| / k of the top-k expert sets, the share of tokens with identical sets)."""
    b, c = np.asarray(base_routes, np.int64), np.asarray(cand_routes, np.int64)
    if b.shape != c.shape:
        raise KldError(f"router traces differ in shape: baseline {b.shape}, candidate {c.shape}")
    k = b.shape[-1]
    inter = (b[..., :, None] == c[..., None, :]).any(-1).sum(-1)      # [L, T]
    return [float(x) for x in (inter / k).mean(axis=1)], [float(x) for x in (inter == k).mean(axis=1)]


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
