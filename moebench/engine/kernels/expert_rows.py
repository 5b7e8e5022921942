"""One expert's rows times x, per storage format and decode mode: the inner loop of the expert kernels.

`row_dots` returns [BN] partial dot products of BN rows of one expert slot with x over one K step;
the expert kernels (moe_kernels.py) sum the steps. Dense and int8 steps cover BK columns; packed
formats cover BK *bytes* (int4: 2 columns per byte, ternary: 5, ternary2: 4), so each loaded byte is
decoded once, whole, in registers. Three decodes:
  BYTES  byte loads converted to float (dense, int8, int4, int4_asym, base-3 ternary)
  WORDS  int32 word loads, conversion-free (word_dots): int8, int4, int4_asym, ternary2; base-3
         ternary's padded rows (trit_word_dots)
  INT8_ACTIVATIONS  words times int8 x with dp4a (int8_activations.a8_word_dots)
"""
from __future__ import annotations

from .int8_activations import a8_word_dots
from .runtime import FMT_INT4, FMT_INT8, FMT_TERNARY, FMT_TERNARY2, MODE_BYTES, MODE_INT8_ACT, tl, triton, word_tile

if triton is not None:
    @triton.jit
    def trit_digit(v):
        """(v // 3, v % 3) of byte values 0 <= v <= 242 (int32; the remainder as float32)."""
        q = (v * 21846) >> 16
        return q, (v - q * 3).to(tl.float32)

    @triton.jit
    def trit_term(v, s_row, x_ptr, b, bmask, K, GROUP_SIZE: tl.constexpr):
        """Scaled dot part [BN, BK] of ternary bytes v [BN, BK] (columns 5b..5b+4) with x.

        A per-digit extraction with a [BN, BK] scale gather each is compute-bound (~10 loads and ~60
        ALU ops per byte). Here the five digits come from one chain of exact multiply-shift divisions (v // 3 =
        (v * 21846) >> 16 for v <= 242); a byte's five columns lie in at most two 64-column groups
        (lo = group of column 5b, hi = the next), so the scale is two [BN, BK] loads per byte, not
        five, and the x side (which digits fall in hi, and the -1 offset of the codes, as -sum x)
        is folded into 1-D [BK] vectors, leaving two FMAs per digit on the [BN, BK] tile."""
        c0 = b * 5
        g_lo = c0 // GROUP_SIZE
        hi_start = (g_lo + 1) * GROUP_SIZE          # first column of the next group
        # digit d goes to the hi group iff c0 + d >= hi_start; x is 0 past K (padding trits)
        x0 = tl.load(x_ptr + c0, mask=c0 < K, other=0.0).to(tl.float32)
        x1 = tl.load(x_ptr + c0 + 1, mask=c0 + 1 < K, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + c0 + 2, mask=c0 + 2 < K, other=0.0).to(tl.float32)
        x3 = tl.load(x_ptr + c0 + 3, mask=c0 + 3 < K, other=0.0).to(tl.float32)
        x4 = tl.load(x_ptr + c0 + 4, mask=c0 + 4 < K, other=0.0).to(tl.float32)
        h1 = tl.where(c0 + 1 >= hi_start, x1, 0.0)
        h2 = tl.where(c0 + 2 >= hi_start, x2, 0.0)
        h3 = tl.where(c0 + 3 >= hi_start, x3, 0.0)
        h4 = tl.where(c0 + 4 >= hi_start, x4, 0.0)
        l1 = x1 - h1
        l2 = x2 - h2
        l3 = x3 - h3
        l4 = x4 - h4
        # codes are trit + 1: sum_d (q_d - 1) x_d = sum_d q_d x_d - sum_d x_d
        lo = tl.zeros(v.shape, dtype=tl.float32) - (x0 + l1 + l2 + l3 + l4)[None, :]
        hi = tl.zeros(v.shape, dtype=tl.float32) - (h1 + h2 + h3 + h4)[None, :]
        q, d = trit_digit(v)
        lo += d * x0[None, :]
        q, d = trit_digit(q)
        lo += d * l1[None, :]
        hi += d * h1[None, :]
        q, d = trit_digit(q)
        lo += d * l2[None, :]
        hi += d * h2[None, :]
        q, d = trit_digit(q)
        lo += d * l3[None, :]
        hi += d * h3[None, :]
        d = q.to(tl.float32)                        # the top digit: v // 81 <= 2
        lo += d * l4[None, :]
        hi += d * h4[None, :]
        s_lo = tl.load(s_row + g_lo[None, :], mask=bmask, other=0.0).to(tl.float32)
        # The hi scale exists only when the next group starts inside this byte and before K (the last
        # byte's padding trits may index one group past the row's scales: masked, else inf * 0 = NaN).
        has_hi = (hi_start < c0 + 5) & (hi_start < K)
        s_hi = tl.load(s_row + (g_lo + 1)[None, :], mask=bmask & has_hi[None, :], other=0.0).to(tl.float32)
        return s_lo * lo + s_hi * hi

    @triton.jit
    def next_trit(v, TOP: tl.constexpr):
        """(v // 3, the lowest base-3 digit of v minus 1 as float32) for int32 byte values v <= 255;
        TOP: v is a byte's top digit itself (v // 81 <= 2). The code c becomes the trit as
        (c | 0x4B000000) read as a float minus 2^23 + 1: no conversion."""
        if TOP:
            q = v
            r = v
        else:
            q = (v * 21846) >> 16                           # v // 3 for v <= 255
            r = v - q * 3
        return q, (r | 0x4B000000).to(tl.float32, bitcast=True) - 8388609.0

    @triton.jit
    def column_x(x_ptr, c, hi_start, K):
        """x at columns c (0 from K on) split by scale group: (the part in c's word's first group,
        the part in the next one, from hi_start)."""
        xd = tl.load(x_ptr + c, mask=c < K, other=0.0).to(tl.float32)
        xh = tl.where(c >= hi_start, xd, 0.0)
        return xd - xh, xh

    @triton.jit
    def trit_word_dots(base, s_row, rmask, x_ptr, k0, K, KB, GROUP_SIZE: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, EVICT: tl.constexpr = tl.constexpr("")):
        """row_dots for base-3 ternary rows padded to whole words (PackedMatrix.storage) and read as
        int32 words, BK bytes (BK/4 words) a step; KB is the padded row length. Word w holds
        bytes 4w..4w+3, so columns 20w..20w+19: at most two 64-column groups, so two scale gathers per
        word (the byte path makes two per byte) and the lo / hi split of x is done on 1-D vectors.
        Each code c (trit + 1) becomes the trit as (c | 0x4B000000) read as a float minus 2^23 + 1,
        no conversion. Padding bytes decode to trits of columns >= K, whose x is 0. EVICT: the word
        loads' L2 eviction policy (DecodeConfig.packed_evict_first)."""
        wi = k0 // 4 + tl.arange(0, BK // 4)
        wv = tl.load(base + wi[None, :], mask=rmask[:, None] & (wi < KB // 4)[None, :], other=0, eviction_policy=EVICT)
        c0 = 20 * wi
        g_lo = c0 // GROUP_SIZE
        hi_start = (g_lo + 1) * GROUP_SIZE                  # first column of the next group
        lo = tl.zeros((BN, BK // 4), dtype=tl.float32)
        hi = tl.zeros((BN, BK // 4), dtype=tl.float32)
        for lane in tl.static_range(4):
            v = (wv >> (8 * lane)) & 255
            for d in tl.static_range(5):
                xl, xh = column_x(x_ptr, c0 + (5 * lane + d), hi_start, K)
                v, t = next_trit(v, d == 4)
                lo += t * xl[None, :]
                hi += t * xh[None, :]
        s_lo = tl.load(s_row + g_lo[None, :], mask=rmask[:, None] & (c0 < K)[None, :], other=0.0).to(tl.float32)
        # the hi scale exists only where the next group starts inside the word and before K
        has_hi = (hi_start < c0 + 20) & (hi_start < K)
        s_hi = tl.load(s_row + (g_lo + 1)[None, :], mask=rmask[:, None] & has_hi[None, :], other=0.0).to(tl.float32)
        return tl.sum(s_lo * lo + s_hi * hi, axis=1)

    @triton.jit
    def dense_dot_pair(base_g, base_u, rmask, x_ptr, k0, K, BK: tl.constexpr, EVICT: tl.constexpr = tl.constexpr("")):
        """row_dots' dense BYTES step (float rows, or int8 codes unscaled) for gate's and up's rows of
        one expert at once: x and both tiles are loaded before either is summed (gate then up through
        row_dots would issue up's loads only after gate's cross-warp sum, a barrier). Same sums.
        EVICT: the weight loads' L2 eviction policy ("" or "evict_first", DecodeConfig.experts_evict_first)."""
        i = k0 + tl.arange(0, BK)
        m = rmask[:, None] & (i < K)[None, :]
        xk = tl.load(x_ptr + i, mask=i < K, other=0.0).to(tl.float32)
        wg = tl.load(base_g + i[None, :], mask=m, other=0, eviction_policy=EVICT)
        wu = tl.load(base_u + i[None, :], mask=m, other=0, eviction_policy=EVICT)
        return tl.sum(wg.to(tl.float32) * xk[None, :], axis=1), tl.sum(wu.to(tl.float32) * xk[None, :], axis=1)

    @triton.jit
    def trit_word_dot_pair(base_g, s_row_g, base_u, s_row_u, rmask, x_ptr, k0, K, KB, GROUP_SIZE: tl.constexpr,
                           BN: tl.constexpr, BK: tl.constexpr, EVICT: tl.constexpr = tl.constexpr("")):
        """trit_word_dots of gate's and up's rows of one expert over one K step, as one: both
        matrices' words and scales are loaded before any digit is decoded, and each column's x is
        loaded once for both (trit_word_dots for gate then up loads x twice, and up's words only
        after gate's reduction). Per matrix the same sums, so the same results. EVICT: trit_word_dots'."""
        wi = k0 // 4 + tl.arange(0, BK // 4)
        wm = rmask[:, None] & (wi < KB // 4)[None, :]
        wg = tl.load(base_g + wi[None, :], mask=wm, other=0, eviction_policy=EVICT)
        wu = tl.load(base_u + wi[None, :], mask=wm, other=0, eviction_policy=EVICT)
        c0 = 20 * wi
        g_lo = c0 // GROUP_SIZE
        hi_start = (g_lo + 1) * GROUP_SIZE
        lo_mask = rmask[:, None] & (c0 < K)[None, :]
        has_hi = (hi_start < c0 + 20) & (hi_start < K)
        hi_mask = rmask[:, None] & has_hi[None, :]
        sg_lo = tl.load(s_row_g + g_lo[None, :], mask=lo_mask, other=0.0).to(tl.float32)
        sg_hi = tl.load(s_row_g + (g_lo + 1)[None, :], mask=hi_mask, other=0.0).to(tl.float32)
        su_lo = tl.load(s_row_u + g_lo[None, :], mask=lo_mask, other=0.0).to(tl.float32)
        su_hi = tl.load(s_row_u + (g_lo + 1)[None, :], mask=hi_mask, other=0.0).to(tl.float32)
        lo_g = tl.zeros((BN, BK // 4), dtype=tl.float32)
        hi_g = tl.zeros((BN, BK // 4), dtype=tl.float32)
        lo_u = tl.zeros((BN, BK // 4), dtype=tl.float32)
        hi_u = tl.zeros((BN, BK // 4), dtype=tl.float32)
        for lane in tl.static_range(4):
            vg = (wg >> (8 * lane)) & 255
            vu = (wu >> (8 * lane)) & 255
            for d in tl.static_range(5):
                xl, xh = column_x(x_ptr, c0 + (5 * lane + d), hi_start, K)
                vg, tg = next_trit(vg, d == 4)
                vu, tu = next_trit(vu, d == 4)
                lo_g += tg * xl[None, :]
                hi_g += tg * xh[None, :]
                lo_u += tu * xl[None, :]
                hi_u += tu * xh[None, :]
        return tl.sum(sg_lo * lo_g + sg_hi * hi_g, axis=1), tl.sum(su_lo * lo_u + su_hi * hi_u, axis=1)

    @triton.jit
    def word_x(x_ptr, wi, K, PER: tl.constexpr, BK: tl.constexpr):
        """The PER x vectors [BK/4] of word-packed columns (x[PER * w + j] for j < PER), from one
        contiguous (vectorised) load of [BK/4, PER] split in registers, not PER strided loads."""
        col = PER * wi[:, None] + tl.arange(0, PER)[None, :]
        xx = tl.load(x_ptr + col, mask=col < K, other=0.0).to(tl.float32)
        if PER == 4:
            e, o = tl.split(tl.reshape(xx, (BK // 4, 2, 2)))       # j = 2p + r: e = r 0, o = r 1
            x0, x2 = tl.split(e)
            x1, x3 = tl.split(o)
            return x0, x1, x2, x3
        else:
            e, o = tl.split(tl.reshape(xx, (BK // 4, 4, 2)))       # j = 2p + r
            ee, eo = tl.split(tl.reshape(e, (BK // 4, 2, 2)))      # even j = 4u + 2v: v 0 / 1
            oe, oo = tl.split(tl.reshape(o, (BK // 4, 2, 2)))
            x0, x4 = tl.split(ee)
            x2, x6 = tl.split(eo)
            x1, x5 = tl.split(oe)
            x3, x7 = tl.split(oo)
            return x0, x1, x2, x3, x4, x5, x6, x7

    @triton.jit
    def crumb_lane(acc, wv, xl, LANE: tl.constexpr, BK: tl.constexpr):
        """acc + the four ternary2 terms of byte lane LANE of words wv [BN, BK/4]: xl [BK/4, 4] holds x
        of columns 16w + 4j + LANE, j = 0..3 (the code of column 16w + 4j + l is bits 8l + 2j..)."""
        p, q = tl.split(tl.reshape(xl, (BK // 4, 2, 2)))           # j = 2c + r
        x0, x2 = tl.split(p)
        x1, x3 = tl.split(q)
        acc += ((((wv >> (8 * LANE)) & 3) | 0x4B000000).to(tl.float32, bitcast=True) - 8388609.0) * x0[None, :]
        acc += ((((wv >> (8 * LANE + 2)) & 3) | 0x4B000000).to(tl.float32, bitcast=True) - 8388609.0) * x1[None, :]
        acc += ((((wv >> (8 * LANE + 4)) & 3) | 0x4B000000).to(tl.float32, bitcast=True) - 8388609.0) * x2[None, :]
        acc += ((((wv >> (8 * LANE + 6)) & 3) | 0x4B000000).to(tl.float32, bitcast=True) - 8388609.0) * x3[None, :]
        return acc


    @triton.jit
    def word_dots(base, s_row, m_row, rmask, x_ptr, k0, K, KB,
                  FMT: tl.constexpr, GROUP_SIZE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  EVICT: tl.constexpr = tl.constexpr(""), wv_pre=None, PRE: tl.constexpr = False):
        """row_dots for int8 / int4 / int4_asym / ternary2 rows read as int32 words (BK bytes = BK/4
        words per step) with float x. No int-to-float conversion instructions, which run at 1/8 of the
        FMA rate and capped the byte path: a code c in the low bits of (0x4B000000 | c) read as a
        float is 2^23 + c, so one OR and one float subtract decode it. int8 bytes are flipped to
        offset binary (XOR 0x80) first; int4 codes are already unsigned. x is loaded once per step
        and split in registers (word_x). EVICT: the word loads' L2 eviction policy. PRE: the step's
        words are wv_pre, loaded already (word_tile), so the sums are the same as loading them here."""
        wi = k0 // 4 + tl.arange(0, BK // 4)
        if PRE:
            wv = wv_pre
        else:
            wv = word_tile(base, rmask, k0, KB, BK, EVICT)
        acc = tl.zeros((BN, BK // 4), dtype=tl.float32)
        if FMT == FMT_INT8:
            wv = wv ^ -2139062144                      # 0x80808080: byte q -> q + 128
            xq = word_x(x_ptr, wi, K, 4, BK)
            for j in tl.static_range(4):
                xj = xq[j]
                q = (((wv >> (8 * j)) & 255) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
                acc += q * xj[None, :]
            return tl.sum(acc, axis=1)
        elif FMT == FMT_TERNARY2:
            # ternary2, float x: column 16w + 4j + l is in bits 8l + 2j..; OR-ing 0x4B000000 onto the
            # 2-bit code c and reading it as a float gives 2^23 + c, so subtracting 2^23 + 1 gives the
            # trit. x comes from one contiguous [BK/4, 16] load, split in registers by lane (l = m % 4
            # of column 16w + m), then by j inside crumb_lane (16 strided loads per step made it
            # slower than base-3 ternary).
            col = 16 * wi[:, None] + tl.arange(0, 16)[None, :]
            xx = tl.load(x_ptr + col, mask=col < K, other=0.0).to(tl.float32)
            e, o = tl.split(tl.reshape(xx, (BK // 4, 8, 2)))          # m = 2a + r
            l0, l2 = tl.split(tl.reshape(e, (BK // 4, 4, 2)))         # a = 2b + r: m = 4b, 4b + 2
            l1, l3 = tl.split(tl.reshape(o, (BK // 4, 4, 2)))         # m = 4b + 1, 4b + 3
            acc = crumb_lane(acc, wv, l0, 0, BK)
            acc = crumb_lane(acc, wv, l1, 1, BK)
            acc = crumb_lane(acc, wv, l2, 2, BK)
            acc = crumb_lane(acc, wv, l3, 3, BK)
            NG: tl.constexpr = BK // (GROUP_SIZE // 4)
            per_group = tl.sum(tl.reshape(acc, (BN, NG, GROUP_SIZE // 16)), axis=2)
            gi = k0 // (GROUP_SIZE // 4) + tl.arange(0, NG)
            gmask = rmask[:, None] & (gi * (GROUP_SIZE // 4) < KB)[None, :]
            s = tl.load(s_row + gi[None, :], mask=gmask, other=0.0).to(tl.float32)
            return tl.sum(s * per_group, axis=1)
        else:
            # word w holds columns 8w..8w+7, column 8w+j in bits 4j..4j+3; 8 words = one 64-column group
            xs = tl.zeros((BK // 4,), dtype=tl.float32)
            xq = word_x(x_ptr, wi, K, 8, BK)
            for j in tl.static_range(8):
                xj = xq[j]
                if FMT == FMT_INT4:
                    q = (((wv >> (4 * j)) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # c - 8
                else:
                    q = (((wv >> (4 * j)) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                    xs += xj
                acc += q * xj[None, :]
            NG: tl.constexpr = BK // (GROUP_SIZE // 2)
            per_group = tl.sum(tl.reshape(acc, (BN, NG, GROUP_SIZE // 8)), axis=2)
            gi = k0 // (GROUP_SIZE // 2) + tl.arange(0, NG)
            gmask = rmask[:, None] & (gi * (GROUP_SIZE // 2) < KB)[None, :]
            s = tl.load(s_row + gi[None, :], mask=gmask, other=0.0).to(tl.float32)
            if FMT == FMT_INT4:
                return tl.sum(s * per_group, axis=1)
            else:
                x_group = tl.sum(tl.reshape(xs, (NG, GROUP_SIZE // 8)), axis=1)
                mn = tl.load(m_row + gi[None, :], mask=gmask, other=0.0).to(tl.float32)
                return tl.sum(s * per_group + mn * x_group[None, :], axis=1)


    @triton.jit
    def row_dots(w_ptr, s_ptr, m_ptr, slot, rows, rmask, x_ptr, k0, K, KB,
                 stride_we, stride_wr, stride_se, stride_sr,
                 FMT: tl.constexpr, MODE: tl.constexpr, GROUP_SIZE: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, QB: tl.constexpr, EVICT: tl.constexpr = tl.constexpr(""),
                 wv_pre=None, PRE: tl.constexpr = False):
        """[BN] partial dots of rows of one expert with x over one K step (int8: unscaled codes).
        EVICT: the weight loads' L2 eviction policy (the launch sets it from experts_evict_first for
        dense rows and int8 byte rows, from packed_evict_first for the others).
        Dense/int8 steps cover BK columns from k0; packed formats cover BK *bytes* from k0 (int4:
        2 columns per byte, ternary: 5), so each loaded byte is decoded once, whole, in registers.
        MODE WORDS / INT8_ACTIVATIONS: the rows come as an int32 view (strides in words); see word_dots
        and int8_activations.a8_word_dots (x_ptr is then x's quantized row, blocks of QB columns).
        PRE (those modes, not base-3 ternary): the step's words are wv_pre, loaded already (word_tile)."""
        base = w_ptr + slot * stride_we + rows[:, None] * stride_wr
        s_row = s_ptr + slot * stride_se + rows[:, None] * stride_sr     # unused (and not built) for dense rows
        if MODE != MODE_BYTES and FMT == FMT_TERNARY:
            return trit_word_dots(base, s_row, rmask, x_ptr, k0, K, KB, GROUP_SIZE, BN, BK, EVICT)
        elif MODE == MODE_INT8_ACT:
            return a8_word_dots(base, s_row, rmask, x_ptr, k0, K, KB, FMT, GROUP_SIZE, BN, BK, QB, EVICT, wv_pre, PRE)
        elif MODE != MODE_BYTES:
            return word_dots(base, s_row, m_ptr + slot * stride_se + rows[:, None] * stride_sr, rmask, x_ptr,
                             k0, K, KB, FMT, GROUP_SIZE, BN, BK, EVICT, wv_pre, PRE)
        else:   # an explicit else: the compiler builds code after a constexpr-if's return too
            i = k0 + tl.arange(0, BK)
            if FMT <= FMT_INT8:
                m = rmask[:, None] & (i < K)[None, :]
                xk = tl.load(x_ptr + i, mask=i < K, other=0.0).to(tl.float32)
                w = tl.load(base + i[None, :], mask=m, other=0, eviction_policy=EVICT).to(tl.float32)
                return tl.sum(w * xk[None, :], axis=1)
            else:
                bmask = rmask[:, None] & (i < KB)[None, :]
                v = tl.load(base + i[None, :], mask=bmask, other=0, eviction_policy=EVICT).to(tl.int32)
                if FMT == FMT_TERNARY:
                    return tl.sum(trit_term(v, s_row, x_ptr, i, bmask, K, GROUP_SIZE), axis=1)
                else:
                    # Low nibble = even column, high nibble = odd column. A group of 64 columns is 32 bytes:
                    # the products are summed per group first and scaled once per (row, group), so the
                    # scales are [BN, BK/32] loads, not one gather per byte.
                    lo = (v & 15).to(tl.float32)
                    hi = ((v >> 4) & 15).to(tl.float32)
                    x0 = tl.load(x_ptr + 2 * i, mask=2 * i < K, other=0.0).to(tl.float32)
                    x1 = tl.load(x_ptr + 2 * i + 1, mask=2 * i + 1 < K, other=0.0).to(tl.float32)
                    gi = k0 // (GROUP_SIZE // 2) + tl.arange(0, BK // (GROUP_SIZE // 2))
                    gmask = rmask[:, None] & (gi * (GROUP_SIZE // 2) < KB)[None, :]
                    s = tl.load(s_row + gi[None, :], mask=gmask, other=0.0).to(tl.float32)
                    if FMT == FMT_INT4:
                        prod = (lo - 8.0) * x0[None, :] + (hi - 8.0) * x1[None, :]
                        per_group = tl.sum(tl.reshape(prod, (BN, BK // (GROUP_SIZE // 2), GROUP_SIZE // 2)), axis=2)
                        return tl.sum(s * per_group, axis=1)
                    else:
                        prod = lo * x0[None, :] + hi * x1[None, :]
                        per_group = tl.sum(tl.reshape(prod, (BN, BK // (GROUP_SIZE // 2), GROUP_SIZE // 2)), axis=2)
                        x_group = tl.sum(tl.reshape(x0 + x1, (BK // (GROUP_SIZE // 2), GROUP_SIZE // 2)), axis=1)
                        mn = tl.load(m_ptr + slot * stride_se + rows[:, None] * stride_sr + gi[None, :], mask=gmask,
                                     other=0.0).to(tl.float32)
                        return tl.sum(s * per_group + mn * x_group[None, :], axis=1)

else:       # no Triton here: the names exist, require() refuses the launches
    row_dots = dense_dot_pair = trit_word_dot_pair = None
