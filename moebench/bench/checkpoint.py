"""A random Qwen3-MoE checkpoint on disk, for benchmarks that load one (peers_h200.py,
engine_paths_h200.py, tiered_prefill.py): the zoo's GPT-2 tokenizer and config, the shape given,
random bf16 weights."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from moebench import jsonout

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
# The shape keys write_checkpoint takes (Qwen3-MoE config names).
SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "num_experts", "num_experts_per_tok", "moe_intermediate_size", "vocab_size")


def tokenizer_dir(root: Path) -> Path:
    """The zoo's tiny-moe folder of the checkout at `root`, or, on a device machine (no zoo there),
    the copy `peers_h200.py stage-source` carries in .peers/tokenizer."""
    zoo = root / "models" / "zoo" / "tiny-moe"
    return zoo if (zoo / "config.json").is_file() else root / ".peers" / "tokenizer"


def model_config(shape: dict[str, int], tokenizer: Path) -> dict[str, Any]:
    """A transformers Qwen3MoeForCausalLM config.json for `shape` (untied output, as the real model)."""
    cfg = json.loads((tokenizer / "config.json").read_text())
    cfg.update(shape, intermediate_size=6144 if shape["hidden_size"] == 2048 else 4 * shape["hidden_size"],
               tie_word_embeddings=False, max_position_embeddings=40960, rope_theta=1_000_000.0,
               rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, dtype="bfloat16")
    return cfg


def write_checkpoint(hf: Path, shape: dict[str, int], seed: int, device: str, tokenizer: Path) -> None:
    """Random bf16 weights, one safetensors file per layer. As decode_setup.realistic_routing does for
    the in-memory benchmarks: embeddings of rms ~1 and o_proj scaled by 0.02 keep each token's identity
    in the residual stream, and Zipf-skewed router rows give token-dependent, skewed expert picks.
    tokenizer: the folder whose config.json and tokenizer files the checkpoint takes (tokenizer_dir)."""
    import torch
    from safetensors.torch import save_file
    hf.mkdir(parents=True, exist_ok=True)
    (hf / "config.json").write_text(jsonout.dumps(model_config(shape, tokenizer), indent=1) + "\n")
    for f in TOKENIZER_FILES:
        shutil.copy2(tokenizer / f, hf / f)
    g = torch.Generator(device=device).manual_seed(seed)
    H, D, I, E = shape["hidden_size"], shape["head_dim"], shape["moe_intermediate_size"], shape["num_experts"]
    nh, nkv, V = shape["num_attention_heads"], shape["num_key_value_heads"], shape["vocab_size"]

    def randn(*size: int, scale: float = 0.02) -> "torch.Tensor":
        return (torch.randn(*size, generator=g, device=device, dtype=torch.float32) * scale).to(torch.bfloat16).cpu()

    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)
    rank_scale = (torch.arange(E, dtype=torch.float32) + 1) ** -0.5
    rank_scale = rank_scale / rank_scale.mean()
    weight_map: dict[str, str] = {}
    for l in range(shape["num_hidden_layers"]):
        p = f"model.layers.{l}."
        t = {p + "input_layernorm.weight": ones(H), p + "post_attention_layernorm.weight": ones(H),
             p + "self_attn.q_norm.weight": ones(D), p + "self_attn.k_norm.weight": ones(D),
             p + "self_attn.q_proj.weight": randn(nh * D, H), p + "self_attn.k_proj.weight": randn(nkv * D, H),
             p + "self_attn.v_proj.weight": randn(nkv * D, H),
             p + "self_attn.o_proj.weight": randn(H, nh * D, scale=0.02 * 0.02)}
        perm = torch.randperm(E, generator=torch.Generator().manual_seed(seed + l))
        router = randn(E, H).float() * rank_scale[torch.argsort(perm)][:, None]
        t[p + "mlp.gate.weight"] = router.to(torch.bfloat16)
        for e in range(E):
            t[p + f"mlp.experts.{e}.gate_proj.weight"] = randn(I, H)
            t[p + f"mlp.experts.{e}.up_proj.weight"] = randn(I, H)
            t[p + f"mlp.experts.{e}.down_proj.weight"] = randn(H, I)
        name = f"model-layer{l:03d}.safetensors"
        save_file(t, str(hf / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in t})
    t = {"model.embed_tokens.weight": randn(V, H, scale=1.0), "lm_head.weight": randn(V, H),
         "model.norm.weight": ones(H)}
    save_file(t, str(hf / "model-rest.safetensors"), metadata={"format": "pt"})
    weight_map.update({k: "model-rest.safetensors" for k in t})
    (hf / "model.safetensors.index.json").write_text(jsonout.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
