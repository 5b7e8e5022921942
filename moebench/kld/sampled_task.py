"""KLD `method = "sampled"`: KL(baseline || candidate) estimated on the baseline's own samples, from one
log-prob per token on each side (moebench.kld.sampled_stats has the estimators and the interval).

Prompts: `prompts` windows of `prompt_tokens` tokens spread evenly over the corpus (BOS in front where
the model adds it). Items: `kld/<corpus stem>/p<prompt>/c<continuation>`, `continuations` per prompt,
each seeded with `seed + prompt * continuations + continuation` (reproducible whatever the order or
concurrency, where the server honours `seed`).

- BASELINE run (no --baseline): `runner.sampled_logprobs` samples `tokens` tokens per continuation
  (temperature 1, no truncation, EOS ignored) with each sampled token's log p. Written under
  <run>/kld/<task>/: meta.json, prompts.npy [prompts, prompt_tokens (+1 with BOS)], and per item
  base/seq_NNNNN.npz: `ids` (int32, the sampled ids) and `logp` (float32).
- CANDIDATE run (--baseline BASE): scores prompt + the baseline's sampled ids, log q of each sampled
  token: from full logits (the engine) or a server's prompt log-probs (K = 1: the actual token always
  comes back); the prompt log-prob parsers check every position's token id against the ids sent (a
  mismatch is an error naming the position). Per item cand/seq_NNNNN.npz: `logp`, `logq`.
"""
from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moebench.datasets import KLD_DEFAULT_CORPUS, data_file, read_text
from moebench.json_types import JsonObject
from moebench.kld import sampled_stats as sk
from moebench.kld.chunk_records import read_items
from moebench.kld.runs import (KldError, KldFolders, KldMeta, sampled_section, save_npz, section_or_error, seq_file,
                               write_json)
from moebench.kld.sections import SampledSection
from moebench.runners.base import Capability, Runner, RunnerError
from moebench.store.records import ItemRecord
from moebench.store import write_bytes_atomic
from moebench.tasks.base import Item, Task, prompt_hash

# Suite keys of this method, with their defaults (KldTask.options holds the schema).
DEFAULTS = {"prompts": 16, "prompt_tokens": 32, "continuations": 2, "tokens": 32, "seed": 0,
            "estimator": "low-variance"}
# Keys both sides must agree on: they decide which tokens exist.
SAME_KEYS = ("corpus", "prompts", "prompt_tokens", "continuations", "tokens", "seed")


@dataclass(frozen=True)
class SampledItem:
    """What both sides' items.jsonl records of one sampled continuation hold: which one (prompt, cont,
    seed), its sampled tokens' count and hash, and its arrays (`file`, relative to the run directory)."""

    prompt: int
    cont: int
    seed: int
    n_tokens: int
    prompt_hash: str
    file: str


@dataclass(frozen=True)
class SampledBaseline(SampledItem):
    """A baseline's record: the sampled tokens and their log p are in `file`."""

    nll_sum: float

    def to_json(self) -> JsonObject:
        return {"prompt": self.prompt, "cont": self.cont, "seed": self.seed, "role": "baseline",
                "n_tokens": self.n_tokens, "prompt_hash": self.prompt_hash, "nll_sum": self.nll_sum,
                "file": self.file}


@dataclass(frozen=True)
class SampledCandidate(SampledItem):
    """A candidate's record: its KLD estimate over the continuation (log p, log q in `file`)."""

    estimator: str
    kld_sum: float
    kld_mean: float

    def to_json(self) -> JsonObject:
        return {"prompt": self.prompt, "cont": self.cont, "seed": self.seed, "role": "candidate",
                "method": "sampled", "estimator": self.estimator, "n_tokens": self.n_tokens,
                "prompt_hash": self.prompt_hash, "file": self.file, "kld_sum": self.kld_sum,
                "kld_mean": self.kld_mean}


