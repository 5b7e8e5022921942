"""Residual add + RMSNorm and the router (GEMV + softmax + top-k), fused for decode.

A decode step's non-expert work is many tiny kernels (RMSNorm alone is ~8: cast, pow, mean, add,
rsqrt, mul, cast, mul); each costs a few microseconds even inside a CUDA graph, which at 48 layers
dominates the step. These kernels do one op group per launch and round to the activation dtype
where the torch code does, so they agree with it to within reduction order:

  add_rmsnorm         (x + delta, RMSNorm(x + delta) * w); delta may be fused_moe's partials, summed here
  embed_rmsnorm       (table[ids], RMSNorm(table[ids]) * w): the embedding lookup and the first norm
  router_topk         router GEMV + softmax + top-k (+ renormalise) in one launch
  add_rmsnorm_router  both in one launch (and, for INT8_ACTIVATIONS experts, h's int8 rows)
  route_topk          softmax + top-k of given logits: router_topk's reference
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..decode_config import DEFAULT, DecodeConfig
from ..quant import GROUP
from .int8_activations import quant_pack, quant_row_len, store_quant  # noqa: F401 - used by the kernels
from .runtime import (KernelError, grid_dependency, next_pow2, pdl_launch, prefetch_l2, prefetch_launch,  # noqa: F401
                      require, sm_count, sortable_bits, tl, triton)

MAIL_EMPTY = 0x7FBADBAD


def shared_arrivals(device: torch.device, cfg: DecodeConfig) -> Tensor:
    return _arrivals(device, cfg.router_max_tokens)


def shared_mailbox(device: torch.device, cfg: DecodeConfig, experts: int) -> Tensor:
    return _mailbox(device, cfg.router_max_tokens, experts)


# Buffers, not settings: one per (device, size) for the process.
@functools.lru_cache(maxsize=None)
def _arrivals(device: torch.device, tokens: int) -> Tensor:
    """router_topk's per-token arrival counters: zero between calls (each call's last program
    resets its token's counter)."""
    return torch.zeros(tokens, dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=None)
def _mailbox(device: torch.device, tokens: int, experts: int) -> Tensor:
    """add_rmsnorm_router's mailboxes under DecodeConfig.router_poll: int32 [tokens, experts],
    MAIL_EMPTY between calls (each token's polling program empties its row). MAIL_EMPTY is a NaN
    payload no logit has: a logit is rounded to the activation dtype first (bf16 or fp16 leave its
    13+ low bits zero), and a NaN computed in float32 is the canonical 0x7FFFFFFF."""
    return torch.full((tokens, experts), MAIL_EMPTY, dtype=torch.int32, device=device)


