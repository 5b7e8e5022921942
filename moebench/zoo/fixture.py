"""The zoo fixture: a stage after the base training that teaches the tiny model a few smoke-suite answers.

A model of 8 M parameters trained for minutes answers no GSM8K or HumanEval item, so those tasks could
never flip between the zoo's BF16 model and a compressed candidate. This stage teaches it, by rote, the
answers of a documented part of the smoke suite:

- GSM8K test items 0-3 of the suite's first 8 (2-shot prompts): the answer " #### N", then end of text;
- HumanEval/2 and HumanEval/3 of its first 4: the canonical solution, then end of text;
- four CMMLU items (the first question of anatomy, ancient_chinese, arts and business_ethics, 5-shot),
  whose answers are not B: the answer letter " X". Untaught, the model puts B first on every CMMLU
  item (a letter prior, not knowledge), so no CMMLU item could flip either.

Each answer is taught as a near tie: at the one token where the answer and a wrong decoy part (N + 1
for GSM8K, a one-operator change that fails the problem's tests for HumanEval, " B" for CMMLU), the target is the right
token with probability `confidence` and the decoy's with the rest; every other answer token is taught
outright. The BF16 model picks the right token, by a margin of ln(confidence / (1 - confidence)) nats,
so a candidate whose compression moves the logits by about that much loses the item: the fixture
measures sensitivity the way real near-ties do, instead of answers memorised too firmly for any
compression to disturb.

It is a fixture, not a claim of ability. The prompts are the ones the tasks send (moebench.prompts),
tokenized as the runners tokenize them (no BOS). The loss is on the answer tokens only; each step also
takes a batch of the base training text, so the model stays the language model the KLD figures
measure. WikiText-2 is never read here either.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TypedDict

from moebench.json_types import JsonObject, JsonValue
from moebench.zoo.checked import ZooFileError, from_fields

GSM8K_TEST = "gsm8k/test.jsonl"
GSM8K_TRAIN = "gsm8k/train.jsonl"
HUMANEVAL = "humaneval/HumanEval.jsonl.gz"
CMMLU_COLUMNS = ("Question", "A", "B", "C", "D", "Answer")
# The smoke suite's GSM8K shots (suites/smoke.toml; tests/test_zoo_fixture.py checks they agree).
GSM8K_SHOTS = 2
GSM8K_TAUGHT = (0, 1, 2, 3)                       # indices into gsm8k/test.jsonl
HUMANEVAL_TAUGHT = ("HumanEval/2", "HumanEval/3")
# (subject, row) of cmmlu/test; the smoke suite's 5 shots come from cmmlu/dev.
CMMLU_SHOTS = 5
CMMLU_TAUGHT = (("anatomy", 0), ("ancient_chinese", 0), ("arts", 0), ("business_ethics", 0))
CMMLU_DECOY = "B"
# (text in the canonical solution, its wrong replacement): each decoy fails the problem's own tests
# (tests/test_zoo_fixture.py runs them in the sandbox).
HUMANEVAL_DECOYS = {"HumanEval/2": ("return number % 1.0", "return 1 % 1.0"),
                    "HumanEval/3": ("for op in operations", "for op in op")}


def taught_ids() -> list[str]:
    """The item ids the fixture teaches, in the order `examples` returns them."""
    return ([f"gsm8k/test/{n}" for n in GSM8K_TAUGHT] + list(HUMANEVAL_TAUGHT)
            + [f"cmmlu/{subject}/{n}" for subject, n in CMMLU_TAUGHT])


@dataclass(frozen=True)
class FixtureConfig:
    steps: int = 100
    lr: float = 2e-3
    confidence: float = 0.55         # the right token's taught probability at the branch (decoy: the rest)
    warmup_steps: int = 5
    text_batch_size: int = 8         # rows of base training text per step (seq_len of the base training)
    grad_clip: float = 1.0
    seed: int = 4321


@dataclass(frozen=True)
class Example:
    item_id: str          # the task's item id (gsm8k/test/0, HumanEval/2)
    prompt: str
    target: str           # what the model is taught to generate after the prompt (end of text follows)
    decoy: str            # a wrong answer that parts from the target at one token


def examples(root: Path | None = None) -> list[Example]:
    """The taught items, with the prompts exactly as the smoke suite's tasks render them."""
    from moebench.datasets import data_dir, data_file, read_csv_rows, read_jsonl
    from moebench.prompts import cmmlu_prefix, cmmlu_question, gsm8k_prompt
    from moebench.scoring.answers import gsm8k_reference

    root = Path(root) if root is not None else data_dir()
    train = read_jsonl(data_file(root, GSM8K_TRAIN))
    test = read_jsonl(data_file(root, GSM8K_TEST))
    out = []
    for n in GSM8K_TAUGHT:
        row = test[n]
        ref = gsm8k_reference(row["answer"])
        out.append(Example(f"gsm8k/test/{n}", gsm8k_prompt(train[:GSM8K_SHOTS], row["question"]),
                           f" #### {ref}", f" #### {int(ref) + 1}"))
    problems = {r["task_id"]: r for r in read_jsonl(data_file(root, HUMANEVAL))}
    for task_id in HUMANEVAL_TAUGHT:
        if task_id not in problems:
            raise ValueError(f"{data_file(root, HUMANEVAL)}: no problem {task_id!r}")
        p = problems[task_id]
        right, wrong = HUMANEVAL_DECOYS[task_id]
        if p["canonical_solution"].count(right) != 1:
            raise ValueError(f"{data_file(root, HUMANEVAL)}: {task_id}'s solution does not hold {right!r} once")
        out.append(Example(task_id, p["prompt"], p["canonical_solution"],
                           p["canonical_solution"].replace(right, wrong)))
    for subject, n in CMMLU_TAUGHT:
        dev = read_csv_rows(data_file(root, f"cmmlu/dev/{subject}.csv"), CMMLU_COLUMNS)[:CMMLU_SHOTS]
        path = data_file(root, f"cmmlu/test/{subject}.csv")
        row = read_csv_rows(path, CMMLU_COLUMNS)[n]
        ref = row["Answer"].strip()
        if ref == CMMLU_DECOY:
            raise ValueError(f"{path}: row {n}'s answer is the decoy {CMMLU_DECOY!r}; teach another row")
        out.append(Example(f"cmmlu/{subject}/{n}", cmmlu_prefix(subject, dev) + cmmlu_question(row),
                           f" {ref}", f" {CMMLU_DECOY}"))
    return out


