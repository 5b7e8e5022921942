"""The expert kernels of a decode step, over the (token, expert) pairs of up to two expert groups:

  gate_up: grid (T*k pairs, I / BN)  h[p] = silu(W_gate[e] x[t]) * (W_up[e] x[t])   (float32 h)
  down:    grid (T*k pairs, H / BN)  part[p] = w[p] * (W_down[e] h[p])             (float32 part)
  expert_ffn: grid (T*k*(I/BN) + T*k*(H/BN),)  gate_up's and down's programs in one launch, one group;
                                     a pair's down programs wait for that pair's h alone
  moe_sum: grid (T, H / 1024)        out[t] = sum_j part[t*k + j], j in order       (x's dtype)
  tail_skip: grid (T*k, H / BLOCK)   route-tail-skip: drop cold pairs of rank >= FROM (ids -1, part 0)

Each selected expert's rows are read in place from the stacked weights, exactly once, never copied.
The weighted sum is done in a fixed order by its own small kernel (or by the next residual add +
RMSNorm, norm_router.residual_sum), so it is deterministic and needs no atomics. moe.fused_moe
launches them.
"""
from __future__ import annotations

from .expert_rows import dense_dot_pair, row_dots, trit_word_dot_pair
from .int8_activations import quant_pack, store_quant
from .runtime import FMT_INT8, FMT_TERNARY, MODE_BYTES, MODE_INT8_ACT, grid_dependency, tl, triton, word_tile

