"""Train the zoo's tiny Qwen3-MoE briefly on real text, deterministically from a seed, on CPU.

A tiny MoE with random weights predicts a near-uniform distribution, so KLD, top-token flips and expert
load would all measure noise. A few minutes of next-token training on War and Peace and GSM8K train give it peaked
predictions and unevenly loaded experts (no load-balancing loss on purpose). A fixture stage then
teaches part of the smoke suite's answers as near ties (moebench/zoo/fixture.py), so every task can
flip. WikiText-2 test is the KLD corpus and is never read here.

    python -m moebench.zoo.train --out moebench/zoo/weights      # what produced the committed weights
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from moebench import jsonout
from moebench.json_types import JsonObject, JsonValue
from moebench.zoo.checked import WORDING, ZooFileError, from_fields, json_object, strings

if TYPE_CHECKING:
    from moebench.zoo.fixture import FixtureSummary

TRAIN_TEXT = "haystack/war_and_peace.txt"   # relative to the dataset mirror
# GSM8K train (MIT) beside the novel: modern English and numbers halve WikiText-2 perplexity
# (measured 10,508 -> 6,126 at the same step count); neither is the KLD corpus.
TRAIN_TEXTS = (TRAIN_TEXT, "gsm8k/train.jsonl")
WEIGHTS_FILE = "model.safetensors"
TRAINING_FILE = "training.json"


@dataclass(frozen=True)
class ModelShape:
    """The Qwen3-MoE shape. Every matrix input dimension is a multiple of 32 (the Q4_0/Q8_0 block)."""
    vocab_size: int = 50257          # GPT-2 vocabulary (see tokenizer.py)
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 128
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True  # keeps the committed weights ~15 MB in bf16

    def hf_config(self) -> JsonObject:
        """config.json for transformers' Qwen3MoeForCausalLM (and convert_hf_to_gguf's qwen3moe)."""
        d = asdict(self)
        rope_theta = d.pop("rope_theta")
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            **d,
            "intermediate_size": 4 * self.hidden_size,   # unused: every layer is sparse
            "hidden_act": "silu",
            # llama.cpp always renormalises qwen3moe top-k weights; the HF side must too.
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "router_aux_loss_coef": 0.0,
            "output_router_logits": False,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "sliding_window": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
            "rope_theta": rope_theta,
            "initializer_range": 0.02,
            "use_cache": True,
            "bos_token_id": 50256,
            "eos_token_id": 50256,
            "dtype": "bfloat16",
        }


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 1234
    steps: int = 300
    batch_size: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    # 0 = no load-balancing loss (uneven experts are wanted); a weak one (e.g. 0.01) only if routers collapse
    router_aux_loss_coef: float = 0.0
    autocast_bf16: bool = False      # bf16 matmuls measured no faster here (logits and softmax dominate)
    threads: int = 1                 # fixed so a retrain from the seed repeats the same float order
    heldout_fraction: float = 0.05   # tail of each text, for a held-out loss
    texts: tuple[str, ...] = TRAIN_TEXTS  # files of the dataset mirror; never wikitext2 (the KLD corpus)
    eval_batches: int = 4
    # The fixture stage after the base steps (moebench/zoo/fixture.py): smoke-suite answers taught by rote.
    fixture: bool = True
    shape: ModelShape = field(default_factory=ModelShape)


def _read_training_text(root: Path, rel: str) -> str:
    """Plain text of one training source: a .txt as is, GSM8K-style .jsonl as question + answer."""
    from moebench.datasets import data_file, read_jsonl, read_text

    path = data_file(root, rel)
    if rel.endswith(".jsonl"):
        rows = read_jsonl(path)
        missing = [n for n, r in enumerate(rows) if "question" not in r or "answer" not in r]
        if missing:
            raise ValueError(f"{path}: rows {missing[:5]} lack 'question'/'answer'")
        return "\n\n".join(f"Question: {r['question']}\nAnswer: {r['answer']}" for r in rows)
    return read_text(path)


class TextSource(TypedDict):
    """One training text as training.json's provenance lists it."""

    file: str                   # relative to the data folder
    sha256: str
    tokens: int


class LoadSkew(TypedDict):
    """How unevenly the router spreads tokens over the experts (training.json, the zoo figures)."""

    busiest_25pct_share_per_layer: list[float]
    busiest_25pct_share_mean: float
    counts_per_layer: list[list[int]]


