"""The reference the decode benchmarks measure against: the Qwen3-30B-A3B shape (and a small CPU
one) as a transformers model with random weights built on the device, an Engine that shares its
tensors, the weight bytes one decode step reads, the device copy bandwidth (the roofline's
denominator) and the extra-tokens-over-extra-time decode rate.
"""
from __future__ import annotations

import time

import torch

from moebench.engine import Engine, ModelConfig

from .measure import sync

QWEN3_30B_A3B = dict(num_hidden_layers=48, num_experts=128, num_experts_per_tok=8, hidden_size=2048,
                     moe_intermediate_size=768, intermediate_size=6144, num_attention_heads=32,
                     num_key_value_heads=4, head_dim=128, vocab_size=151936, norm_topk_prob=True,
                     max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
SMALL = dict(num_hidden_layers=4, num_experts=16, num_experts_per_tok=4, hidden_size=256,
             moe_intermediate_size=128, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
             head_dim=32, vocab_size=4096, norm_topk_prob=True, max_position_embeddings=4096)


def bench_shape(small: bool, layers: int = 0, experts: int = 0) -> dict:
    """SMALL or QWEN3_30B_A3B, a copy; layers > 0: that many decoder layers of the same shape (the
    quantized plans beside the bf16 model then fit a smaller GPU: 24 on an 80 GB one); experts > 0:
    that many experts a layer (the peers' checkpoint has 32: docs/peers-h200.md)."""
    shape = dict(SMALL if small else QWEN3_30B_A3B)
    if layers:
        shape["num_hidden_layers"] = layers
    if experts:
        if experts < shape["num_experts_per_tok"]:
            raise ValueError(f"bench_shape: {experts} experts a layer, fewer than top-k {shape['num_experts_per_tok']}")
        shape["num_experts"] = experts
    return shape


def build_transformers(shape: dict, device: torch.device, dtype: torch.dtype, seed: int):
    import transformers
    cfg = transformers.Qwen3MoeConfig(**shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def engine_sharing_weights(hf, max_seq_len: int, cuda_graphs: bool = False, experts_impl: str = "auto") -> Engine:
    """An Engine whose parameters are the transformers model's tensors (views, no copies)."""
    from .engine_setup import build_engine     # one weight-sharing builder for every decode benchmark
    return build_engine(hf, max_seq_len=max_seq_len, cuda_graphs=cuda_graphs, experts_impl=experts_impl)


def active_bytes_per_token(cfg: ModelConfig, elem: int) -> dict[str, float]:
    """Weight bytes one decode step reads (batch 1): attention, router, top-k experts, norms, lm_head."""
    H, D = cfg.hidden_size, cfg.head_dim
    attn = H * cfg.num_heads * D * 2 + H * cfg.num_kv_heads * D * 2
    expert = 3 * H * cfg.expert_intermediate_size
    per_layer = attn + cfg.num_experts * H + cfg.top_k * expert + 2 * H + 2 * D
    active = cfg.num_layers * per_layer + H + cfg.vocab_size * H + H   # + embedding row + lm_head + norm
    total = cfg.num_layers * (attn + cfg.num_experts * H + cfg.num_experts * expert) + 2 * cfg.vocab_size * H
    return {"active_params": active, "total_params": total, "active_bytes": active * elem,
            "kv_bytes_per_context_token": cfg.num_layers * 2 * cfg.num_kv_heads * D * elem}


def non_expert_bytes_per_token(cfg: ModelConfig, elem: int) -> float:
    """active_bytes_per_token's bytes less the top-k experts': what every expert plan reads alike."""
    experts = cfg.num_layers * cfg.top_k * 3 * cfg.hidden_size * cfg.expert_intermediate_size * elem
    return active_bytes_per_token(cfg, elem)["active_bytes"] - experts


def copy_bandwidth(device: torch.device, nbytes: int, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    t = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * iters / (time.perf_counter() - t)


def timed(fn, device) -> float:
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def decode_rate(run, n_short: int, n_long: int, device, reps: int) -> float:
    """tok/s from the time difference of generating n_long vs n_short tokens (best of reps)."""
    run(n_short)   # warm-up
    short = min(timed(lambda: run(n_short), device) for _ in range(reps))
    long = min(timed(lambda: run(n_long), device) for _ in range(reps))
    return (n_long - n_short) / max(long - short, 1e-9)
