"""The greedy pick of a decode step inside its lm_head GEMV, and the step's feed of the next one.

torch's argmax over the [B, V] logits is a launch of its own (~9 us at V = 151,936 on the H200, plus
its launch gap). Here each lm_head GEMV program folds its rows' logits into one int64 key per token
with an atomic max, and one small launch after it decodes the key: the picks (in one of two rows,
by the step's parity), written to the next step's token inputs too, and the positions moved on by
one (Engine's CUDA graphs; the graphs of a greedy generation then need no copies in).

The key orders like torch.argmax: the larger value wins, the lowest index on ties. Its high 32 bits
are the value's float32 bits made to order as signed integers (negative floats have their 31 low
bits flipped; -0.0 counts as +0.0), its low 32 bits 0xFFFFFFFF - index. NaN logits order above
+inf (positive NaN) or below -inf (negative NaN), where torch.argmax returns the first NaN.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..decode_config import DEFAULT, DecodeConfig
from .runtime import KernelError, grid_dependency, next_pow2, pdl_launch, require, sortable_bits, tl, triton  # noqa: F401

EMPTY_KEY = -(1 << 63)       # below every key: what the feed leaves for the next step's GEMV


def empty_keys(batch: int, device) -> Tensor:
    """A pick-key buffer [batch] int64 for linear(..., pick_keys=...): starts empty, the feed empties it."""
    return torch.full((batch,), EMPTY_KEY, dtype=torch.int64, device=device)


if triton is not None:
    EMPTY = tl.constexpr(EMPTY_KEY)

    @triton.jit
    def fold_pick(key_ptr, y, rows, rmask):
        """Fold this program's rows (values y [BN] float32, indices rows) into key_ptr's max key. The
        atomic runs only where the program's best beats the key seen, so ~V / BN programs do not
        all queue on one address."""
        hi = sortable_bits(tl.where(y == 0.0, 0.0, y))        # -0.0 ties with +0.0, as in torch.argmax
        key = (hi.to(tl.int64) << 32) | (4294967295 - rows.to(tl.int64))
        best = tl.max(tl.where(rmask, key, EMPTY), axis=0)
        if best > tl.load(key_ptr, volatile=True):
            tl.atomic_max(key_ptr, best, sem="relaxed")

    @triton.jit
    def feed_kernel(key_ptr, ids_ptr, tok_ptr, pos_ptr, B, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """One program: picks row (positions[0] % 2) = tokens = the keys' indices, positions += 1,
        keys emptied."""
        grid_dependency(PDL)
        b = tl.arange(0, BLOCK)
        m = b < B
        key = tl.load(key_ptr + b, mask=m, other=0)
        ids = 4294967295 - (key & 4294967295)
        tl.store(ids_ptr + (tl.load(pos_ptr) % 2) * B + b, ids, mask=m)
        tl.store(tok_ptr + b, ids, mask=m)
        tl.store(pos_ptr + b, tl.load(pos_ptr + b, mask=m, other=0) + 1, mask=m)
        tl.store(key_ptr + b, tl.full((BLOCK,), EMPTY, tl.int64), mask=m)


def feed_next_step(keys: Tensor, tokens: Tensor, positions: Tensor, picks: Tensor,
                   cfg: DecodeConfig = DEFAULT) -> None:
    """After a lm_head GEMV that folded its picks into `keys` [B] int64: the picks (int64) to row
    positions[0] % 2 of `picks` [2, B] and to tokens [B, 1], positions [B, 1] += 1, the keys emptied
    for the next step. One launch. Two rows of picks, by the step's parity, so the host's copy of
    one step's picks can run beside the next step, which writes the other row."""
    require()
    B = keys.numel()
    if tokens.numel() != B or positions.numel() != B or not tokens.is_contiguous() or not positions.is_contiguous():
        raise KernelError(f"feed_next_step: tokens {tuple(tokens.shape)}, positions {tuple(positions.shape)}; "
                         f"expected contiguous [{B}, 1]")
    if tuple(picks.shape) != (2, B) or picks.dtype != torch.int64 or not picks.is_contiguous():
        raise KernelError(f"feed_next_step: picks {tuple(picks.shape)} {picks.dtype}; expected int64 [2, {B}]")
    feed_kernel[(1,)](keys, picks, tokens, positions, B, BLOCK=next_pow2(max(B, 2)), num_warps=1,
                      **pdl_launch(keys.device, cfg))
