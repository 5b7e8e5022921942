"""Fused MoE decode kernels (Triton): each selected expert's weights are read in place, exactly once.

The engine's "gather" decode path copies the selected experts' weights (`w[ids]`) before a bmm, so a
step moves about three times the expert bytes. These kernels read the rows of expert ids[t, j]
straight from the stacked weights (dense bf16/fp16/fp32, or the packed formats of quant.py,
dequantized in registers) and never materialise a copy:

  gate_up: grid (T*k pairs, I / BN)  h[p] = silu(W_gate[e] x[t]) * (W_up[e] x[t])   (float32 h)
  down:    grid (T*k pairs, H / BN)  part[p] = w[p] * (W_down[e] h[p])             (float32 part)
  moe_sum: grid (T, H / 1024)        out[t] = sum_j part[t*k + j], j in order       (x's dtype)

The weighted sum is done in a fixed order by its own small kernel, so it is deterministic and
needs no atomics. Both kernels are static-shape and sync-free, so a
decode step that uses them can be captured in a CUDA graph. Per-pair reads suit small T (decode);
with many tokens the same expert would be re-read per token, so callers switch to a grouped GEMM.

Experts may be split into groups (one per storage format and home, see `ExpertGroup`): each launch
handles the pairs whose expert has a slot in its group (each pair's `part` row is written by
exactly one group), so the result does not depend on the grouping.
A group's tensors may live in pinned host memory: CUDA maps pinned memory into the device's address
space (unified addressing), so the kernels read host experts over PCIe with no copy and no host
sync ("zero-copy"), which keeps the host tier inside a CUDA graph.

Triton is imported lazily (`available()` says whether it can run). On a machine without CUDA the
kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set here before the kernels
are built), which is how the parity tests run on CPU.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .quant import GROUP, QuantizedTensor, parse_format

# Storage formats the kernels decode; the code is the FMT constexpr of the kernels.
FORMAT_CODES = {"dense": 0, "int8": 1, "int4": 2, "int4_asym": 3, "ternary": 4, "ternary2": 5}

# Launch parameters per (kernel, format) or (kernel, format, "host") for groups in pinned host
# memory: BN output rows per program, BK input columns (packed formats: bytes) per loop step,
# num_warps, num_stages. benchmarks/decode_h200.py sweeps them on the GPU it runs on and sets the best.
DEFAULT_CONFIG = {"BN": 16, "BK": 256, "num_warps": 4, "num_stages": 3}


def _cfg(bn: int, bk: int, warps: int, stages: int) -> dict[str, int]:
    return {"BN": bn, "BK": bk, "num_warps": warps, "num_stages": stages}


# Shipped values: the H200 sweeps of benchmarks/decode_h200.py (round 5, 8 disjoint experts per call;
# round 7 for ternary) and, for int8, benchmarks/quant_kernels_h200.py (round 7, FAST_DECODE 2).
CONFIG: dict[tuple[str, ...], dict[str, int]] = {
    ("gate_up", "dense"): _cfg(2, 2048, 4, 2), ("down", "dense"): _cfg(16, 256, 4, 3),
    ("gate_up", "int8"): _cfg(8, 512, 4, 3), ("down", "int8"): _cfg(16, 256, 4, 3),
    ("gate_up", "int4"): _cfg(8, 256, 4, 3), ("down", "int4"): _cfg(16, 256, 4, 3),
    ("gate_up", "int4_asym"): _cfg(8, 256, 4, 3), ("down", "int4_asym"): _cfg(16, 256, 4, 3),
    # ternary is the cold format of the hot/cold plans: tuned with one pair of a layer's eight (round 7 run 3)
    ("gate_up", "ternary"): _cfg(4, 512, 4, 3), ("down", "ternary"): _cfg(8, 256, 4, 3),
    ("gate_up", "ternary", "host"): _cfg(4, 512, 4, 3), ("down", "ternary", "host"): _cfg(16, 256, 4, 3),
    # ternary2 (2-bit codes, word decode): not yet swept; int4's mode-2 shapes, a whole 2048-column row
    # (512 bytes) per a8 gate_up step
    ("gate_up", "ternary2"): _cfg(8, 256, 4, 3), ("down", "ternary2"): _cfg(16, 256, 4, 3),
    ("gate_up", "ternary2", "a8"): _cfg(16, 512, 4, 2), ("down", "ternary2", "a8"): _cfg(16, 256, 4, 2),
    # decode mode 3 (int8 activations; gate_up BN is 8 at least), round 8's quant_kernels_h200 sweep:
    # int4 gate_up 7.94 us against 9.76 with the mode-2 config, int8 10.88 against 11.21
    ("gate_up", "int4", "a8"): _cfg(8, 1024, 4, 2), ("down", "int4", "a8"): _cfg(16, 128, 4, 2),
    ("gate_up", "int8", "a8"): _cfg(8, 1024, 4, 3),
    # round 8's sweep over every layer's weights (cold, as in a decode step; round 7 re-read one
    # layer's from L2): [q;k;v] 7.5 us, o_proj 6.5 us, against 15.7 together for round 7's (2, 2048, 4, 3)
    # and cuBLAS' 8.4 + 9.9
    ("gemv", "dense"): {"BN": 2, "BK": 1024, "num_warps": 4, "num_stages": 4},
    # num_warps 1: the last program's softmax/top-k reductions stay inside one warp (round 5: 4 warps,
    # 8 experts per program: 8 us per call, slower than cuBLAS + route_topk's ~7; this one: 5.0-5.3)
    ("router", "dense"): {"BN": 2, "BK": 2048, "num_warps": 1, "num_stages": 2},
}


# fused_moe runs host-memory expert groups, and HBM groups of formats other than the largest group's,
# on side streams, concurrently with the largest group's format.
OVERLAP_HOST = True
_SIDE_STREAMS: dict = {}


def _side_stream(device, key) -> "torch.cuda.Stream":
    """fused_moe's side stream `key` of a device, made on first use."""
    device = torch.device(device)
    if device.index is None:        # "cuda" and "cuda:0" must name one stream
        device = torch.device(device.type, torch.cuda.current_device())
    side = _SIDE_STREAMS.get((device, key))
    if side is None:
        side = _SIDE_STREAMS[(device, key)] = torch.cuda.Stream(device)
    return side


def host_lane(device) -> "torch.cuda.Stream":
    """The side stream of a device's host-tier work: fused_moe's host groups and the groups marked
    host_lane (prefetch's HBM stage), and prefetch's stage copies. One stream, so a layer's host
    launches follow its stage copies in stream order: no join per copy, and the main stream never
    waits for a copy, only for the host launches at the layer's end."""
    return _side_stream(device, "host")


class KernelError(ValueError):
    """Weights or inputs the fused kernels cannot take; the message says what was expected."""


