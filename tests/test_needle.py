"""Needle task: placement, token counts with a real byte-level BPE tokenizer, scoring, compare."""
from __future__ import annotations

import asyncio
import re

import pytest

from conftest import haystack_bpe
from moebench.config import ProfileError, validate, COMMON_TASK_SCHEMA
from moebench.datasets import data_dir
from moebench.runners.base import Capability, GenerateRequest, GenerateResult, Runner
from moebench.store.records import ItemRecord
from moebench.tasks.base import TaskContext
from moebench.compare.needle import needle_compare
from moebench.tasks.needle import (HAYSTACK_FILE, NEEDLE_TEMPLATE, NeedleError, NeedleTask, QUESTION,
                                   build_index, build_needle_prompt, load_haystack, needle_code,
                                   score_answer)

DATA = data_dir()
HAYSTACK = DATA / HAYSTACK_FILE
pytestmark = pytest.mark.skipif(not HAYSTACK.is_file(), reason=f"{HAYSTACK} not in the data mirror")


TOK = haystack_bpe(400000, prefer_zoo=True)


class ReaderRunner(Runner):
    """Tokenizes with the real tokenizer; 'answers' by reading the code out of the prompt.

    `blind_beyond` makes it miss needles placed past that token position (a model that loses
    long context), so scoring sees both outcomes.
    """

    kind = "test-reader"
    capabilities = frozenset({Capability.GENERATE, Capability.TOKENIZE})

    def __init__(self, blind_beyond: int | None = None):
        super().__init__({})
        self.blind_beyond = blind_beyond
        self.tokenize_calls = 0

    async def tokenize(self, text: str) -> list[int]:
        self.tokenize_calls += 1
        return TOK.encode(text).ids

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        m = re.search(r"secret access code is ([A-Z0-9]{10})\.", request.prompt)
        assert m, "prompt lacks the needle"
        pos = len(TOK.encode(request.prompt[: m.start()]).ids)
        text = " WRONGCODE1" if self.blind_beyond is not None and pos > self.blind_beyond else f" {m.group(1)}"
        return GenerateResult(text=text, prompt_tokens=len(TOK.encode(request.prompt).ids), output_tokens=3)


def _task(**opts) -> NeedleTask:
    return NeedleTask(validate({"task": "needle", **opts}, {**COMMON_TASK_SCHEMA, **NeedleTask.options},
                               "test suite"), TaskContext(data_dir=DATA))


def test_codes_are_fixed_by_seed_and_cell_and_ids_follow_contract():
    task = _task(lengths=[4096, 131072], depths=[0.0, 0.45, 1.0], seed=7)
    ids = [it.item_id for it in task.items()]
    assert ids == ["needle/4096/0", "needle/4096/0.45", "needle/4096/1",
                   "needle/131072/0", "needle/131072/0.45", "needle/131072/1"]
    codes = [it.data["code"] for it in task.items()]
    assert len(set(codes)) == 6 and all(re.fullmatch(r"[A-Z0-9]{10}", c) for c in codes)
    assert needle_code(7, 131072, 0.45) == codes[4]          # same cell, same code, any grid
    assert needle_code(8, 131072, 0.45) != codes[4]
    default = _task()
    assert len(default.items()) == 5 * 12                     # 0.9 listed once
    assert "needle/173000/0.45" in {it.item_id for it in default.items()}


def test_bad_options_name_the_key():
    with pytest.raises(ProfileError, match="'depths'.*between 0 and 1"):
        _task(depths=[0.5, 1.5])
    with pytest.raises(ProfileError, match="'lengths'"):
        _task(lengths=[4096, -1])


def test_haystack_skips_gutenberg_header_and_contents():
    text = load_haystack(HAYSTACK)
    assert text.startswith("“Well, Prince, so Genoa and Lucca")
    assert "PROJECT GUTENBERG" not in text.upper()[:10000] and "*** END OF" not in text


