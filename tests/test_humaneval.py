"""HumanEval on the real dataset: every canonical solution passes in the sandbox, wrong and hostile
completions fail, and `evaluate` records what the design asks for."""
from __future__ import annotations

import asyncio
import gzip
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from moebench.datasets import DatasetError, data_dir
from moebench.runners.base import Capability, GenerateRequest, GenerateResult, Runner
from moebench.scoring import sandbox
from moebench.scoring.sandbox import SandboxError
from moebench.tasks.base import TaskContext, prompt_hash
from moebench.tasks.humaneval import DEFAULT_STOP, HumanEvalTask, check_program, run_check

HUMANEVAL_SHA256 = "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"


def make_task(**opts) -> HumanEvalTask:
    defaults = {"max_tokens": 512, "timeout_s": 10.0, "stop": list(DEFAULT_STOP)}
    return HumanEvalTask({**defaults, **opts}, TaskContext(data_dir=data_dir()))


class PlantedRunner(Runner):
    """Answers each prompt with a completion planted for it; records what it was asked."""

    kind = "planted"
    capabilities = frozenset({Capability.GENERATE})

    def __init__(self, completions: dict[str, str]):
        super().__init__({})
        self.completions = completions
        self.requests: list[GenerateRequest] = []

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.requests.append(request)
        text = self.completions[request.prompt]
        return GenerateResult(text=text, prompt_tokens=len(request.prompt.split()), output_tokens=len(text.split()),
                              finish_reason="stop")


@pytest.fixture(scope="module")
def items():
    task = make_task()
    got = task.items()
    assert task.ctx.data_files == {"humaneval/HumanEval.jsonl.gz": HUMANEVAL_SHA256}
    return got


def test_items_are_the_164_problems_in_order(items):
    assert len(items) == 164
    assert [it.item_id for it in items] == [f"HumanEval/{n}" for n in range(164)]
    assert items[0].data["entry_point"] == "has_close_elements"
    assert make_task(limit=3).items()[-1].item_id == "HumanEval/2"


def test_every_canonical_solution_passes_in_the_sandbox(items):
    def check(item):
        d = item.data
        return item.item_id, run_check(check_program(d["prompt"], d["canonical_solution"], d["test"],
                                                     d["entry_point"]), timeout_s=20)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(check, items))
    failed = {iid: (r.status, r.reason) for iid, (r, _) in results if not r.passed}
    assert failed == {}
    assert len(results) == 164
    assert all(r.isolation == results[0][1][0].isolation for _, (r, _) in results)


def test_obviously_wrong_completion_fails(items):
    d = items[0].data
    result, statuses = run_check(check_program(d["prompt"], "    return not True\n", d["test"], d["entry_point"]), 10)
    assert not result.passed and statuses == ["failed"]
    assert result.reason == "AssertionError"


def test_evaluate_pass_fail_and_hostile(items):
    task = make_task(timeout_s=2.0)
    p0, p1, p2 = (items[n].data for n in range(3))
    # Canonical solution followed by junk a server forgot to cut: the stop at "\ndef" must drop it.
    planted = {
        p0["prompt"]: p0["canonical_solution"] + "\ndef extra():\n    pass\nraise SystemExit(3)\n",
        p1["prompt"]: "    return []\n",
        p2["prompt"]: "    import os\n    while True:\n        try:\n            os.fork()\n        except OSError:\n"
                      "            pass\n",
    }
    runner = PlantedRunner(planted)

    rec = asyncio.run(task.evaluate(items[0], runner)).to_dict()
    assert rec["correct"] is True
    assert rec["answer"] == p0["canonical_solution"]
    assert rec["output"] == planted[p0["prompt"]]
    assert rec["reference"] == p0["canonical_solution"]
    assert rec["prompt_hash"] == prompt_hash(p0["prompt"])
    assert rec["sandbox"]["status"] == "passed" and rec["sandbox"]["attempts"] == ["passed"]
    assert "net-namespace" in rec["sandbox"]["isolation"] or sandbox.plan().missing
    assert rec["finish_reason"] == "stop" and rec["output_tokens"] > 0
    req = runner.requests[0]
    assert req.temperature == 0 and req.max_tokens == 512 and req.stop == DEFAULT_STOP

    rec = asyncio.run(task.evaluate(items[1], runner)).to_dict()
    assert rec["correct"] is False
    assert rec["sandbox"]["status"] == "failed" and rec["sandbox"]["reason"] == "AssertionError"

    rec = asyncio.run(task.evaluate(items[2], runner)).to_dict()    # a fork bomb: times out twice, then a loss
    assert rec["correct"] is False
    assert rec["sandbox"]["attempts"] == ["timeout", "timeout"]
    assert "timeout" in rec["sandbox"]["reason"]
    bomb = {**rec, "task": "humaneval", "item_id": items[2].item_id, "status": "ok"}
    # the harness is fine: the next item still evaluates
    ok = asyncio.run(task.evaluate(items[0], runner)).to_dict()
    assert ok["correct"] is True
    summary = task.summarize([bomb, {**ok, "task": "humaneval", "item_id": items[0].item_id, "status": "ok"}])
    assert summary["n_scored"] == 2 and summary["n_correct"] == 1
    assert summary["n_timeouts"] == 1 and summary["n_reruns"] == 1


def test_sandbox_failure_raises_instead_of_scoring_wrong(items, monkeypatch):
    monkeypatch.setattr(sandbox, "_interpreters", lambda dropping: ["/nonexistent/python3"])
    runner = PlantedRunner({items[0].data["prompt"]: items[0].data["canonical_solution"]})
    with pytest.raises(SandboxError, match="could not start"):
        asyncio.run(make_task().evaluate(items[0], runner))


def test_malformed_data_file_names_the_line(tmp_path):
    bad = tmp_path / "humaneval" / "HumanEval.jsonl.gz"
    bad.parent.mkdir()
    with gzip.open(bad, "wt") as f:
        f.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def f():\n", "canonical_solution": "  pass\n",
                            "test": "", "entry_point": "f"}) + "\n")
        f.write(json.dumps({"task_id": "HumanEval/1", "prompt": "def g():\n"}) + "\n")
    task = HumanEvalTask({}, TaskContext(data_dir=Path(tmp_path)))
    with pytest.raises(DatasetError, match=r"line 2 lacks string field\(s\) canonical_solution, test, entry_point"):
        task.items()


def test_suite_options_validate(tmp_path):
    from moebench.config import ProfileError, load_suite

    good = tmp_path / "he.toml"
    good.write_text('name = "he"\n[[tasks]]\ntask = "humaneval"\nlimit = 5\ntimeout_s = 5\n')
    suite = load_suite(good, {"humaneval": HumanEvalTask.options})
    assert suite.tasks[0] == {"task": "humaneval", "limit": 5, "timeout_s": 5, "max_tokens": 512,
                              "stop": DEFAULT_STOP}
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "he"\n[[tasks]]\ntask = "humaneval"\nmax_tokens = "many"\n')
    with pytest.raises(ProfileError, match=r"bad.toml \[\[tasks\]\] #1: key 'max_tokens' must be an integer"):
        load_suite(bad, {"humaneval": HumanEvalTask.options})