if triton is not None:
    @triton.jit
    def pair_slot(ids_ptr, slot_ptr, pair, HAS_MAP: tl.constexpr, DROPPED: tl.constexpr = False):
        """The stack slot of pair `pair`'s expert in this launch's group (-1: another group's).
        DROPPED: ids may hold -1, a pair route-tail-skip dropped, which is in no group."""
        slot = tl.load(ids_ptr + pair).to(tl.int64)        # the expert id is the slot without a map
        if HAS_MAP:
            if DROPPED:
                mapped = tl.load(slot_ptr + tl.maximum(slot, 0)).to(tl.int64)
                slot = tl.where(slot >= 0, mapped, -1)
            else:
                slot = tl.load(slot_ptr + slot).to(tl.int64)
        return slot

    @triton.jit
    def count_pick(ids_ptr, picks_ptr, pair, blk):
        """picks[expert of `pair`] += 1, once per pair (from the program of its row block 0)."""
        if blk == 0:
            tl.atomic_add(picks_ptr + tl.load(ids_ptr + pair).to(tl.int64), 1)

    @triton.jit
    def gate_up_rows(x_row, h_out, hq_out, slot, blk, rows, rmask, N, K, KB, g_ptr, gs_ptr, gm_ptr, u_ptr, us_ptr,
                     um_ptr, stride_ge, stride_gr, stride_gse, stride_gsr, stride_ue, stride_ur, stride_use, stride_usr,
                     FMT: tl.constexpr, MODE: tl.constexpr, GROUP_SIZE: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, EVICT: tl.constexpr = tl.constexpr("")):
        """h rows = silu(W_gate x) * (W_up x) for one expert slot of one group: rows blk * BN + [0, BN).
        INT8_ACTIVATIONS: x_row is x's quantized row (blocks of GROUP_SIZE), and h goes out quantized,
        block blk of BN rows (a multiple of 8), into hq_out, the pair's row of down's quantized input.
        EVICT: row_dots'."""
        g = tl.zeros((BN,), dtype=tl.float32)
        u = tl.zeros((BN,), dtype=tl.float32)
        if FMT <= FMT_INT8:
            lim = K
        else:
            lim = KB
        if FMT == FMT_INT8:
            # int8's per-row scales before the K loop: loaded after it, behind the loop's sums, they
            # would be one more round trip at every program's end
            g_scale = tl.load(gs_ptr + slot * stride_gse + rows * stride_gsr, mask=rmask, other=0.0).to(tl.float32)
            u_scale = tl.load(us_ptr + slot * stride_use + rows * stride_usr, mask=rmask, other=0.0).to(tl.float32)
        # gate's and up's rows of this expert slot (dense strides in elements, packed in bytes or words)
        g_base = g_ptr + slot * stride_ge + rows[:, None] * stride_gr
        u_base = u_ptr + slot * stride_ue + rows[:, None] * stride_ur
        if FMT <= FMT_INT8 and MODE == MODE_BYTES:
            # dense rows (and int8 bytes): both tiles of a step loaded before either is summed (bf16's
            # single K step has no software pipelining that would hide a second round trip)
            for k0 in range(0, lim, BK):
                gk, uk = dense_dot_pair(g_base, u_base, rmask, x_row, k0, K, BK, EVICT)
                g += gk
                u += uk
        elif FMT == FMT_TERNARY and MODE != MODE_BYTES:
            # base-3 words: gate's and up's words, scales and x loaded once, before either is decoded
            for k0 in range(0, lim, BK):
                gk, uk = trit_word_dot_pair(g_base, gs_ptr + slot * stride_gse + rows[:, None] * stride_gsr,
                                            u_base, us_ptr + slot * stride_use + rows[:, None] * stride_usr,
                                            rmask, x_row, k0, K, KB, GROUP_SIZE, BN, BK, EVICT)
                g += gk
                u += uk
        else:
            for k0 in range(0, lim, BK):
                g += row_dots(g_ptr, gs_ptr, gm_ptr, slot, rows, rmask, x_row, k0, K, KB, stride_ge, stride_gr,
                              stride_gse, stride_gsr, FMT, MODE, GROUP_SIZE, BN, BK, GROUP_SIZE, EVICT)
                u += row_dots(u_ptr, us_ptr, um_ptr, slot, rows, rmask, x_row, k0, K, KB, stride_ue, stride_ur,
                              stride_use, stride_usr, FMT, MODE, GROUP_SIZE, BN, BK, GROUP_SIZE, EVICT)
        if FMT == FMT_INT8:
            g = g * g_scale
            u = u * u_scale
        h = g / (1.0 + tl.exp(-g)) * u
        if MODE == MODE_INT8_ACT:
            nat_lo, nat_hi, even, odd, qsum, scale = quant_pack(tl.reshape(h, (BN // 8, 8)), BN)
            w8 = blk * (BN // 8) + tl.arange(0, BN // 8)
            b = blk + tl.arange(0, 1)
            store_quant(hq_out, w8, 8 * w8 < N, b, b * BN < N, N, BN, nat_lo, nat_hi, even, odd, qsum, scale)
        else:
            tl.store(h_out + rows, h, mask=rmask)

    @triton.jit
    def gate_up_kernel(x_ptr, xq_ptr, ids_ptr, h_ptr, hq_ptr, N, K, stride_xt, stride_xqt, stride_ht, stride_hqt,
                       slot_a, ga_ptr, gsa_ptr, gma_ptr, ua_ptr, usa_ptr, uma_ptr, KB_a,
                       sge_a, sgr_a, sgse_a, sgsr_a, sue_a, sur_a, suse_a, susr_a,
                       slot_b, gb_ptr, gsb_ptr, gmb_ptr, ub_ptr, usb_ptr, umb_ptr, KB_b,
                       sge_b, sgr_b, sgse_b, sgsr_b, sue_b, sur_b, suse_b, susr_b,
                       TOPK: tl.constexpr, GROUP_SIZE: tl.constexpr, BN: tl.constexpr,
                       FMT_A: tl.constexpr, MAP_A: tl.constexpr, MODE_A: tl.constexpr, BK_A: tl.constexpr,
                       HAS_B: tl.constexpr, FMT_B: tl.constexpr, MAP_B: tl.constexpr, MODE_B: tl.constexpr,
                       BK_B: tl.constexpr, DROPPED: tl.constexpr = False, EVICT: tl.constexpr = "",
                       PDL: tl.constexpr = False):
        """Program (pair, row block) for up to two expert groups (A, and B when HAS_B): each pair's
        expert is in at most one of them; a pair in neither is left to another launch. Two groups per
        launch: a hot/cold plan's second format costs no extra launches (~3 us each).
        xq / hq: x and h quantized (store_quant rows), for groups in INT8_ACTIVATIONS.
        DROPPED: ids may hold -1 (pairs route-tail-skip dropped: in no group).
        EVICT: the weight rows' L2 eviction policy (DecodeConfig.experts_evict_first for dense rows
        and int8 byte rows, packed_evict_first for the others)."""
        grid_dependency(PDL)
        pair = tl.program_id(0)
        rows = tl.program_id(1) * BN + tl.arange(0, BN)
        rmask = rows < N
        tok = pair // TOPK
        h_out = h_ptr + pair * stride_ht
        hq_out = hq_ptr + pair * stride_hqt
        sa = pair_slot(ids_ptr, slot_a, pair, MAP_A, DROPPED)
        if sa >= 0:
            if MODE_A == MODE_INT8_ACT:
                xa = xq_ptr + tok * stride_xqt
            else:
                xa = x_ptr + tok * stride_xt
            gate_up_rows(xa, h_out, hq_out, sa, tl.program_id(1), rows, rmask, N, K, KB_a, ga_ptr, gsa_ptr, gma_ptr,
                         ua_ptr, usa_ptr, uma_ptr, sge_a, sgr_a, sgse_a, sgsr_a, sue_a, sur_a, suse_a, susr_a,
                         FMT_A, MODE_A, GROUP_SIZE, BN, BK_A, EVICT)
        elif HAS_B:
            sb = pair_slot(ids_ptr, slot_b, pair, MAP_B, DROPPED)
            if sb >= 0:
                if MODE_B == MODE_INT8_ACT:
                    xb = xq_ptr + tok * stride_xqt
                else:
                    xb = x_ptr + tok * stride_xt
                gate_up_rows(xb, h_out, hq_out, sb, tl.program_id(1), rows, rmask, N, K, KB_b, gb_ptr,
                             gsb_ptr, gmb_ptr, ub_ptr, usb_ptr, umb_ptr, sge_b, sgr_b, sgse_b, sgsr_b, sue_b, sur_b,
                             suse_b, susr_b, FMT_B, MODE_B, GROUP_SIZE, BN, BK_B, EVICT)

    @triton.jit
    def early_down_tile(d_ptr, slot, rows, rmask, stride_de, stride_dr, K, KB, step, MODE: tl.constexpr,
                        BK: tl.constexpr, EVICT: tl.constexpr = tl.constexpr("")):
        """Rows `rows` of slot `slot`'s W_down, K step `step`: dense elements (BYTES) or the int32
        words word_tile loads (WORDS, INT8_ACTIVATIONS); 0 past the row, or for slot -1."""
        base = d_ptr + tl.maximum(slot, 0) * stride_de + rows[:, None] * stride_dr
        if MODE == MODE_BYTES:
            i = step * BK + tl.arange(0, BK)
            return tl.load(base + i[None, :], mask=(slot >= 0) & rmask[:, None] & (i < K)[None, :], other=0.0,
                           eviction_policy=EVICT)
        else:
            return word_tile(base, (slot >= 0) & rmask, step * BK, KB, BK, EVICT)

    @triton.jit
    def early_down_step(w, h_row, slot, rows, rmask, K, KB, d_ptr, ds_ptr, dm_ptr, stride_de, stride_dr,
                        stride_dse, stride_dsr, step, FMT: tl.constexpr, MODE: tl.constexpr,
                        GROUP_SIZE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, QH: tl.constexpr):
        """row_dots' step `step` on weights loaded already (early_down_tile): the same sums."""
        if MODE == MODE_BYTES:
            i = step * BK + tl.arange(0, BK)
            xk = tl.load(h_row + i, mask=i < K, other=0.0).to(tl.float32)
            return tl.sum(w.to(tl.float32) * xk[None, :], axis=1)
        else:
            return row_dots(d_ptr, ds_ptr, dm_ptr, slot, rows, rmask, h_row, step * BK, K, KB, stride_de, stride_dr,
                            stride_dse, stride_dsr, FMT, MODE, GROUP_SIZE, BN, BK, QH, wv_pre=w, PRE=True)

    @triton.jit
    def down_rows(h_row, part_out, w, slot, rows, rmask, K, KB, d_ptr, ds_ptr, dm_ptr,
                  stride_de, stride_dr, stride_dse, stride_dsr,
                  FMT: tl.constexpr, MODE: tl.constexpr, GROUP_SIZE: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, QH: tl.constexpr, w0=None, w1=None, w2=None, w3=None,
                  EARLY: tl.constexpr = 0, EVICT: tl.constexpr = tl.constexpr("")):
        """part rows = w * (W_down h) for one expert slot of one group (float32). INT8_ACTIVATIONS: h_row is h's
        quantized row, blocks of QH columns (gate_up's BN). EARLY: w0.. hold the first EARLY K steps'
        weights, loaded already (early_down_tile; row_dots' steps on them)."""
        if FMT <= FMT_INT8:
            lim = K
        else:
            lim = KB
        y = tl.zeros((BN,), dtype=tl.float32)
        if FMT == FMT_INT8:      # before the K loop, as in gate_up_rows
            d_scale = tl.load(ds_ptr + slot * stride_dse + rows * stride_dsr, mask=rmask, other=0.0).to(tl.float32)
        if EARLY >= 1:
            y += early_down_step(w0, h_row, slot, rows, rmask, K, KB, d_ptr, ds_ptr, dm_ptr, stride_de, stride_dr,
                                 stride_dse, stride_dsr, 0, FMT, MODE, GROUP_SIZE, BN, BK, QH)
        if EARLY >= 2:
            y += early_down_step(w1, h_row, slot, rows, rmask, K, KB, d_ptr, ds_ptr, dm_ptr, stride_de, stride_dr,
                                 stride_dse, stride_dsr, 1, FMT, MODE, GROUP_SIZE, BN, BK, QH)
        if EARLY >= 3:
            y += early_down_step(w2, h_row, slot, rows, rmask, K, KB, d_ptr, ds_ptr, dm_ptr, stride_de, stride_dr,
                                 stride_dse, stride_dsr, 2, FMT, MODE, GROUP_SIZE, BN, BK, QH)
        if EARLY >= 4:
            y += early_down_step(w3, h_row, slot, rows, rmask, K, KB, d_ptr, ds_ptr, dm_ptr, stride_de, stride_dr,
                                 stride_dse, stride_dsr, 3, FMT, MODE, GROUP_SIZE, BN, BK, QH)
        for k0 in range(EARLY * BK, lim, BK):
            y += row_dots(d_ptr, ds_ptr, dm_ptr, slot, rows, rmask, h_row, k0, K, KB,
                          stride_de, stride_dr, stride_dse, stride_dsr, FMT, MODE, GROUP_SIZE, BN, BK, QH, EVICT)
        if FMT == FMT_INT8:
            y = y * d_scale
        tl.store(part_out + rows, y * w, mask=rmask)

    @triton.jit
    def down_kernel(h_ptr, hq_ptr, ids_ptr, wts_ptr, part_ptr, N, K, stride_ht, stride_hqt, stride_pt,
                    slot_a, da_ptr, dsa_ptr, dma_ptr, KB_a, sde_a, sdr_a, sdse_a, sdsr_a, picks_a,
                    slot_b, db_ptr, dsb_ptr, dmb_ptr, KB_b, sde_b, sdr_b, sdse_b, sdsr_b, picks_b,
                    FIRST: tl.constexpr, GROUP_SIZE: tl.constexpr, BN: tl.constexpr,
                    FMT_A: tl.constexpr, MAP_A: tl.constexpr, MODE_A: tl.constexpr, BK_A: tl.constexpr,
                    COUNT_A: tl.constexpr,
                    HAS_B: tl.constexpr, FMT_B: tl.constexpr, MAP_B: tl.constexpr, MODE_B: tl.constexpr,
                    BK_B: tl.constexpr, COUNT_B: tl.constexpr, QH: tl.constexpr, DROPPED: tl.constexpr = False,
                    EARLY: tl.constexpr = 0, EVICT: tl.constexpr = "", PDL: tl.constexpr = False,
                    LAUNCH_FIRST: tl.constexpr = False):
        """Program (pair, row block): part[pair, rows] = w[pair] * (W_down[e] h[pair])[rows] in
        float32, for up to two groups like gate_up. One program per pair: looping over a token's k
        experts in one program makes a chain of dependent loads (~1.8 TB/s against gate_up's ~3.1). The first launch also zeroes the rows of pairs in neither of its groups, so
        every row is written once whatever the grouping, and moe_sum adds the k rows in a fixed order.
        INT8_ACTIVATIONS groups read h quantized (hq, blocks of QH columns).
        COUNT_A / COUNT_B: the group's pick counter (picks_a / picks_b, int32 [E]) gets 1 at the
        pair's expert, from the pair's first row block: tier telemetry at the cost of one atomic per
        pair, inside a launch the step makes anyway (so CUDA-graph replays are counted too).
        DROPPED: as gate_up's (a dropped pair is in neither group: zeroed by a FIRST launch).
        EARLY (group A dense BYTES, or int8 / int4 / int4_asym / ternary2 words; 0 to 4): the pair's
        slot and its first EARLY K steps of group A's weights are loaded before the PDL wait. The
        ids and slot maps come from launches before gate_up (the router, route-tail-skip,
        prefetch's maps), which had finished before gate_up's programs passed their own wait, so
        before this launch started; only h is gate_up's.
        EVICT: as gate_up's."""
        pair = tl.program_id(0)
        rows = tl.program_id(1) * BN + tl.arange(0, BN)
        rmask = rows < N
        part_out = part_ptr + pair * stride_pt
        w0 = None
        w1 = None
        w2 = None
        w3 = None
        if EARLY >= 1:
            sa = pair_slot(ids_ptr, slot_a, pair, MAP_A, DROPPED)
            w0 = early_down_tile(da_ptr, sa, rows, rmask, sde_a, sdr_a, K, KB_a, 0, MODE_A, BK_A, EVICT)
        if EARLY >= 2:
            w1 = early_down_tile(da_ptr, sa, rows, rmask, sde_a, sdr_a, K, KB_a, 1, MODE_A, BK_A, EVICT)
        if EARLY >= 3:
            w2 = early_down_tile(da_ptr, sa, rows, rmask, sde_a, sdr_a, K, KB_a, 2, MODE_A, BK_A, EVICT)
        if EARLY >= 4:
            w3 = early_down_tile(da_ptr, sa, rows, rmask, sde_a, sdr_a, K, KB_a, 3, MODE_A, BK_A, EVICT)
        grid_dependency(PDL, LAUNCH_FIRST)
        if EARLY == 0:
            sa = pair_slot(ids_ptr, slot_a, pair, MAP_A, DROPPED)
        if sa >= 0:
            if MODE_A == MODE_INT8_ACT:
                ha = hq_ptr + pair * stride_hqt
            else:
                ha = h_ptr + pair * stride_ht
            down_rows(ha, part_out, tl.load(wts_ptr + pair).to(tl.float32), sa, rows, rmask, K, KB_a,
                      da_ptr, dsa_ptr, dma_ptr, sde_a, sdr_a, sdse_a, sdsr_a, FMT_A, MODE_A, GROUP_SIZE, BN, BK_A, QH,
                      w0, w1, w2, w3, EARLY, EVICT)
            if COUNT_A:
                count_pick(ids_ptr, picks_a, pair, tl.program_id(1))
        else:
            sb = -1
            if HAS_B:
                sb = pair_slot(ids_ptr, slot_b, pair, MAP_B, DROPPED)
            if sb >= 0:
                if MODE_B == MODE_INT8_ACT:
                    hb = hq_ptr + pair * stride_hqt
                else:
                    hb = h_ptr + pair * stride_ht
                down_rows(hb, part_out, tl.load(wts_ptr + pair).to(tl.float32), sb, rows, rmask, K, KB_b,
                          db_ptr, dsb_ptr, dmb_ptr, sde_b, sdr_b, sdse_b, sdsr_b, FMT_B, MODE_B, GROUP_SIZE, BN,
                          BK_B, QH, EVICT=EVICT)
                if COUNT_B:
                    count_pick(ids_ptr, picks_b, pair, tl.program_id(1))
            elif FIRST:
                tl.store(part_out + rows, tl.zeros((BN,), dtype=tl.float32), mask=rmask)

    @triton.jit
    def expert_ffn_kernel(x_ptr, xq_ptr, ids_ptr, wts_ptr, h_ptr, hq_ptr, part_ptr, ready_ptr, P, N, K,
                          stride_xt, stride_xqt, stride_ht, stride_hqt, stride_pt,
                          slot_a, g_ptr, gs_ptr, gm_ptr, u_ptr, us_ptr, um_ptr, KB_gu,
                          sge, sgr, sgse, sgsr, sue, sur, suse, susr,
                          d_ptr, ds_ptr, dm_ptr, KB_dn, sde, sdr, sdse, sdsr, picks_ptr,
                          TOPK: tl.constexpr, GROUP_SIZE: tl.constexpr, FMT: tl.constexpr, MAP: tl.constexpr,
                          MODE_GU: tl.constexpr, MODE_DN: tl.constexpr, BN_GU: tl.constexpr, BK_GU: tl.constexpr,
                          BN_DN: tl.constexpr, BK_DN: tl.constexpr, COUNT: tl.constexpr, LINE: tl.constexpr,
                          EARLY: tl.constexpr = 0,
                          EVICT_GU: tl.constexpr = "", EVICT_DN: tl.constexpr = "", PDL: tl.constexpr = False):
        """gate_up_kernel and down_kernel of one expert group in one launch (DecodeConfig.fused_experts),
        over P = T * TOPK pairs: programs [0, P * ceil(N / BN_GU)) are gate_up's (pair, row block),
        the rest down's (pair, row block of K = hidden). A down program waits for its own pair's h,
        not for the whole of gate_up: each gate_up program counts itself into its pair's ready
        counter after a CTA barrier (release), and the pair's down programs, having loaded their
        first EARLY K steps of weights, poll it (volatile loads from L2, then one acquire) until all
        of the pair's row blocks are in. Each counter has a 128-byte line of its own (LINE int32s
        apart), so the polls of one pair do not queue behind another pair's.
        The poll cannot starve what it waits for: a down program has a larger program id than every
        gate_up program, and the GPU starts a launch's programs in id order, so every gate_up
        program is resident or done before a down program polls (the ordering CUB's single-pass
        scan rests on). The pair's last down program to finish (a second counter per pair, of its
        down programs) resets both to 0 for the next launch, which touches them only after its PDL
        wait, when this launch has finished. The sums are gate_up's and down's, bit for bit. Every
        pair's expert must have a slot in the group (the caller's single group)."""
        grid_dependency(PDL)
        pid = tl.program_id(0)
        nb_gu = tl.cdiv(N, BN_GU)
        n_gu = P * nb_gu
        if pid < n_gu:
            pair = pid // nb_gu
            blk = pid - pair * nb_gu
            rows_gu = blk * BN_GU + tl.arange(0, BN_GU)     # (the branches name their tiles apart: Triton
                                                            # wants one type per name across an if)
            slot = pair_slot(ids_ptr, slot_a, pair, MAP)
            if MODE_GU == MODE_INT8_ACT:
                x_row = xq_ptr + (pair // TOPK) * stride_xqt
            else:
                x_row = x_ptr + (pair // TOPK) * stride_xt
            gate_up_rows(x_row, h_ptr + pair * stride_ht, hq_ptr + pair * stride_hqt, slot, blk, rows_gu, rows_gu < N,
                         N, K, KB_gu, g_ptr, gs_ptr, gm_ptr, u_ptr, us_ptr, um_ptr, sge, sgr, sgse, sgsr,
                         sue, sur, suse, susr, FMT, MODE_GU, GROUP_SIZE, BN_GU, BK_GU, EVICT_GU)
            tl.debug_barrier()          # every thread's h stores before the release
            tl.atomic_add(ready_ptr + pair * LINE, 1, sem="release")
        else:
            nb_dn = tl.cdiv(K, BN_DN)
            pair = (pid - n_gu) // nb_dn
            blk = pid - n_gu - pair * nb_dn
            rows_dn = blk * BN_DN + tl.arange(0, BN_DN)
            rmask = rows_dn < K
            slot = pair_slot(ids_ptr, slot_a, pair, MAP)
            w0 = None
            w1 = None
            w2 = None
            w3 = None
            if EARLY >= 1:
                w0 = early_down_tile(d_ptr, slot, rows_dn, rmask, sde, sdr, N, KB_dn, 0, MODE_DN, BK_DN, EVICT_DN)
            if EARLY >= 2:
                w1 = early_down_tile(d_ptr, slot, rows_dn, rmask, sde, sdr, N, KB_dn, 1, MODE_DN, BK_DN, EVICT_DN)
            if EARLY >= 3:
                w2 = early_down_tile(d_ptr, slot, rows_dn, rmask, sde, sdr, N, KB_dn, 2, MODE_DN, BK_DN, EVICT_DN)
            if EARLY >= 4:
                w3 = early_down_tile(d_ptr, slot, rows_dn, rmask, sde, sdr, N, KB_dn, 3, MODE_DN, BK_DN, EVICT_DN)
            arrived = tl.load(ready_ptr + pair * LINE, volatile=True)
            while arrived < nb_gu:
                arrived = tl.load(ready_ptr + pair * LINE, volatile=True)
            tl.atomic_add(ready_ptr + pair * LINE, 0, sem="acquire")
            tl.debug_barrier()          # the acquire before any thread loads h
            if MODE_DN == MODE_INT8_ACT:
                h_row = hq_ptr + pair * stride_hqt
            else:
                h_row = h_ptr + pair * stride_ht
            down_rows(h_row, part_ptr + pair * stride_pt, tl.load(wts_ptr + pair).to(tl.float32), slot, rows_dn,
                      rmask, N, KB_dn, d_ptr, ds_ptr, dm_ptr, sde, sdr, sdse, sdsr, FMT, MODE_DN, GROUP_SIZE,
                      BN_DN, BK_DN, BN_GU, w0, w1, w2, w3, EARLY, EVICT_DN)
            if COUNT:
                count_pick(ids_ptr, picks_ptr, pair, blk)
            if tl.atomic_add(ready_ptr + (P + pair) * LINE, 1, sem="relaxed") == nb_dn - 1:
                tl.atomic_xchg(ready_ptr + pair * LINE, 0)
                tl.atomic_xchg(ready_ptr + (P + pair) * LINE, 0)

    @triton.jit
    def tail_skip_kernel(ids_ptr, out_ptr, maps_ptr, stride_map, skips_ptr, part_ptr, stride_pt, N, FROM,
                         TOPK: tl.constexpr, G: tl.constexpr, BLOCK: tl.constexpr, COUNT: tl.constexpr,
                         PDL: tl.constexpr = False):
        """Route-tail-skip, program (pair, column block): the pair's expert is cold when some row g of
        maps [G, E] has a slot for it (the host groups that would read it over PCIe); a cold pair of
        rank >= FROM is dropped: out[pair] = -1 (else its expert id), its part row zeroed (no group
        writes it), and skips[expert] += 1 when COUNT (one atomic per dropped pair)."""
        grid_dependency(PDL)
        pair = tl.program_id(0)
        e = tl.load(ids_ptr + pair).to(tl.int64)
        cold = 0
        for g in tl.static_range(G):
            cold += (tl.load(maps_ptr + g * stride_map + e) >= 0).to(tl.int32)
        drop = (cold > 0) & (pair % TOPK >= FROM)
        if tl.program_id(1) == 0:
            tl.store(out_ptr + pair, tl.where(drop, -1, e))
            if COUNT:
                if drop:
                    tl.atomic_add(skips_ptr + e, 1)
        if drop:
            offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            tl.store(part_ptr + pair * stride_pt + offs, tl.zeros((BLOCK,), dtype=tl.float32), mask=offs < N)

    @triton.jit
    def moe_sum_kernel(part_ptr, out_ptr, N, stride_pt, stride_ot, TOPK: tl.constexpr, BLOCK: tl.constexpr,
                       PDL: tl.constexpr = False):
        """out[t] = sum_j part[t * TOPK + j] in the order j = 0..TOPK-1 (deterministic), x's dtype."""
        grid_dependency(PDL)
        t = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for j in tl.static_range(TOPK):
            acc += tl.load(part_ptr + (t * TOPK + j) * stride_pt + offs, mask=m, other=0.0)
        tl.store(out_ptr + t * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=m)

else:       # no Triton here: the names exist, require() refuses the launches
    gate_up_kernel = down_kernel = expert_ffn_kernel = moe_sum_kernel = tail_skip_kernel = None
