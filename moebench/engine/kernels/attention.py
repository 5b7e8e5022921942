"""Decode attention in one Triton launch (two for longer contexts): mask, softmax(q k^T) v, output layout.

Replaces, in model.py `Attention.forward`'s fused decode path, the torch sequence
    slots = arange(kv_len); mask = slots <= positions                 (2-3 tiny kernels)
    out = F.scaled_dot_product_attention(q, k[:B, :, :kv_len], ...)   (cudnn, ~5.5 us)
    out = out.transpose(1, 2).reshape(B, T, NH * D)                   (a copy kernel)
Each of those is a few microseconds of launch-bound work per layer at batch-1 decode; this module
does all of it in one kernel that reads the cache in place, applies the causal-by-position mask from
`positions` itself and writes [B, T, NH * D], the layout o_proj consumes.

It uses flash-decoding: the KV range of each (query row, KV head) is split across programs, each
writing its partial (max, sum, unnormalised output) in float32 to a scratch, and either the last split
of each (query row, KV head) to finish merges them (up to AttentionLaunch.last_split_merges splits:
short contexts) or a small combine kernel does (more splits: longer contexts). Where there is one
split (a context of one block of slots, or AttentionLaunch.short_splits 1) the main kernel writes
the output directly.

Numerics: float32 scores, online softmax (base 2, the scale folded with log2(e)) and float32
accumulation; the output is rounded once to q's dtype. Static shapes given (B, T, kv_len), no host
sync: capturable in a CUDA graph.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from ..decode_config import DEFAULT, AttentionLaunch, DecodeConfig
from .runtime import KernelError, grid_dependency, next_pow2, pdl_launch, require, sm_count, tl, triton  # noqa: F401

# Launch shape and KV splits: DecodeConfig.attention (AttentionLaunch).
LOG2E = 1.4426950408889634

if triton is not None:
    from .rope_kv import norm_rope_head     # the ROPE path's per-head norm + RoPE, qk_rope_cache's own

    @triton.jit
    def _attend_block(q, k, v, smask, m_i, l_i, acc, qk_scale, FP32: tl.constexpr):
        """One block of slots into the online softmax: returns the new (max, sum, acc)."""
        if FP32:
            scores = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(q, tl.trans(k))         # 16-bit inputs: exact products, float32 sums
        scores = tl.where(smask[None, :], scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # A row with no slot yet keeps m = -inf; subtract 0 then so exp2 gives 0, not NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        if FP32:
            acc = tl.dot(p, v, acc, input_precision="ieee")
        else:
            # p in two 16-bit parts (hi + lo, ~16 significant bits) so the tensor-core product
            # keeps p to ~1e-5 relative instead of rounding it to bf16 (one more output rounding).
            p_hi = p.to(v.dtype)
            p_lo = (p - p_hi.to(tl.float32)).to(v.dtype)
            acc = tl.dot(p_hi, v, acc)
            acc = tl.dot(p_lo, v, acc)
        return m_new, l_i, acc

    # kv_len changes every decode step: not specialised (Triton would compile kv_len % 16 == 0 apart).
    @triton.jit(do_not_specialize=["kv_len"])
    def decode_attention_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
                                T, NH, kv_len, chunk, qk_scale,
                                s_qb, s_qh, s_qt, s_cb, s_ch, s_cs, s_pb, s_pt,
                                kn_ptr, vn_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, eps,
                                s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_rb, s_rt,
                                G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
                                SPLIT: tl.constexpr, FP32: tl.constexpr, PDL: tl.constexpr = False,
                                ROPE: tl.constexpr = False, HAS_NORM: tl.constexpr = False,
                                LAUNCH_FIRST: tl.constexpr = False, EARLY_KV: tl.constexpr = False,
                                count_ptr=None, LAST_MERGES: tl.constexpr = False, GR: tl.constexpr = 1,
                                SP: tl.constexpr = 1, TABLES: tl.constexpr = False):
        """Program (b*T + t, kv head, split): the G query heads of one KV head group over the cache
        slots [split * chunk, split * chunk + chunk) that are < kv_len and <= positions[b, t].

        The G heads are the rows of one tile, so each K/V block is loaded once for all of them, and
        both products are tl.dot (tensor cores on the GPU): tl.dot needs every dim >= 16, so the G rows
        are padded to GP >= 16 with zero queries (never stored). The broadcast-multiply alternative
        ([G, BLOCK_S, D] products + tl.sum) runs on the CUDA cores at ~16 FMAs per loaded K/V element,
        close to the H200's float32 rate at full memory bandwidth, and needs large register tiles;
        the padded dot costs no extra memory traffic and keeps the long-context kernel memory-bound.

        ROPE (one-token steps): q is the projection's raw output; each program does qk_rope_cache's
        work for its heads in registers (q/k norm when HAS_NORM, RoPE from cos/sin [b, t], or with
        TABLES from the float32 tables' row positions[b, t], rounded to q's dtype as
        qk_rope_cache rounds it), and the program whose split holds slot positions[b, t] writes this
        step's key and value there (raw kn / vn) before its loop reads the slot: one launch where
        there were two.

        EARLY_KV (one-token steps, DecodeConfig.early_weights "attention_kv"): the split's first
        block of slots before the position loads before the PDL wait; the sums are the same.

        LAST_MERGES (SPLIT, at most AttentionLaunch.last_split_merges splits): each program counts
        itself in at its (row, KV head)'s arrival counter once its partials are stored, and the last
        of the splits to arrive merges them (combine_heads) and resets the counter: no combine launch."""
        bt = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        b = (bt // T).to(tl.int64)
        t = bt % T
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        gmask = g < G
        heads = kvh * G + g
        # The positions are written before a step's first kernel: loaded before the wait, the loop
        # bounds are known when it returns, and the K/V loads start one round trip earlier.
        pos = tl.load(pos_ptr + b * s_pb + t * s_pt).to(tl.int32)     # slots < 2^31; int32 loop bounds
        start = split * chunk
        cache = b * s_cb + kvh.to(tl.int64) * s_ch
        if ROPE and TABLES:
            # the tables never change: their rows load before the wait (rows a kernel of this step
            # wrote load after it)
            c = tl.load(cos_ptr + pos.to(tl.int64) * s_rb + d).to(q_ptr.dtype.element_ty).to(tl.float32)
            sn = tl.load(sin_ptr + pos.to(tl.int64) * s_rb + d).to(q_ptr.dtype.element_ty).to(tl.float32)
        if EARLY_KV:
            # One-token steps: every slot before the row's position holds a key and value an earlier
            # step wrote, so the split's first block of them loads before the wait (its DRAM latency
            # overlaps the kernel before); only the position's own slot is this step's.
            s_first = start + tl.arange(0, BLOCK_S)
            old = s_first < tl.minimum(tl.minimum(start + chunk, kv_len), pos)
            first = cache + s_first[:, None].to(tl.int64) * s_cs + d[None, :]
            k_early = tl.load(k_ptr + first, mask=old[:, None], other=0.0)
            v_early = tl.load(v_ptr + first, mask=old[:, None], other=0.0)
        grid_dependency(PDL, LAUNCH_FIRST)
        # Slots past the row's position (or past kv_len) are never loaded: they may hold garbage.
        end = tl.minimum(tl.minimum(start + chunk, kv_len), pos + 1)
        if ROPE:
            dt = q_ptr.dtype.element_ty
            partner = (d + D // 2) % D
            if not TABLES:
                c = tl.load(cos_ptr + b * s_rb + t * s_rt + d).to(tl.float32)
                sn = tl.load(sin_ptr + b * s_rb + t * s_rt + d).to(tl.float32)
            q = norm_rope_head((q_ptr + b * s_qb + heads * s_qh + t * s_qt)[:, None], qw_ptr, c[None, :],
                               sn[None, :], d[None, :], partner[None, :], eps, HAS_NORM, D, dt, mask=gmask[:, None])
            if (start <= pos) & (pos < start + chunk):
                kr = norm_rope_head(kn_ptr + b * s_kb + t * s_kt + kvh * s_kh, kw_ptr, c, sn, d, partner, eps,
                                    HAS_NORM, D, dt)
                slot = cache + pos.to(tl.int64) * s_cs + d
                tl.store(k_ptr + slot, kr.to(k_ptr.dtype.element_ty))
                vr = tl.load(vn_ptr + b * s_vb + t * s_vt + kvh * s_vh + d)
                tl.store(v_ptr + slot, vr.to(v_ptr.dtype.element_ty))
            tl.debug_barrier()          # the slot's writes, by this program's threads, before its loads
        else:
            q = tl.load(q_ptr + b * s_qb + heads[:, None] * s_qh + t * s_qt + d[None, :], mask=gmask[:, None],
                        other=0.0)
        m_i = tl.full((GP,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((GP,), dtype=tl.float32)
        acc = tl.zeros((GP, D), dtype=tl.float32)
        loop_start = start
        if EARLY_KV:
            if start < end:
                # the first block: its old slots loaded before the wait, the step's own slot after it
                # (masks disjoint: where() gives each slot the one load that read it)
                smask = s_first < end
                late = smask & ~old
                k = tl.where(old[:, None], k_early, tl.load(k_ptr + first, mask=late[:, None], other=0.0))
                v = tl.where(old[:, None], v_early, tl.load(v_ptr + first, mask=late[:, None], other=0.0))
                m_i, l_i, acc = _attend_block(q, k, v, smask, m_i, l_i, acc, qk_scale, FP32)
            loop_start = start + BLOCK_S
        for s0 in range(loop_start, end, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)
            smask = s < end
            offs = cache + s[:, None].to(tl.int64) * s_cs + d[None, :]
            k = tl.load(k_ptr + offs, mask=smask[:, None], other=0.0)
            v = tl.load(v_ptr + offs, mask=smask[:, None], other=0.0)
            m_i, l_i, acc = _attend_block(q, k, v, smask, m_i, l_i, acc, qk_scale, FP32)
        if SPLIT:
            row = (bt * NH + heads).to(tl.int64) * tl.num_programs(2) + split     # [B*T, NH, splits]
            tl.store(part_acc_ptr + row[:, None] * D + d[None, :], acc, mask=gmask[:, None])
            tl.store(part_ml_ptr + row * 2, m_i, mask=gmask)
            tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=gmask)
            if LAST_MERGES:
                # every thread's partial stores, then one acq_rel count: the release covers them all
                tl.debug_barrier()
                counter = count_ptr + bt * tl.num_programs(1) + kvh
                arrived = tl.atomic_add(counter, 1, sem="acq_rel")
                if arrived == tl.num_programs(2) - 1:
                    combine_heads(part_acc_ptr, part_ml_ptr, out_ptr, (bt * NH + kvh * G).to(tl.int64), G,
                                  tl.num_programs(2), D, GR, SP)
                    tl.atomic_xchg(counter, 0)
        else:
            out = acc / l_i[:, None]
            tl.store(out_ptr + (bt * NH + heads[:, None]).to(tl.int64) * D + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])

    @triton.jit
    def combine_heads(part_acc_ptr, part_ml_ptr, out_ptr, r0, G, n_splits, D: tl.constexpr, GR: tl.constexpr,
                      SP: tl.constexpr):
        """The last split's merge (LAST_MERGES): rows r0 .. r0 + G - 1 of [B*T, NH] (one KV head's
        query heads; GR = G rounded up to a power of two), each over its n_splits <= SP partials, as
        combine_kernel merges one row. The splits' loop is unrolled, so all their loads are issued
        before the first is used (one L2 round trip, not one per split). Loads bypass L1 (.cg):
        other programs wrote the partials during this launch."""
        g = tl.arange(0, GR)
        rmask = g < G
        r = r0 + g
        j = tl.arange(0, SP)
        d = tl.arange(0, D)
        ml = (r[:, None] * n_splits + j[None, :]) * 2
        mm = rmask[:, None] & (j < n_splits)[None, :]
        m = tl.load(part_ml_ptr + ml, mask=mm, other=float("-inf"), cache_modifier=".cg")
        l = tl.load(part_ml_ptr + ml + 1, mask=mm, other=0.0, cache_modifier=".cg")
        m_all = tl.max(m, axis=1)
        m_all = tl.where(rmask, m_all, 0.0)      # padding rows (never stored) would be -inf
        total = tl.sum(l * tl.exp2(m - m_all[:, None]), axis=1)
        out = tl.zeros((GR, D), dtype=tl.float32)
        for s in tl.static_range(SP):
            row = r * n_splits + s
            smask = rmask & (s < n_splits)
            m_s = tl.load(part_ml_ptr + row * 2, mask=smask, other=float("-inf"), cache_modifier=".cg")
            acc = tl.load(part_acc_ptr + row[:, None] * D + d[None, :], mask=smask[:, None], other=0.0,
                          cache_modifier=".cg")
            out += acc * tl.exp2(m_s - m_all)[:, None]       # splits with no slot (m = -inf) weigh 0
        out = out / tl.where(rmask, total, 1.0)[:, None]
        tl.store(out_ptr + r[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=rmask[:, None])

    @triton.jit
    def combine_kernel(part_acc_ptr, part_ml_ptr, out_ptr, n_splits, D: tl.constexpr, SP: tl.constexpr,
                       PDL: tl.constexpr = False):
        """Program (b*T + t) * NH + head: merge the head's n_splits partials (base-2 max, sum,
        unnormalised output) into its output row."""
        grid_dependency(PDL)
        r = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, SP)
        d = tl.arange(0, D)
        jmask = j < n_splits
        m = tl.load(part_ml_ptr + (r * n_splits + j) * 2, mask=jmask, other=float("-inf"))
        l = tl.load(part_ml_ptr + (r * n_splits + j) * 2 + 1, mask=jmask, other=0.0)
        acc = tl.load(part_acc_ptr + (r * n_splits + j)[:, None] * D + d[None, :], mask=jmask[:, None], other=0.0)
        m_all = tl.max(m, axis=0)
        w = tl.exp2(m - m_all)          # splits with no slot (m = -inf) weigh 0; slot 0 is always in
        total = tl.sum(l * w, axis=0)
        out = tl.sum(acc * w[:, None], axis=0) / total
        tl.store(out_ptr + r * D + d, out.to(out_ptr.dtype.element_ty))


@functools.lru_cache(maxsize=None)
def _arrivals(device: torch.device, n: int) -> Tensor:
    """The last split's merge's arrival counters of n (row, KV head) pairs: a buffer, one per (device,
    n) for the process, zero between launches (each launch's last split resets its pair's counter)."""
    return torch.zeros(n, dtype=torch.int32, device=device)


def num_splits_for(kv_len: int, programs: int, sm_count: int = 132,
                   launch: AttentionLaunch = DEFAULT.attention) -> int:
    """Splits of the KV range for `programs` = B * T * NKV programs per split: launch.short_splits
    (at most one per block of slots) for contexts shorter than launch.first_split_slots, else enough
    for ~launch.programs_per_sm programs per SM, each split covering at least launch.split_min_slots
    slots."""
    if kv_len < launch.first_split_slots:
        return max(1, min(launch.short_splits, -(-kv_len // launch.block_s)))
    by_length = max(1, kv_len // launch.split_min_slots)
    by_occupancy = max(1, -(-launch.programs_per_sm * sm_count // max(1, programs)))
    return min(by_length, by_occupancy)


@dataclass(frozen=True)
class RopeInputs:
    """What rope_kv.qk_rope_cache takes besides q and the caches, for decode_attention to do its
    work in the same launch (one-token steps): this step's raw keys and values [B, 1, NKV, D] (unit
    last stride), the q/k norm weights (both or neither), eps, and cos / sin: this step's rows
    [B or 1, 1, D] in q's dtype, or the float32 tables [S, D] (model.rope_tables), whose rows the
    kernel reads at the positions (no gather and cast launches)."""

    k: Tensor
    v: Tensor
    q_norm_w: Tensor | None
    k_norm_w: Tensor | None
    eps: float
    cos: Tensor
    sin: Tensor


def _rope_query_layout(q: Tensor, rope: RopeInputs, k_cache: Tensor) -> Tensor:
    """decode_attention's checks of a rope call; returns q [B, 1, NH, D] as the [B, NH, T, D] view the
    kernel indexes (strides only, nothing copied)."""
    if q.dim() != 4 or q.shape[1] != 1:
        raise KernelError(f"decode_attention(rope=...): q {tuple(q.shape)}; expected the raw one-token "
                          f"projection [B, 1, NH, D]")
    B, _, NH, D = q.shape
    NKV = k_cache.shape[1]
    for name, t in (("k", rope.k), ("v", rope.v)):
        if tuple(t.shape) != (B, 1, NKV, D) or t.stride(-1) != 1:
            raise KernelError(f"decode_attention(rope=...): {name} {tuple(t.shape)}; expected [{B}, 1, {NKV}, {D}] "
                              f"with a unit last stride")
    if (rope.q_norm_w is None) != (rope.k_norm_w is None):
        raise KernelError("decode_attention(rope=...): give both q and k norm weights or neither")
    for name, t in (("cos", rope.cos), ("sin", rope.sin)):
        table = t.dim() == 2 and t.shape[1] == D and t.dtype == torch.float32
        if not table and (t.dim() != 3 or t.shape[0] not in (1, B) or tuple(t.shape[1:]) != (1, D)):
            raise KernelError(f"decode_attention(rope=...): {name} {tuple(t.shape)} {t.dtype}; expected "
                              f"[{B} or 1, 1, {D}] or a float32 table [S, {D}]")
    if rope.cos.dim() != rope.sin.dim():
        raise KernelError("decode_attention(rope=...): cos and sin need the same form (rows or tables)")
    if D & (D - 1):
        raise KernelError(f"decode_attention(rope=...): head_dim {D} must be a power of two")
    if q.stride(-1) != 1:
        raise KernelError("decode_attention(rope=...): q needs a unit last stride")
    return q.transpose(1, 2)


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, positions: Tensor, kv_len: int,
                     scale: float | None = None, num_splits: int | None = None,
                     cfg: DecodeConfig = DEFAULT, rope: RopeInputs | None = None) -> Tensor:
    """softmax(q k^T * scale) v over cache slots [0, kv_len) with slot <= positions[b, t], GQA.

    q [B, NH, T, D] (unit last stride; rope_kv.qk_rope_cache's output), k_cache / v_cache
    [B', NKV, S, D] with B' >= B, the same strides and a unit last stride, positions [B, T] integer
    (cache slot of each query), kv_len a python int <= S, scale default 1/sqrt(D). Query head h uses KV
    head h // (NH // NKV), as F.scaled_dot_product_attention(..., enable_gqa=True). Returns
    [B, T, NH * D] contiguous in q's dtype. num_splits forces the KV split count (tests, tuning);
    None picks it from kv_len (`num_splits_for`). q and the caches must share a dtype.
    rope: q is the projection's raw output [B, 1, NH, D] (a view with a unit last stride) and this
    launch also does qk_rope_cache(q, rope.k, rope.v, ...)'s norm, RoPE and cache writes, with the
    same results; one-token steps only (T > 1 would read slots other programs write)."""
    require()
    if rope is not None:
        q = _rope_query_layout(q, rope, k_cache)
    if q.dim() != 4 or k_cache.dim() != 4 or v_cache.dim() != 4:
        raise KernelError(f"decode_attention: q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache "
                          f"{tuple(v_cache.shape)}; expected q [B, NH, T, D] and caches [B', NKV, S, D]")
    B, NH, T, D = q.shape
    Bc, NKV, S, Dc = k_cache.shape
    if D < 16 or D & (D - 1):
        raise KernelError(f"decode_attention: head_dim {D}; expected a power of two >= 16")
    if tuple(v_cache.shape) != tuple(k_cache.shape) or Dc != D or Bc < B:
        raise KernelError(f"decode_attention: k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)} "
                          f"for q {tuple(q.shape)}; expected both [B' >= {B}, NKV, S, {D}]")
    if NH % NKV:
        raise KernelError(f"decode_attention: {NH} query heads, {NKV} KV heads; expected NH % NKV == 0")
    if q.dtype != k_cache.dtype or q.dtype != v_cache.dtype:
        raise KernelError(f"decode_attention: q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}; "
                          f"expected one dtype")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise KernelError("decode_attention: q and the caches need a unit last stride, and k_cache and "
                          "v_cache the same strides")
    if tuple(positions.shape) != (B, T) or positions.dtype.is_floating_point:
        raise KernelError(f"decode_attention: positions {tuple(positions.shape)} {positions.dtype}; "
                          f"expected integer [{B}, {T}]")
    if not 0 < kv_len <= S:
        raise KernelError(f"decode_attention: kv_len {kv_len}; expected 1..{S} (the cache length)")
    if q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1":
        # Seen with triton 3.9: the interpreter's tl.dot on bf16 tiles returns values ~1e10 off.
        raise KernelError("decode_attention: Triton's interpreter miscomputes bf16 tl.dot; use float32 "
                          "or float16 on CPU (bf16 runs compiled on CUDA)")
    G = NH // NKV
    launch = cfg.attention
    block = launch.block_s
    if num_splits is None:
        num_splits = num_splits_for(kv_len, B * T * NKV, sm_count(q.device), launch)
    # Split boundaries on block multiples; recount so no split is empty.
    chunk = -(-(-(-kv_len // max(1, num_splits))) // block) * block
    splits = -(-kv_len // chunk)
    out = torch.empty(B, T, NH * D, dtype=q.dtype, device=q.device)
    if splits > 1:
        part_acc = torch.empty(B * T, NH, splits, D, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(B * T, NH, splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out       # unused
    qk_scale = (1.0 / math.sqrt(D) if scale is None else float(scale)) * LOG2E
    if rope is None:
        extra = [q, q, q, q, q, q, 0.0] + [0] * 8
        rope_kw = {}
    else:
        tables = rope.cos.dim() == 2
        if tables:
            cos, sin = rope.cos, rope.sin
            if cos.stride() != sin.stride() or cos.stride(-1) != 1:
                cos, sin = cos.contiguous(), sin.contiguous()
            cos_strides = (cos.stride(0), 0)
        else:
            cos = rope.cos.expand(B, 1, D) if rope.cos.shape[0] != B else rope.cos
            sin = rope.sin.expand(B, 1, D) if rope.sin.shape[0] != B else rope.sin
            if cos.stride() != sin.stride() or cos.stride(-1) != 1:
                cos, sin = cos.contiguous(), sin.contiguous()
            cos_strides = (cos.stride(0), cos.stride(1))
        has_norm = rope.q_norm_w is not None
        extra = [rope.k, rope.v, rope.q_norm_w if has_norm else q, rope.k_norm_w if has_norm else q, cos, sin,
                 rope.eps, rope.k.stride(0), rope.k.stride(1), rope.k.stride(2), rope.v.stride(0), rope.v.stride(1),
                 rope.v.stride(2), *cos_strides]
        rope_kw = {"ROPE": True, "HAS_NORM": has_norm, "TABLES": tables}
    last = 1 < splits <= launch.last_split_merges
    combine_kw = {"count_ptr": _arrivals(q.device, B * T * NKV), "LAST_MERGES": True, "GR": next_pow2(G),
                  "SP": next_pow2(splits)} if last else {}
    decode_attention_kernel[(B * T, NKV, splits)](
        q, k_cache, v_cache, positions, out, part_acc, part_ml, T, NH, kv_len, chunk, qk_scale,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        positions.stride(0), positions.stride(1), *extra,
        G=G, GP=max(16, next_pow2(G)), D=D, BLOCK_S=block, SPLIT=splits > 1, FP32=q.dtype == torch.float32,
        num_warps=launch.num_warps, num_stages=launch.num_stages, **pdl_launch(q.device, cfg, "attention"),
        EARLY_KV=T == 1 and "attention_kv" in cfg.early_weights, **rope_kw, **combine_kw)
    if splits > 1 and not last:
        combine_kernel[(B * T * NH,)](part_acc, part_ml, out, splits, D=D, SP=next_pow2(splits), num_warps=4,
                                      **pdl_launch(q.device, cfg))
    return out