class SampledKldTask(KldFolders, Task):
    kind = "kld"
    phase = "score"

    def __init__(self, opts: JsonObject, ctx):
        """`opts`: the suite's task table as read, checked against KldTask.options by the suite loader."""
        super().__init__(opts, ctx)
        self.conf = {k: opts.get(k) if opts.get(k) is not None else v for k, v in DEFAULTS.items()}
        self.conf["corpus"] = opts.get("corpus", KLD_DEFAULT_CORPUS)
        self.corpus: str = self.conf["corpus"]
        self.n_prompts, self.n_cont = int(self.conf["prompts"]), int(self.conf["continuations"])
        self.n_tokens, self.seed = int(self.conf["tokens"]), int(self.conf["seed"])
        self.prompt_ids: np.ndarray | None = None
        self.base_meta: KldMeta | None = None

    def needs(self, runner: Runner) -> set[str]:
        if not self.is_candidate:
            return {Capability.SAMPLED_LOGPROBS, Capability.TOKENIZE}
        if Capability.FULL_LOGITS in runner.capabilities:
            return {Capability.FULL_LOGITS}
        return {Capability.PROMPT_LOGPROBS}

    def items(self) -> list[Item]:
        self.register_corpus()
        n_prompts = self.n_prompts
        if self.is_candidate:
            meta = self.baseline_meta()
            if meta.method != "sampled":
                raise KldError(f"baseline {self.ctx.baseline_run} task {self.name!r} is a teacher-forced KLD "
                               "baseline; method = \"sampled\" needs a baseline run of a sampled suite")
            for key in SAME_KEYS:
                if getattr(meta, key) != self.conf[key]:
                    raise KldError(f"baseline {self.ctx.baseline_run} used {key} = {getattr(meta, key)!r}, this suite "
                                   f"{self.conf[key]!r}: the sampled tokens would differ")
        stem = Path(self.corpus).stem
        items = [Item(f"kld/{stem}/p{j}/c{c}", {"prompt": j, "cont": c, "seq": j * self.n_cont + c,
                                                "seed": self.seed + j * self.n_cont + c})
                 for j in range(n_prompts) for c in range(self.n_cont)]
        return self._cut(items)

    async def prepare(self, runner: Runner) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if self.is_candidate:
            self.base_meta = self.baseline_meta()
            vocab = runner.vocab_size()
            if vocab is not None and self.base_meta.n_vocab not in (None, vocab):
                raise KldError(f"vocabularies differ: baseline {self.ctx.baseline_run} has "
                               f"{self.base_meta.n_vocab} tokens, this runner's model {vocab}")
            self.prompt_ids = np.load(self.base_dir / "prompts.npy")
            return
        text = read_text(data_file(self.ctx.data_dir, self.corpus))
        ids = await runner.tokenize(text)
        width = int(self.conf["prompt_tokens"])
        if len(ids) < self.n_prompts * width:
            raise KldError(f"{self.corpus}: {len(ids)} tokens, need {self.n_prompts * width} for {self.n_prompts} "
                           f"prompts of {width}")
        stride = len(ids) // self.n_prompts                 # prompts spread over the corpus
        prompts = np.asarray([ids[j * stride:j * stride + width] for j in range(self.n_prompts)], dtype=np.int32)
        add_bos, bos = runner.bos_policy()
        if add_bos:
            prompts = np.concatenate([np.full((self.n_prompts, 1), bos, np.int32), prompts], axis=1)
        self.prompt_ids = prompts
        buf = io.BytesIO()
        np.save(buf, prompts)
        write_bytes_atomic(self.out_dir / "prompts.npy", buf.getvalue())
        write_json(self.out_dir / "meta.json", KldMeta(
            format="sampled", method="sampled", **{k: self.conf[k] for k in SAME_KEYS},
            n_vocab=runner.vocab_size(), add_bos=add_bos, bos_token_id=bos, runner_kind=runner.kind,
            sampling="temperature 1, no top-p/top-k/min-p truncation, no penalties, EOS ignored").to_json())

    async def evaluate(self, item: Item, runner: Runner) -> ItemRecord:
        return ItemRecord.from_fields(self.name, item.item_id, (await self._sample(item, runner)).to_json())

    async def _sample(self, item: Item, runner: Runner) -> SampledBaseline | SampledCandidate:
        prompt = [int(t) for t in self.prompt_ids[item.data["prompt"]]]
        seq = item.data["seq"]
        if not self.is_candidate:
            ids, logp = await runner.sampled_logprobs(prompt, self.n_tokens, item.data["seed"])
            vocab = runner.vocab_size()
            bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
            if bad:
                raise RunnerError(f"{item.item_id}: sampled token id {bad[0]} is outside the vocabulary of {vocab}")
            path = seq_file(self.out_dir / "base", seq)
            save_npz(path, ids=np.asarray(ids, np.int32), logp=np.asarray(logp, np.float32))
            return SampledBaseline(item.data["prompt"], item.data["cont"], item.data["seed"], len(ids),
                                   prompt_hash(prompt + list(ids)), str(path.relative_to(self.ctx.run_dir)),
                                   nll_sum=float(-np.sum(logp)))
        base_file = seq_file(self.base_dir / "base", seq)
        if not base_file.is_file():
            raise KldError(f"{item.item_id}: the baseline run {self.ctx.baseline_run} has no sample for it "
                           f"({base_file.name} missing: the item errored there)")
        base = np.load(base_file)
        sample = [int(t) for t in base["ids"]]
        logq = await self._score(runner, prompt, sample, item.item_id)
        logp = base["logp"].astype(np.float64)
        path = seq_file(self.out_dir / "cand", seq)
        save_npz(path, logp=logp.astype(np.float32), logq=logq.astype(np.float32))
        est = self.conf["estimator"]
        per_token = sk.per_token(logp, logq, est)
        return SampledCandidate(item.data["prompt"], item.data["cont"], item.data["seed"], len(sample),
                                prompt_hash(prompt + sample), str(path.relative_to(self.ctx.run_dir)),
                                estimator=est, kld_sum=float(per_token.sum()),
                                kld_mean=float(per_token.mean()))

    async def _score(self, runner: Runner, prompt: list[int], sample: list[int], where: str) -> np.ndarray:
        """log q of each sampled token, given the prompt and the tokens before it."""
        ids = prompt + sample
        first = len(prompt)
        if Capability.FULL_LOGITS in runner.capabilities:
            import torch
            logits = await runner.logits(ids)
            lq = torch.log_softmax(logits[first - 1:len(ids) - 1].double(), dim=-1)
            return lq[torch.arange(len(sample)), torch.tensor(sample)].numpy()
        rows = await runner.prompt_logprobs(ids, 1)
        if len(rows) != len(ids):
            raise RunnerError(f"{where}: prompt log-probs for {len(rows)} positions, sent {len(ids)} tokens")
        out = np.empty(len(sample))
        for i in range(len(sample)):
            row = rows[first + i]
            if row is None:
                raise RunnerError(f"{where}: no log-prob at position {first + i}")
            out[i] = float(row[0])
        return out

    def summarize(self, records: list[JsonObject]) -> JsonObject:
        """The manifest's summary of this task from its items.jsonl records."""
        items = read_items(records, f"items.jsonl of task {self.name!r}")
        ok = [r for r in items if r.status == "ok"]
        out = SampledRunSummary(n=len(items), n_errors=sum(1 for r in items if r.status == "error"),
                                role="candidate" if self.is_candidate else "baseline", n_sequences=len(ok))
        if not ok or self.ctx.run_dir is None:
            return out.to_json()
        n = sum(r.n_tokens or 0 for r in ok)
        if not self.is_candidate:
            out.n_tokens = n
            out.nll_base = sum(r.nll_sum or 0.0 for r in ok) / n if n else None
            return out.to_json()
        run_dir = self.ctx.run_dir
        out.kld = section_or_error(lambda: sampled_section(run_dir, ok))
        return out.to_json()


@dataclass
class SampledRunSummary:
    """A sampled KLD task's summary in manifest.json: counts, the role, a baseline's tokens and mean
    NLL, a candidate's estimate or what stopped it (`kld` a message)."""

    n: int
    n_errors: int
    role: str
    n_sequences: int
    n_tokens: int | None = None               # a baseline's
    nll_base: float | None = None
    kld: SampledSection | str | None = None   # a candidate's

    def to_json(self) -> JsonObject:
        out: JsonObject = {"n": self.n, "n_scored": 0, "n_correct": 0, "accuracy": None, "method": "sampled",
                           "n_errors": self.n_errors, "role": self.role, "n_sequences": self.n_sequences}
        if self.n_tokens is not None:
            out.update(n_tokens=self.n_tokens, nll_base=self.nll_base)
        if isinstance(self.kld, str):
            out["kld"] = {"error": self.kld}
        elif self.kld is not None:
            out["kld"] = self.kld.to_json()
        return out
