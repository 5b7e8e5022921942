"""The engine's Triton kernels for decode, one module per concern:

  runtime           Triton's import (CPU interpreter where there is no CUDA), KernelError, PDL launch
  packed            PackedMatrix / ExpertGroup: stacked expert weights as the expert kernels read them
  expert_rows       one expert's rows times x per format and decode mode (bytes, words)
  int8_activations  INT8_ACTIVATIONS: int8 x and h, dp4a (and its torch reference)
  moe_kernels       gate_up / down / moe_sum kernels over (token, expert) pairs
  moe               fused_moe: groups -> launches, side streams, the host lane
  norm_router       residual add + RMSNorm, router GEMV + softmax + top-k, both fused
  rope_kv           q/k norm + RoPE + KV-cache write
  attention         decode attention (flash-decoding splits for long contexts)
  dense_gemv        the attention projections' and the lm_head's GEMV
  greedy_pick       the greedy pick inside the lm_head GEMV, and the feed of the next step's inputs
  staging           side streams, the host lane, and prefetch's stage copies

Every launcher takes the engine's DecodeConfig (`cfg`) for its launch shapes and switches; none of
these modules holds a setting. Static shapes, no host sync: a decode step made of them can be
captured in a CUDA graph.
"""
from .attention import RopeInputs, decode_attention, num_splits_for
from .dense_gemv import linear
from .greedy_pick import empty_keys, feed_next_step
from .int8_activations import quant_row_len, quantize_activations
from .moe import TailSkip, fused_moe, group_mode, wants_quantized_x
from .norm_router import add_rmsnorm, add_rmsnorm_router, embed_rmsnorm, route_topk, router_topk
from .packed import ExpertGroup, PackedMatrix, dense_group
from .rope_kv import qk_rope_cache
from .runtime import KernelError, available, pdl_launch, unavailable_reason
from .staging import host_lane, stage_experts

__all__ = ["RopeInputs", "decode_attention", "num_splits_for", "linear", "empty_keys", "feed_next_step", "quant_row_len", "quantize_activations", "TailSkip", "fused_moe",
           "group_mode", "wants_quantized_x", "add_rmsnorm", "add_rmsnorm_router", "embed_rmsnorm", "route_topk", "router_topk",
           "ExpertGroup", "PackedMatrix", "dense_group", "qk_rope_cache", "KernelError", "available", "pdl_launch", "unavailable_reason",
           "host_lane", "stage_experts"]
