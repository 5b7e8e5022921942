"""What a MoE block asks of its experts: the `ExpertsModule` protocol.

Two implementations: `model.Experts` (every expert resident, one dtype, stacked) and
`placement.TieredExperts` (quantized experts over a device tier and a host tier). The model and the
engine call only these members, never a private attribute or a probe for an optional one.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor

from .decode_config import DecodeConfig


@runtime_checkable
class ExpertsModule(Protocol):
    num_experts: int

    def configure(self, cfg: DecodeConfig, top_k: int) -> None:
        """Take the engine's decode config (which experts path runs; tiered experts build their
        fused groups and, with cfg.prefetch_host, their HBM stage of top_k slots)."""

    def __call__(self, x: Tensor, topk_ids: Tensor, topk_w: Tensor) -> Tensor:
        """x [T, H], topk_ids [T, k] int64, topk_w [T, k] -> [T, H]: the routed experts' weighted sum."""

    def partials_ok(self, tokens: int) -> bool:
        """Whether forward_partials runs for this many tokens."""

    def forward_partials(self, x: Tensor, topk_ids: Tensor, topk_w: Tensor, xq: Tensor | None = None) -> Tensor:
        """The float32 weighted terms [T * k, H] (pair t*k + j) whose per-token sums __call__
        returns, for the next residual add + RMSNorm to sum. xq: x's int8 rows (wants_quantized_x)."""

    def wants_quantized_x(self) -> bool:
        """Whether forward_partials multiplies int8 activations (the caller can then hand it x's int8
        rows, made by the post-attention norm's launch)."""

    def sync_free_tokens(self) -> int:
        """Up to how many tokens a call runs without host syncs (CUDA-graph capturable)."""

    def segment_tokens(self) -> int:
        """Up to how many tokens a decode step holding this module can be captured as CUDA graphs
        cut at its host syncs (Engine's segmented graphs); sync_free_tokens for a module without."""

    def segment_with(self, segments) -> None:
        """Capture into the engine's segmented graph `segments` (None: stop)."""

    @property
    def prefetching(self) -> bool:
        """Whether prefetch stages anything (host experts guessed one layer early)."""

    def prefetch(self, h: Tensor, gate_weight: Tensor, top_k: int, renormalize: bool, own_stream: bool = False,
                 ahead: int = 1) -> None:
        """Guess this layer's experts from an earlier hidden state h [1, H] and stage them."""
