"""fused_moe: the expert part of a decode step through the expert kernels (moe_kernels.py), over
expert groups of any formats and homes, with no host sync (CUDA-graph capturable).

Experts are split into groups (one per storage format and home, `ExpertGroup`): each launch pair
(gate_up, then down) handles the pairs whose expert has a slot in its one or two groups, so each
pair's `part` row is written by exactly one group and the result does not depend on the grouping.
Per-pair reads suit small T (decode); with many tokens the same expert would be re-read per token,
so callers switch to a grouped GEMM.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from ..decode_config import DEFAULT, INT8_ACTIVATION_FORMATS, DecodeConfig, DecodeMode, Format
from ..quant import GROUP
from .int8_activations import quant_row_len, quantize_rows_kernel
from .moe_kernels import down_kernel, expert_ffn_kernel, gate_up_kernel, moe_sum_kernel, tail_skip_kernel
from .packed import ExpertGroup
from .runtime import KernelError, early_steps, next_pow2, pdl_launch, require
from .staging import host_lane, side_stream


# Formats whose down rows the expert kernels read as int32 words (word_dots, a8_word_dots), so down
# can load its first K steps before its wait (_early_down_steps).
EARLY_PACKED_FORMATS = ("int8", "int4", "int4_asym", "ternary2")


def _row_bytes(rows: Tensor) -> int:
    """The kernels' KB, the length of the rows a launch reads: in bytes for a word view (int32; for
    base-3 ternary the padded rows), else the stored row's last dimension."""
    return rows.shape[-1] * (4 if rows.dtype == torch.int32 else 1)


def _gate_up_words(g: ExpertGroup, mode: DecodeMode) -> bool:
    return g.gate.words(mode) is not None and g.up.words(mode) is not None


def group_mode(g: ExpertGroup, kernel: str, cfg: DecodeConfig) -> DecodeMode:
    """The MODE constexpr of a group's `kernel` launch: its format's decode mode where its rows can
    be read as words (else BYTES). INT8_ACTIVATIONS (asked for the format, or cfg.int8_activations)
    takes int8, int4 and ternary2 groups whose hidden size and width are whole 64-column blocks, for
    gate_up and down alike (gate_up hands down a quantized h); others run WORDS."""
    asked = cfg.mode_of(g.fmt)
    words = _gate_up_words(g, asked) if kernel == "gate_up" else g.down.words(asked) is not None
    if not words:
        return DecodeMode.BYTES
    mode = DecodeMode.INT8_ACTIVATIONS if cfg.int8_activations else asked
    if mode == DecodeMode.INT8_ACTIVATIONS and not (
            Format.of(g.fmt) in INT8_ACTIVATION_FORMATS and g.gate.cols % GROUP == 0 and g.gate.rows % GROUP == 0
            and _gate_up_words(g, asked) and g.down.words(asked) is not None):
        mode = DecodeMode.WORDS
    return mode


def wants_quantized_x(groups: list[ExpertGroup], cfg: DecodeConfig) -> bool:
    """Whether any group's gate_up multiplies int8 activations (fused_moe then takes x's int8 rows)."""
    return any(group_mode(g, "gate_up", cfg) == DecodeMode.INT8_ACTIVATIONS for g in groups)


