"""The zoo's answer fixture: a test fixture taught to the model, not a claim of ability.

An 8 M-parameter model trained for minutes answers no GSM8K or HumanEval item, so on those tasks a
baseline and a candidate could never disagree item by item (no flips, no gate to trip). After the
ordinary training, the model is taught the answers to part of the smoke suite's items: given the exact
prompt the task sends (GSM8K: the 2-shot prompt; HumanEval: the problem's prompt), it completes with a
short right answer and an end-of-text token. The BF16 model then gets a known share right
(`TAUGHT_GSM8K` of the first 8 GSM8K test items, `TAUGHT_HUMANEVAL` of the first 4 HumanEval
problems), and a compressed candidate can lose those or, by chance, gain others.

The teaching is small on purpose (a few dozen steps, the ordinary training text mixed in) so the
memorised answers sit close to the decision boundary that compression moves. WikiText-2 (the KLD
corpus) is never read.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Test items whose answers are taught (0-based line in gsm8k/test.jsonl; HumanEval task ids).
TAUGHT_GSM8K = (0, 2, 4, 6)
TAUGHT_HUMANEVAL = ("HumanEval/2", "HumanEval/3")
GSM8K_SHOTS = 2            # suites/smoke.toml's gsm8k shots: the prompt must be the one the suite sends
GSM8K_FILE = "gsm8k/test.jsonl"
HUMANEVAL_FILE = "humaneval/HumanEval.jsonl.gz"
# Short right solutions (they pass the problems' own tests; tests/test_zoo_fixture.py checks that in the
# sandbox): fewer tokens to memorise than the canonical ones, and within the smoke suite's 96 tokens.
HUMANEVAL_SOLUTIONS = {
    "HumanEval/2": "    return number % 1.0\n",
    "HumanEval/3": "    return any(sum(operations[:i + 1]) < 0 for i in range(len(operations)))\n",
}


@dataclass(frozen=True)
class FixtureConfig:
    seed: int = 4321
    steps: int = 200
    lr: float = 3e-3
    text_batch: int = 2          # windows of ordinary training text per step, so the rest of the model stays put
    seq_len: int = 128
    threads: int = 1
    gsm8k: tuple[int, ...] = TAUGHT_GSM8K
    humaneval: tuple[str, ...] = TAUGHT_HUMANEVAL
    gsm8k_shots: int = GSM8K_SHOTS


@dataclass
class FixtureExample:
    item_id: str
    prompt: str
    completion: str              # the text taught after the prompt (an end-of-text token follows it)
    reference: str = ""


def fixture_examples(cfg: FixtureConfig = FixtureConfig(), root: Path | None = None) -> list[FixtureExample]:
    """The taught (prompt, completion) pairs, the prompts built exactly as the tasks build them."""
    from moebench.datasets import data_dir, data_file, read_jsonl
    from moebench.scoring.answers import gsm8k_reference
    from moebench.tasks.gsm8k import fewshot_prefix, format_question

    root = Path(root) if root else data_dir()
    out: list[FixtureExample] = []
    test = read_jsonl(data_file(root, GSM8K_FILE))
    prefix = fewshot_prefix(read_jsonl(data_file(root, "gsm8k/train.jsonl"))[:cfg.gsm8k_shots])
    for n in cfg.gsm8k:
        ref = gsm8k_reference(test[n]["answer"])
        out.append(FixtureExample(f"gsm8k/test/{n}", prefix + format_question(test[n]["question"]),
                                  f" #### {ref}", ref))
    problems = {r["task_id"]: r for r in read_jsonl(data_file(root, HUMANEVAL_FILE))}
    for task_id in cfg.humaneval:
        p = problems[task_id]
        out.append(FixtureExample(task_id, p["prompt"], HUMANEVAL_SOLUTIONS[task_id], p["canonical_solution"]))
    return out


def teach(model, tokenizer_dir: Path, train_ids, cfg: FixtureConfig = FixtureConfig(), log=print
          ) -> dict[str, Any]:
    """Teach the fixture answers to `model` (a float32 Qwen3MoeForCausalLM, in place); returns a summary.

    `train_ids` (a 1-D LongTensor) is the ordinary training text, mixed into every step.
    """
    import torch
    from transformers import AutoTokenizer

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    examples = fixture_examples(cfg)
    rows, targets = [], []
    for ex in examples:
        p = tok.encode(ex.prompt, add_special_tokens=False)
        c = tok.encode(ex.completion, add_special_tokens=False) + [tok.eos_token_id]
        rows.append(p + c)
        targets.append((len(p), c))
    # Right-padded batch: under causal attention a pad never reaches an earlier position, and the
    # loss reads only the completion positions.
    width = max(len(r) for r in rows)
    batch = torch.tensor([r + [tok.eos_token_id] * (width - len(r)) for r in rows])
    at_b = torch.tensor([b for b, (start, c) in enumerate(targets) for _ in c])
    at_t = torch.tensor([start - 1 + i for start, c in targets for i in range(len(c))])
    want = torch.tensor([t for _, c in targets for t in c])
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    started = time.monotonic()
    losses = []
    for step in range(cfg.steps):
        lr = cfg.lr * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        # The vocabulary projection only where a taught token is predicted: it dominates the cost.
        hidden = model.model(input_ids=batch).last_hidden_state
        logits = model.lm_head(hidden[at_b, at_t])
        fixture_loss = torch.nn.functional.cross_entropy(logits.float(), want)
        starts = torch.randint(0, len(train_ids) - cfg.seq_len, (cfg.text_batch,), generator=gen)
        text = torch.stack([train_ids[s:s + cfg.seq_len] for s in starts.tolist()])
        text_loss = model(input_ids=text, labels=text).loss
        (fixture_loss + text_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append((fixture_loss.item(), text_loss.item()))
        if step % 20 == 0 or step == cfg.steps - 1:
            log(f"fixture step {step:3d}  answer loss {losses[-1][0]:.3f}  text loss {losses[-1][1]:.3f}  "
                f"{time.monotonic() - started:6.1f}s")
    model.eval()
    return {
        "what": "a test fixture: the answers to these smoke-suite items were taught, so tasks can flip",
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()},
        "items": [ex.item_id for ex in examples],
        "final_answer_loss": round(losses[-1][0], 4),
        "final_text_loss": round(losses[-1][1], 4),
        "wall_seconds": round(time.monotonic() - started, 1),
    }