@pytest.mark.parametrize("target", [1000, 8192])
def test_placement_and_length_with_real_tokenizer(target):
    runner = ReaderRunner()
    text = load_haystack(HAYSTACK)

    async def go():
        index = await build_index(runner, text, int(target * 1.05) + 1024)
        out = []
        for depth in (0.0, 0.1, 0.45, 0.9, 1.0):
            code = needle_code(1, target, depth)
            out.append((depth, code, await build_needle_prompt(runner.tokenize, index, target, depth, code)))
        return out

    for depth, code, built in asyncio.run(go()):
        ids = TOK.encode(built.prompt).ids
        assert built.prompt_tokens == len(ids)
        assert abs(len(ids) - target) <= 0.005 * target, (depth, len(ids))
        # the needle's first token sits exactly at the recorded position
        pos = built.needle_token_position
        assert built.needle_position_exact
        assert TOK.decode(ids[pos:pos + 12]).startswith(NEEDLE_TEMPLATE.format(code=code)[:20]), depth
        assert "secret access code is" not in TOK.decode(ids[:pos])
        # depth lands near the requested share of the haystack, at a sentence boundary
        assert abs(pos / len(ids) - depth) < 0.06 + 80 / target, (depth, pos / len(ids))
        before = built.prompt[: built.prompt.index(" The secret access code")]
        assert before.endswith("Passage:") or re.search(r"[.!?][\"'”’)\]]*$", before) or depth == 1.0
        assert code not in built.prompt[built.prompt.index(QUESTION):]      # the question never holds it
        assert built.prompt.count(code) == 1


def test_evaluate_records_and_scoring_end_to_end():
    task = _task(lengths=[2048, 4096], depths=[0.0, 0.5, 1.0], seed=3)
    runner = ReaderRunner(blind_beyond=3000)

    async def go():
        await task.prepare(runner)
        return [{"task": "needle", "item_id": it.item_id, "status": "ok", **(await task.evaluate(it, runner)).to_dict()}
                for it in task.items()]

    records = asyncio.run(go())
    assert HAYSTACK_FILE in task.ctx.data_files and len(task.ctx.data_files[HAYSTACK_FILE]) == 64
    for r in records:
        assert abs(r["prompt_tokens"] - r["length"]) <= 0.005 * r["length"]
        assert r["reference"] == needle_code(3, r["length"], r["depth"])
        assert r["correct"] == (r["needle_token_position"] <= 3000), r["item_id"]
        assert r["answer"] == (r["reference"] if r["correct"] else "WRONGCODE1")
    summary = task.summarize(records)
    assert summary["by_length"]["2048"]["found"] == 3 and summary["by_length"]["4096"]["found"] < 3

    cand = [{**r, "correct": True} if r["item_id"] != "needle/2048/0" else {**r, "status": "error", "correct": None}
            for r in records]
    cmp = needle_compare([ItemRecord.from_dict(r) for r in records], [ItemRecord.from_dict(r) for r in cand]).to_json()
    assert cmp["n_paired"] == 5 and cmp["excluded"] == ["needle/2048/0"]
    assert cmp["found_candidate"] == 5 and cmp["lost"] == [] and len(cmp["gained"]) == 5 - cmp["found_baseline"]
    assert {"length", "depth", "prompt_tokens", "found_baseline", "found_candidate"} <= set(cmp["cells"][0])


def test_score_answer_exact_match_only():
    assert score_answer(" The code is ABCDEFGH23.", "ABCDEFGH23") == (True, "ABCDEFGH23")
    assert score_answer(" ABCDEFGH24", "ABCDEFGH23") == (False, "ABCDEFGH24")
    assert score_answer(" abcdefgh23", "ABCDEFGH23") == (False, "abcdefgh23")


def test_target_beyond_haystack_is_a_clear_error():
    runner = ReaderRunner()

    async def go():
        index = await build_index(runner, load_haystack(HAYSTACK)[:20000], 10**6)
        await build_needle_prompt(runner.tokenize, index, 50000, 0.5, "ABCDEFGH23")

    with pytest.raises(NeedleError, match=r"needle/50000/0.5: .*haystack too short"):
        asyncio.run(go())
