"""HumanEval: complete a Python function greedily, then run the problem's own tests in the sandbox.

The program checked is the human-eval one: prompt + completion + "\\n" + test + "\\ncheck(entry_point)".
Stop sequences are the Codex paper's / lm-eval's set ["\\nclass", "\\ndef", "\\n#", "\\nif", "\\nprint"]:
they end the completion at the first new top-level statement, so the model's own trailing tests or
extra functions never reach the checker. The completion is cut at them here too, in case a server
does not apply them.

A check that times out is run once more before it may count as a loss (a loaded machine can make a
correct solution slow); both attempts are recorded. A sandbox that cannot start is an error (raised),
never a wrong answer.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from moebench.config import MAX_IDLE_SECONDS, MAX_NEW_TOKENS, Field, positive
from moebench.datasets import DatasetError, data_file, read_jsonl, register
from moebench.runners.base import Capability, GenerateRequest, Runner
from moebench.scoring.answers import cut_at_stop
from moebench.scoring.sandbox import SandboxError, SandboxResult, run_untrusted
from moebench.store.records import ItemRecord
from moebench.tasks.base import Item, Task, TaskOptions, prompt_hash, runner_fields
from moebench.tasks.records import AccuracySummary

DATA_FILE = "humaneval/HumanEval.jsonl.gz"
# Codex paper (Chen et al. 2021) and lm-eval 0.4.13 tasks/humaneval/humaneval.yaml `until`.
DEFAULT_STOP = ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]
REQUIRED_KEYS = ("task_id", "prompt", "canonical_solution", "test", "entry_point")


def check_program(prompt: str, completion: str, test: str, entry_point: str) -> str:
    """The program human-eval executes: passing = exit status 0."""
    return prompt + completion + "\n" + test + "\n" + f"check({entry_point})\n"


def run_check(program: str, timeout_s: float) -> tuple[SandboxResult, list[str]]:
    """Run a check; re-run once on timeout. Returns the deciding result and every attempt's status.

    Raises SandboxError when the sandbox itself could not run the check.
    """
    statuses: list[str] = []
    for _attempt in range(2):
        result = run_untrusted(program, timeout_s=timeout_s)
        statuses.append(result.status)
        if result.status == "error":
            raise SandboxError(f"sandbox failure (not the completion's fault): {result.reason}")
        if result.status != "timeout":
            break
    return result, statuses


class Problem(TypedDict):
    """A HumanEval problem (REQUIRED_KEYS): the function's prompt, the reference solution, its tests."""

    task_id: str
    prompt: str
    canonical_solution: str
    test: str
    entry_point: str


def load_problems(path: Path) -> list[Problem]:
    rows = read_jsonl(path)
    for n, row in enumerate(rows):
        missing = [k for k in REQUIRED_KEYS if not isinstance(row.get(k), str)]
        if missing:
            raise DatasetError(f"{path}: line {n + 1} lacks string field(s) {', '.join(missing)}; "
                               f"expected {', '.join(REQUIRED_KEYS)}")
    return [Problem(task_id=row["task_id"], prompt=row["prompt"], canonical_solution=row["canonical_solution"],
                    test=row["test"], entry_point=row["entry_point"]) for row in rows]


class HumanEvalOptions(TaskOptions, total=False):
    max_tokens: int
    timeout_s: float
    stop: list[str]


@dataclass(frozen=True)
class HumanEvalSummary(AccuracySummary):
    """The accuracy figures plus how many checks ended in a timeout (after the re-run), and how many
    were re-run."""

    n_timeouts: int
    n_reruns: int

    @classmethod
    def of(cls, records: list[ItemRecord]) -> HumanEvalSummary:
        sandboxes = [r.extra.get("sandbox", {}) for r in records]
        final = [sb.get("status") for r, sb in zip(records, sandboxes) if r.status == "ok"]
        return cls(*cls.counts(records), n_timeouts=sum(1 for s in final if s == "timeout"),
                   n_reruns=sum(1 for sb in sandboxes if len(sb.get("attempts", [])) > 1))


class HumanEvalTask(Task):
    kind = "humaneval"
    opts: HumanEvalOptions
    options = {
        "max_tokens": Field(int, default=512, check=positive, low=1, high=MAX_NEW_TOKENS),
        "timeout_s": Field(float, default=10.0, check=positive, low=0, low_open=True, high=MAX_IDLE_SECONDS,
                           doc="wall seconds for one check in the sandbox (re-run once on timeout)"),
        "stop": Field(list, item_type=str, default=lambda: list(DEFAULT_STOP)),
    }

    def needs(self, runner: Runner) -> set[str]:
        return {Capability.GENERATE}

    def items(self) -> list[Item[Problem]]:
        root = self.ctx.data_dir
        path = data_file(root, DATA_FILE)
        register(self.ctx.data_files, root, path)
        items = [Item(problem["task_id"], problem) for problem in load_problems(path)]
        return self._cut(items)

    async def evaluate(self, item: Item[Problem], runner: Runner) -> ItemRecord:
        d = item.data
        prompt = d["prompt"]
        stop = list(self.opts.get("stop", DEFAULT_STOP))
        result = await runner.generate(GenerateRequest(
            prompt=prompt, max_tokens=int(self.opts.get("max_tokens", 512)), stop=stop, temperature=0.0))
        completion = cut_at_stop(result.text, stop)
        program = check_program(prompt, completion, d["test"], d["entry_point"])
        # The sandbox blocks (a child process): keep the event loop free for other requests.
        check, statuses = await asyncio.to_thread(run_check, program, float(self.opts.get("timeout_s", 10.0)))
        return self.record(item, correct=check.passed, answer=completion, reference=d["canonical_solution"],
                           output=result.text,
                           extra={**runner_fields(result), "prompt_hash": prompt_hash(prompt),
                                  "sandbox": {**check.summary(), "attempts": statuses,
                                              **({"missing": check.missing} if check.missing else {})}})

    def summary(self, records: list[ItemRecord]) -> HumanEvalSummary:
        return HumanEvalSummary.of(records)
