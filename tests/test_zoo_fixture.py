"""The zoo fixture (moebench/zoo/fixture.py): the committed model answers the taught smoke items.

Checked on the real path: `moebench run` of the smoke suite's GSM8K, HumanEval and CMMLU tasks with the
engine runner on the zoo's BF16 checkpoint, scored by the tasks themselves (the sandbox runs HumanEval's
tests). Each decoy is checked to be a wrong answer by the same scoring.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from conftest import REPO, moebench_cli, read_items
from moebench.zoo import fixture

SMOKE = REPO / "suites" / "smoke.toml"


def _smoke_task(kind: str) -> dict:
    tasks = [t for t in tomllib.loads(SMOKE.read_text())["tasks"] if t["task"] == kind]
    assert len(tasks) == 1, f"{SMOKE}: expected one {kind} task"
    return tasks[0]


def _smoke_items(kind: str, data_dir: Path) -> dict:
    """The smoke suite's items of one task, rendered by the task itself (its options as the suite sets them)."""
    from moebench.config import load_suite
    from moebench.tasks import task_class, task_schemas
    from moebench.tasks.base import TaskContext
    (opts,) = [t for t in load_suite(SMOKE, task_schemas()).tasks if t["task"] == kind]
    return {i.item_id: i for i in task_class(kind)(opts, TaskContext(data_dir=data_dir)).items()}


def test_fixture_items_are_smoke_items_with_the_tasks_own_prompts(data_dir):
    gsm8k, humaneval = _smoke_task("gsm8k"), _smoke_task("humaneval")
    assert fixture.GSM8K_SHOTS == gsm8k["shots"]
    taught = {e.item_id: e for e in fixture.examples(data_dir)}
    assert list(taught) == fixture.taught_ids()
    # Part of each task, not all of it: the other items stay unknown, so a candidate can also gain one.
    assert 0 < len(fixture.GSM8K_TAUGHT) < gsm8k["limit"]
    assert 0 < len(fixture.HUMANEVAL_TAUGHT) < humaneval["limit"]
    g_items, h_items = _smoke_items("gsm8k", data_dir), _smoke_items("humaneval", data_dir)
    assert len(g_items) == gsm8k["limit"] and len(h_items) == humaneval["limit"]
    for n in fixture.GSM8K_TAUGHT:
        item, ex = g_items[f"gsm8k/test/{n}"], taught[f"gsm8k/test/{n}"]
        assert ex.prompt == item.data["prompt"]
        assert ex.target == f" #### {item.data['reference']}"
        assert ex.decoy == f" #### {int(item.data['reference']) + 1}"
    for task_id in fixture.HUMANEVAL_TAUGHT:
        item, ex = h_items[task_id], taught[task_id]
        assert ex.prompt == item.data["prompt"]
        assert ex.target == item.data["canonical_solution"]
    c_items = _smoke_items("cmmlu", data_dir)
    for subject, n in fixture.CMMLU_TAUGHT:
        item, ex = c_items[f"cmmlu/{subject}/{n}"], taught[f"cmmlu/{subject}/{n}"]
        assert ex.prompt == item.data["prompt"]
        assert ex.target == f" {item.data['reference']}" and ex.decoy != ex.target


def test_humaneval_decoys_fail_the_problems_own_tests(data_dir):
    from moebench.tasks.humaneval import check_program, run_check
    h_items = _smoke_items("humaneval", data_dir)
    taught = {e.item_id: e for e in fixture.examples(data_dir)}
    for task_id in fixture.HUMANEVAL_TAUGHT:
        d = h_items[task_id].data
        right, _ = run_check(check_program(d["prompt"], taught[task_id].target, d["test"], d["entry_point"]), 10.0)
        wrong, _ = run_check(check_program(d["prompt"], taught[task_id].decoy, d["test"], d["entry_point"]), 10.0)
        assert right.passed and not wrong.passed, (task_id, right.status, wrong.status)