def set_config(kernel: str, fmt: str, host: bool = False, a8: bool = False, **params: int) -> None:
    """Launch parameters for `kernel` ("gate_up", "down", "gemv" or "router"; the last two take
    fmt "dense") on weights of format `fmt`; host=True:
    for groups read from pinned host memory (zero-copy over PCIe wants other block shapes than HBM);
    a8=True: for HBM groups in decode mode 3 (int8 activations). Host and a8 groups without their own
    config use the format's config."""
    if kernel not in ("gate_up", "down", "gemv", "router"):
        raise KernelError(f"set_config: kernel {kernel!r}; expected 'gate_up', 'down', 'gemv' or 'router'")
    if fmt not in FORMAT_CODES:
        raise KernelError(f"set_config: format {fmt!r}; expected one of {list(FORMAT_CODES)}")
    bad = set(params) - set(DEFAULT_CONFIG)
    if bad:
        raise KernelError(f"set_config: unknown parameters {sorted(bad)}; expected {list(DEFAULT_CONFIG)}")
    key = (kernel, fmt, "host") if host else (kernel, fmt, "a8") if a8 else (kernel, fmt)
    cfg = {**CONFIG.get(key, CONFIG.get((kernel, fmt), DEFAULT_CONFIG)), **params}
    per_byte = {"int4": 2, "int4_asym": 2, "ternary2": 4}.get(fmt)
    if per_byte and kernel in ("gate_up", "down") and cfg["BK"] % (GROUP // per_byte):
        # steps cover whole 64-column groups (int4: 32 bytes, ternary2: 16) so each group's scale is loaded once
        raise KernelError(f"set_config: {kernel}/{fmt} BK={cfg['BK']} bytes; expected a multiple of "
                          f"{GROUP // per_byte}")
    CONFIG[key] = cfg


def get_config(kernel: str, fmt: str, host: bool = False, a8: bool = False) -> dict[str, int]:
    cfg = CONFIG.get((kernel, fmt, "host")) if host else None
    if cfg is None and a8:
        cfg = CONFIG.get((kernel, fmt, "a8"))
    return dict(cfg or CONFIG.get((kernel, fmt), DEFAULT_CONFIG))


def available() -> bool:
    """True when Triton imports and can run here (a CUDA device, or the CPU interpreter)."""
    return _IMPORT_ERROR is None


# ------------------------------------------------------------------------------------------------
# Stacked weights

@dataclass
class PackedMatrix:
    """One weight kind (gate, up or down) of a group of experts, stacked along a slot dimension.

    fmt: "dense" (a float tensor) or a quant.py base format. data: [S, rows, row_bytes_or_cols]
    (dense: [S, rows, cols], may be a strided view with a unit last stride). scale / minimum: the
    format's fp16 scales ([S, rows] for int8, [S, rows, groups] otherwise), None for dense.
    rows / cols: the logical [out, in] shape of one expert's matrix.
    """

    fmt: str
    data: Tensor
    rows: int
    cols: int
    scale: Tensor | None = None
    minimum: Tensor | None = None

    @classmethod
    def dense(cls, w: Tensor) -> "PackedMatrix":
        """Stacked float weights [E, out, in] (a view is fine when its last stride is 1)."""
        if w.dim() != 3:
            raise KernelError(f"PackedMatrix.dense: expected [experts, out, in], got shape {tuple(w.shape)}")
        if w.stride(-1) != 1:
            raise KernelError("PackedMatrix.dense: the input dimension must be contiguous (stride 1)")
        return cls("dense", w, int(w.shape[1]), int(w.shape[2]))

    @classmethod
    def stack(cls, mats: list[QuantizedTensor], device, pin: bool = False) -> "PackedMatrix":
        """Stack same-format, same-shape quantized matrices (slot i = mats[i]) on `device`, or in
        pinned host memory when `pin` (for zero-copy reads by the kernels)."""
        if not mats:
            raise KernelError("PackedMatrix.stack: no matrices")
        fmt, shape = mats[0].fmt, mats[0].shape
        base, rank = parse_format(fmt)
        if rank:
            raise KernelError(f"format {fmt!r}: the fused kernels do not apply low-rank terms; "
                              f"use the default experts path for it")
        for i, m in enumerate(mats):
            if m.fmt != fmt or tuple(m.shape) != tuple(shape):
                raise KernelError(f"PackedMatrix.stack: matrix {i} is {m.fmt} {tuple(m.shape)}, "
                                  f"matrix 0 is {fmt} {tuple(shape)}")
        names = {"bf16": ("w",), "int8": ("q", "scale"), "int4": ("q", "scale"),
                 "int4_asym": ("q", "scale", "min"), "ternary": ("q", "scale"), "ternary2": ("q", "scale")}[base]
        stacked = {}
        for name in names:
            first = mats[0].parts[name]
            out = torch.empty((len(mats), *first.shape), dtype=first.dtype,
                              device="cpu" if pin else device, pin_memory=pin)
            for i, m in enumerate(mats):
                out[i].copy_(m.parts[name])
            stacked[name] = out
        if base == "bf16":
            return cls("dense", stacked["w"], shape[0], shape[1])
        return cls(base, stacked["q"], shape[0], shape[1], stacked["scale"], stacked.get("min"))

    def slot(self, i: int) -> QuantizedTensor:
        """Slot i as a QuantizedTensor whose parts are views into the stack (no copy)."""
        if self.fmt == "dense":
            return QuantizedTensor("bf16", (self.rows, self.cols), {"w": self.data[i]})
        parts = {"q": self.data[i], "scale": self.scale[i]}
        if self.minimum is not None:
            parts["min"] = self.minimum[i]
        return QuantizedTensor(self.fmt, (self.rows, self.cols), parts)

    @property
    def nbytes_per_slot(self) -> int:
        n = self.data[0].numel() * self.data.element_size()
        for t in (self.scale, self.minimum):
            if t is not None:
                n += t[0].numel() * t.element_size()
        return n


@dataclass
class ExpertGroup:
    """Experts sharing one format and home. slot_of: int32 [E] (slot in this group's stacks, -1 for
    experts of other groups), or None when slot == expert id for every expert. int8_activations: run
    the group in decode mode 3 where it can (int8/int4, whole 64-column blocks), whatever FAST_DECODE."""

    gate: PackedMatrix
    up: PackedMatrix
    down: PackedMatrix
    slot_of: Tensor | None = None
    label: str = field(default="")
    int8_activations: bool = False
    host_lane: bool = False      # HBM group run with the host groups (on host_lane): prefetch's stage


# ------------------------------------------------------------------------------------------------
# Kernels. Triton decides at decoration time whether a kernel is compiled or interpreted, so on a
# machine without CUDA the interpreter is switched on before the decorators run.

_IMPORT_ERROR: str | None = None
if not torch.cuda.is_available():
    # triton.language's own helpers are decorated when triton is first imported: the switch only
    # works if nobody imported triton before.
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        _IMPORT_ERROR = ("no CUDA here, and triton was imported before TRITON_INTERPRET=1 was set; set it "
                         "before the first `import triton` to run the kernels in the interpreter")
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl
except Exception as _err:  # noqa: BLE001 - any import failure means "no Triton here"
    triton = None
    _IMPORT_ERROR = f"triton does not import: {_err}"


def _kernels():
    if _IMPORT_ERROR is not None:
        raise KernelError(f"the fused MoE kernels cannot run here: {_IMPORT_ERROR}")
    return gate_up_kernel, down_kernel, moe_sum_kernel


# Programmatic dependent launch (PDL, sm_90+): each decode-step kernel is launched with the
# programmatic-serialization attribute, so the GPU starts launching it while the kernel before it in
# the stream is still running; its programs then wait (griddepcontrol.wait) until that kernel has
# finished and its writes are visible, before touching any memory. What it saves is the launch gap
# between two dependent kernels (~1.5 us each in round 8's CUDA-graph steps: ~390 kernels, ~0.57 ms
# of a 2.6 ms step). Every program waits first, whatever it does after: a kernel whose programs all
# exited without waiting could finish before its predecessor, and the next kernel's wait would then
# not cover that predecessor. PDL = False turns it off (benchmarks A/B it).
PDL = True
_PDL_OK: dict = {}


def pdl_launch(device: torch.device) -> dict:
    """Keyword arguments for launching a kernel that has the PDL constexpr on `device`: PDL and
    launch_pdl both on where it can work (CUDA, compute capability 9+, a Triton that has
    griddepcontrol and the launch option), else PDL off (the wait compiles away)."""
    if not PDL or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return {"PDL": False}
    ok = _PDL_OK.get(device)
    if ok is None:
        try:
            import dataclasses

            from triton.backends.nvidia.compiler import CUDAOptions
            from triton.language.extra.cuda import gdc_wait  # noqa: F401 - presence check
            ok = ("launch_pdl" in {f.name for f in dataclasses.fields(CUDAOptions)}
                  and torch.cuda.get_device_capability(device)[0] >= 9)
        except Exception:  # noqa: BLE001 - an older Triton: no PDL
            ok = False
        _PDL_OK[device] = ok
    return {"PDL": True, "launch_pdl": True} if ok else {"PDL": False}


if triton is not None:
    @triton.jit
    def grid_dependency(PDL: tl.constexpr):
        """With PDL: wait for the previous kernel in the stream to finish (its writes visible), then
        let the next one start launching. Must run before the program touches memory."""
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def trit_digit(v):
        """(v // 3, v % 3) of byte values 0 <= v <= 242 (int32; the remainder as float32)."""
        q = (v * 21846) >> 16
        return q, (v - q * 3).to(tl.float32)

    @triton.jit
    def trit_term(v, s_row, x_ptr, b, bmask, K, GROUP_SIZE: tl.constexpr):
        """Scaled dot part [BN, BK] of ternary bytes v [BN, BK] (columns 5b..5b+4) with x.

        Round 3 did, per digit, a two-multiply digit extraction, a [BN, BK] scale gather and a float
        subtract/multiply/multiply: ~10 loads and ~60 ALU ops per byte, compute-bound at ~154 GB/s.
        Here: the five digits come from one chain of exact multiply-shift divisions (v // 3 =
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
        """Mode 3's activation quantizer on a float32 tile xx [W, 8] (columns 8w..8w+7 of a row, W * 8
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
    def a8_group_sums(acc, x_ptr, s_row, rmask, k0, K, KB, CPB: tl.constexpr, OFFSET: tl.constexpr,
                      GROUP_SIZE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, QB: tl.constexpr):
        """The end of a mode-3 step over packed codes (int4: CPB 2 columns per byte, codes offset by 8;
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
    def word_dots(base, s_row, m_row, rmask, x_ptr, k0, K, KB,
                  FMT: tl.constexpr, FAST: tl.constexpr, GROUP_SIZE: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, QB: tl.constexpr):
        """row_dots for int8 / int4 / int4_asym / ternary2 rows read as int32 words (BK bytes = BK/4 words per
        step). No int-to-float conversion instructions, which run at 1/8 of the FMA rate and capped
        the byte path (round 6: int8 at 41%, int4 at 21% of copy bandwidth): a code c in the low bits
        of (0x4B000000 | c) read as a float is 2^23 + c, so one OR and one float subtract decode it.
        int8 bytes are flipped to offset binary (XOR 0x80) first; int4 codes are already unsigned."""
        wi = k0 // 4 + tl.arange(0, BK // 4)
        wv = tl.load(base + wi[None, :], mask=rmask[:, None] & (wi < KB // 4)[None, :], other=0)
        if FAST == 3:
            # int8 activations, quantized beforehand (x_ptr is the store_quant row, QB columns per
            # block): four multiply-adds per dp4a on the raw weight bytes, exact int32 sums per block,
            # one float multiply per block (and per int4 weight group)
            zero = tl.zeros((BN, BK // 4), dtype=tl.int32)
            if FMT == 1:
                NB: tl.constexpr = BK // QB
                xw = tl.load(x_ptr + wi, mask=wi < K // 4, other=0)
                acc = dp4a(wv, tl.broadcast_to(xw[None, :], (BN, BK // 4)), zero, True)
                bi = k0 // QB + tl.arange(0, NB)
                xs = tl.load(x_ptr + K // 2 + K // QB + bi, mask=bi < K // QB, other=0).to(tl.float32, bitcast=True)
                blk = tl.sum(tl.reshape(acc, (BN, NB, QB // 4)), axis=2)
                return tl.sum(blk.to(tl.float32) * xs[None, :], axis=1)
            elif FMT == 5:
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
        acc = tl.zeros((BN, BK // 4), dtype=tl.float32)
        if FMT == 1:
            wv = wv ^ -2139062144                      # 0x80808080: byte q -> q + 128
            if FAST == 2:
                xq = word_x(x_ptr, wi, K, 4, BK)
            for j in tl.static_range(4):
                if FAST == 2:
                    xj = xq[j]
                else:
                    col = 4 * wi + j
                    xj = tl.load(x_ptr + col, mask=col < K, other=0.0).to(tl.float32)
                q = (((wv >> (8 * j)) & 255) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
                acc += q * xj[None, :]
            return tl.sum(acc, axis=1)
        elif FMT == 5:
            # ternary2, float x: column 16w + 4j + l is in bits 8l + 2j..; OR-ing 0x4B000000 onto the
            # 2-bit code c and reading it as a float gives 2^23 + c, so subtracting 2^23 + 1 gives the
            # trit. x comes from one contiguous [BK/4, 16] load, split in registers by lane (l = m % 4
            # of column 16w + m), then by j inside crumb_lane (round 9: 16 strided loads per step ran
            # the layer at 31.7 + 17.0 us, slower than base-3 ternary).
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
            if FAST == 2:
                xq = word_x(x_ptr, wi, K, 8, BK)
            for j in tl.static_range(8):
                if FAST == 2:
                    xj = xq[j]
                else:
                    col = 8 * wi + j
                    xj = tl.load(x_ptr + col, mask=col < K, other=0.0).to(tl.float32)
                if FMT == 2:
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
            if FMT == 2:
                return tl.sum(s * per_group, axis=1)
            else:
                x_group = tl.sum(tl.reshape(xs, (NG, GROUP_SIZE // 8)), axis=1)
                mn = tl.load(m_row + gi[None, :], mask=gmask, other=0.0).to(tl.float32)
                return tl.sum(s * per_group + mn * x_group[None, :], axis=1)

    @triton.jit
    def row_dots(w_ptr, s_ptr, m_ptr, slot, rows, rmask, x_ptr, k0, K, KB,
                 stride_we, stride_wr, stride_se, stride_sr,
                 FMT: tl.constexpr, FAST: tl.constexpr, GROUP_SIZE: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, QB: tl.constexpr):
        """[BN] partial dots of rows of one expert with x over one K step (int8: unscaled codes).
        Dense/int8 steps cover BK columns from k0; packed formats cover BK *bytes* from k0 (int4:
        2 columns per byte, ternary: 5), so each loaded byte is decoded once, whole, in registers.
        FAST (1, 2): int8/int4 rows come as an int32 view (strides in words) and are decoded without
        int-to-float conversions; see word_dots."""
        base = w_ptr + slot * stride_we + rows[:, None] * stride_wr
        if FAST and FMT != 4:
            s_row = s_ptr + slot * stride_se + rows[:, None] * stride_sr
            return word_dots(base, s_row, m_ptr + slot * stride_se + rows[:, None] * stride_sr, rmask, x_ptr,
                             k0, K, KB, FMT, FAST, GROUP_SIZE, BN, BK, QB)
        else:   # an explicit else: the compiler builds code after a constexpr-if's return too
            i = k0 + tl.arange(0, BK)
            if FMT <= 1:
                m = rmask[:, None] & (i < K)[None, :]
                xk = tl.load(x_ptr + i, mask=i < K, other=0.0).to(tl.float32)
                w = tl.load(base + i[None, :], mask=m, other=0).to(tl.float32)
                return tl.sum(w * xk[None, :], axis=1)
            else:
                bmask = rmask[:, None] & (i < KB)[None, :]
                v = tl.load(base + i[None, :], mask=bmask, other=0).to(tl.int32)
                s_row = s_ptr + slot * stride_se + rows[:, None] * stride_sr
                if FMT == 4:
                    return tl.sum(trit_term(v, s_row, x_ptr, i, bmask, K, GROUP_SIZE), axis=1)
                else:
                    # Low nibble = even column, high nibble = odd column. A group of 64 columns is 32 bytes:
                    # the products are summed per group first and scaled once per (row, group), so the
                    # scales are [BN, BK/32] loads, not one gather per byte (round 4: 618 GB/s).
                    lo = (v & 15).to(tl.float32)
                    hi = ((v >> 4) & 15).to(tl.float32)
                    x0 = tl.load(x_ptr + 2 * i, mask=2 * i < K, other=0.0).to(tl.float32)
                    x1 = tl.load(x_ptr + 2 * i + 1, mask=2 * i + 1 < K, other=0.0).to(tl.float32)
                    gi = k0 // (GROUP_SIZE // 2) + tl.arange(0, BK // (GROUP_SIZE // 2))
                    gmask = rmask[:, None] & (gi * (GROUP_SIZE // 2) < KB)[None, :]
                    s = tl.load(s_row + gi[None, :], mask=gmask, other=0.0).to(tl.float32)
                    if FMT == 2:
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

    @triton.jit
    def pair_slot(ids_ptr, slot_ptr, pair, HAS_MAP: tl.constexpr):
        """The stack slot of pair `pair`'s expert in this launch's group (-1: another group's)."""
        slot = tl.load(ids_ptr + pair).to(tl.int64)        # the expert id is the slot without a map
        if HAS_MAP:
            slot = tl.load(slot_ptr + slot).to(tl.int64)
        return slot

    @triton.jit
    def gate_up_rows(x_row, h_out, hq_out, slot, rows, rmask, N, K, KB, g_ptr, gs_ptr, gm_ptr, u_ptr, us_ptr,
                     um_ptr, stride_ge, stride_gr, stride_gse, stride_gsr, stride_ue, stride_ur, stride_use, stride_usr,
                     FMT: tl.constexpr, FAST: tl.constexpr, GROUP_SIZE: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr):
        """h rows = silu(W_gate x) * (W_up x) for one expert slot of one group. Mode 3: x_row is x's
        quantized row (blocks of GROUP_SIZE), and h goes out quantized, one block per program (BN rows,
        a multiple of 8), into hq_out, the pair's row of down's quantized input."""
        g = tl.zeros((BN,), dtype=tl.float32)
        u = tl.zeros((BN,), dtype=tl.float32)
        if FMT <= 1:
            lim = K
        else:
            lim = KB
        for k0 in range(0, lim, BK):
            g += row_dots(g_ptr, gs_ptr, gm_ptr, slot, rows, rmask, x_row, k0, K, KB,
                          stride_ge, stride_gr, stride_gse, stride_gsr, FMT, FAST, GROUP_SIZE, BN, BK, GROUP_SIZE)
            u += row_dots(u_ptr, us_ptr, um_ptr, slot, rows, rmask, x_row, k0, K, KB,
                          stride_ue, stride_ur, stride_use, stride_usr, FMT, FAST, GROUP_SIZE, BN, BK, GROUP_SIZE)
        if FMT == 1:
            g = g * tl.load(gs_ptr + slot * stride_gse + rows * stride_gsr, mask=rmask, other=0.0).to(tl.float32)
            u = u * tl.load(us_ptr + slot * stride_use + rows * stride_usr, mask=rmask, other=0.0).to(tl.float32)
        h = g / (1.0 + tl.exp(-g)) * u
        if FAST == 3:
            nat_lo, nat_hi, even, odd, qsum, scale = quant_pack(tl.reshape(h, (BN // 8, 8)), BN)
            w8 = tl.program_id(1) * (BN // 8) + tl.arange(0, BN // 8)
            b = tl.program_id(1) + tl.arange(0, 1)
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
                       FMT_A: tl.constexpr, MAP_A: tl.constexpr, FAST_A: tl.constexpr, BK_A: tl.constexpr,
                       HAS_B: tl.constexpr, FMT_B: tl.constexpr, MAP_B: tl.constexpr, FAST_B: tl.constexpr,
                       BK_B: tl.constexpr, PDL: tl.constexpr = False):
        """Program (pair, row block) for up to two expert groups (A, and B when HAS_B): each pair's
        expert is in at most one of them; a pair in neither is left to another launch. Two groups per
        launch: a hot/cold plan's second format costs no extra launches (round 6: ~3 us each).
        xq / hq: x and h quantized (store_quant rows), for groups in mode 3."""
        grid_dependency(PDL)
        pair = tl.program_id(0)
        rows = tl.program_id(1) * BN + tl.arange(0, BN)
        rmask = rows < N
        tok = pair // TOPK
        h_out = h_ptr + pair * stride_ht
        hq_out = hq_ptr + pair * stride_hqt
        sa = pair_slot(ids_ptr, slot_a, pair, MAP_A)
        if sa >= 0:
            if FAST_A == 3:
                xa = xq_ptr + tok * stride_xqt
            else:
                xa = x_ptr + tok * stride_xt
            gate_up_rows(xa, h_out, hq_out, sa, rows, rmask, N, K, KB_a, ga_ptr, gsa_ptr, gma_ptr, ua_ptr, usa_ptr,
                         uma_ptr, sge_a, sgr_a, sgse_a, sgsr_a, sue_a, sur_a, suse_a, susr_a,
                         FMT_A, FAST_A, GROUP_SIZE, BN, BK_A)
        elif HAS_B:
            sb = pair_slot(ids_ptr, slot_b, pair, MAP_B)
            if sb >= 0:
                if FAST_B == 3:
                    xb = xq_ptr + tok * stride_xqt
                else:
                    xb = x_ptr + tok * stride_xt
                gate_up_rows(xb, h_out, hq_out, sb, rows, rmask, N, K, KB_b, gb_ptr, gsb_ptr, gmb_ptr, ub_ptr,
                             usb_ptr, umb_ptr, sge_b, sgr_b, sgse_b, sgsr_b, sue_b, sur_b, suse_b, susr_b,
                             FMT_B, FAST_B, GROUP_SIZE, BN, BK_B)

    @triton.jit
    def down_rows(h_row, part_out, w, slot, rows, rmask, K, KB, d_ptr, ds_ptr, dm_ptr,
                  stride_de, stride_dr, stride_dse, stride_dsr,
                  FMT: tl.constexpr, FAST: tl.constexpr, GROUP_SIZE: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr, QH: tl.constexpr):
        """part rows = w * (W_down h) for one expert slot of one group (float32). Mode 3: h_row is h's
        quantized row, blocks of QH columns (gate_up's BN)."""
        if FMT <= 1:
            lim = K
        else:
            lim = KB
        y = tl.zeros((BN,), dtype=tl.float32)
        for k0 in range(0, lim, BK):
            y += row_dots(d_ptr, ds_ptr, dm_ptr, slot, rows, rmask, h_row, k0, K, KB,
                          stride_de, stride_dr, stride_dse, stride_dsr, FMT, FAST, GROUP_SIZE, BN, BK, QH)
        if FMT == 1:
            y = y * tl.load(ds_ptr + slot * stride_dse + rows * stride_dsr, mask=rmask, other=0.0).to(tl.float32)
        tl.store(part_out + rows, y * w, mask=rmask)

    @triton.jit
    def down_kernel(h_ptr, hq_ptr, ids_ptr, wts_ptr, part_ptr, N, K, stride_ht, stride_hqt, stride_pt,
                    slot_a, da_ptr, dsa_ptr, dma_ptr, KB_a, sde_a, sdr_a, sdse_a, sdsr_a,
                    slot_b, db_ptr, dsb_ptr, dmb_ptr, KB_b, sde_b, sdr_b, sdse_b, sdsr_b,
                    FIRST: tl.constexpr, GROUP_SIZE: tl.constexpr, BN: tl.constexpr,
                    FMT_A: tl.constexpr, MAP_A: tl.constexpr, FAST_A: tl.constexpr, BK_A: tl.constexpr,
                    HAS_B: tl.constexpr, FMT_B: tl.constexpr, MAP_B: tl.constexpr, FAST_B: tl.constexpr,
                    BK_B: tl.constexpr, QH: tl.constexpr, PDL: tl.constexpr = False):
        """Program (pair, row block): part[pair, rows] = w[pair] * (W_down[e] h[pair])[rows] in
        float32, for up to two groups like gate_up. One program per pair: round 4's down looped over
        a token's k experts in one program, a chain of dependent loads that ran at ~1.8 TB/s against
        gate_up's ~3.1. The first launch also zeroes the rows of pairs in neither of its groups, so
        every row is written once whatever the grouping, and moe_sum adds the k rows in a fixed order.
        Mode 3 groups read h quantized (hq, blocks of QH columns)."""
        grid_dependency(PDL)
        pair = tl.program_id(0)
        rows = tl.program_id(1) * BN + tl.arange(0, BN)
        rmask = rows < N
        part_out = part_ptr + pair * stride_pt
        sa = pair_slot(ids_ptr, slot_a, pair, MAP_A)
        if sa >= 0:
            if FAST_A == 3:
                ha = hq_ptr + pair * stride_hqt
            else:
                ha = h_ptr + pair * stride_ht
            down_rows(ha, part_out, tl.load(wts_ptr + pair).to(tl.float32), sa, rows, rmask, K, KB_a,
                      da_ptr, dsa_ptr, dma_ptr, sde_a, sdr_a, sdse_a, sdsr_a, FMT_A, FAST_A, GROUP_SIZE, BN, BK_A, QH)
        else:
            sb = -1
            if HAS_B:
                sb = pair_slot(ids_ptr, slot_b, pair, MAP_B)
            if sb >= 0:
                if FAST_B == 3:
                    hb = hq_ptr + pair * stride_hqt
                else:
                    hb = h_ptr + pair * stride_ht
                down_rows(hb, part_out, tl.load(wts_ptr + pair).to(tl.float32), sb, rows, rmask, K, KB_b,
                          db_ptr, dsb_ptr, dmb_ptr, sde_b, sdr_b, sdse_b, sdsr_b, FMT_B, FAST_B, GROUP_SIZE, BN,
                          BK_B, QH)
            elif FIRST:
                tl.store(part_out + rows, tl.zeros((BN,), dtype=tl.float32), mask=rmask)

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


def _scale_args(pm: PackedMatrix):
    """(scale tensor, minimum tensor, stride over slots, stride over rows) for a launch."""
    if pm.scale is None:
        return pm.data, pm.data, 0, 0
    s = pm.scale
    return s, (pm.minimum if pm.minimum is not None else s), s.stride(0), s.stride(1)


# row_dots' FAST for int8/int4 rows that can be read as int32 words: 0 = bytes with int-to-float
# conversions; 1 = words, conversion-free decode, x loaded per column; 2 = as 1 with x loaded once
# per step and split in registers. H200 (benchmarks/quant_kernels_h200.py, round 7), one int8 layer:
# gate_up + down 19.4 / 29.0 / 17.4 us for 0 / 1 / 2. A float digit split for ternary was tried and
# measured slower than its integer one (36.3 against 33.5 us), so ternary keeps the integer split.
# 3 = int8 activations ("W8A8" / "W4A8", as llama.cpp's MMVQ does with q8_1): x is quantized to int8
# per block of GROUP columns once per layer (quantize_rows_kernel), h per block of gate_up's BN rows by
# gate_up itself, and the kernels multiply raw weight bytes with dp4a, exact int32 sums per block.
# Per layer on the H200, int4: gate_up + down 9.76 + 4.79 us against 10.16 + 7.90 in mode 2. Round 8's counters (ncu, benchmarks/kernel_counters_h200.py)
# put mode 2's int4 gate_up at ~7 issued instructions per weight element and 24% of DRAM bandwidth:
# issue-bound; dp4a does 4 (int8) or 8 (int4, two dp4a and two masks per word) per few instructions.
# It changes the numbers (x is rounded to 8 bits per block; quantize_activations is the reference), so
# it is opt-in per format.
FAST_DECODE = 2
FAST_BY_FORMAT: dict[str, int] = {}     # per-format overrides of FAST_DECODE (benchmarks set them)
INT8_ACTIVATION_FORMATS = ("int8", "int4", "ternary2")


def decode_mode(fmt: str) -> int:
    mode = FAST_BY_FORMAT.get(fmt, FAST_DECODE)
    # ternary2 has no byte path: float x runs its word decode (mode 2) whatever is asked below that
    return max(mode, 2) if fmt == "ternary2" else mode


def _words(pm: PackedMatrix) -> Tensor | None:
    """pm's data as an int32 view for the word decode path, or None (bytes path): dense and ternary
    formats, rows not a whole number of words, or FAST_DECODE off (ternary2 has only the word path)."""
    if pm.fmt not in ("int8", "int4", "int4_asym", "ternary2") or not decode_mode(pm.fmt):
        return None
    cached = pm.__dict__.get("_words")
    if cached is not None and cached[0] is pm.data:
        return cached[1]
    d = pm.data
    ok = d.shape[-1] % 4 == 0 and d.stride(0) % 4 == 0 and d.stride(1) % 4 == 0 and d.data_ptr() % 4 == 0
    view = d.view(torch.int32) if ok and d.stride(-1) == 1 else None
    pm.__dict__["_words"] = (d, view)
    return view


def _gate_up_words(g: ExpertGroup) -> bool:
    return _words(g.gate) is not None and _words(g.up) is not None


def _fast(g: ExpertGroup, kernel: str) -> int:
    """The FAST constexpr of a group's launch: its format's decode_mode where its rows can be read as
    words. Mode 3 takes int8 and int4 groups whose hidden size and width are multiples of 64 (whole
    quantization blocks), for gate_up and down alike (gate_up hands down a quantized h); others run 2."""
    words = _gate_up_words(g) if kernel == "gate_up" else _words(g.down) is not None
    mode = (3 if g.int8_activations else int(decode_mode(g.gate.fmt))) if words else 0
    if mode == 3 and not (g.gate.fmt in INT8_ACTIVATION_FORMATS and g.gate.cols % GROUP == 0
                          and g.gate.rows % GROUP == 0 and _gate_up_words(g) and _words(g.down) is not None):
        mode = 2
    return mode


def quant_row_len(K: int, block: int) -> int:
    """int32 slots of one quantized row (store_quant's layout): K/4 natural words, K/8 even and K/8
    odd words, then a code sum and a scale per block."""
    return K // 2 + 2 * (K // block)


def quantize_activations(x: Tensor, block: int = GROUP) -> Tensor:
    """What mode 3's kernels multiply with, as float32: each row of x cut into blocks of `block`
    columns from column 0, each block scaled by 127 / its absmax, rounded half to even, scaled back."""
    xf = x.float()
    T, K = xf.shape
    pad = -K % block
    xb = torch.nn.functional.pad(xf, (0, pad)).view(T, -1, block)
    amax = xb.abs().amax(dim=-1, keepdim=True)
    amax = torch.where(amax > 0, amax, torch.ones_like(amax))
    q = torch.round(xb * (127.0 / amax))
    return (q * (amax / 127.0)).view(T, -1)[:, :K]


def _check_group(group: ExpertGroup, hidden: int) -> None:
    g, u, d = group.gate, group.up, group.down
    if not (g.fmt == u.fmt == d.fmt):
        raise KernelError(f"expert group {group.label!r}: gate/up/down formats differ ({g.fmt}, {u.fmt}, {d.fmt})")
    if g.fmt not in FORMAT_CODES:
        raise KernelError(f"expert group {group.label!r}: format {g.fmt!r} not one of {list(FORMAT_CODES)}")
    if g.cols != hidden or u.cols != hidden or d.rows != hidden or g.rows != u.rows or d.cols != g.rows:
        raise KernelError(f"expert group {group.label!r}: shapes gate {g.rows}x{g.cols}, up {u.rows}x{u.cols}, "
                          f"down {d.rows}x{d.cols} do not fit hidden size {hidden}")
    for name, pm in (("gate", g), ("up", u), ("down", d)):
        if pm.data.stride(-1) != 1:
            raise KernelError(f"expert group {group.label!r}: {name} weights need a unit last stride")


def fused_moe(x: Tensor, topk_ids: Tensor, topk_w: Tensor, groups: list[ExpertGroup],
              reduce: bool = True, xq: Tensor | None = None, after_lane: bool = False) -> Tensor:
    """x [T, H]; topk_ids [T, k] (int64/int32); topk_w [T, k] -> [T, H] in x's dtype:
    sum_j topk_w[t, j] * down(silu(gate x) * up x) of expert topk_ids[t, j], every expert in
    exactly one of `groups`. Reads each (token, expert) pair's weights once; no host sync.
    reduce=False: the float32 terms [T * k, H] instead (pair t*k + j), for add_rmsnorm to sum.
    xq: x's int8 rows as add_rmsnorm_router(quantize_h=True) made them, for groups in decode mode 3
    (else they are made here, one more launch).
    after_lane: the host lane holds work the groups read (prefetch's stage copies): where the host
    groups do not run on the lane, the main stream waits for it first."""
    if not groups:
        raise KernelError("fused_moe: no expert groups")
    gate_up_kernel, down_kernel, moe_sum_kernel = _kernels()
    T, H = x.shape
    k = topk_ids.shape[1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    ids = topk_ids.contiguous()
    wts = topk_w.contiguous()
    inter = groups[0].gate.rows
    for g in groups:
        _check_group(g, H)
        if g.gate.rows != inter:
            raise KernelError(f"fused_moe: expert group {g.label!r} has width {g.gate.rows}, another {inter}")
    h = torch.empty(T * k, inter, dtype=torch.float32, device=x.device)
    part = torch.empty(T * k, H, dtype=torch.float32, device=x.device)
    # mode 3: x quantized once here; h quantized by gate_up, blocks of its BN (8 or more) columns
    hq = h
    if any(_fast(g, "gate_up") == 3 for g in groups):
        if xq is None:
            xq = torch.empty(T, quant_row_len(H, GROUP), dtype=torch.int32, device=x.device)
            quantize_rows_kernel[(T,)](x, xq, H, x.stride(0), xq.stride(0), W=_next_pow2(H // 8), QB=GROUP,
                                       num_warps=4, **pdl_launch(x.device))
        elif xq.dtype != torch.int32 or tuple(xq.shape) != (T, quant_row_len(H, GROUP)) or xq.stride(-1) != 1:
            raise KernelError(f"fused_moe: xq {xq.dtype} {tuple(xq.shape)}; expected int32 "
                              f"[{T}, {quant_row_len(H, GROUP)}] rows from add_rmsnorm_router(quantize_h=True)")
        hq = torch.empty(T * k, quant_row_len(inter, 8), dtype=torch.int32, device=x.device)
    else:
        xq = h

    def launch(pair_groups: list[ExpertGroup], first: bool) -> None:
        """gate_up then down for the pairs of one or two groups (first: also zero the part rows of
        pairs in neither). Block rows (BN), warps and stages follow the first group's config; each
        group keeps its own BK."""
        host = pair_groups[0].gate.data.device.type == "cpu"
        ga, gb = pair_groups[0], pair_groups[-1]
        a8 = _fast(ga, "gate_up") == 3
        meta = {}
        for kernel in ("gate_up", "down"):
            cfg = get_config(kernel, ga.gate.fmt, host=host, a8=a8)
            bn = cfg["BN"]
            if kernel == "gate_up" and a8:
                # one block of h per program: 8 to 64 rows (ternary2's down words span 16 columns)
                bn = min(max(bn, 16 if ga.gate.fmt == "ternary2" else 8), GROUP)
            meta[kernel] = dict(BN=bn, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                                HAS_B=len(pair_groups) > 1, GROUP_SIZE=GROUP)
            for tag, g in (("A", ga), ("B", gb)):
                fast = _fast(g, kernel)
                bk = get_config(kernel, g.gate.fmt, host=host, a8=a8)["BK"]
                if fast == 3:       # a step covers whole x blocks (64 columns; int4: 2 columns per byte)
                    bk = max(bk, {"int8": GROUP, "int4": GROUP // 2}.get(g.gate.fmt, GROUP // 4))
                meta[kernel].update({f"FMT_{tag}": FORMAT_CODES[g.gate.fmt], f"MAP_{tag}": g.slot_of is not None,
                                     f"FAST_{tag}": fast, f"BK_{tag}": bk})
        args = []
        for g in (ga, gb):
            gs, gm, gse, gsr = _scale_args(g.gate)
            us, um, use, usr = _scale_args(g.up)
            gd, ud = (_words(g.gate), _words(g.up)) if _gate_up_words(g) else (g.gate.data, g.up.data)
            args += [g.slot_of if g.slot_of is not None else ids, gd, gs, gm, ud, us, um, g.gate.data.shape[-1],
                     gd.stride(0), gd.stride(1), gse, gsr, ud.stride(0), ud.stride(1), use, usr]
        gate_up_kernel[(T * k, -(-inter // meta["gate_up"]["BN"]))](
            x, xq, ids, h, hq, inter, H, x.stride(0), xq.stride(0), h.stride(0), hq.stride(0), *args, TOPK=k,
            **meta["gate_up"], **pdl_launch(x.device))
        args = []
        for g in (ga, gb):
            ds, dm, dse, dsr = _scale_args(g.down)
            dw = _words(g.down)
            dd = g.down.data if dw is None else dw
            args += [g.slot_of if g.slot_of is not None else ids, dd, ds, dm, g.down.data.shape[-1],
                     dd.stride(0), dd.stride(1), dse, dsr]
        down_kernel[(T * k, -(-H // meta["down"]["BN"]))](
            h, hq, ids, wts, part, H, inter, h.stride(0), hq.stride(0), part.stride(0), *args, FIRST=first,
            QH=meta["gate_up"]["BN"], **meta["down"], **pdl_launch(x.device))

    def launches(gs: list[ExpertGroup], first: bool) -> None:
        # The group with the most experts leads; groups of one format share a launch pair. Two
        # formats never do: a kernel gets the registers of its heaviest branch, and an int8 + ternary
        # launch ran its int8 pairs at 16.5 + 10.9 us against 11.7 + 6.4 alone (round 7).
        by_fmt: dict[str, list[ExpertGroup]] = {}
        for g in sorted(gs, key=lambda g: -g.gate.data.shape[0]):
            by_fmt.setdefault(g.gate.fmt, []).append(g)
        for same in by_fmt.values():
            for i in range(0, len(same), 2):
                launch(same[i:i + 2], first)
                first = False

    # The host lane: host groups (zero-copy reads over PCIe, latency-bound) and prefetch's stage,
    # whose launches must follow the stage copies (host_lane's docstring). A stage of the host
    # groups' format shares their launch pair.
    lane = [g for g in groups if x.is_cuda and (g.host_lane or g.gate.data.device.type == "cpu")]
    in_hbm = sorted((g for g in groups if not any(g is lg for lg in lane)),   # identity: == compares tensors
                    key=lambda g: -g.gate.data.shape[0])
    # Branches that run concurrently with the lead group's launches: the other HBM formats, and the
    # host lane. Their pairs' rows are disjoint.
    fmts: dict[str, list[ExpertGroup]] = {}
    for g in in_hbm:                     # the largest group's format first
        fmts.setdefault(g.gate.fmt, []).append(g)
    lead, *branches = list(fmts.values()) or [[]]
    if x.is_cuda and OVERLAP_HOST and lead and (branches or lane):
        # No zeroing of other pairs' rows here (it would race): the groups cover every expert
        # (TieredExperts builds them so).
        main = torch.cuda.current_stream(x.device)
        sides = []
        for key, branch in [*enumerate(branches), *([("host", lane)] if lane else [])]:
            side = _side_stream(x.device, key)      # "host": host_lane
            side.wait_stream(main)
            with torch.cuda.stream(side):
                launches(branch, first=False)
            sides.append(side)
        launches(lead, first=False)
        for side in sides:
            main.wait_stream(side)
    else:
        # host groups (pinned, read over PCIe) never share a launch with HBM groups: other block shapes
        if after_lane and x.is_cuda:
            torch.cuda.current_stream(x.device).wait_stream(host_lane(x.device))   # prefetch's copies
        launches(in_hbm, first=True)
        if lane:
            launches(lane, first=not in_hbm)
    if not reduce:
        return part
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    block = min(1024, _next_pow2(H))
    moe_sum_kernel[(T, -(-H // block))](part, out, H, part.stride(0), out.stride(0), TOPK=k, BLOCK=block,
                                        num_warps=4, **pdl_launch(x.device))
    return out


def dense_group(w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> ExpertGroup:
    """The group for a dense `Experts` module's stacked weights (views, no copy)."""
    return ExpertGroup(PackedMatrix.dense(w_gate), PackedMatrix.dense(w_up), PackedMatrix.dense(w_down),
                       None, "dense")


# ------------------------------------------------------------------------------------------------
# Fused non-expert decode ops. A decode step's non-expert work is many tiny kernels (RMSNorm alone is
# ~8: cast, pow, mean, add, rsqrt, mul, cast, mul); each costs a few microseconds even inside a CUDA
# graph, which at 48 layers dominates the step. These kernels do one op group per launch and round
# to the activation dtype where the torch code does, so they agree with it to within reduction order.

if triton is not None:
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
    def rms_scale(s, inv, w_ptr, offs, m):
        """w[offs] * (s * inv rounded to s's dtype), float32 (0 on masked lanes)."""
        xn = (s.to(tl.float32) * inv).to(s.dtype).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
        return w * xn

    @triton.jit
    def add_rmsnorm_kernel(x_ptr, d_ptr, w_ptr, res_ptr, out_ptr, N, eps,
                           HAS_DELTA: tl.constexpr, DELTA_ROWS: tl.constexpr, BLOCK: tl.constexpr,
                           PDL: tl.constexpr = False):
        """Row r: s = x + delta (rounded to x's dtype, written to res), out = w * norm(s) (see
        residual_sum for DELTA_ROWS > 1)."""
        grid_dependency(PDL)
        r = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        m = offs < N
        x = residual_sum(x_ptr, d_ptr, r, N, offs, m, HAS_DELTA, DELTA_ROWS)
        if HAS_DELTA:
            tl.store(res_ptr + r * N + offs, x, mask=m)
        out = rms_scale(x, rms_inv(x, N, eps), w_ptr, offs, m)
        tl.store(out_ptr + r * N + offs, out.to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def softmax_topk_store(z, m, offs, ids_ptr, w_ptr, r, TOPK: tl.constexpr, KP: tl.constexpr,
                           NORM: tl.constexpr, BLOCK_E: tl.constexpr):
        """Softmax over one token's router logits z [BLOCK_E] (float32, -inf where ~m), top-k by k
        rounds of argmax (lowest index wins ties), optional renormalisation; no sort."""
        p = tl.exp(z - tl.max(z, axis=0))
        p = p / tl.sum(p, axis=0)
        p = tl.where(m, p, -1.0)
        ks = tl.arange(0, KP)
        vals = tl.zeros((KP,), dtype=tl.float32)
        idx = tl.zeros((KP,), dtype=tl.int64)
        for j in tl.static_range(TOPK):
            best = tl.max(p, axis=0)
            at = tl.min(tl.where(p == best, offs, BLOCK_E), axis=0)
            vals = tl.where(ks == j, best, vals)
            idx = tl.where(ks == j, at.to(tl.int64), idx)
            p = tl.where(offs == at, -2.0, p)
        if NORM:
            vals = vals / tl.sum(tl.where(ks < TOPK, vals, 0.0), axis=0)
        tl.store(ids_ptr + r * TOPK + ks, idx, mask=ks < TOPK)
        tl.store(w_ptr + r * TOPK + ks, vals, mask=ks < TOPK)

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
        logits and resets the counter for the next call. One launch where there were two (cuBLAS'
        M=1 GEMM, ~5 us for this 128 x 2048 matrix, and route_topk)."""
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
        arrived = tl.atomic_add(count_ptr + t, 1, sem="acq_rel")
        if arrived == tl.num_programs(1) - 1:
            offs = tl.arange(0, BLOCK_E)
            m = offs < E
            z = tl.load(logits_ptr + t * E + offs, mask=m, other=float("-inf"), cache_modifier=".cg")
            softmax_topk_store(z, m, offs, ids_ptr, w_ptr, t, TOPK, KP, NORM, BLOCK_E)
            tl.atomic_xchg(count_ptr + t, 0)

    @triton.jit
    def norm_rope_head(src, w_ptr, c, s, d, partner, eps, HAS_NORM: tl.constexpr, D: tl.constexpr,
                       dt: tl.constexpr):
        """One head vector (float32, rounded as the torch code rounds): optional RMSNorm, then RoPE
        with rotate_half: out[d] = x[d] cos[d] + sign(d) x[partner(d)] sin[d]."""
        x = tl.load(src + d).to(tl.float32)
        xp = tl.load(src + partner).to(tl.float32)
        if HAS_NORM:
            inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
            x = (tl.load(w_ptr + d).to(tl.float32) * (x * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            xp = (tl.load(w_ptr + partner).to(tl.float32) * (xp * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        sign = tl.where(d < D // 2, -1.0, 1.0)
        return ((x * c).to(dt).to(tl.float32) + (sign * xp * s).to(dt).to(tl.float32)).to(dt)

    @triton.jit
    def qk_rope_cache_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, pos_ptr,
                             qo_ptr, kc_ptr, vc_ptr, T, NH, eps,
                             s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_cb, s_ct,
                             s_ob, s_oh, s_ot, s_cab, s_cah, s_cas,
                             HAS_NORM: tl.constexpr, D: tl.constexpr, PDL: tl.constexpr = False):
        """Program (b*T + t, head): query heads -> normed, rotated, written to qo [B, NH, T, D];
        key/value heads -> normed+rotated key and the value written to their cache slot pos[b, t]."""
        grid_dependency(PDL)
        bt = tl.program_id(0)
        h = tl.program_id(1)
        b = bt // T
        t = bt - b * T
        d = tl.arange(0, D)
        partner = (d + D // 2) % D
        c = tl.load(cos_ptr + b * s_cb + t * s_ct + d).to(tl.float32)
        s = tl.load(sin_ptr + b * s_cb + t * s_ct + d).to(tl.float32)
        dt = qo_ptr.dtype.element_ty
        if h < NH:
            out = norm_rope_head(q_ptr + b * s_qb + t * s_qt + h * s_qh, qw_ptr, c, s, d, partner, eps,
                                 HAS_NORM, D, dt)
            tl.store(qo_ptr + b * s_ob + h * s_oh + t * s_ot + d, out)
        else:
            kh = h - NH
            pos = tl.load(pos_ptr + bt).to(tl.int64)
            out = norm_rope_head(k_ptr + b * s_kb + t * s_kt + kh * s_kh, kw_ptr, c, s, d, partner, eps,
                                 HAS_NORM, D, dt)
            slot = b * s_cab + kh * s_cah + pos * s_cas + d
            tl.store(kc_ptr + slot, out.to(kc_ptr.dtype.element_ty))
            v = tl.load(v_ptr + b * s_vb + t * s_vt + kh * s_vh + d)
            tl.store(vc_ptr + slot, v.to(vc_ptr.dtype.element_ty))


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def add_rmsnorm(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float,
                delta_rows: int = 1) -> tuple[Tensor, Tensor]:
    """(x + delta, RMSNorm(x + delta) * weight) in one launch, both in x's dtype (delta None: (x,
    norm(x))). Rounds like `x + delta` then model.RMSNorm: the sum to x's dtype, the normalised value
    to x's dtype before the weight. delta_rows > 1: delta is fused_moe(..., reduce=False)'s float32
    partials [rows * delta_rows, N], summed here (this saves moe_sum's launch; same result)."""
    _kernels()
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
                                DELTA_ROWS=delta_rows, BLOCK=_next_pow2(N), num_warps=4 if N >= 1024 else 1,
                                **pdl_launch(x.device))
    return res, out


def route_topk(logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """Router logits [N, E] -> (topk_ids [N, k] int64, topk_w [N, k] float32): softmax in float32,
    top-k, optional renormalisation, in one launch per call (what MoEBlock.route does in ~6)."""
    _kernels()
    if logits.dim() != 2 or not 0 < top_k <= logits.shape[1]:
        raise KernelError(f"route_topk: logits shape {tuple(logits.shape)} with top_k {top_k}; expected "
                          f"[tokens, experts] and 0 < top_k <= experts")
    lg = logits if logits.stride(-1) == 1 else logits.contiguous()
    N, E = lg.shape
    ids = torch.empty(N, top_k, dtype=torch.long, device=lg.device)
    w = torch.empty(N, top_k, dtype=torch.float32, device=lg.device)
    route_topk_kernel[(N,)](lg, ids, w, E, lg.stride(0), TOPK=top_k, KP=_next_pow2(top_k), NORM=renormalize,
                            BLOCK_E=_next_pow2(E), num_warps=1, **pdl_launch(logits.device))
    return ids, w


# MoEBlock.route uses router_topk when True, else F.linear + route_topk (two launches). The fused one
# wins only if its GEMV slices are fast for the router's shape: benchmarks/decode_h200.py times both.
FUSED_ROUTER = True
# The fused decode layers let add_rmsnorm sum the MoE partials (no moe_sum launch) when True.
DEFER_MOE_SUM = True
_ARRIVALS: dict[torch.device, Tensor] = {}   # router_topk's per-token counters, zero between calls
ROUTER_MAX_TOKENS = 64


def router_topk(x: Tensor, weight: Tensor, top_k: int, renormalize: bool,
                arrivals: Tensor | None = None, out: tuple[Tensor, Tensor, Tensor] | None = None
                ) -> tuple[Tensor, Tensor, Tensor]:
    """x [N, H] (N <= ROUTER_MAX_TOKENS), router weight [E, H] -> (logits [N, E] float32 (values
    rounded to x's dtype), topk_ids [N, k] int64, topk_w [N, k] float32): F.linear + route_topk in
    one launch. The arrival counters (int32 [>= N], zero) are shared per device unless `arrivals` is
    given: calls on two streams at once need their own (the host-tier prefetch passes its own).
    out: the three result tensors to write (shapes and dtypes as above), instead of new ones."""
    _kernels()
    N, H = x.shape
    E = weight.shape[0]
    if weight.dim() != 2 or weight.shape[1] != H or weight.stride(-1) != 1:
        raise KernelError(f"router_topk: weight shape {tuple(weight.shape)}; expected [experts, {H}] with a unit "
                          f"last stride")
    if not 0 < top_k <= E or N > ROUTER_MAX_TOKENS:
        raise KernelError(f"router_topk: {N} tokens, top_k {top_k}, {E} experts; expected <= {ROUTER_MAX_TOKENS} "
                          f"tokens and 0 < top_k <= experts")
    xc = x if x.stride(-1) == 1 else x.contiguous()
    counts = arrivals if arrivals is not None else _ARRIVALS.get(x.device)
    if counts is None:
        counts = _ARRIVALS[x.device] = torch.zeros(ROUTER_MAX_TOKENS, dtype=torch.int32, device=x.device)
    if out is None:
        out = (torch.empty(N, E, dtype=torch.float32, device=x.device),
               torch.empty(N, top_k, dtype=torch.long, device=x.device),
               torch.empty(N, top_k, dtype=torch.float32, device=x.device))
    logits, ids, w = out
    want = ((N, E, torch.float32), (N, top_k, torch.long), (N, top_k, torch.float32))
    if any((*t.shape, t.dtype) != wt or not t.is_contiguous() for t, wt in zip(out, want)):
        raise KernelError(f"router_topk: out {[(tuple(t.shape), t.dtype) for t in out]}; expected contiguous "
                          f"{[((a, b), d) for a, b, d in want]}")
    cfg = get_config("router", "dense")
    be = min(cfg["BN"], _next_pow2(E))
    router_topk_kernel[(N, -(-E // be))](xc, weight, logits, counts, ids, w, E, H, xc.stride(0), weight.stride(0),
                                         TOPK=top_k, KP=_next_pow2(top_k), NORM=renormalize,
                                         BLOCK_E=_next_pow2(E), BE=be, BH=min(cfg["BK"], _next_pow2(H)),
                                         num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                                         **pdl_launch(x.device))
    return logits, ids, w


# _fused_layers routes a MoE block inside its post-attention norm (add_rmsnorm_router) when True.
FUSED_NORM_ROUTER = True

if triton is not None:
    @triton.jit
    def add_rmsnorm_router_kernel(x_ptr, d_ptr, nw_ptr, res_ptr, h_ptr, g_ptr, logits_ptr, count_ptr, ids_ptr,
                                  w_ptr, q_ptr, N, E, eps, stride_g, stride_q, HAS_DELTA: tl.constexpr,
                                  TOPK: tl.constexpr, KP: tl.constexpr, NORM: tl.constexpr, BLOCK: tl.constexpr,
                                  BLOCK_E: tl.constexpr, BE: tl.constexpr, BH: tl.constexpr, QUANT: tl.constexpr,
                                  QB: tl.constexpr, PDL: tl.constexpr = False):
        """Program (token t, block of BE experts): add_rmsnorm_kernel's row t (program 0 stores res
        and h), then router_topk_kernel's program on that h. Every program normalises the row itself
        (no grid-wide wait for program 0), so the norm's loads are repeated per expert block; they are
        one row each, L2-resident. The GEMV steps, sums and roundings are router_topk_kernel's."""
        grid_dependency(PDL)
        t = tl.program_id(0).to(tl.int64)
        pb = tl.program_id(1)
        dt = x_ptr.dtype.element_ty
        offs = tl.arange(0, BLOCK)
        m = offs < N
        s = residual_sum(x_ptr, d_ptr, t, N, offs, m, HAS_DELTA, 1)
        inv = rms_inv(s, N, eps)
        h = rms_scale(s, inv, nw_ptr, offs, m).to(dt)
        if pb == 0:
            if HAS_DELTA:
                tl.store(res_ptr + t * N + offs, s, mask=m)
            tl.store(h_ptr + t * N + offs, h, mask=m)
        rows = pb * BE + tl.arange(0, BE)
        rm = rows < E
        acc = tl.zeros((BE, BH), dtype=tl.float32)
        if BH == BLOCK:      # one GEMV step (the usual case): the row is already in registers
            wv = tl.load(g_ptr + rows[:, None].to(tl.int64) * stride_g + offs[None, :],
                         mask=rm[:, None] & m[None, :], other=0.0).to(tl.float32)
            acc += wv * h.to(tl.float32)[None, :]
        else:                # BH-column steps: each step's slice of h is recomputed from x, delta, inv
            for h0 in range(0, N, BH):
                cols = h0 + tl.arange(0, BH)
                cm = cols < N
                sc = residual_sum(x_ptr, d_ptr, t, N, cols, cm, HAS_DELTA, 1)
                hv = rms_scale(sc, inv, nw_ptr, cols, cm).to(dt).to(tl.float32)
                wv = tl.load(g_ptr + rows[:, None].to(tl.int64) * stride_g + cols[None, :],
                             mask=rm[:, None] & cm[None, :], other=0.0).to(tl.float32)
                acc += wv * hv[None, :]
        logit = tl.sum(acc, axis=1).to(dt).to(tl.float32)
        tl.store(logits_ptr + t * E + rows, logit, mask=rm)
        arrived = tl.atomic_add(count_ptr + t, 1, sem="acq_rel")
        if arrived == tl.num_programs(1) - 1:
            eo = tl.arange(0, BLOCK_E)
            em = eo < E
            z = tl.load(logits_ptr + t * E + eo, mask=em, other=float("-inf"), cache_modifier=".cg")
            softmax_topk_store(z, em, eo, ids_ptr, w_ptr, t, TOPK, KP, NORM, BLOCK_E)
            tl.atomic_xchg(count_ptr + t, 0)
        if QUANT:
            # The experts' int8 activations (decode mode 3): quantize_rows_kernel's row of h, one block
            # of QB columns per program, recomputed from x, delta and inv (the whole row quantized by
            # one 1-warp program spilled: 1,168 bytes of stack on sm_90).
            for qb in range(pb, (N + QB - 1) // QB, tl.num_programs(1)):
                cols = qb * QB + tl.arange(0, QB)
                cm = cols < N
                sc = residual_sum(x_ptr, d_ptr, t, N, cols, cm, HAS_DELTA, 1)
                hv = rms_scale(sc, inv, nw_ptr, cols, cm).to(dt).to(tl.float32)
                nat_lo, nat_hi, even, odd, qsum, scale = quant_pack(tl.reshape(hv, (QB // 8, 8)), QB)
                w8 = qb * (QB // 8) + tl.arange(0, QB // 8)
                b = qb + tl.arange(0, 1)
                store_quant(q_ptr + t * stride_q, w8, 8 * w8 < N, b, b * QB < N, N, QB, nat_lo, nat_hi, even, odd,
                            qsum, scale)


def add_rmsnorm_router(x: Tensor, delta: Tensor | None, norm_weight: Tensor, eps: float, router_weight: Tensor,
                       top_k: int, renormalize: bool, arrivals: Tensor | None = None, quantize_h: bool = False
                       ) -> tuple[Tensor, ...]:
    """add_rmsnorm(x, delta, norm_weight, eps) followed by router_topk(h, router_weight, top_k,
    renormalize) in one launch, bitwise the same results: (res, h) shaped like x in x's dtype, and
    (logits [N, E] float32, topk_ids [N, k] int64, topk_w [N, k] float32) over the N = x.numel() / H
    flattened tokens (N <= ROUTER_MAX_TOKENS). `arrivals` as in router_topk. quantize_h (H a multiple
    of 64): also h's int8 rows for fused_moe(xq=...), a sixth result, as quantize_rows_kernel makes
    them (one launch fewer per layer for experts in decode mode 3)."""
    _kernels()
    H = x.shape[-1]
    if tuple(norm_weight.shape) != (H,):
        raise KernelError(f"add_rmsnorm_router: norm weight shape {tuple(norm_weight.shape)}, expected ({H},)")
    if router_weight.dim() != 2 or router_weight.shape[1] != H or router_weight.stride(-1) != 1:
        raise KernelError(f"add_rmsnorm_router: router weight shape {tuple(router_weight.shape)}; expected "
                          f"[experts, {H}] with a unit last stride")
    E = router_weight.shape[0]
    xc = x.contiguous()
    N = xc.numel() // H
    if not 0 < top_k <= E or not 0 < N <= ROUTER_MAX_TOKENS:
        raise KernelError(f"add_rmsnorm_router: {N} tokens, top_k {top_k}, {E} experts; expected 1 to "
                          f"{ROUTER_MAX_TOKENS} tokens and 0 < top_k <= experts")
    if delta is not None and delta.numel() != xc.numel():
        raise KernelError(f"add_rmsnorm_router: delta shape {tuple(delta.shape)}; expected x's {tuple(xc.shape)}")
    if quantize_h and H % GROUP:
        raise KernelError(f"add_rmsnorm_router: quantize_h needs a hidden size that is a multiple of {GROUP}, got {H}")
    counts = arrivals if arrivals is not None else _ARRIVALS.get(x.device)
    if counts is None:
        counts = _ARRIVALS[x.device] = torch.zeros(ROUTER_MAX_TOKENS, dtype=torch.int32, device=x.device)
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
    cfg = get_config("router", "dense")
    be = min(cfg["BN"], _next_pow2(E))
    block = _next_pow2(H)
    xq = torch.empty(N, quant_row_len(H, GROUP), dtype=torch.int32, device=x.device) if quantize_h else logits
    add_rmsnorm_router_kernel[(N, -(-E // be))](
        xc, dc, norm_weight, res, h, router_weight, logits, counts, ids, w, xq, H, E, eps, router_weight.stride(0),
        xq.stride(0), HAS_DELTA=delta is not None, TOPK=top_k, KP=_next_pow2(top_k), NORM=renormalize, BLOCK=block,
        BLOCK_E=_next_pow2(E), BE=be, BH=min(cfg["BK"], block), QUANT=quantize_h, QB=GROUP,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl_launch(x.device))
    return (res, h, logits, ids, w, xq) if quantize_h else (res, h, logits, ids, w)


def qk_rope_cache(q: Tensor, k: Tensor, v: Tensor, q_norm_w: Tensor | None, k_norm_w: Tensor | None,
                  eps: float, cos: Tensor, sin: Tensor, positions: Tensor, k_cache: Tensor,
                  v_cache: Tensor) -> Tensor:
    """q [B, T, NH, D], k/v [B, T, NKV, D] (views with unit last stride), cos/sin [B, T, D] in q's
    dtype, positions [B, T]: per-head RMSNorm of q and k (when weights are given), RoPE, and the
    keys/values written to k_cache/v_cache [B', NKV, S, D] at slot positions[b, t]. Returns the
    rotated queries [B, NH, T, D] (contiguous). One launch instead of ~30 small kernels."""
    _kernels()
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
    cos = cos.expand(B, T, D) if cos.shape[0] != B else cos
    sin = sin.expand(B, T, D) if sin.shape[0] != B else sin
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    pos = positions.expand(B, T).contiguous()
    qo = torch.empty(B, NH, T, D, dtype=q.dtype, device=q.device)
    has_norm = q_norm_w is not None
    qw, kw = (q_norm_w, k_norm_w) if has_norm else (qo, qo)
    qk_rope_cache_kernel[(B * T, NH + NKV)](
        q, k, v, qw, kw, cos, sin, pos, qo, k_cache, v_cache, T, NH, eps,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), cos.stride(0), cos.stride(1),
        qo.stride(0), qo.stride(1), qo.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HAS_NORM=has_norm, D=D, num_warps=1, **pdl_launch(q.device))
    return qo


# ------------------------------------------------------------------------------------------------
# Decode GEMV for the attention projections. cuBLAS' M=1 kernels reach ~1.5-1.7 TB/s on the H200 for
# these [5120 x 2048] / [2048 x 4096] matrices (round 2 profile); a plain row-blocked GEMV with a 2-D
# float32 accumulator (reduced once at the end) keeps more bytes in flight per program.

if triton is not None:
    @triton.jit
    def gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_xt, stride_wn, stride_yt,
                    HAS_BIAS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr = False):
        """Program (row block, token): y[t, rows] = W[rows] . x[t] (+ bias), float32 accumulation."""
        grid_dependency(PDL)
        nb = tl.program_id(0)
        t = tl.program_id(1).to(tl.int64)
        rows = nb * BN + tl.arange(0, BN)
        rmask = rows < N
        acc = tl.zeros((BN, BK), dtype=tl.float32)
        for k0 in range(0, K, BK):
            i = k0 + tl.arange(0, BK)
            xk = tl.load(x_ptr + t * stride_xt + i, mask=i < K, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wn + i[None, :],
                        mask=rmask[:, None] & (i < K)[None, :], other=0.0).to(tl.float32)
            acc += w * xk[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + t * stride_yt + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear for a few tokens: x [..., K], weight [N, K] (unit last stride), bias [N] or None ->
    [..., N] in x's dtype. One program per (BN rows, token): each token re-reads the weight (from L2
    at best), so this suits decode (1-4 tokens), not prefill."""
    _kernels()
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
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    cfg = get_config("gemv", "dense")
    gemv_kernel[(-(-N // cfg["BN"]), T)](x2, weight, bias if bias is not None else weight, y, N, K,
                                         x2.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=bias is not None,
                                         BN=cfg["BN"], BK=cfg["BK"], num_warps=cfg["num_warps"],
                                         num_stages=cfg["num_stages"], **pdl_launch(x.device))
    return y.view(*x.shape[:-1], N)


# ------------------------------------------------------------------------------------------------
# Host-tier prefetch: copy the host experts a prediction names into a device stage (HBM), so the
# layer that uses them reads HBM instead of PCIe. Launched on a side stream one layer early (see
# placement.TieredExperts.prefetch), the PCIe reads overlap the previous layer's work.

if triton is not None:
    @triton.jit
    def stage_copy_kernel(src_ptr, dst_ptr, pred_ptr, host_slot_ptr, n_words, src_stride, dst_stride,
                          BLOCK: tl.constexpr, PDL: tl.constexpr = False):
        """Program (j, chunk): if predicted expert pred[j] lives in this host group (slot s >= 0),
        copy chunk `chunk` of slot s's words to stage slot j."""
        grid_dependency(PDL)
        j = tl.program_id(0)
        c = tl.program_id(1)
        e = tl.load(pred_ptr + j).to(tl.int64)
        s = tl.load(host_slot_ptr + e).to(tl.int64)
        if s >= 0:
            offs = c * BLOCK + tl.arange(0, BLOCK)
            m = offs < n_words
            v = tl.load(src_ptr + s * src_stride + offs, mask=m)
            tl.store(dst_ptr + j * dst_stride + offs, v, mask=m)

    @triton.jit
    def stage_maps_kernel(pred_ptr, host_slot_ptr, stage_slot_ptr, host_dyn_ptr, E,
                          K: tl.constexpr, BLOCK_E: tl.constexpr, PDL: tl.constexpr = False):
        """stage_slot[e] = j if e == pred[j] and e lives in this host group, else -1; host_dyn[e] =
        the host slot of e unless it is staged (-1): the two groups then cover e exactly once."""
        grid_dependency(PDL)
        offs = tl.arange(0, BLOCK_E)
        m = offs < E
        hs = tl.load(host_slot_ptr + offs, mask=m, other=-1)
        stage = tl.full((BLOCK_E,), -1, tl.int32)
        for j in tl.static_range(K):
            pj = tl.load(pred_ptr + j).to(tl.int32)
            stage = tl.where((offs == pj) & (hs >= 0), j, stage)
        tl.store(stage_slot_ptr + offs, stage, mask=m)
        tl.store(host_dyn_ptr + offs, tl.where(stage >= 0, -1, hs), mask=m)


def _word_view(t: Tensor) -> Tensor:
    """[S, ...] contiguous -> [S, words] (int32 words when the slot size allows, else bytes)."""
    flat = t.reshape(t.shape[0], -1).view(torch.uint8)
    return flat.view(torch.int32) if flat.shape[1] % 4 == 0 else flat


def stage_experts(pred_ids: Tensor, host_slot_of: Tensor, host: ExpertGroup, stage: ExpertGroup,
                  stage_slot_of: Tensor, host_dyn: Tensor) -> None:
    """Copy the predicted experts (pred_ids [k]) that live in `host` into `stage` (slot j for
    pred_ids[j]) and rewrite the maps (stage.slot_of is stage_slot_of, the host group's dynamic
    slot_of is host_dyn; host_slot_of is its static one). No host sync; graph-capturable."""
    _kernels()
    k = pred_ids.numel()
    pred = pred_ids.reshape(-1)
    for mat in ("gate", "up", "down"):
        src_pm, dst_pm = getattr(host, mat), getattr(stage, mat)
        for src_t, dst_t in ((src_pm.data, dst_pm.data), (src_pm.scale, dst_pm.scale),
                             (src_pm.minimum, dst_pm.minimum)):
            if src_t is None:
                continue
            src, dst = _word_view(src_t), _word_view(dst_t)
            block = 4096
            stage_copy_kernel[(k, -(-src.shape[1] // block))](src, dst, pred, host_slot_of, src.shape[1],
                                                                src.stride(0), dst.stride(0), BLOCK=block,
                                                                num_warps=8, **pdl_launch(dst.device))
    E = host_slot_of.numel()
    stage_maps_kernel[(1,)](pred, host_slot_of, stage_slot_of, host_dyn, E, K=k, BLOCK_E=_next_pow2(E),
                            num_warps=1, **pdl_launch(pred.device))
