"""INT8_ACTIVATIONS decode ("W8A8" / "W4A8", as llama.cpp's MMVQ does with q8_1): activations
rounded to int8 per block of 64 columns, multiplied with the raw weight bytes by dp4a.

x is quantized once per layer (quantize_rows_kernel, or inside add_rmsnorm_router), h per block of
gate_up's BN rows by gate_up itself; the sums are exact int32 per block, then one float multiply per
block (and per int4 / ternary2 weight group). The float decode (WORDS) issues ~7 instructions per
int4 weight element and is issue-bound; dp4a does four multiply-adds in one. It changes the numbers
(x is rounded to 8 bits per block): `quantize_activations` is the torch reference of what the
kernels multiply with.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

from ..quant import GROUP
from .runtime import FMT_INT8, FMT_TERNARY2, grid_dependency, tl, triton, word_tile


def quant_row_len(K: int, block: int) -> int:
    """int32 slots of one quantized row (store_quant's layout): K/4 natural words, K/8 even and K/8
    odd words, then a code sum and a scale per block."""
    return K // 2 + 2 * (K // block)


def quantize_activations(x: Tensor, block: int = GROUP) -> Tensor:
    """What the INT8_ACTIVATIONS kernels multiply with, as float32: each row of x cut into blocks of
    `block` columns from column 0, each block scaled by 127 / its absmax, rounded half to even,
    scaled back."""
    xf = x.float()
    T, K = xf.shape
    pad = -K % block
    xb = torch.nn.functional.pad(xf, (0, pad)).view(T, -1, block)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    amax = torch.where(amax > 0, amax, torch.ones_like(amax))
    q = torch.round(xb * (127.0 / amax))
    return (q * (amax / 127.0)).view(T, -1)[:, :K]


if triton is not None:
    # dp4a through inline PTX on the GPU; the interpreter (CPU tests) runs the same sum in plain integers
    _USE_ASM = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")

    @triton.jit
    def dp4a(a, b, c, SIGNED_A: tl.constexpr):
        """c + sum_i a.byte[i] * b.byte[i] per int32 element: b's bytes signed, a's signed when
        SIGNED_A else unsigned (one instruction for four multiply-adds: sm_61+)."""
        if _USE_ASM:
            if SIGNED_A:
                return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                                 dtype=tl.int32, is_pure=True, pack=1)
            else:
                return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                                 dtype=tl.int32, is_pure=True, pack=1)
        else:
            out = c
            for i in tl.static_range(4):
                bi = (b << (24 - 8 * i)) >> 24
                if SIGNED_A:
                    ai = (a << (24 - 8 * i)) >> 24
                else:
                    ai = (a >> (8 * i)) & 255
                out += ai * bi
            return out

    @triton.jit
    def quant_pack(xx, QB: tl.constexpr):
        """The INT8_ACTIVATIONS quantizer on a float32 tile xx [W, 8] (columns 8w..8w+7 of a row, W * 8
        a multiple of QB): int8 codes per block of QB columns (scale absmax / 127, round half to even;
        quantize_activations is the torch reference), packed four to an int32 word in two layouts:
        natural (columns 8w..8w+3, 8w+4..8w+7: int8 weights' bytes) and even/odd (columns 8w, 8w+2, ...
        and 8w+1, 8w+3, ...: int4 weights' low and high nibbles). Per block: the codes' sum (int4's -8
        offset) and the scale."""
        W: tl.constexpr = xx.shape[0]
        NB: tl.constexpr = W * 8 // QB
        amax = tl.max(tl.reshape(tl.abs(xx), (NB, QB)), axis=1)
        amax = tl.where(amax > 0.0, amax, 1.0)
        inv = tl.reshape(tl.broadcast_to(tl.div_rn(127.0, amax)[:, None], (NB, QB // 8)), (W,))
        p = xx * inv[:, None]
        if _USE_ASM:   # round half to even; asm, so the multiply cannot fuse into an FMA with a rounding add
            q = tl.inline_asm_elementwise("cvt.rni.s32.f32 $0, $1;", "=r,r", [p], dtype=tl.int32, is_pure=True,
                                          pack=1)
        else:          # 1.5 * 2^23 added in float32 rounds to an integer (half to even); its low bits are q
            q = (p + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000
        qsum = tl.sum(tl.reshape(q, (NB, QB)), axis=1)
        j = tl.arange(0, 8)[None, :]
        byte = q & 255
        nat_lo = tl.sum(tl.where(j < 4, byte << (8 * j), 0), axis=1)      # disjoint bytes: the sum is the OR
        nat_hi = tl.sum(tl.where(j >= 4, byte << (8 * (j - 4)), 0), axis=1)
        even = tl.sum(tl.where(j % 2 == 0, byte << (8 * (j // 2)), 0), axis=1)
        odd = tl.sum(tl.where(j % 2 == 1, byte << (8 * (j // 2)), 0), axis=1)
        return nat_lo, nat_hi, even, odd, qsum, tl.div_rn(amax, 127.0)

    @triton.jit
    def store_quant(q_row, w8, wmask, b, bmask, K, QB: tl.constexpr, nat_lo, nat_hi, even, odd, qsum, scale):
        """One quantized row's layout (int32 slots, K a multiple of 64): natural words [K/4], even words
        [K/8], odd words [K/8], code sums [K/QB], scales [K/QB] (float32 bits). w8: 8-column word
        indices; b: block indices."""
        tl.store(q_row + 2 * w8, nat_lo, mask=wmask)
        tl.store(q_row + 2 * w8 + 1, nat_hi, mask=wmask)
        tl.store(q_row + K // 4 + w8, even, mask=wmask)
        tl.store(q_row + K // 4 + K // 8 + w8, odd, mask=wmask)
        tl.store(q_row + K // 2 + b, qsum, mask=bmask)
        tl.store(q_row + K // 2 + K // QB + b, scale.to(tl.int32, bitcast=True), mask=bmask)

    @triton.jit
    def quantize_rows_kernel(x_ptr, q_ptr, K, stride_x, stride_q, W: tl.constexpr, QB: tl.constexpr,
                             PDL: tl.constexpr = False):
        """Program t: row t of x (K columns) quantized into q's layout (store_quant)."""
        grid_dependency(PDL)
        t = tl.program_id(0).to(tl.int64)
        w8 = tl.arange(0, W)
        col = 8 * w8[:, None] + tl.arange(0, 8)[None, :]
        xx = tl.load(x_ptr + t * stride_x + col, mask=col < K, other=0.0).to(tl.float32)
        nat_lo, nat_hi, even, odd, qsum, scale = quant_pack(xx, QB)
        b = tl.arange(0, W * 8 // QB)
        store_quant(q_ptr + t * stride_q, w8, 8 * w8 < K, b, b * QB < K, K, QB, nat_lo, nat_hi, even, odd, qsum,
                    scale)


    @triton.jit
    def a8_group_sums(acc, x_ptr, s_row, rmask, k0, K, KB, CPB: tl.constexpr, OFFSET: tl.constexpr,
                      GROUP_SIZE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, QB: tl.constexpr):
        """The end of an INT8_ACTIVATIONS step over packed codes (int4: CPB 2 columns per byte, codes offset by 8;
        ternary2: CPB 4, offset 1): acc [BN, BK/4] int32 dp4a sums per word -> per x block (QB
        columns) minus OFFSET * the block's code sum, times x's block scale, summed per 64-column
        weight group and scaled by it: [BN] float32."""
        NB: tl.constexpr = CPB * BK // QB
        bi = CPB * k0 // QB + tl.arange(0, NB)
        qsum = tl.load(x_ptr + K // 2 + bi, mask=bi < K // QB, other=0)
        xs = tl.load(x_ptr + K // 2 + K // QB + bi, mask=bi < K // QB, other=0).to(tl.float32, bitcast=True)
        blk = tl.sum(tl.reshape(acc, (BN, NB, QB // (4 * CPB))), axis=2) - OFFSET * qsum[None, :]
        part = blk.to(tl.float32) * xs[None, :]
        NQ: tl.constexpr = BK // (GROUP_SIZE // CPB)
        per_group = tl.sum(tl.reshape(part, (BN, NQ, GROUP_SIZE // QB)), axis=2)
        gi = k0 // (GROUP_SIZE // CPB) + tl.arange(0, NQ)
        gmask = rmask[:, None] & (gi * (GROUP_SIZE // CPB) < KB)[None, :]
        s = tl.load(s_row + gi[None, :], mask=gmask, other=0.0).to(tl.float32)
        return tl.sum(s * per_group, axis=1)

    @triton.jit
    def a8_word_dots(base, s_row, rmask, x_ptr, k0, K, KB, FMT: tl.constexpr, GROUP_SIZE: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, QB: tl.constexpr, EVICT: tl.constexpr = tl.constexpr(""),
                     wv_pre=None, PRE: tl.constexpr = False):
        """row_dots of int8 / int4 / ternary2 rows (int32 words) with x quantized beforehand (x_ptr is
        the store_quant row, QB columns per block): four multiply-adds per dp4a on the raw weight
        bytes, exact int32 sums per block, one float multiply per block (and per weight group). EVICT:
        the word loads' L2 eviction policy. PRE: the step's words are wv_pre, loaded already."""
        wi = k0 // 4 + tl.arange(0, BK // 4)
        if PRE:
            wv = wv_pre
        else:
            wv = word_tile(base, rmask, k0, KB, BK, EVICT)
        zero = tl.zeros((BN, BK // 4), dtype=tl.int32)
        if FMT == FMT_INT8:
            NB: tl.constexpr = BK // QB
            xw = tl.load(x_ptr + wi, mask=wi < K // 4, other=0)
            acc = dp4a(wv, tl.broadcast_to(xw[None, :], (BN, BK // 4)), zero, True)
            bi = k0 // QB + tl.arange(0, NB)
            xs = tl.load(x_ptr + K // 2 + K // QB + bi, mask=bi < K // QB, other=0).to(tl.float32, bitcast=True)
            blk = tl.sum(tl.reshape(acc, (BN, NB, QB // 4)), axis=2)
            return tl.sum(blk.to(tl.float32) * xs[None, :], axis=1)
        elif FMT == FMT_TERNARY2:
            # ternary2: word w = columns 16w..16w+15; (w >> 2j) & 0x03030303 = the codes (trit + 1)
            # of columns 16w+4j..+3, the bytes of x's natural word 4w+j. sum (c - 1) x = dp4a - qsum.
            xi = 4 * wi[:, None] + tl.arange(0, 4)[None, :]
            xx = tl.load(x_ptr + xi, mask=xi < K // 4, other=0)          # [BK/4, 4], contiguous
            xe, xo = tl.split(tl.reshape(xx, (BK // 4, 2, 2)))           # j = 2p + r
            x0, x2 = tl.split(xe)
            x1, x3 = tl.split(xo)
            acc = dp4a(wv & 0x03030303, tl.broadcast_to(x0[None, :], (BN, BK // 4)), zero, False)
            acc = dp4a((wv >> 2) & 0x03030303, tl.broadcast_to(x1[None, :], (BN, BK // 4)), acc, False)
            acc = dp4a((wv >> 4) & 0x03030303, tl.broadcast_to(x2[None, :], (BN, BK // 4)), acc, False)
            acc = dp4a((wv >> 6) & 0x03030303, tl.broadcast_to(x3[None, :], (BN, BK // 4)), acc, False)
            return a8_group_sums(acc, x_ptr, s_row, rmask, k0, K, KB, 4, 1, GROUP_SIZE, BN, BK, QB)
        else:
            xe = tl.load(x_ptr + K // 4 + wi, mask=wi < K // 8, other=0)
            xo = tl.load(x_ptr + K // 4 + K // 8 + wi, mask=wi < K // 8, other=0)
            lo = wv & 0x0F0F0F0F                          # columns 8w, 8w+2, 8w+4, 8w+6
            hi = (wv >> 4) & 0x0F0F0F0F                   # columns 8w+1, ...
            acc = dp4a(lo, tl.broadcast_to(xe[None, :], (BN, BK // 4)), zero, False)
            acc = dp4a(hi, tl.broadcast_to(xo[None, :], (BN, BK // 4)), acc, False)
            return a8_group_sums(acc, x_ptr, s_row, rmask, k0, K, KB, 2, 8, GROUP_SIZE, BN, BK, QB)
else:       # no Triton here: the names exist, require() refuses the launches
    dp4a = quant_pack = store_quant = quantize_rows_kernel = a8_group_sums = a8_word_dots = None