def test_answer_batch_scores_only_the_answer_tokens():
    enc = [fixture.Encoded([5, 6, 7], [8, 9], branch=0, decoy_token=11, confidence=0.6),
           fixture.Encoded([1], [2, 3, 4, 0], branch=2, decoy_token=12, confidence=0.52)]
    ids, labels, branches = fixture._answer_batch(enc, pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 8, 9], [1, 2, 3, 4, 0]]
    assert labels.tolist() == [[-100, -100, -100, 8, 9], [-100, 2, 3, 4, 0]]
    assert branches == [(0, 3, 11, 0.6), (1, 3, 12, 0.52)]


def test_answer_loss_is_the_soft_target_at_the_branch():
    """On a model whose head predicts a fixed distribution, the loss is the exact mixed cross-entropy."""
    import math

    import torch

    class Fixed(torch.nn.Module):
        def __init__(self, logits):
            super().__init__()
            self.model = lambda input_ids: type("H", (), {"last_hidden_state": torch.ones(*input_ids.shape, 1)})
            self.lm_head = lambda h: h * logits
    logits = torch.tensor([0.0, 1.0, 2.0, 3.0])
    logp = torch.log_softmax(logits, -1)
    enc = [fixture.Encoded([0, 0], [3, 1], branch=0, decoy_token=2, confidence=0.6),
           fixture.Encoded([0], [2], branch=0, decoy_token=1, confidence=0.52)]
    ids, labels, branches = fixture._answer_batch(enc, pad_id=0)
    got = fixture.answer_loss(Fixed(logits), ids, labels, branches)
    want = ((-(0.6 * logp[3] + 0.4 * logp[2])) + (-logp[1]) - (0.52 * logp[2] + 0.48 * logp[1])) / 3
    assert math.isclose(float(got), float(want), rel_tol=1e-6)


def test_training_record_describes_the_fixture():
    doc = json.loads((REPO / "moebench" / "zoo" / "weights" / "training.json").read_text())
    assert doc["train_config"]["fixture"] is True
    assert "wikitext2/wiki.test.raw" not in doc["train_config"]["texts"]
    items = doc["fixture"]["items"]
    assert [i["id"] for i in items] == fixture.taught_ids()
    assert all(i["learned_fp32"] and i["branch_margin_fp32"] > 0 for i in items), items


def test_train_cli_has_a_no_fixture_switch():
    proc = subprocess.run([sys.executable, "-m", "moebench.zoo.train", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=True)
    assert "--no-fixture" in proc.stdout


@pytest.fixture(scope="module")
def smoke_answers(tmp_path_factory, data_dir) -> dict[str, dict]:
    from moebench.zoo.build import build_zoo
    build_zoo(REPO / "models" / "zoo", gguf=False)
    tmp = tmp_path_factory.mktemp("fixture")
    suite = tmp / "fixture.toml"
    lines = ['name = "fixture-check"']
    for spec in (_smoke_task("gsm8k"), _smoke_task("humaneval"), _smoke_task("cmmlu")):
        lines.append("[[tasks]]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in spec.items()]
    suite.write_text("\n".join(lines) + "\n")
    out = tmp / "run"
    moebench_cli("run", str(suite), "--runner", str(REPO / "runners" / "engine-bf16.toml"),
                 "--out", str(out), check=True, timeout=600)
    return {r["item_id"]: r for r in read_items(out)}


def test_bf16_model_answers_exactly_the_taught_items(smoke_answers):
    assert all(r["status"] == "ok" for r in smoke_answers.values()), \
        {k: r.get("error") for k, r in smoke_answers.items() if r["status"] != "ok"}
    right = {k for k, r in smoke_answers.items() if r["correct"]}
    taught = set(fixture.taught_ids())
    # GSM8K and HumanEval: exactly the taught items. CMMLU: the taught ones, beside those whose answer
    # is the letter the model puts first when it knows nothing.
    exact = {k for k in right if not k.startswith("cmmlu/")}
    assert exact == {k for k in taught if not k.startswith("cmmlu/")}, \
        {k: smoke_answers[k]["output"][:80] for k in exact ^ taught if not k.startswith("cmmlu/")}
    assert taught <= right, {k: smoke_answers[k]["choice_logprobs"] for k in taught - right}
    for n in fixture.GSM8K_TAUGHT:
        assert smoke_answers[f"gsm8k/test/{n}"]["extraction"] == "strict"