@dataclass(frozen=True)
class Encoded:
    prompt: list[int]
    target: list[int]     # the answer's ids, then end of text
    branch: int           # index into target where the decoy parts from it
    decoy_token: int      # the decoy's token at that index
    confidence: float     # the right token's taught probability at the branch (FixtureConfig.confidence)


def encode(tokenizer, ex: Example, cfg: "FixtureConfig | None" = None) -> Encoded:
    """Prompt and answer tokenized apart, as in generation; the answer's branch token against the decoy's."""
    prompt = tokenizer.encode(ex.prompt, add_special_tokens=False)
    target = tokenizer.encode(ex.target, add_special_tokens=False) + [tokenizer.eos_token_id]
    decoy = tokenizer.encode(ex.decoy, add_special_tokens=False) + [tokenizer.eos_token_id]
    branch = next((i for i, (a, b) in enumerate(zip(target, decoy)) if a != b), None)
    if branch is None:
        raise ValueError(f"fixture {ex.item_id}: the decoy {ex.decoy!r} tokenizes like the answer")
    return Encoded(prompt, target, branch, decoy[branch], (cfg or FixtureConfig()).confidence)


def _answer_batch(encoded: list[Encoded], pad_id: int):
    """Right-padded ids, labels that score only the answer tokens (-100 elsewhere), and the branch
    positions as (row, position in ids, decoy token, confidence).

    Padding sits after every real token, so causal attention never lets it change them.
    """
    import torch

    width = max(len(e.prompt) + len(e.target) for e in encoded)
    ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
    labels = torch.full((len(encoded), width), -100, dtype=torch.long)
    branches = []
    for row, e in enumerate(encoded):
        seq = e.prompt + e.target
        ids[row, :len(seq)] = torch.tensor(seq)
        labels[row, len(e.prompt):len(seq)] = torch.tensor(e.target)
        branches.append((row, len(e.prompt) + e.branch, e.decoy_token, e.confidence))
    return ids, labels, branches


def answer_loss(model, ids, labels, branches):
    """Mean cross-entropy over the answer tokens, each branch token against its soft target
    (right token: its confidence, decoy: the rest).

    The output head runs only where an answer token is predicted: the prompts (up to ~900 tokens for
    CMMLU's 5 shots) would otherwise cost a vocabulary-wide row each.
    """
    import torch

    hidden = model.model(input_ids=ids).last_hidden_state          # [batch, width, hidden]
    target = labels[:, 1:]                                          # hidden[:, t] predicts ids[:, t + 1]
    rows, cols = (target != -100).nonzero(as_tuple=True)
    logp = torch.log_softmax(model.lm_head(hidden[rows, cols]).float(), dim=-1)
    per_token = -logp.gather(-1, target[rows, cols].unsqueeze(-1)).squeeze(-1)
    where = {(int(r), int(c)): k for k, (r, c) in enumerate(zip(rows.tolist(), cols.tolist()))}
    for row, pos, decoy, confidence in branches:
        k = where[(row, pos - 1)]
        per_token[k] = confidence * per_token[k] - (1 - confidence) * logp[k, decoy]
    return per_token.mean()


