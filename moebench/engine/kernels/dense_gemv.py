"""The decode GEMV of the attention projections ([q;k;v] and o_proj).

cuBLAS' M=1 kernels reach ~1.5-1.7 TB/s on the H200 for these [5120 x 2048] / [2048 x 4096]
matrices; a plain row-blocked GEMV with a 2-D float32 accumulator (reduced once at the end) keeps
more bytes in flight per program.
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..decode_config import DEFAULT, DecodeConfig
from .greedy_pick import fold_pick
from .runtime import KernelError, early_steps, grid_dependency, pdl_launch, require, tl, triton  # noqa: F401

if triton is not None:
    @triton.jit
    def early_tile(w_ptr, rows, rmask, stride_wn, K, step, BK: tl.constexpr):
        """W[rows, step * BK : step * BK + BK], loaded as stored (0 past K)."""
        i = step * BK + tl.arange(0, BK)
        return tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wn + i[None, :],
                       mask=rmask[:, None] & (i < K)[None, :], other=0.0)

    @triton.jit
    def early_step(acc, w, x_ptr, K, step, BK: tl.constexpr):
        """acc + w * x[step * BK : step * BK + BK] (an early-loaded K step, as the loop adds it)."""
        i = step * BK + tl.arange(0, BK)
        xk = tl.load(x_ptr + i, mask=i < K, other=0.0).to(tl.float32)
        return acc + w.to(tl.float32) * xk[None, :]

    @triton.jit
    def gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_xt, stride_wn, stride_yt,
                    HAS_BIAS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EARLY: tl.constexpr = 0,
                    ROUND_X: tl.constexpr = False, key_ptr=None, PICK: tl.constexpr = False,
                    PDL: tl.constexpr = False, LAUNCH_FIRST: tl.constexpr = False):
        """Program (row block, token): y[t, rows] = W[rows] . x[t] (+ bias), float32 accumulation.
        EARLY (0 to 4): that many first K steps' weights are loaded before the PDL wait (same sums).
        ROUND_X: y is rounded to x's dtype before it is stored in y's (a wider one). PICK: the
        stored values are folded into token t's greedy-pick key (greedy_pick.fold_pick)."""
        nb = tl.program_id(0)
        t = tl.program_id(1).to(tl.int64)
        rows = nb * BN + tl.arange(0, BN)
        rmask = rows < N
        if EARLY >= 1:
            w0 = early_tile(w_ptr, rows, rmask, stride_wn, K, 0, BK)
        if EARLY >= 2:
            w1 = early_tile(w_ptr, rows, rmask, stride_wn, K, 1, BK)
        if EARLY >= 3:
            w2 = early_tile(w_ptr, rows, rmask, stride_wn, K, 2, BK)
        if EARLY >= 4:
            w3 = early_tile(w_ptr, rows, rmask, stride_wn, K, 3, BK)
        grid_dependency(PDL, LAUNCH_FIRST)
        acc = tl.zeros((BN, BK), dtype=tl.float32)
        xt = x_ptr + t * stride_xt
        if EARLY >= 1:
            acc = early_step(acc, w0, xt, K, 0, BK)
        if EARLY >= 2:
            acc = early_step(acc, w1, xt, K, 1, BK)
        if EARLY >= 3:
            acc = early_step(acc, w2, xt, K, 2, BK)
        if EARLY >= 4:
            acc = early_step(acc, w3, xt, K, 3, BK)
        for k0 in range(EARLY * BK, K, BK):
            i = k0 + tl.arange(0, BK)
            xk = tl.load(xt + i, mask=i < K, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wn + i[None, :],
                        mask=rmask[:, None] & (i < K)[None, :], other=0.0).to(tl.float32)
            acc += w * xk[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        if ROUND_X:
            y = y.to(x_ptr.dtype.element_ty)
        y = y.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + t * stride_yt + rows, y, mask=rmask)
        if PICK:
            fold_pick(key_ptr + t, y.to(tl.float32), rows, rmask)



def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, cfg: DecodeConfig = DEFAULT,
           out_dtype: torch.dtype | None = None, pick_keys: Tensor | None = None, shape: str = "gemv") -> Tensor:
    """F.linear for a few tokens: x [..., K], weight [N, K] (unit last stride), bias [N] or None ->
    [..., N] in x's dtype. One program per (BN rows, token): each token re-reads the weight (from L2
    at best), so this suits decode (1-4 tokens), not prefill. out_dtype (float32 for the lm_head's
    logits): the result's dtype, its values still rounded to x's, as `F.linear(...).to(out_dtype)`
    gives them, without the cast's launch. pick_keys (int64 [tokens], greedy_pick.empty_keys): each
    token's argmax over the result is folded into its key (greedy_pick.feed_next_step reads it).
    shape: the launch table's kernel whose shape the launch takes ("gemv", or "lm_head")."""
    require()
    K = x.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != K or weight.stride(-1) != 1:
        raise KernelError(f"linear: weight shape {tuple(weight.shape)} (last stride {weight.stride(-1)}); "
                          f"expected [out, {K}] with a unit last stride")
    N = weight.shape[0]
    if bias is not None and tuple(bias.shape) != (N,):
        raise KernelError(f"linear: bias shape {tuple(bias.shape)}, expected ({N},)")
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    T = x2.shape[0]
    if pick_keys is not None and (pick_keys.dtype != torch.int64 or pick_keys.numel() != T or N >= 1 << 32):
        raise KernelError(f"linear: pick_keys {pick_keys.dtype} [{pick_keys.numel()}] for {T} tokens of {N} "
                          f"outputs; expected int64 [{T}] and fewer than 2^32 outputs")
    y = torch.empty(T, N, dtype=out_dtype or x.dtype, device=x.device)
    shape = cfg.launch_for(shape, "dense")
    gemv_kernel[(-(-N // shape.BN), T)](x2, weight, bias if bias is not None else weight, y, N, K,
                                         x2.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=bias is not None,
                                         BN=shape.BN, BK=shape.BK, EARLY=early_steps("gemv", K, shape.BK, cfg),
                                         ROUND_X=y.dtype != x.dtype, key_ptr=pick_keys, PICK=pick_keys is not None,
                                         num_warps=shape.num_warps, num_stages=shape.num_stages,
                                         **pdl_launch(x.device, cfg, "gemv"))
    return y.view(*x.shape[:-1], N)