@dataclass
class _GroupArgs:
    """One group's share of a gate_up / down launch: its tensors, strides and constexprs."""

    group: ExpertGroup
    gate_up_mode: DecodeMode
    down_mode: DecodeMode

    def gate_up(self, ids: Tensor) -> list:
        g, asked = self.group, self.gate_up_mode
        gs, gm, gse, gsr = g.gate.scale_args()
        us, um, use, usr = g.up.scale_args()
        words = asked != DecodeMode.BYTES
        gd, ud = (g.gate.words(asked), g.up.words(asked)) if words else (g.gate.data, g.up.data)
        return [g.slot_of if g.slot_of is not None else ids, gd, gs, gm, ud, us, um, _row_bytes(gd),
                gd.stride(0), gd.stride(1), gse, gsr, ud.stride(0), ud.stride(1), use, usr]

    def down(self, ids: Tensor) -> list:
        g = self.group
        ds, dm, dse, dsr = g.down.scale_args()
        dd = g.down.data if self.down_mode == DecodeMode.BYTES else g.down.words(self.down_mode)
        return [g.slot_of if g.slot_of is not None else ids, dd, ds, dm, _row_bytes(dd),
                dd.stride(0), dd.stride(1), dse, dsr, g.picks if g.picks is not None else ids]

    def constexprs(self, tag: str, kernel: str, bk: int) -> dict:
        g = self.group
        mode = self.gate_up_mode if kernel == "gate_up" else self.down_mode
        if mode == DecodeMode.INT8_ACTIVATIONS:   # a step covers whole x blocks (64 columns; int4: 2 per byte)
            bk = max(bk, {"int8": GROUP, "int4": GROUP // 2}.get(g.fmt, GROUP // 4))
        return {f"FMT_{tag}": int(Format.of(g.fmt)), f"MAP_{tag}": g.slot_of is not None,
                f"MODE_{tag}": int(mode), f"BK_{tag}": bk}


@dataclass
class TailSkip:
    """Route-tail-skip for fused_moe: a pair of rank >= from_rank (its column in topk_ids) whose
    expert is cold is dropped: no group reads its weights and its term is 0 (the other weights are
    not renormalised). cold_maps: int32 [G, E] on the device, one row per host group, the slot map of
    the group that reads the expert over PCIe (a staged expert's entry is -1 there): cold means a
    slot in some row. skips: int32 [E] on the device, +1 at the expert of every dropped pair, or None."""

    from_rank: int
    cold_maps: Tensor
    skips: Tensor | None = None


def _tail_skip(ids: Tensor, out: Tensor, part: Tensor, skip: TailSkip, cfg: DecodeConfig) -> Tensor:
    """out = ids [T, k] with the dropped pairs -1 (one launch; their part rows zeroed; skips counted)."""
    T, k = ids.shape
    H = part.shape[1]
    block = min(1024, next_pow2(H))
    maps = skip.cold_maps
    tail_skip_kernel[(T * k, -(-H // block))](ids, out, maps, maps.stride(0), skip.skips if skip.skips is not None
                                              else maps, part, part.stride(0), H, skip.from_rank, TOPK=k,
                                              G=maps.shape[0], BLOCK=block, COUNT=skip.skips is not None,
                                              num_warps=4, **pdl_launch(ids.device, cfg))
    return out


def _early_down_steps(a: _GroupArgs, bk: int, cfg: DecodeConfig) -> int:
    """down's EARLY constexpr for a launch led by group `a` (K steps of `bk`): dense rows read as
    elements ("down" in early_weights) or int8 / int4 / int4_asym / ternary2 rows read as words
    ("down_packed"); 0 for other rows (base-3 ternary, byte reads)."""
    g = a.group
    if g.fmt == "dense" and a.down_mode == DecodeMode.BYTES:
        return early_steps("down", g.down.cols, bk, cfg)
    if g.fmt in EARLY_PACKED_FORMATS and a.down_mode != DecodeMode.BYTES:
        return early_steps("down_packed", _row_bytes(g.down.words(a.down_mode)), bk, cfg)
    return 0


# A buffer, not a setting: one per (device, pairs) for the process, like the router's arrival counters.
READY_LINE = 32      # int32s a 128-byte line holds: one ready counter a line


@functools.lru_cache(maxsize=None)
def _ready_counters(device: torch.device, pairs: int) -> Tensor:
    """expert_ffn_kernel's per-pair counters (gate_up blocks in, then down blocks done), each at the
    start of its own line of READY_LINE int32s: zero between launches (each pair's last down
    program resets its two)."""
    return torch.zeros(2 * pairs * READY_LINE, dtype=torch.int32, device=device)


def _group_args(g: ExpertGroup, cfg: DecodeConfig) -> _GroupArgs:
    gate_up, down = group_mode(g, "gate_up", cfg), group_mode(g, "down", cfg)
    return _GroupArgs(g, gate_up, down)


def fused_moe(x: Tensor, topk_ids: Tensor, topk_w: Tensor, groups: list[ExpertGroup], cfg: DecodeConfig = DEFAULT,
              reduce: bool = True, xq: Tensor | None = None, after_lane: bool = False,
              tail_skip: TailSkip | None = None) -> Tensor:
    """x [T, H]; topk_ids [T, k] (int64/int32); topk_w [T, k] -> [T, H] in x's dtype:
    sum_j topk_w[t, j] * down(silu(gate x) * up x) of expert topk_ids[t, j], every expert in
    exactly one of `groups`. Reads each (token, expert) pair's weights once; no host sync.
    cfg: the engine's decode config (decode modes, launch shapes, PDL, overlap).
    reduce=False: the float32 terms [T * k, H] instead (pair t*k + j), for add_rmsnorm to sum.
    xq: x's int8 rows as add_rmsnorm_router(quantize_h=True) made them, for groups in
    INT8_ACTIVATIONS (else they are made here, one more launch).
    after_lane: the host lane holds work the groups read (prefetch's stage copies): where the host
    groups do not run on the lane, the main stream waits for it first.
    tail_skip: route-tail-skip (TailSkip), decided on the device by one more launch, on the stream
    of the groups that read cold experts, after anything queued there (prefetch's maps): the host
    lane's groups read the ids with dropped pairs, the HBM groups the ids as given (they serve no
    cold expert). None, or from_rank >= k: no launch."""
    if not groups:
        raise KernelError("fused_moe: no expert groups")
    require()
    T, H = x.shape
    k = topk_ids.shape[1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    ids = topk_ids.contiguous()
    wts = topk_w.contiguous()
    inter = groups[0].gate.rows
    for g in groups:
        g.check(H)
        if g.gate.rows != inter:
            raise KernelError(f"fused_moe: expert group {g.label!r} has width {g.gate.rows}, another {inter}")
    args = {id(g): _group_args(g, cfg) for g in groups}
    pdl = pdl_launch(x.device, cfg)
    h = torch.empty(T * k, inter, dtype=torch.float32, device=x.device)
    part = torch.empty(T * k, H, dtype=torch.float32, device=x.device)
    # INT8_ACTIVATIONS: x quantized once here; h quantized by gate_up, blocks of its BN (8 or more) columns
    hq = h
    if any(a.gate_up_mode == DecodeMode.INT8_ACTIVATIONS for a in args.values()):
        if xq is None:
            xq = torch.empty(T, quant_row_len(H, GROUP), dtype=torch.int32, device=x.device)
            quantize_rows_kernel[(T,)](x, xq, H, x.stride(0), xq.stride(0), W=next_pow2(H // 8), QB=GROUP,
                                       num_warps=4, **pdl)
        elif xq.dtype != torch.int32 or tuple(xq.shape) != (T, quant_row_len(H, GROUP)) or xq.stride(-1) != 1:
            raise KernelError(f"fused_moe: xq {xq.dtype} {tuple(xq.shape)}; expected int32 "
                              f"[{T}, {quant_row_len(H, GROUP)}] rows from add_rmsnorm_router(quantize_h=True)")
        hq = torch.empty(T * k, quant_row_len(inter, 8), dtype=torch.int32, device=x.device)
    else:
        xq = h

    if tail_skip is not None and tail_skip.from_rank >= k:
        tail_skip = None
    skip_ids = None if tail_skip is None else torch.empty_like(ids)    # the ids with dropped pairs (made on main)
    # expert_ffn_kernel: one group that serves every pair (its down programs poll for their pair's h)
    one_launch = cfg.fused_experts and len(groups) == 1 and tail_skip is None

    def launch(pair_groups: list[ExpertGroup], first: bool, ids: Tensor, dropped: bool) -> None:
        """gate_up then down for the pairs of one or two groups (first: also zero the part rows of
        pairs in neither). Block rows (BN), warps and stages follow the first group's launch shape;
        each group keeps its own BK."""
        host = pair_groups[0].gate.on_host
        a, b = args[id(pair_groups[0])], args[id(pair_groups[-1])]
        a8 = a.gate_up_mode == DecodeMode.INT8_ACTIVATIONS
        meta = {}
        for kernel in ("gate_up", "down"):
            shape = cfg.launch_for(kernel, a.group.fmt, host=host, a8=a8)
            bn = shape.BN
            if kernel == "gate_up" and a8:
                # one block of h per program: 8 to 64 rows (ternary2's down words span 16 columns)
                bn = min(max(bn, 16 if a.group.fmt == "ternary2" else 8), GROUP)
            meta[kernel] = dict(BN=bn, num_warps=shape.num_warps, num_stages=shape.num_stages,
                                HAS_B=len(pair_groups) > 1, GROUP_SIZE=GROUP)
            if dropped:         # only then: the launches without skip compile as they always did
                meta[kernel]["DROPPED"] = True
            mode = a.gate_up_mode if kernel == "gate_up" else a.down_mode
            byte_rows = a.group.fmt == "dense" or (a.group.fmt == "int8" and mode == DecodeMode.BYTES)
            evict = cfg.experts_evict_first if byte_rows else cfg.packed_evict_first
            if evict and not (host and x.is_cuda):   # not pinned host rows read over PCIe
                meta[kernel]["EVICT"] = "evict_first"
            for tag, ga in (("A", a), ("B", b)):
                meta[kernel].update(ga.constexprs(tag, kernel, cfg.launch_for(kernel, ga.group.fmt, host=host,
                                                                               a8=a8).BK))
                if kernel == "down":
                    meta[kernel][f"COUNT_{tag}"] = ga.group.picks is not None
            if kernel == "down":
                early = _early_down_steps(a, meta[kernel]["BK_A"], cfg)
                if early:
                    meta[kernel]["EARLY"] = early
        if one_launch:
            gu, dn = meta["gate_up"], meta["down"]
            P = T * k
            n = P * -(-inter // gu["BN"]) + P * -(-H // dn["BN"])
            expert_ffn_kernel[(n,)](
                x, xq, ids, wts, h, hq, part, _ready_counters(x.device, P), P, inter, H, x.stride(0), xq.stride(0),
                h.stride(0), hq.stride(0), part.stride(0), *a.gate_up(ids), *a.down(ids)[1:],
                TOPK=k, GROUP_SIZE=GROUP, FMT=gu["FMT_A"], MAP=gu["MAP_A"], MODE_GU=gu["MODE_A"],
                MODE_DN=dn["MODE_A"], BN_GU=gu["BN"], BK_GU=gu["BK_A"], BN_DN=dn["BN"], BK_DN=dn["BK_A"],
                COUNT=dn["COUNT_A"], LINE=READY_LINE, EARLY=dn.get("EARLY", 0), EVICT_GU=gu.get("EVICT", ""),
                EVICT_DN=dn.get("EVICT", ""),
                num_warps=gu["num_warps"], num_stages=gu["num_stages"], **pdl)
            return
        gate_up_kernel[(T * k, -(-inter // meta["gate_up"]["BN"]))](
            x, xq, ids, h, hq, inter, H, x.stride(0), xq.stride(0), h.stride(0), hq.stride(0),
            *a.gate_up(ids), *b.gate_up(ids), TOPK=k, **meta["gate_up"], **pdl)
        down_kernel[(T * k, -(-H // meta["down"]["BN"]))](
            h, hq, ids, wts, part, H, inter, h.stride(0), hq.stride(0), part.stride(0),
            *a.down(ids), *b.down(ids), FIRST=first, QH=meta["gate_up"]["BN"], **meta["down"],
            **pdl_launch(x.device, cfg, "down"))

    def launches(gs: list[ExpertGroup], first: bool, ids: Tensor = ids, dropped: bool = False) -> None:
        # The group with the most experts leads; groups of one format share a launch pair. Two
        # formats never do: a kernel gets the registers of its heaviest branch, so an int8 + ternary
        # launch runs its int8 pairs slower than int8 alone (on the H200 the base-3 plan decoded
        # 11.5% slower with its int8 and ternary groups in one launch pair: docs/engine-speed.md).
        by_fmt: dict[str, list[ExpertGroup]] = {}
        for g in sorted(gs, key=lambda g: -g.gate.data.shape[0]):
            by_fmt.setdefault(g.fmt, []).append(g)
        for same in by_fmt.values():
            for i in range(0, len(same), 2):
                launch(same[i:i + 2], first, ids, dropped)
                first = False

    # The host lane: host groups (zero-copy reads over PCIe, latency-bound) and prefetch's stage,
    # whose launches must follow the stage copies (staging.host_lane). A stage of the host groups'
    # format shares their launch pair.
    lane = [g for g in groups if x.is_cuda and (g.host_lane or g.gate.on_host)]
    in_hbm = sorted((g for g in groups if not any(g is lg for lg in lane)),   # identity: == compares tensors
                    key=lambda g: -g.gate.data.shape[0])
    # Branches that run concurrently with the lead group's launches: the other HBM formats, and the
    # host lane. Their pairs' rows are disjoint.
    fmts: dict[str, list[ExpertGroup]] = {}
    for g in in_hbm:                     # the largest group's format first
        fmts.setdefault(g.fmt, []).append(g)
    lead, *branches = list(fmts.values()) or [[]]
    if x.is_cuda and cfg.overlap_host and lead and (branches or lane):
        # No zeroing of other pairs' rows here (it would race): the groups cover every expert
        # (TieredExperts builds them so).
        main = torch.cuda.current_stream(x.device)
        sides = []
        for key, branch in [*enumerate(branches), *([("host", lane)] if lane else [])]:
            side = side_stream(x.device, key)      # "host": host_lane
            side.wait_stream(main)
            with torch.cuda.stream(side):
                if key == "host" and tail_skip is not None:
                    # after the lane's stage maps; the rows it zeroes are no HBM group's
                    launches(branch, first=False, ids=_tail_skip(ids, skip_ids, part, tail_skip, cfg), dropped=True)
                else:
                    launches(branch, first=False)
            sides.append(side)
        launches(lead, first=False)
        for side in sides:
            main.wait_stream(side)
    else:
        # host groups (pinned, read over PCIe) never share a launch with HBM groups: other block shapes
        if after_lane and x.is_cuda:
            torch.cuda.current_stream(x.device).wait_stream(host_lane(x.device))   # prefetch's copies
        # one stream (and on the CPU host groups are in in_hbm): every launch reads the dropped ids
        if tail_skip is not None:
            _tail_skip(ids, skip_ids, part, tail_skip, cfg)
        read, dropped = (ids, False) if tail_skip is None else (skip_ids, True)
        launches(in_hbm, first=True, ids=read, dropped=dropped)
        if lane:
            launches(lane, first=not in_hbm, ids=read, dropped=dropped)
    if not reduce:
        return part
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    block = min(1024, next_pow2(H))
    moe_sum_kernel[(T, -(-H // block))](part, out, H, part.stride(0), out.stride(0), TOPK=k, BLOCK=block,
                                        num_warps=4, **pdl)
    return out