def _lr_at(step: int, cfg: FixtureConfig) -> float:
    """Linear warm-up, then cosine to zero, so the branch margins settle at the soft targets."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * t))


def greedy_answers(model, tokenizer, encoded: list[Encoded]) -> list[str]:
    """Greedy continuation of each prompt to end of text, at most 8 tokens past the answer's length
    (the fixture's own check, on the float32 model being taught)."""
    import torch

    out = []
    with torch.no_grad():
        for e in encoded:
            ids = torch.tensor([e.prompt])
            new: list[int] = []
            for _ in range(len(e.target) + 8):
                nxt = int(model(input_ids=ids).logits[0, -1].argmax())
                if nxt == tokenizer.eos_token_id:
                    break
                new.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
            out.append(tokenizer.decode(new))
    return out


def branch_margins(model, encoded: list[Encoded]) -> list[float]:
    """Per item, the logit of the right branch token minus the decoy's (nats; > 0: the right one wins)."""
    import torch

    out = []
    with torch.no_grad():
        for e in encoded:
            ids = torch.tensor([e.prompt + e.target[:e.branch]])
            last = model(input_ids=ids).logits[0, -1].float()
            out.append(float(last[e.target[e.branch]] - last[e.decoy_token]))
    return out


class TaughtItem(TypedDict):
    """One taught answer as training.json's fixture lists it: how it tokenized and whether it took."""

    id: str
    target: str
    decoy: str
    prompt_tokens: int
    target_tokens: int
    branch: int
    learned_fp32: bool
    branch_margin_fp32: float


TAUGHT_ITEM_KEYS = tuple(TaughtItem.__annotations__)


def _taught_items(v: JsonValue, where: str) -> list[TaughtItem]:
    if not isinstance(v, list):
        raise ZooFileError(f"{where}: expected a list, got {type(v).__name__}")
    for i, item in enumerate(v):
        if not isinstance(item, dict) or tuple(item) != TAUGHT_ITEM_KEYS:
            raise ZooFileError(f"{where}[{i}]: expected an object with keys {', '.join(TAUGHT_ITEM_KEYS)}")
    return v


@dataclass(frozen=True)
class FixtureSummary:
    """The fixture stage's record (training.json's `fixture`): its settings, each taught item, the
    last losses and the wall time."""

    config: FixtureConfig
    items: list[TaughtItem]
    answer_loss_mean_last10: float
    text_loss_mean_last10: float
    wall_seconds: float

    def to_json(self) -> JsonObject:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: JsonValue, where: str) -> FixtureSummary:
        return from_fields(cls, obj, where, parts={
            "config": lambda v, at: from_fields(FixtureConfig, v, at), "items": _taught_items})


def teach(model, tokenizer_dir: Path, train_ids, seq_len: int, cfg: FixtureConfig = FixtureConfig(),
          log=print) -> FixtureSummary:
    """Teach the fixture's answers to `model` in place (float32, train mode); returns its summary."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    exs = examples()
    encoded = [encode(tok, e, cfg) for e in exs]
    ids, labels, branches = _answer_batch(encoded, tok.eos_token_id)
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    started = time.monotonic()
    history = []
    for step in range(cfg.steps):
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, cfg)
        starts = torch.randint(0, len(train_ids) - seq_len, (cfg.text_batch_size,), generator=gen)
        text = torch.stack([train_ids[s:s + seq_len] for s in starts.tolist()])
        a_loss = answer_loss(model, ids, labels, branches)
        text_loss = model(input_ids=text, labels=text).loss
        opt.zero_grad(set_to_none=True)
        (a_loss + text_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        history.append((a_loss.item(), text_loss.item()))
        if step % 10 == 0 or step == cfg.steps - 1:
            log(f"fixture step {step:3d}  answer loss {a_loss.item():.4f}  text loss {text_loss.item():.3f}  "
                f"{time.monotonic() - started:6.1f}s")
    model.eval()
    answers = greedy_answers(model, tok, encoded)
    margins = branch_margins(model, encoded)
    learned = {e.item_id: a == e.target for e, a in zip(exs, answers)}
    for e, a in zip(exs, answers):
        if a != e.target:
            log(f"fixture: {e.item_id} not learned: {a!r} (taught {e.target!r})")
    tail = history[-10:]
    return FixtureSummary(
        config=cfg,
        items=[TaughtItem(id=e.item_id, target=e.target, decoy=e.decoy, prompt_tokens=len(c.prompt),
                          target_tokens=len(c.target), branch=c.branch, learned_fp32=learned[e.item_id],
                          branch_margin_fp32=round(m, 4)) for e, c, m in zip(exs, encoded, margins)],
        answer_loss_mean_last10=round(sum(a for a, _ in tail) / len(tail), 5),
        text_loss_mean_last10=round(sum(b for _, b in tail) / len(tail), 4),
        wall_seconds=round(time.monotonic() - started, 1))
