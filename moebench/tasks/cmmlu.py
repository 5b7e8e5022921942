"""CMMLU: 5-shot Chinese multiple choice from the dev split, prompts ending in "答案：".

Prompt format as lm-eval's cmmlu task: a subject description, then exemplars
"{Question}\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\n答案： {Answer}" joined by blank lines, then the question.
Scoring, best available first:
1. the runner's choice log-probs (the engine's whole next-token distribution, or llama-server under a
   grammar allowing only the letters: renormalised over them, same ranking);
2. prompt log-probs (a server with `prompt_logprobs`, e.g. vLLM): the exact log-likelihood of each
   continuation " A" ... " D" after the prompt, as lm-eval scores CMMLU, one teacher-forced request each;
3. the next token's top-k log-probs over A/B/C/D (each letter's log-prob is the best of its spellings
   "A" / " A"); a letter outside the top-k is below every returned token, so a known letter still
   wins exactly; when no letter is among the top-k the item ABSTAINS (correct null, `abstained`
   true, counted apart, never a silent wrong answer);
4. generation and the first A-D letter.
All four choice log-probs are recorded.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import PurePosixPath
from typing import TypedDict

from moebench.config import MAX_ITEMS, MAX_NEW_TOKENS, MAX_VOCAB, Field, non_negative, positive
from moebench.datasets import data_file, read_csv_rows, register
from moebench.lmeval.scoring import score_tokens
from moebench.prompts import cmmlu_prefix, cmmlu_question
from moebench.runners.base import Capability, GenerateRequest, Runner, RunnerError
from moebench.scoring.answers import first_choice_letter
from moebench.store.records import ItemRecord
from moebench.tasks.base import Item, Task, TaskOptions, prompt_hash, runner_fields
from moebench.tasks.records import AccuracySummary

LETTERS = ("A", "B", "C", "D")
COLUMNS = ("Question", "A", "B", "C", "D", "Answer")
DEV_SHOTS = 5                 # rows per subject in the dev split: more shots could not be filled


@lru_cache(maxsize=1)
def known_subjects() -> frozenset[str]:
    """The 67 subject names: the stems of cmmlu/test/*.csv in the project's list of mirror files."""
    from moebench.data_fetch import mirror_files
    return frozenset(PurePosixPath(f.path).stem for f in mirror_files()
                     if PurePosixPath(f.path).parent == PurePosixPath("cmmlu/test"))


def _subjects_problem(value: list[str]) -> str | None:
    # A subject becomes a path (cmmlu/test/<subject>.csv): only a known name may, so none can
    # reach outside the mirror ("../x", "/etc/x").
    unknown = [s for s in value if s not in known_subjects()]
    if not unknown:
        return None
    return (f"names {', '.join(map(repr, unknown))}, not a CMMLU subject: expected names such as 'agronomy' "
            "(the stems of cmmlu/test/*.csv listed in moebench/mirror/SHA256SUMS)")


class CmmluOptions(TaskOptions, total=False):
    shots: int
    subjects: list[str]
    per_subject_limit: int
    top_logprobs: int
    scoring: str
    max_tokens: int


class CmmluItem(TypedDict):
    """One question: the whole prompt, the question text, the reference letter, the subject."""

    prompt: str
    question: str
    reference: str
    subject: str


@dataclass(frozen=True)
class CmmluSummary(AccuracySummary):
    """The accuracy figures plus the abstentions (no letter among the top-k log-probs) and the scoring
    methods the ok items used."""

    n_abstained: int
    scoring: list[str]

    @classmethod
    def of(cls, records: list[ItemRecord]) -> CmmluSummary:
        methods = {r.extra.get("scoring") for r in records if r.status == "ok" and r.extra.get("scoring")}
        return cls(*cls.counts(records), n_abstained=sum(1 for r in records if r.extra.get("abstained")),
                   scoring=sorted(methods))


class CmmluTask(Task):
    kind = "cmmlu"
    opts: CmmluOptions
    phase = "score"
    options = {
        "shots": Field(int, default=5, check=non_negative, low=0, high=DEV_SHOTS,
                       doc="dev exemplars before each question (the dev split holds 5 per subject)"),
        "subjects": Field(list, item_type=str, check=_subjects_problem,
                          doc="subject file stems (the mirror's 67 names); default all 67"),
        "per_subject_limit": Field(int, check=positive, low=1, high=MAX_ITEMS,
                                   doc="the first N questions of each subject"),
        "top_logprobs": Field(int, default=100, check=positive, low=1, high=MAX_VOCAB,
                              doc="alternatives asked for the next token"),
        "scoring": Field(str, default="auto", choices=("auto", "logprobs", "generate")),
        "max_tokens": Field(int, default=8, check=positive, low=1, high=MAX_NEW_TOKENS,
                            doc="tokens generated when scoring by generation"),
    }

    def needs(self, runner: Runner) -> set[str]:
        if self.opts["scoring"] == "logprobs":
            return {Capability.GENERATE, Capability.TOP_LOGPROBS}
        return {Capability.GENERATE}

    def _use_logprobs(self, runner: Runner) -> bool:
        mode = self.opts["scoring"]
        return mode == "logprobs" or (mode == "auto" and Capability.TOP_LOGPROBS in runner.capabilities)

    def items(self) -> list[Item[CmmluItem]]:
        root = self.ctx.data_dir
        test_dir = root / "cmmlu" / "test"
        if not test_dir.is_dir():
            data_file(root, "cmmlu/test/agronomy.csv")   # raises the standard missing-data error
        subjects = self.opts.get("subjects") or sorted(p.stem for p in test_dir.glob("*.csv"))
        items = []
        for subject in subjects:
            test_path = data_file(root, f"cmmlu/test/{subject}.csv")
            dev_path = data_file(root, f"cmmlu/dev/{subject}.csv")
            register(self.ctx.data_files, root, test_path)
            register(self.ctx.data_files, root, dev_path)
            dev = read_csv_rows(dev_path, COLUMNS)[: self.opts["shots"]]
            prefix = cmmlu_prefix(subject, dev)
            rows = read_csv_rows(test_path, COLUMNS)
            if self.opts.get("per_subject_limit"):
                rows = rows[: self.opts["per_subject_limit"]]
            for n, row in enumerate(rows):
                ref = row["Answer"].strip()
                if ref not in LETTERS:
                    raise ValueError(f"{test_path}: row {n} has Answer {ref!r}, expected one of A-D")
                items.append(Item(f"cmmlu/{subject}/{n}", CmmluItem(
                    prompt=prefix + cmmlu_question(row), question=row["Question"].strip(), reference=ref,
                    subject=subject)))
        return self._cut(items)

    async def evaluate(self, item: Item[CmmluItem], runner: Runner) -> ItemRecord:
        prompt = item.data["prompt"]
        reference = item.data["reference"]
        common = {"question": item.data["question"], "subject": item.data["subject"],
                  "prompt_hash": prompt_hash(prompt)}
        if self.opts["scoring"] != "generate" and Capability.CHOICE_LOGPROBS in runner.capabilities:
            # Exact ranking of the four letters whatever their rank in the vocabulary (the engine: the
            # whole next-token distribution; llama-server: a grammar over the letters).
            spellings = [v for letter in LETTERS for v in (letter, " " + letter)]
            lps, kind = await runner.choice_logprobs(prompt, spellings)
            choice_lp = {}
            for letter in LETTERS:
                vals = [lps.get(v) for v in (letter, " " + letter) if lps.get(v) is not None]
                choice_lp[letter] = max(vals) if vals else None
            ranked = [(lp, letter) for letter, lp in choice_lp.items() if lp is not None]
            answer = max(ranked)[1] if ranked else None
            return self.record(item, correct=answer == reference, answer=answer, reference=reference,
                               output=answer or "",
                               extra={**common, "scoring": f"choice_logprobs:{kind}", "choice_logprobs": choice_lp})
        if (self.opts["scoring"] != "generate" and Capability.PROMPT_LOGPROBS in runner.capabilities
                and Capability.TOKENIZE in runner.capabilities):
            choice_lp = await continuation_logprobs(runner, prompt)
            answer = max((lp, letter) for letter, lp in choice_lp.items())[1]
            return self.record(item, correct=answer == reference, answer=answer, reference=reference, output=answer,
                               extra={**common, "scoring": "prompt_logprobs", "choice_logprobs": choice_lp})
        if self._use_logprobs(runner):
            result = await runner.generate(GenerateRequest(
                prompt=prompt, max_tokens=1, temperature=0.0, top_logprobs=self.opts["top_logprobs"]))
            if not result.top_logprobs:
                raise RunnerError("the runner returned no top log-probs for the next token")
            choice_lp = choice_logprobs(result.top_logprobs[0])
            ranked = [(lp, letter) for letter, lp in choice_lp.items() if lp is not None]
            if not ranked:                 # unknown is not wrong: abstain, counted apart
                return self.record(item, correct=None, answer=None, reference=reference, output=result.text,
                                   extra={**runner_fields(result), **common, "scoring": "logprobs",
                                          "choice_logprobs": choice_lp, "abstained": True,
                                          "abstain_reason": f"none of A-D among the next token's top "
                                                            f"{self.opts['top_logprobs']} log-probs: "
                                                            "their ranking is unknown"})
            answer = max(ranked)[1]
            return self.record(item, correct=answer == reference, answer=answer, reference=reference,
                               output=result.text,
                               extra={**runner_fields(result), **common, "scoring": "logprobs",
                                      "choice_logprobs": choice_lp})
        result = await runner.generate(GenerateRequest(
            prompt=prompt, max_tokens=self.opts["max_tokens"], temperature=0.0, stop=["\n"]))
        answer = first_choice_letter(result.text)
        return self.record(item, correct=answer == reference, answer=answer, reference=reference, output=result.text,
                           extra={**runner_fields(result), **common, "scoring": "generate", "choice_logprobs": None})


    def summary(self, records: list[ItemRecord]) -> CmmluSummary:
        return CmmluSummary.of(records)


async def continuation_logprobs(runner: Runner, prompt: str) -> dict[str, float]:
    """Log-likelihood of each continuation " A" ... " D" after `prompt` (context and continuation
    tokenized apart, as lm-eval does), from teacher-forced prompt log-probs: exact, whatever the
    letters' rank in the vocabulary."""
    ctx = list(await runner.tokenize(prompt))
    out: dict[str, float] = {}
    for letter in LETTERS:
        cont = list(await runner.tokenize(" " + letter))
        scores = await score_tokens(runner, ctx + cont, top_k=1)
        lps = [scores[len(ctx) + i] for i in range(len(cont))]
        if any(s is None for s in lps):
            raise RunnerError(f"no prompt log-prob for continuation {letter!r}")
        out[letter] = float(sum(s.logprob for s in lps))
    return out


def choice_logprobs(top: dict[str, float]) -> dict[str, float | None]:
    """Each letter's log-prob from one position's top-k (best of its spellings; None if absent)."""
    out: dict[str, float | None] = {}
    for letter in LETTERS:
        values = [lp for tok, lp in top.items() if tok.strip() == letter and lp is not None and not math.isnan(lp)]
        out[letter] = max(values) if values else None
    return out
