"""GSM8K: few-shot "Question: ...\\nAnswer:" prompts, greedy, answers after `####` (docs/design.md section 7).

The prompt format is lm-eval's gsm8k task (doc_to_text "Question: {{question}}\\nAnswer:", target
delimiter " ", few-shot delimiter "\\n\\n"), with the first `shots` train items as exemplars so the
prompt is the same on every machine.
"""
from __future__ import annotations

from pathlib import Path
from typing import TypedDict

from moebench.config import MAX_NEW_TOKENS, Field, non_negative, positive
from moebench.datasets import data_file, read_jsonl, register
from moebench.prompts import gsm8k_fewshot_prefix, gsm8k_question
from moebench.runners.base import Capability, GenerateRequest, Runner
from moebench.scoring.answers import cut_at_stop, extract_gsm8k, gsm8k_reference, numbers_equal
from moebench.store.records import ItemRecord
from moebench.tasks.base import Item, PrefixHash, Task, TaskOptions, runner_fields

DEFAULT_STOP = ["Question:", "</s>", "<|im_end|>"]
# 64 exemplars already make a prompt of about 10k tokens; more only grows every prompt.
MAX_SHOTS = 64


class Gsm8kRow(TypedDict):
    """A line of gsm8k/<split>.jsonl: the question and the worked answer ending in "#### <number>"."""

    question: str
    answer: str


def read_rows(path: Path, first: int | None = None) -> list[Gsm8kRow]:
    """The lines of a gsm8k jsonl file (the `first` ones only, if given), each checked for its
    question and answer."""
    rows = read_jsonl(path)[:first]
    for n, row in enumerate(rows):
        for key in ("question", "answer"):
            if key not in row:
                raise ValueError(f"{path}: line {n + 1} has no {key!r}")
    return [Gsm8kRow(question=row["question"], answer=row["answer"]) for row in rows]


class Gsm8kOptions(TaskOptions, total=False):
    shots: int
    max_tokens: int
    stop: list[str]
    split: str


class Gsm8kItem(TypedDict):
    """What one question is asked with: the whole prompt and its hash, the question, the reference number."""

    prompt: str
    prompt_hash: str
    question: str
    reference: str


class Gsm8kTask(Task):
    kind = "gsm8k"
    opts: Gsm8kOptions
    options = {
        "shots": Field(int, default=5, check=non_negative, low=0, high=MAX_SHOTS,
                       doc="train exemplars before each question (lm-eval: 5 or 8)"),
        "max_tokens": Field(int, default=256, check=positive, low=1, high=MAX_NEW_TOKENS),
        "stop": Field(list, item_type=str, default=lambda: list(DEFAULT_STOP)),
        "split": Field(str, default="test", choices=("test", "train")),
    }

    def needs(self, runner: Runner) -> set[str]:
        return {Capability.GENERATE}

    def items(self) -> list[Item[Gsm8kItem]]:
        root = self.ctx.data_dir
        test_path = data_file(root, f"gsm8k/{self.opts['split']}.jsonl")
        register(self.ctx.data_files, root, test_path)
        rows = read_rows(test_path)
        exemplars: list[Gsm8kRow] = []
        if self.opts["shots"]:
            train_path = data_file(root, "gsm8k/train.jsonl")
            register(self.ctx.data_files, root, train_path)
            exemplars = read_rows(train_path, first=self.opts["shots"])
        # Every prompt is the same few-shot prefix and its own question (moebench.prompts.gsm8k_prompt):
        # the prefix is built and hashed once, and each item's prompt hash is taken here, not per request.
        prefix = gsm8k_fewshot_prefix(exemplars)
        hasher = PrefixHash(prefix)
        items = []
        for n, row in enumerate(rows):
            question = gsm8k_question(row["question"])
            items.append(Item(f"gsm8k/{self.opts['split']}/{n}", Gsm8kItem(
                prompt=prefix + question, prompt_hash=hasher.of_tail(question), question=row["question"],
                reference=gsm8k_reference(row["answer"]))))
        return self._cut(items)

    async def evaluate(self, item: Item[Gsm8kItem], runner: Runner) -> ItemRecord:
        q = item.data
        result = await runner.generate(GenerateRequest(
            prompt=q["prompt"], max_tokens=self.opts["max_tokens"], stop=self.opts["stop"], temperature=0.0))
        text = cut_at_stop(result.text, self.opts["stop"])
        answer, method = extract_gsm8k(text)
        return self.record(item, correct=numbers_equal(answer, q["reference"]), answer=answer,
                           reference=q["reference"], output=result.text,
                           extra={**runner_fields(result), "extraction": method, "question": q["question"],
                                  "prompt_hash": q["prompt_hash"]})