def load_training_ids(tokenizer_dir: Path, texts: tuple[str, ...] = TRAIN_TEXTS,
                      heldout_fraction: float = 0.05) -> tuple[list[int], list[int], list[TextSource]]:
    """(train ids, held-out ids, provenance) of the training texts; the tail of each text is held out."""
    from transformers import AutoTokenizer

    from moebench.datasets import data_dir, data_file, sha256_file

    if "wikitext2/wiki.test.raw" in texts:
        raise ValueError("wikitext2/wiki.test.raw is the KLD corpus and must stay out of training")
    root = data_dir()
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    train_ids: list[int] = []
    held_ids: list[int] = []
    sources: list[TextSource] = []
    for rel in texts:
        ids = tok.encode(_read_training_text(root, rel), add_special_tokens=False)
        split = int(len(ids) * (1 - heldout_fraction))
        train_ids += ids[:split] + [tok.eos_token_id]
        held_ids += ids[split:] + [tok.eos_token_id]
        sources.append({"file": rel, "sha256": sha256_file(data_file(root, rel)), "tokens": len(ids)})
    return train_ids, held_ids, sources


def _lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def _batch(data, starts, seq_len: int):
    import torch

    return torch.stack([data[s:s + seq_len] for s in starts.tolist()])


def route_counts(model, ids) -> "Any":
    """Per-layer count of routed token slots per expert ([layers, experts]) for one forward pass."""
    import torch

    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    if not routers:
        raise RuntimeError("no MoE router modules found in the model (expected Qwen3MoeTopKRouter)")
    n_exp = model.config.num_experts
    counts = torch.zeros(len(routers), n_exp, dtype=torch.long)

    def hook(idx):
        def fn(_mod, _inp, out):
            counts[idx] += torch.bincount(out[2].reshape(-1), minlength=n_exp)
        return fn

    handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(routers)]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return counts


