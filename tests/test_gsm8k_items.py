"""GSM8K items carry their prompt hash, taken once from the shared few-shot prefix: it must be the hash
of the whole prompt as `prompt_hash` takes it (compare pairs items by it), and the record must carry it."""
from __future__ import annotations

import asyncio
import hashlib

from moebench.config import COMMON_TASK_SCHEMA, validate
from moebench.datasets import read_jsonl
from moebench.prompts import gsm8k_prompt
from moebench.runners.base import GenerateResult
from moebench.tasks.base import PrefixHash, TaskContext, prompt_hash
from moebench.tasks.gsm8k import Gsm8kTask


def test_prefix_hash_is_the_hash_of_the_whole_text():
    for prefix, tail in [("", ""), ("Question: 1+1?\nAnswer: 2\n\n", "Question: 2+2?\nAnswer:"),
                         ("以下是关于数学的单项选择题\n", "答案：ü ∑ 😀"), ("x" * 5000, "")]:
        whole = prefix + tail
        assert PrefixHash(prefix).of_tail(tail) == prompt_hash(whole)
        assert prompt_hash(whole) == hashlib.sha256(whole.encode("utf-8")).hexdigest()[:16]
    h = PrefixHash("same prefix ")
    assert h.of_tail("a") == prompt_hash("same prefix a") and h.of_tail("b") == prompt_hash("same prefix b")
    assert h.of_tail("a") != h.of_tail("b")           # the prefix's state is copied, never consumed


def test_every_item_holds_its_prompt_and_that_prompts_hash(data_dir):
    opts = validate({"task": "gsm8k", "shots": 5}, {**COMMON_TASK_SCHEMA, **Gsm8kTask.options}, "test")
    items = Gsm8kTask(opts, TaskContext(data_dir=data_dir)).items()
    shots = read_jsonl(data_dir / "gsm8k" / "train.jsonl")[:5]
    rows = read_jsonl(data_dir / "gsm8k" / "test.jsonl")
    assert len(items) == len(rows) == 1319
    for item, row in zip(items, rows):
        prompt = gsm8k_prompt(shots, row["question"])
        assert item.data["prompt"] == prompt
        assert item.data["prompt_hash"] == prompt_hash(prompt)


def test_the_record_carries_the_items_prompt_hash(data_dir):
    opts = validate({"task": "gsm8k", "shots": 2, "limit": 3}, {**COMMON_TASK_SCHEMA, **Gsm8kTask.options}, "test")
    task = Gsm8kTask(opts, TaskContext(data_dir=data_dir))

    class Answers:
        asked: list[str] = []

        async def generate(self, request):
            self.asked.append(request.prompt)
            return GenerateResult(text="so #### 18", output_tokens=4)

    runner = Answers()

    async def go():
        return [(await task.evaluate(item, runner)).to_dict() for item in task.items()]

    recs = asyncio.run(go())
    assert [r["prompt_hash"] for r in recs] == [prompt_hash(p) for p in runner.asked]
    assert len(set(r["prompt_hash"] for r in recs)) == 3 and recs[0]["answer"] == "18"
