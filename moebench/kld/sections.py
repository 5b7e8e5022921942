"""compare.json["kld"]'s parts as classes: what kld/runs.py builds from a candidate run's arrays and
kld/compare.py puts together with the MoE signals. Each `to_json` gives the JSON object docs/schema.md
describes, keys in the order compare.json holds them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from moebench.json_types import JsonObject
from moebench.kld.chunk_records import KldEstimate
from moebench.kld.perplexity_tool import PrintedKld
from moebench.kld.sampled_stats import SampledEstimate
from moebench.kld.stats import KldSummary


@dataclass(frozen=True)
class EstimateNote:
    """How the candidate's KLD was estimated (its first chunk's estimate), lower bound if any chunk's is."""

    estimate: KldEstimate

    @property
    def note(self) -> str:
        if not self.estimate.lower_bound:
            return "exact: both sides gave whole distributions"
        return (f"top-{self.estimate.k} prompt log-probs: a lower bound of the full KLD (the vocabulary beyond "
                "the known tokens is lumped into one bin); same top p and delta-p are exact")

    def to_json(self) -> JsonObject:
        return {**self.estimate.to_json(), "note": self.note}

    @staticmethod
    def of(first: KldEstimate, any_lower_bound: bool) -> EstimateNote:
        return EstimateNote(replace(first, lower_bound=any_lower_bound))


@dataclass(frozen=True)
class TopkError:
    """The top-K estimate at one K against the exact KLD over the same tokens."""

    mean: float
    abs_err: float
    rel_err: float | None           # None where the exact mean is 0
    max_token_abs_err: float

    def to_json(self) -> JsonObject:
        return {"mean": self.mean, "abs_err": self.abs_err, "rel_err": self.rel_err,
                "max_token_abs_err": self.max_token_abs_err}


@dataclass(frozen=True)
class TopkVsExact:
    """The top-K estimate checked against the exact KLD, per K (str(K) -> TopkError), over `n_tokens`."""

    n_tokens: int
    exact_mean: float
    by_k: dict[str, TopkError]

    def to_json(self) -> JsonObject:
        return {"n_tokens": self.n_tokens, "exact_mean": self.exact_mean,
                "by_k": {k: v.to_json() for k, v in self.by_k.items()}}


@dataclass(frozen=True)
class ForcedSection:
    """A teacher-forced candidate's KLD statistics from its per-token arrays; `method` is None only
    where no candidate chunk was scored (then the section is just n_tokens = 0)."""

    summary: KldSummary
    method: str | None = None
    estimate: EstimateNote | None = None
    topk_vs_exact: TopkVsExact | None = None

    def to_json(self) -> JsonObject:
        out = self.summary.to_json()
        if self.method is None:
            return out
        out["method"] = self.method
        if self.estimate is not None:
            out["estimate"] = self.estimate.to_json()
        if self.topk_vs_exact is not None:
            out["topk_vs_exact"] = self.topk_vs_exact.to_json()
        return out


@dataclass(frozen=True)
class LlamaSection:
    """A llama-perplexity candidate's figures: the statistics it printed (llama_stats.json read back)
    and the build that measured (llama_perplexity.json: binary, version, flags, command lines; written
    from the runner's PerplexityPlan, passed through as read)."""

    n_tokens: int
    printed: PrintedKld
    tool: JsonObject | None = None

    def to_json(self) -> JsonObject:
        out: JsonObject = {"method": "llama-perplexity", "n_tokens": self.n_tokens,
                           **{k: v for k, v in self.printed.to_json().items() if k != "per_chunk_cumulative"}}
        if self.tool is not None:
            out["llama_perplexity"] = self.tool
        return out


@dataclass(frozen=True)
class SampledSection:
    """A sampled KLD candidate's estimate over `n_prompts` prompts, with the note on what it measures;
    `estimate` is None where no continuation was scored."""

    estimate: SampledEstimate | None
    n_prompts: int = 0

    @property
    def note(self) -> str:
        e = self.estimate
        assert e is not None
        return (f"sampled: mean {e.estimator} estimate of KL(baseline || candidate) per token over "
                f"{e.n_sequences} continuations sampled from the baseline (temperature 1, no truncation), "
                f"{e.confidence:.0%} bootstrap interval over sequences; unbiased, but on the baseline's "
                "own generated contexts, not the teacher-forced corpus text, so it measures other contexts "
                "than a teacher-forced KLD")

    def to_json(self) -> JsonObject:
        if self.estimate is None:
            return {"method": "sampled", "n_tokens": 0}
        return {**self.estimate.to_json(), "n_prompts": self.n_prompts, "note": self.note}


KldSection = ForcedSection | LlamaSection