def load_skew(counts) -> LoadSkew:
    """Share of routed tokens taken by the busiest 25% of experts, per layer and overall (mean)."""
    n_exp = counts.shape[1]
    top = max(1, n_exp // 4)
    per_layer = []
    for row in counts.tolist():
        total = sum(row)
        per_layer.append(sum(sorted(row, reverse=True)[:top]) / total if total else 0.0)
    return {
        "busiest_25pct_share_per_layer": [round(x, 4) for x in per_layer],
        "busiest_25pct_share_mean": round(sum(per_layer) / len(per_layer), 4),
        "counts_per_layer": counts.tolist(),
    }


def _text_sources(v: JsonValue, where: str) -> list[TextSource]:
    keys = tuple(TextSource.__annotations__)
    if not isinstance(v, list) or not all(isinstance(x, dict) and tuple(x) == keys for x in v):
        raise ZooFileError(f"{where}: expected a list of objects with keys {', '.join(keys)}")
    return v


def _load_skew(v: JsonValue, where: str) -> LoadSkew:
    d = json_object(v, where)
    if tuple(d) != tuple(LoadSkew.__annotations__):
        raise ZooFileError(f"{where}: expected keys {', '.join(LoadSkew.__annotations__)}, got {', '.join(d)}")
    return d


def _train_config(train_config: JsonValue, shape: JsonValue, where: str) -> TrainConfig:
    """training.json's train_config (its keys without `shape`) and shape, as the TrainConfig they came from."""
    d = json_object(train_config, f"{where}.train_config")
    if "shape" in d:
        raise ZooFileError(f"{where}.train_config: unexpected key 'shape' (the shape is its own key)")
    return from_fields(TrainConfig, {**d, "shape": shape}, f"{where}.train_config", parts={
        "texts": strings, "shape": lambda v, at: from_fields(ModelShape, v, f"{where}.shape")})


@dataclass(frozen=True)
class TrainingSummary:
    """What a training run reports (training.json without the files' keys): settings, data, losses,
    wall time, torch version, expert load and the fixture stage's record."""

    config: TrainConfig
    data: list[TextSource]
    tokens_seen: int
    first_loss: float
    final_loss_mean_last20: float
    heldout_loss: float
    heldout_ppl: float
    wall_seconds: float
    torch: str
    expert_load_on_training_text: LoadSkew
    fixture: FixtureSummary | None = None

    def to_json(self) -> JsonObject:
        """training.json's summary keys in their written order (seed; train_config without the shape,
        which follows as its own key; ...; fixture where taught)."""
        out: JsonObject = {
            "seed": self.config.seed,
            "train_config": {k: v for k, v in asdict(self.config).items() if k != "shape"},
            "shape": asdict(self.config.shape), "data": [dict(s) for s in self.data],
            "tokens_seen": self.tokens_seen, "first_loss": self.first_loss,
            "final_loss_mean_last20": self.final_loss_mean_last20, "heldout_loss": self.heldout_loss,
            "heldout_ppl": self.heldout_ppl, "wall_seconds": self.wall_seconds, "torch": self.torch,
            "expert_load_on_training_text": self.expert_load_on_training_text}
        if self.fixture is not None:
            out["fixture"] = self.fixture.to_json()
        return out


SUMMARY_KEYS = ("seed", "train_config", "shape", "data", "tokens_seen", "first_loss", "final_loss_mean_last20",
                "heldout_loss", "heldout_ppl", "wall_seconds", "torch", "expert_load_on_training_text")
FILE_KEYS = ("hf_config", "weights", "weights_dtype")


@dataclass(frozen=True)
class TrainingRecord:
    """training.json: the summary, the config.json the HF checkpoint gets, and the weights file's name
    and dtype."""

    summary: TrainingSummary
    hf_config: JsonObject             # transformers' config.json, written as is
    weights: str
    weights_dtype: str

    @property
    def seed(self) -> int:
        return self.summary.config.seed

    def to_json(self) -> JsonObject:
        return {**self.summary.to_json(), "hf_config": self.hf_config, "weights": self.weights,
                "weights_dtype": self.weights_dtype}

    @classmethod
    def from_json(cls, obj: JsonValue, where: str) -> TrainingRecord:
        """training.json read back; a missing key, an unknown one or a wrong type names the file and key."""
        d = json_object(obj, where)
        for key in ("hf_config", "seed") + SUMMARY_KEYS + FILE_KEYS:
            if key not in d:
                raise WORDING.refuse_missing(where, key, "")
        unknown = [k for k in d if k not in SUMMARY_KEYS + FILE_KEYS + ("fixture",)]
        if unknown:
            raise ZooFileError(f"{where}: unknown key {unknown[0]!r}")
        from moebench.zoo.fixture import FixtureSummary
        # The summary's fields under their written keys: train_config and shape make the config.
        summary = from_fields(TrainingSummary, {
            "config": d["train_config"], **{k: d[k] for k in SUMMARY_KEYS[3:]}, "fixture": d.get("fixture")},
            where, parts={
                "config": lambda v, at: _train_config(v, d["shape"], where),
                "fixture": lambda v, at: FixtureSummary.from_json(v, at) if v is not None else None,
                "data": _text_sources, "expert_load_on_training_text": _load_skew})
        if d["seed"] != summary.config.seed:
            raise ZooFileError(f"{where}: key 'seed' is {d['seed']!r}, train_config.seed is {summary.config.seed!r}")
        weights, weights_dtype = (WORDING.value(d, key, where, (str,)) for key in ("weights", "weights_dtype"))
        return cls(summary=summary, hf_config=json_object(d["hf_config"], f"{where}.hf_config"),
                   weights=weights, weights_dtype=weights_dtype)


def train(tokenizer_dir: Path, cfg: TrainConfig = TrainConfig(), log=print) -> tuple[Any, TrainingSummary]:
    """Train from cfg.seed; returns (model in float32, training summary)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    train_list, held_list, source = load_training_ids(tokenizer_dir, cfg.texts, cfg.heldout_fraction)
    train_ids = torch.tensor(train_list, dtype=torch.long)
    held_ids = torch.tensor(held_list, dtype=torch.long)

    hf_cfg = cfg.shape.hf_config()
    hf_cfg.pop("architectures"), hf_cfg.pop("model_type"), hf_cfg.pop("dtype")
    hf_cfg["router_aux_loss_coef"] = cfg.router_aux_loss_coef
    hf_cfg["output_router_logits"] = cfg.router_aux_loss_coef > 0   # HF adds coef * aux loss to .loss
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**hf_cfg)).float()
    model.train()
    gen = torch.Generator().manual_seed(cfg.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    started = time.monotonic()
    losses: list[float] = []
    for step in range(cfg.steps):
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, cfg)
        starts = torch.randint(0, len(train_ids) - cfg.seq_len, (cfg.batch_size,), generator=gen)
        batch = _batch(train_ids, starts, cfg.seq_len)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.autocast_bf16):
            loss = model(input_ids=batch, labels=batch).loss  # HF shifts the labels by one itself
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        losses.append(loss.item())
        if step % 20 == 0 or step == cfg.steps - 1:
            log(f"step {step:4d}  loss {loss.item():.3f}  lr {_lr_at(step, cfg):.2e}  "
                f"{time.monotonic() - started:6.1f}s")
    wall = time.monotonic() - started
    fixture = None
    if cfg.fixture:
        from moebench.zoo.fixture import teach
        fixture = teach(model, tokenizer_dir, train_ids, cfg.seq_len, log=log)

    model.eval()
    eval_gen = torch.Generator().manual_seed(cfg.seed + 1)
    held = []
    with torch.no_grad():
        for _ in range(cfg.eval_batches):
            starts = torch.randint(0, len(held_ids) - cfg.seq_len, (cfg.batch_size,), generator=eval_gen)
            b = _batch(held_ids, starts, cfg.seq_len)
            held.append(model(input_ids=b, labels=b).loss.item())
    skew_ids = _batch(train_ids, torch.arange(0, 16 * 512, 512), 512)  # 16 x 512 tokens of training text
    skew = load_skew(route_counts(model, skew_ids))
    tail = losses[-20:]
    summary = TrainingSummary(
        config=cfg, data=source, tokens_seen=cfg.steps * cfg.batch_size * cfg.seq_len,
        first_loss=round(losses[0], 4), final_loss_mean_last20=round(sum(tail) / len(tail), 4),
        heldout_loss=round(sum(held) / len(held), 4), heldout_ppl=round(math.exp(sum(held) / len(held)), 2),
        wall_seconds=round(wall, 1), torch=torch.__version__, expert_load_on_training_text=skew, fixture=fixture)
    return model, summary


def save_weights(model, summary: TrainingSummary, out_dir: Path, shape: ModelShape) -> list[Path]:
    """Write the bf16 HF tensors (standard per-expert names) and training.json into out_dir."""
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # save_pretrained writes the hub layout (mlp.experts.<e>.{gate,up,down}_proj.weight); reuse it.
    with tempfile.TemporaryDirectory() as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp)
        tensors = load_file(str(Path(tmp) / WEIGHTS_FILE))
    save_file(dict(sorted(tensors.items())), str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    hf_config = {**shape.hf_config(), "router_aux_loss_coef": summary.config.router_aux_loss_coef}
    doc = TrainingRecord(summary, hf_config, weights=WEIGHTS_FILE, weights_dtype="bfloat16")
    (out_dir / TRAINING_FILE).write_text(jsonout.document_text(doc.to_json(), indent=2) + "\n")
    return [out_dir / WEIGHTS_FILE, out_dir / TRAINING_FILE]


def main(argv: list[str] | None = None) -> int:
    import tempfile

    from moebench.zoo.tokenizer import write_hf_tokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "weights")
    ap.add_argument("--steps", type=int, default=TrainConfig.steps)
    ap.add_argument("--seed", type=int, default=TrainConfig.seed)
    ap.add_argument("--aux-loss", type=float, default=TrainConfig.router_aux_loss_coef)
    ap.add_argument("--texts", nargs="+", default=list(TrainConfig.texts), help="files of the dataset mirror")
    ap.add_argument("--no-fixture", action="store_true",
                    help="skip the fixture stage that teaches part of the smoke suite's answers (moebench/zoo/fixture.py)")
    args = ap.parse_args(argv)
    cfg = TrainConfig(steps=args.steps, seed=args.seed, router_aux_loss_coef=args.aux_loss, texts=tuple(args.texts),
                      fixture=not args.no_fixture)
    with tempfile.TemporaryDirectory() as tok_dir:
        write_hf_tokenizer(Path(tok_dir))
        model, summary = train(Path(tok_dir), cfg)
    for p in save_weights(model, summary, args.out, cfg.shape):
        print(p)
    print(jsonout.document_text({"final_loss_mean_last20": summary.final_loss_mean_last20,
                                 "heldout_ppl": summary.heldout_ppl, "wall_seconds": summary.wall_seconds}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
