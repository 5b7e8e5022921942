"""Per-head q/k RMSNorm, RoPE and the KV-cache write of a decode step, in one launch (~30 torch ops)."""
from __future__ import annotations

import torch
from torch import Tensor

from ..decode_config import DEFAULT, DecodeConfig
from .runtime import (KernelError, grid_dependency, pdl_launch, prefetch_l2, prefetch_launch, require,  # noqa: F401
                      tl, triton)

if triton is not None:
    @triton.jit
    def norm_rope_head(src, w_ptr, c, s, d, partner, eps, HAS_NORM: tl.constexpr, D: tl.constexpr,
                       dt: tl.constexpr, mask=None):
        """Head vectors along the last axis (src + d: [D], or [rows, D] with src a column of row
        pointers; float32 math, rounded as the torch code rounds): optional RMSNorm, then RoPE with
        rotate_half: out[d] = x[d] cos[d] + sign(d) x[partner(d)] sin[d]. mask: rows to load (others
        read as 0)."""
        if mask is None:
            x = tl.load(src + d).to(tl.float32)
            xp = tl.load(src + partner).to(tl.float32)
        else:
            x = tl.load(src + d, mask=mask, other=0.0).to(tl.float32)
            xp = tl.load(src + partner, mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=-1, keep_dims=True) / D + eps)
            x = (tl.load(w_ptr + d).to(tl.float32) * (x * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            xp = (tl.load(w_ptr + partner).to(tl.float32) * (xp * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        sign = tl.where(d < D // 2, -1.0, 1.0)
        return ((x * c).to(dt).to(tl.float32) + (sign * xp * s).to(dt).to(tl.float32)).to(dt)

    @triton.jit
    def qk_rope_cache_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr,
                             qo_ptr, kc_ptr, vc_ptr, T, NH, eps,
                             s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_cb, s_ct,
                             s_ob, s_oh, s_ot, s_cab, s_cah, s_cas,
                             HAS_NORM: tl.constexpr, D: tl.constexpr, TABLES: tl.constexpr = False,
                             pf_ptr=None, pf_bytes=0, PF_PARTS: tl.constexpr = 0, PF_ASM: tl.constexpr = False,
                             PDL: tl.constexpr = False, LAUNCH_FIRST: tl.constexpr = False):
        """Program (b*T + t, head): query heads -> normed, rotated, written to qo [B, NH, T, D];
        key/value heads -> normed+rotated key and the value written to their cache slot pos[b, t].
        TABLES: cos / sin are the float32 tables [S, D] (row stride s_cb), read at row pos[b, t] and
        rounded to q's dtype here, as `table[positions].to(dtype)` rounds them.
        PF_PARTS > 0 (DecodeConfig.l2_prefetch "o_proj"): the last PF_PARTS programs of row 0's heads
        axis are prefetch programs: each asks L2 for its share of pf_ptr's pf_bytes (runtime.prefetch_l2)
        before the wait, and writes nothing."""
        bt = tl.program_id(0)
        h = tl.program_id(1)
        b = bt // T
        t = bt - b * T
        d = tl.arange(0, D)
        partner = (d + D // 2) % D
        dt = qo_ptr.dtype.element_ty
        # The positions and cos / sin rows are written before a step's first kernel (or never change):
        # loaded before the wait, their round trips overlap the kernel before this one.
        pos = tl.load(pos_ptr + bt).to(tl.int64)
        if TABLES:
            c = tl.load(cos_ptr + pos * s_cb + d).to(dt).to(tl.float32)
            s = tl.load(sin_ptr + pos * s_cb + d).to(dt).to(tl.float32)
        else:
            c = tl.load(cos_ptr + b * s_cb + t * s_ct + d).to(tl.float32)
            s = tl.load(sin_ptr + b * s_cb + t * s_ct + d).to(tl.float32)
        # a program past the query heads is a key/value head, unless it is a prefetch program
        if PF_PARTS > 0:
            heads = tl.num_programs(1) - PF_PARTS
            if bt == 0 and h >= heads:
                prefetch_l2(pf_ptr, pf_bytes, h - heads, PF_PARTS, PF_ASM)
            kv = h < heads
        else:
            kv = True
        grid_dependency(PDL, LAUNCH_FIRST)
        if h < NH:
            out = norm_rope_head(q_ptr + b * s_qb + t * s_qt + h * s_qh, qw_ptr, c, s, d, partner, eps,
                                 HAS_NORM, D, dt)
            tl.store(qo_ptr + b * s_ob + h * s_oh + t * s_ot + d, out)
        elif kv:
            kh = h - NH
            out = norm_rope_head(k_ptr + b * s_kb + t * s_kt + kh * s_kh, kw_ptr, c, s, d, partner, eps,
                                 HAS_NORM, D, dt)
            slot = b * s_cab + kh * s_cah + pos * s_cas + d
            tl.store(kc_ptr + slot, out.to(kc_ptr.dtype.element_ty))
            v = tl.load(v_ptr + b * s_vb + t * s_vt + kh * s_vh + d)
            tl.store(vc_ptr + slot, v.to(vc_ptr.dtype.element_ty))



def qk_rope_cache(q: Tensor, k: Tensor, v: Tensor, q_norm_w: Tensor | None, k_norm_w: Tensor | None,
                  eps: float, cos: Tensor, sin: Tensor, positions: Tensor, k_cache: Tensor,
                  v_cache: Tensor, cfg: DecodeConfig = DEFAULT, prefetch: Tensor | None = None) -> Tensor:
    """q [B, T, NH, D], k/v [B, T, NKV, D] (views with unit last stride), cos/sin [B, T, D] in q's
    dtype or the float32 tables [S, D] (model.rope_tables; rows read at the positions in the
    kernel, which saves a decode step the gather and cast launches), positions [B, T]: per-head
    RMSNorm of q and k (when weights are given), RoPE, and the keys/values written to
    k_cache/v_cache [B', NKV, S, D] at slot positions[b, t]. Returns the rotated queries
    [B, NH, T, D] (contiguous). One launch instead of ~30 small kernels. prefetch: a weight the
    launch's extra programs ask L2 for where cfg.l2_prefetch lists "o_proj" (the layer's o_proj)."""
    require()
    B, T, NH, D = q.shape
    NKV = k.shape[2]
    if D & (D - 1) or D < 2:
        raise KernelError(f"qk_rope_cache: head_dim {D} must be a power of two")
    if (q_norm_w is None) != (k_norm_w is None):
        raise KernelError("qk_rope_cache: give both q and k norm weights or neither")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise KernelError(f"qk_rope_cache: {name} needs a unit last stride")
    if k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise KernelError("qk_rope_cache: k_cache and v_cache need the same layout with a unit last stride")
    tables = cos.dim() == 2
    if tables:
        if cos.shape != sin.shape or cos.shape[1] != D or cos.dtype != torch.float32:
            raise KernelError(f"qk_rope_cache: cos {tuple(cos.shape)} {cos.dtype}, sin {tuple(sin.shape)}; expected "
                              f"float32 tables [S, {D}]")
        if cos.stride() != sin.stride() or cos.stride(-1) != 1:
            cos, sin = cos.contiguous(), sin.contiguous()
        cos_strides = (cos.stride(0), 0)
    else:
        cos = cos.expand(B, T, D) if cos.shape[0] != B else cos
        sin = sin.expand(B, T, D) if sin.shape[0] != B else sin
        if cos.stride() != sin.stride() or cos.stride(-1) != 1:
            cos, sin = cos.contiguous(), sin.contiguous()
        cos_strides = (cos.stride(0), cos.stride(1))
    pos = positions.expand(B, T).contiguous()
    qo = torch.empty(B, NH, T, D, dtype=q.dtype, device=q.device)
    has_norm = q_norm_w is not None
    qw, kw = (q_norm_w, k_norm_w) if has_norm else (qo, qo)
    pf = prefetch_launch(prefetch, cfg, "o_proj")
    qk_rope_cache_kernel[(B * T, NH + NKV + pf.get("PF_PARTS", 0))](
        q, k, v, qw, kw, cos, sin, pos, qo, k_cache, v_cache, T, NH, eps,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), *cos_strides,
        qo.stride(0), qo.stride(1), qo.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HAS_NORM=has_norm, D=D, TABLES=tables, num_warps=1, **pf, **pdl_launch(q.device, cfg, "rope"))
    return qo