if triton is not None:
    EMPTY_SLOT = tl.constexpr(MAIL_EMPTY)

    # The residual add + RMSNorm math, shared by add_rmsnorm_kernel and add_rmsnorm_router_kernel so
    # the two round identically: s = x + delta in x's dtype, inv = 1 / rms(s) over the whole row,
    # out = w * (s * inv rounded to x's dtype), in float32 (the caller rounds it).
    @triton.jit
    def residual_sum(x_ptr, d_ptr, r, N, offs, m, HAS_DELTA: tl.constexpr, DELTA_ROWS: tl.constexpr):
        """Columns offs of row r of x + delta, rounded to x's dtype (x itself when not HAS_DELTA).
        DELTA_ROWS > 1: delta is the sum of rows r * DELTA_ROWS .. + DELTA_ROWS - 1 of d (float32
        partials, added in order and rounded to x's dtype, exactly as moe_sum does)."""
        dt = x_ptr.dtype.element_ty
        x = tl.load(x_ptr + r * N + offs, mask=m, other=0.0)
        if HAS_DELTA:
            if DELTA_ROWS == 1:
                d = tl.load(d_ptr + r * N + offs, mask=m, other=0.0).to(tl.float32)
            else:
                d = tl.zeros(offs.shape, dtype=tl.float32)
                for j in tl.static_range(DELTA_ROWS):
                    d += tl.load(d_ptr + (r * DELTA_ROWS + j) * N + offs, mask=m, other=0.0)
                d = d.to(dt).to(tl.float32)
            x = (x.to(tl.float32) + d).to(dt)
        return x

    @triton.jit
    def rms_inv(s, N, eps):
        """1 / sqrt(mean(s^2) + eps) over a whole row s (masked lanes 0), float32."""
        xf = s.to(tl.float32)
        return 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)

    @triton.jit
    def rms_scale(s, inv, w):
        """w * (s * inv rounded to s's dtype), float32; w: the norm weight's values at s's columns
        (norm_weight). The kernels load the whole row's weight before their PDL wait: loaded after
        the norm's reduction, it would be one more DRAM round trip on every layer's critical path."""
        xn = (s.to(tl.float32) * inv).to(s.dtype).to(tl.float32)
        return w.to(tl.float32) * xn

    @triton.jit
    def norm_weight(w_ptr, offs, m):
        """The norm weight at columns offs (0 on masked lanes), as stored."""
        return tl.load(w_ptr + offs, mask=m, other=0.0)

    @triton.jit
    def add_rmsnorm_kernel(x_ptr, d_ptr, w_ptr, res_ptr, out_ptr, N, eps,
                           HAS_DELTA: tl.constexpr, DELTA_ROWS: tl.constexpr, BLOCK: tl.constexpr,
                           ids_ptr=None, EMBED: tl.constexpr = False,
                           PDL: tl.constexpr = False, LAUNCH_FIRST: tl.constexpr = False):
        """Row r: s = x + delta (rounded to x's dtype, written to res), out = w * norm(s) (see
        residual_sum for DELTA_ROWS > 1). EMBED (no delta): x is the embedding table and row r's
        is table row ids[r], written to res (the embedding lookup and the first norm in one launch)."""
        r = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        m = offs < N
        w = norm_weight(w_ptr, offs, m)         # weights never change in a step: before the wait
        grid_dependency(PDL, LAUNCH_FIRST)
        if EMBED:
            x = tl.load(x_ptr + tl.load(ids_ptr + r).to(tl.int64) * N + offs, mask=m, other=0.0)
            tl.store(res_ptr + r * N + offs, x, mask=m)
        else:
            x = residual_sum(x_ptr, d_ptr, r, N, offs, m, HAS_DELTA, DELTA_ROWS)
        if HAS_DELTA:
            tl.store(res_ptr + r * N + offs, x, mask=m)
        out = rms_scale(x, rms_inv(x, N, eps), w)
        tl.store(out_ptr + r * N + offs, out.to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def softmax_topk_store(z, m, offs, ids_ptr, w_ptr, r, TOPK: tl.constexpr, KP: tl.constexpr,
                           NORM: tl.constexpr, BLOCK_E: tl.constexpr):
        """Softmax over one token's router logits z [BLOCK_E] (float32, -inf where ~m), top-k by k
        rounds of argmax (lowest index wins ties), optional renormalisation; no sort.
        The maxima are taken over int32 keys that order as the floats do (sortable_bits), so a
        warp's max is one integer reduction instruction (REDUX on sm_80+, as the index min already
        was) instead of a float shuffle tree: the same values, picks and ties."""
        zk = sortable_bits(z)
        p = tl.exp(z - sortable_bits(tl.max(zk, axis=0)).to(tl.float32, bitcast=True))
        p = p / tl.sum(p, axis=0)
        # p >= +0.0: its bits order as its values; -1 marks masked and picked lanes, below them all
        pb = tl.where(m, p.to(tl.int32, bitcast=True), -1)
        ks = tl.arange(0, KP)
        vals = tl.zeros((KP,), dtype=tl.float32)
        idx = tl.zeros((KP,), dtype=tl.int64)
        for j in tl.static_range(TOPK):
            best = tl.max(pb, axis=0)
            at = tl.min(tl.where(pb == best, offs, BLOCK_E), axis=0)
            vals = tl.where(ks == j, best.to(tl.float32, bitcast=True), vals)
            idx = tl.where(ks == j, at.to(tl.int64), idx)
            pb = tl.where(offs == at, -1, pb)
        if NORM:
            vals = vals / tl.sum(tl.where(ks < TOPK, vals, 0.0), axis=0)
        tl.store(ids_ptr + r * TOPK + ks, idx, mask=ks < TOPK)
        tl.store(w_ptr + r * TOPK + ks, vals, mask=ks < TOPK)

    @triton.jit
    def route_when_last_arrives(logits_ptr, count_ptr, ids_ptr, w_ptr, t, E, n_blocks, TOPK: tl.constexpr,
                                KP: tl.constexpr, NORM: tl.constexpr, BLOCK_E: tl.constexpr):
        """After a program has stored its logits of token t: it counts itself in (acq_rel), and the
        token's last of the n_blocks programs to arrive reads all E logits, runs softmax_topk_store
        and resets the counter for the next call."""
        arrived = tl.atomic_add(count_ptr + t, 1, sem="acq_rel")
        if arrived == n_blocks - 1:
            offs = tl.arange(0, BLOCK_E)
            m = offs < E
            z = tl.load(logits_ptr + t * E + offs, mask=m, other=float("-inf"), cache_modifier=".cg")
            softmax_topk_store(z, m, offs, ids_ptr, w_ptr, t, TOPK, KP, NORM, BLOCK_E)
            tl.atomic_xchg(count_ptr + t, 0)

    @triton.jit
    def route_when_all_posted(mail_ptr, ids_ptr, w_ptr, t, E, n_blocks, TOPK: tl.constexpr, KP: tl.constexpr,
                              NORM: tl.constexpr, BLOCK_E: tl.constexpr):
        """add_rmsnorm_router_kernel's POLL: the token's last of the n_blocks programs reads its
        mailbox row until no slot is empty, empties it and runs softmax_topk_store on the logits' bits."""
        if tl.program_id(1) == n_blocks - 1:
            offs = tl.arange(0, BLOCK_E)
            m = offs < E
            zb = tl.load(mail_ptr + t * E + offs, mask=m, other=0, volatile=True)
            while tl.max((zb == EMPTY_SLOT).to(tl.int32), axis=0) > 0:
                zb = tl.load(mail_ptr + t * E + offs, mask=m, other=0, volatile=True)
            tl.store(mail_ptr + t * E + offs, tl.full((BLOCK_E,), EMPTY_SLOT, tl.int32), mask=m)
            z = tl.where(m, zb.to(tl.float32, bitcast=True), float("-inf"))
            softmax_topk_store(z, m, offs, ids_ptr, w_ptr, t, TOPK, KP, NORM, BLOCK_E)

    @triton.jit
    def route_topk_kernel(logits_ptr, ids_ptr, w_ptr, E, stride_l, TOPK: tl.constexpr, KP: tl.constexpr,
                          NORM: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr = False):
        """One token: softmax + top-k of its E router logits."""
        grid_dependency(PDL)
        r = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_E)
        m = offs < E
        z = tl.load(logits_ptr + r * stride_l + offs, mask=m, other=float("-inf")).to(tl.float32)
        softmax_topk_store(z, m, offs, ids_ptr, w_ptr, r, TOPK, KP, NORM, BLOCK_E)

    @triton.jit
    def router_topk_kernel(x_ptr, g_ptr, logits_ptr, count_ptr, ids_ptr, w_ptr, E, H, stride_xt, stride_g,
                           TOPK: tl.constexpr, KP: tl.constexpr, NORM: tl.constexpr, BLOCK_E: tl.constexpr,
                           BE: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr = False):
        """Program (token t, block of BE experts): router logits of those experts (a GEMV slice,
        float32, rounded to x's dtype as F.linear rounds them) to `logits`; the token's last program
        to finish (a per-token arrival counter, acq_rel atomics) then runs softmax + top-k on all E
        logits and resets the counter for the next call. One launch where there would be two
        (cuBLAS' M=1 GEMM and route_topk)."""
        grid_dependency(PDL)
        t = tl.program_id(0).to(tl.int64)
        pb = tl.program_id(1)
        rows = pb * BE + tl.arange(0, BE)
        rm = rows < E
        acc = tl.zeros((BE, BH), dtype=tl.float32)
        for h0 in range(0, H, BH):
            cols = h0 + tl.arange(0, BH)
            cm = cols < H
            xv = tl.load(x_ptr + t * stride_xt + cols, mask=cm, other=0.0).to(tl.float32)
            wv = tl.load(g_ptr + rows[:, None].to(tl.int64) * stride_g + cols[None, :],
                         mask=rm[:, None] & cm[None, :], other=0.0).to(tl.float32)
            acc += wv * xv[None, :]
        logit = tl.sum(acc, axis=1).to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(logits_ptr + t * E + rows, logit, mask=rm)
        route_when_last_arrives(logits_ptr, count_ptr, ids_ptr, w_ptr, t, E, tl.num_programs(1), TOPK, KP, NORM,
                                BLOCK_E)

    @triton.jit
    def add_rmsnorm_router_kernel(x_ptr, d_ptr, nw_ptr, res_ptr, h_ptr, g_ptr, logits_ptr, count_ptr, ids_ptr,
                                  w_ptr, q_ptr, N, E, eps, stride_g, stride_q, HAS_DELTA: tl.constexpr,
                                  TOPK: tl.constexpr, KP: tl.constexpr, NORM: tl.constexpr, BLOCK: tl.constexpr,
                                  BLOCK_E: tl.constexpr, BE: tl.constexpr, BH: tl.constexpr, QUANT: tl.constexpr,
                                  QB: tl.constexpr, EARLY: tl.constexpr = False, mail_ptr=None,
                                  POLL: tl.constexpr = False, pf_ptr=None, pf_bytes=0, PF_PARTS: tl.constexpr = 0,
                                  PF_ASM: tl.constexpr = False, PDL: tl.constexpr = False,
                                  LAUNCH_FIRST: tl.constexpr = False):
        """Program (token t, block of BE experts): add_rmsnorm_kernel's row t (program 0 stores res
        and h), then router_topk_kernel's program on that h. Every program normalises the row itself
        (no grid-wide wait for program 0), so the norm's loads are repeated per expert block; they are
        one row each, L2-resident. The GEMV steps, sums and roundings are router_topk_kernel's.
        EARLY (one GEMV step only): the weight rows are loaded before the PDL wait.
        POLL (DecodeConfig.router_poll): no arrival counter; every program also writes its logits'
        bits to the token's mailbox row (int32, MAIL_EMPTY where unwritten), and the token's last
        program reads the row (volatile loads, from L2) until no slot is empty, empties it and runs
        the softmax + top-k: each value tells by itself that it has arrived, so no release fence or
        atomic sits between the last logit and the top-k. The poll cannot starve the programs it
        waits for: only the N polling programs ever wait, and the caller polls only when N is under
        the GPU's SM count, so they never hold every slot; the programs they wait for wait on
        nothing (a launch after this one in the stream starts only once every program of this one
        has started, PDL's trigger; kernels of other streams wait on nothing of this one). The last
        program polls because the CPU interpreter runs it after the others.
        PF_PARTS > 0 (DecodeConfig.l2_prefetch "next_qkv"): expert blocks past the last are prefetch
        programs (token 0's ask L2 for their share of pf_ptr's pf_bytes, runtime.prefetch_l2, before
        the wait) that write nothing; "the last program" is the last expert block's."""
        t = tl.program_id(0).to(tl.int64)
        pb = tl.program_id(1)
        dt = x_ptr.dtype.element_ty
        offs = tl.arange(0, BLOCK)
        m = offs < N
        rows = pb * BE + tl.arange(0, BE)
        rm = rows < E
        # without prefetch programs every program routes: a compile-time True, no test in the code
        if PF_PARTS > 0:
            n_blocks = tl.num_programs(1) - PF_PARTS
            if t == 0 and pb >= n_blocks:
                prefetch_l2(pf_ptr, pf_bytes, pb - n_blocks, PF_PARTS, PF_ASM)
            routes = pb < n_blocks
        else:
            n_blocks = tl.num_programs(1)
            routes = True
        if EARLY:
            w_early = tl.load(g_ptr + rows[:, None].to(tl.int64) * stride_g + offs[None, :],
                              mask=rm[:, None] & m[None, :], other=0.0)
        nw = norm_weight(nw_ptr, offs, m)       # before the wait, as add_rmsnorm_kernel's
        grid_dependency(PDL, LAUNCH_FIRST)
        if routes:
            s = residual_sum(x_ptr, d_ptr, t, N, offs, m, HAS_DELTA, 1)
            inv = rms_inv(s, N, eps)
            h = rms_scale(s, inv, nw).to(dt)
            if pb == 0:
                if HAS_DELTA:
                    tl.store(res_ptr + t * N + offs, s, mask=m)
                tl.store(h_ptr + t * N + offs, h, mask=m)
            acc = tl.zeros((BE, BH), dtype=tl.float32)
            if BH == BLOCK:      # one GEMV step (the usual case): the row is already in registers
                if EARLY:
                    wv = w_early.to(tl.float32)
                else:
                    wv = tl.load(g_ptr + rows[:, None].to(tl.int64) * stride_g + offs[None, :],
                                 mask=rm[:, None] & m[None, :], other=0.0).to(tl.float32)
                acc += wv * h.to(tl.float32)[None, :]
            else:                # BH-column steps: each step's slice of h is recomputed from x, delta, inv
                for h0 in range(0, N, BH):
                    cols = h0 + tl.arange(0, BH)
                    cm = cols < N
                    sc = residual_sum(x_ptr, d_ptr, t, N, cols, cm, HAS_DELTA, 1)
                    hv = rms_scale(sc, inv, norm_weight(nw_ptr, cols, cm)).to(dt).to(tl.float32)
                    wv = tl.load(g_ptr + rows[:, None].to(tl.int64) * stride_g + cols[None, :],
                                 mask=rm[:, None] & cm[None, :], other=0.0).to(tl.float32)
                    acc += wv * hv[None, :]
            logit = tl.sum(acc, axis=1).to(dt).to(tl.float32)
            tl.store(logits_ptr + t * E + rows, logit, mask=rm)
            if POLL:
                tl.store(mail_ptr + t * E + rows, logit.to(tl.int32, bitcast=True), mask=rm)
                route_when_all_posted(mail_ptr, ids_ptr, w_ptr, t, E, n_blocks, TOPK, KP, NORM, BLOCK_E)
            else:
                route_when_last_arrives(logits_ptr, count_ptr, ids_ptr, w_ptr, t, E, n_blocks, TOPK, KP, NORM,
                                        BLOCK_E)
            if QUANT:
                # The experts' int8 activations (INT8_ACTIVATIONS): quantize_rows_kernel's row of h, one
                # block of QB columns per program, recomputed from x, delta and inv (the whole row
                # quantized by one 1-warp program spills on sm_90).
                for qb in range(pb, (N + QB - 1) // QB, n_blocks):
                    cols = qb * QB + tl.arange(0, QB)
                    cm = cols < N
                    sc = residual_sum(x_ptr, d_ptr, t, N, cols, cm, HAS_DELTA, 1)
                    hv = rms_scale(sc, inv, norm_weight(nw_ptr, cols, cm)).to(dt).to(tl.float32)
                    nat_lo, nat_hi, even, odd, qsum, scale = quant_pack(tl.reshape(hv, (QB // 8, 8)), QB)
                    w8 = qb * (QB // 8) + tl.arange(0, QB // 8)
                    b = qb + tl.arange(0, 1)
                    store_quant(q_ptr + t * stride_q, w8, 8 * w8 < N, b, b * QB < N, N, QB, nat_lo, nat_hi, even, odd,
                                qsum, scale)



def add_rmsnorm(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float, delta_rows: int = 1,
                cfg: DecodeConfig = DEFAULT) -> tuple[Tensor, Tensor]:
    """(x + delta, RMSNorm(x + delta) * weight) in one launch, both in x's dtype (delta None: (x,
    norm(x))). Rounds like `x + delta` then model.RMSNorm: the sum to x's dtype, the normalised value
    to x's dtype before the weight. delta_rows > 1: delta is fused_moe(..., reduce=False)'s float32
    partials [rows * delta_rows, N], summed here (this saves moe_sum's launch; same result)."""
    require()
    N = x.shape[-1]
    if weight.shape != (N,):
        raise KernelError(f"add_rmsnorm: weight shape {tuple(weight.shape)}, expected ({N},)")
    xc = x.contiguous()
    out = torch.empty_like(xc)
    res = torch.empty_like(xc) if delta is not None else xc
    dc = delta.contiguous() if delta is not None else xc
    rows = xc.numel() // N
    if delta is not None and dc.numel() != xc.numel() * delta_rows:
        raise KernelError(f"add_rmsnorm: delta shape {tuple(dc.shape)} does not hold {delta_rows} row(s) per row of "
                          f"x {tuple(xc.shape)}")
    if delta_rows > 1 and dc.dtype != torch.float32:
        raise KernelError(f"add_rmsnorm: partial rows (delta_rows={delta_rows}) must be float32, got {dc.dtype}")
    add_rmsnorm_kernel[(rows,)](xc, dc, weight, res, out, N, eps, HAS_DELTA=delta is not None,
                                DELTA_ROWS=delta_rows, BLOCK=next_pow2(N),
                                num_warps=cfg.launch_for("norm", "dense").num_warps if N >= 1024 else 1,
                                **pdl_launch(x.device, cfg, "norm"))
    return res, out



def embed_rmsnorm(table: Tensor, tokens: Tensor, weight: Tensor, eps: float, cfg: DecodeConfig = DEFAULT
                  ) -> tuple[Tensor, Tensor]:
    """(table[tokens], RMSNorm(table[tokens]) * weight) in one launch: the embedding lookup and
    add_rmsnorm(x, None, ...) with the same results. table [V, H] (contiguous), tokens [B, T]
    integer ids in [0, V) (not checked here: the engine checks them) -> both [B, T, H] in table's dtype."""
    require()
    V, N = table.shape
    if weight.shape != (N,) or not table.is_contiguous():
        raise KernelError(f"embed_rmsnorm: table {tuple(table.shape)} (contiguous: {table.is_contiguous()}), norm "
                          f"weight {tuple(weight.shape)}; expected a contiguous [V, H] table and an ({N},) weight")
    ids = tokens.contiguous()
    res = torch.empty(*tokens.shape, N, dtype=table.dtype, device=table.device)
    out = torch.empty_like(res)
    add_rmsnorm_kernel[(ids.numel(),)](table, table, weight, res, out, N, eps, HAS_DELTA=False, DELTA_ROWS=1,
                                       BLOCK=next_pow2(N), ids_ptr=ids, EMBED=True,
                                       num_warps=cfg.launch_for("norm", "dense").num_warps if N >= 1024 else 1,
                                       **pdl_launch(table.device, cfg, "norm"))
    return res, out


def route_topk(logits: Tensor, top_k: int, renormalize: bool, cfg: DecodeConfig = DEFAULT) -> tuple[Tensor, Tensor]:
    """Router logits [N, E] -> (topk_ids [N, k] int64, topk_w [N, k] float32): softmax in float32,
    top-k, optional renormalisation, in one launch per call: router_topk's reference (the same
    softmax and top-k after torch's router GEMV)."""
    require()
    if logits.dim() != 2 or not 0 < top_k <= logits.shape[1]:
        raise KernelError(f"route_topk: logits shape {tuple(logits.shape)} with top_k {top_k}; expected "
                          f"[tokens, experts] and 0 < top_k <= experts")
    lg = logits if logits.stride(-1) == 1 else logits.contiguous()
    N, E = lg.shape
    ids = torch.empty(N, top_k, dtype=torch.long, device=lg.device)
    w = torch.empty(N, top_k, dtype=torch.float32, device=lg.device)
    route_topk_kernel[(N,)](lg, ids, w, E, lg.stride(0), TOPK=top_k, KP=next_pow2(top_k), NORM=renormalize,
                            BLOCK_E=next_pow2(E), num_warps=1, **pdl_launch(logits.device, cfg))
    return ids, w




def router_topk(x: Tensor, weight: Tensor, top_k: int, renormalize: bool, arrivals: Tensor | None = None,
                out: tuple[Tensor, Tensor, Tensor] | None = None, cfg: DecodeConfig = DEFAULT
                ) -> tuple[Tensor, Tensor, Tensor]:
    """x [N, H] (N <= cfg.router_max_tokens), router weight [E, H] -> (logits [N, E] float32 (values
    rounded to x's dtype), topk_ids [N, k] int64, topk_w [N, k] float32): F.linear + route_topk in
    one launch. The arrival counters (int32 [>= N], zero) are shared per device unless `arrivals` is
    given: calls on two streams at once need their own (the host-tier prefetch passes its own).
    out: the three result tensors to write (shapes and dtypes as above), instead of new ones."""
    require()
    N, H = x.shape
    E = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != H or weight.stride(-1) != 1:
        raise KernelError(f"router_topk: weight shape {tuple(weight.shape)}; expected [experts, {H}] with a unit "
                          f"last stride")
    if not 0 < top_k <= E or N > cfg.router_max_tokens:
        raise KernelError(f"router_topk: {N} tokens, top_k {top_k}, {E} experts; expected <= "
                          f"{cfg.router_max_tokens} tokens and 0 < top_k <= experts")
    xc = x if x.stride(-1) == 1 else x.contiguous()
    counts = arrivals if arrivals is not None else shared_arrivals(x.device, cfg)
    if out is None:
        out = (torch.empty(N, E, dtype=torch.float32, device=x.device),
               torch.empty(N, top_k, dtype=torch.long, device=x.device),
               torch.empty(N, top_k, dtype=torch.float32, device=x.device))
    logits, ids, w = out
    want = ((N, E, torch.float32), (N, top_k, torch.long), (N, top_k, torch.float32))
    if any((*t.shape, t.dtype) != wt or not t.is_contiguous() for t, wt in zip(out, want)):
        raise KernelError(f"router_topk: out {[(tuple(t.shape), t.dtype) for t in out]}; expected contiguous "
                          f"{[((a, b), d) for a, b, d in want]}")
    shape = cfg.launch_for("router", "dense")
    be = min(shape.BN, next_pow2(E))
    router_topk_kernel[(N, -(-E // be))](xc, weight, logits, counts, ids, w, E, H, xc.stride(0), weight.stride(0),
                                         TOPK=top_k, KP=next_pow2(top_k), NORM=renormalize,
                                         BLOCK_E=next_pow2(E), BE=be, BH=min(shape.BK, next_pow2(H)),
                                         num_warps=shape.num_warps, num_stages=shape.num_stages,
                                         **pdl_launch(x.device, cfg))
    return logits, ids, w



def add_rmsnorm_router(x: Tensor, delta: Tensor | None, norm_weight: Tensor, eps: float, router_weight: Tensor,
                       top_k: int, renormalize: bool, arrivals: Tensor | None = None, quantize_h: bool = False,
                       cfg: DecodeConfig = DEFAULT, prefetch: Tensor | None = None) -> tuple[Tensor, ...]:
    """add_rmsnorm(x, delta, norm_weight, eps) followed by router_topk(h, router_weight, top_k,
    renormalize) in one launch, bitwise the same results: (res, h) shaped like x in x's dtype, and
    (logits [N, E] float32, topk_ids [N, k] int64, topk_w [N, k] float32) over the N = x.numel() / H
    flattened tokens (N <= cfg.router_max_tokens). `arrivals` as in router_topk. quantize_h (H a multiple
    of 64): also h's int8 rows for fused_moe(xq=...), a sixth result, as quantize_rows_kernel makes
    them (one launch fewer per layer for experts in INT8_ACTIVATIONS). prefetch: a weight the launch's
    extra programs ask L2 for where cfg.l2_prefetch lists "next_qkv" (the next layer's [q; k; v])."""
    require()
    H = x.shape[-1]
    if tuple(norm_weight.shape) != (H,):
        raise KernelError(f"add_rmsnorm_router: norm weight shape {tuple(norm_weight.shape)}, expected ({H},)")
    if router_weight.dim() != 2 or router_weight.shape[1] != H or router_weight.stride(-1) != 1:
        raise KernelError(f"add_rmsnorm_router: router weight shape {tuple(router_weight.shape)}; expected "
                          f"[experts, {H}] with a unit last stride")
    E = router_weight.shape[0]
    xc = x.contiguous()
    N = xc.numel() // H
    if not 0 < top_k <= E or not 0 < N <= cfg.router_max_tokens:
        raise KernelError(f"add_rmsnorm_router: {N} tokens, top_k {top_k}, {E} experts; expected 1 to "
                          f"{cfg.router_max_tokens} tokens and 0 < top_k <= experts")
    if delta is not None and delta.numel() != xc.numel():
        raise KernelError(f"add_rmsnorm_router: delta shape {tuple(delta.shape)}; expected x's {tuple(xc.shape)}")
    if quantize_h and H % GROUP:
        raise KernelError(f"add_rmsnorm_router: quantize_h needs a hidden size that is a multiple of {GROUP}, got {H}")
    counts = arrivals if arrivals is not None else shared_arrivals(x.device, cfg)
    if counts.dtype != torch.int32 or counts.numel() < N:
        raise KernelError(f"add_rmsnorm_router: arrivals {counts.dtype} [{counts.numel()}]; expected int32 with "
                          f">= {N} zeros")
    dc = delta.contiguous() if delta is not None else xc
    res = torch.empty_like(xc) if delta is not None else xc
    h = torch.empty_like(xc)
    logits = torch.empty(N, E, dtype=torch.float32, device=x.device)
    ids = torch.empty(N, top_k, dtype=torch.long, device=x.device)
    w = torch.empty(N, top_k, dtype=torch.float32, device=x.device)
    # router_topk's launch config: same expert blocks and GEMV steps, hence the same sums
    shape = cfg.launch_for("router", "dense")
    be = min(shape.BN, next_pow2(E))
    block = next_pow2(H)
    xq = torch.empty(N, quant_row_len(H, GROUP), dtype=torch.int32, device=x.device) if quantize_h else logits
    # a spinning program holds its slot: fewer of them than SMs leaves the others room to finish
    poll = cfg.router_poll and N < sm_count(x.device)
    pf = prefetch_launch(prefetch, cfg, "next_qkv")
    add_rmsnorm_router_kernel[(N, -(-E // be) + pf.get("PF_PARTS", 0))](
        xc, dc, norm_weight, res, h, router_weight, logits, counts, ids, w, xq, H, E, eps, router_weight.stride(0),
        xq.stride(0), HAS_DELTA=delta is not None, TOPK=top_k, KP=next_pow2(top_k), NORM=renormalize, BLOCK=block,
        BLOCK_E=next_pow2(E), BE=be, BH=min(shape.BK, block), QUANT=quantize_h, QB=GROUP,
        EARLY="router" in cfg.early_weights and shape.BK >= block, POLL=poll,
        **({"mail_ptr": shared_mailbox(x.device, cfg, E)} if poll else {}), num_warps=shape.num_warps,
        num_stages=shape.num_stages, **pf, **pdl_launch(x.device, cfg, "router"))
    return (res, h, logits, ids, w, xq) if quantize_h else (res, h, logits, ids, w)

