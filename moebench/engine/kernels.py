"""Fused MoE decode kernels (Triton): each selected expert's weights are read in place, exactly once.

The engine's "gather" decode path copies the selected experts' weights (`w[ids]`) before a bmm, so a
step moves about three times the expert bytes. These kernels read the rows of expert ids[t, j]
straight from the stacked weights (dense bf16/fp16/fp32, or the packed formats of quant.py,
dequantized in registers) and never materialise a copy:

  gate_up: grid (T*k pairs, I / BN)  h[p] = silu(W_gate[e] x[t]) * (W_up[e] x[t])   (float32 h)
  down:    grid (T tokens, H / BN)   out[t] = sum_j w[t, j] * (W_down[ids[t, j]] h[t*k + j])

The down kernel loops over a token's k experts itself, so the weighted sum is deterministic and
needs no atomics nor a second reduction kernel. Both kernels are static-shape and sync-free, so a
decode step that uses them can be captured in a CUDA graph. Per-pair reads suit small T (decode);
with many tokens the same expert would be re-read per token, so callers switch to a grouped GEMM.

Experts may be split into groups (one per storage format and home, see `ExpertGroup`): each launch
handles the pairs whose expert has a slot in its group; down launches chain a float32 accumulator.
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
FORMAT_CODES = {"dense": 0, "int8": 1, "int4": 2, "int4_asym": 3, "ternary": 4}

# Launch parameters per (kernel, format): BN output rows per program, BK input columns per loop
# step, num_warps. Defaults are reasonable guesses; benchmarks/decode_h200.py sweeps and sets them.
DEFAULT_CONFIG = {"BN": 16, "BK": 256, "num_warps": 4}
CONFIG: dict[tuple[str, str], dict[str, int]] = {}


class KernelError(ValueError):
    """Weights or inputs the fused kernels cannot take; the message says what was expected."""


def set_config(kernel: str, fmt: str, **params: int) -> None:
    """Launch parameters for `kernel` ("gate_up" or "down") on weights of format `fmt`."""
    if kernel not in ("gate_up", "down"):
        raise KernelError(f"set_config: kernel {kernel!r}; expected 'gate_up' or 'down'")
    if fmt not in FORMAT_CODES:
        raise KernelError(f"set_config: format {fmt!r}; expected one of {list(FORMAT_CODES)}")
    bad = set(params) - set(DEFAULT_CONFIG)
    if bad:
        raise KernelError(f"set_config: unknown parameters {sorted(bad)}; expected {list(DEFAULT_CONFIG)}")
    CONFIG[(kernel, fmt)] = {**CONFIG.get((kernel, fmt), DEFAULT_CONFIG), **params}


def get_config(kernel: str, fmt: str) -> dict[str, int]:
    return dict(CONFIG.get((kernel, fmt), DEFAULT_CONFIG))


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
                 "int4_asym": ("q", "scale", "min"), "ternary": ("q", "scale")}[base]
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
    experts of other groups), or None when slot == expert id for every expert."""

    gate: PackedMatrix
    up: PackedMatrix
    down: PackedMatrix
    slot_of: Tensor | None = None
    label: str = field(default="")


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
    return gate_up_kernel, down_kernel


if triton is not None:
    @triton.jit
    def trit_term(v, base_ptr_s, x_ptr, b, rmask, bmask, K, D: tl.constexpr, MULT: tl.constexpr,
                  GROUP_SIZE: tl.constexpr):
        """Digit D of bytes v [BN, BK] times its scale and x: sum over the tile is the dot part.
        Digit d of byte v is (v // 3^d) % 3, exact multiply-shift divisions for v <= 242."""
        c = b * 5 + D
        q = (v * MULT) >> 16
        trit = q - ((q * 21846) >> 16) * 3
        xd = tl.load(x_ptr + c, mask=c < K, other=0.0).to(tl.float32)
        s = tl.load(base_ptr_s + (c // GROUP_SIZE)[None, :], mask=bmask, other=0.0).to(tl.float32)
        return (trit - 1).to(tl.float32) * s * xd[None, :]

    @triton.jit
    def row_dots(w_ptr, s_ptr, m_ptr, slot, rows, rmask, x_ptr, k0, K, KB,
                 stride_we, stride_wr, stride_se, stride_sr,
                 FMT: tl.constexpr, GROUP_SIZE: tl.constexpr, BK: tl.constexpr):
        """[BN] partial dots of rows of one expert with x over one K step (int8: unscaled codes).
        Dense/int8 steps cover BK columns from k0; packed formats cover BK *bytes* from k0 (int4:
        2 columns per byte, ternary: 5), so each loaded byte is decoded once, whole, in registers."""
        base = w_ptr + slot * stride_we + rows[:, None] * stride_wr
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
                part = trit_term(v, s_row, x_ptr, i, rmask, bmask, K, 0, 65536, GROUP_SIZE)
                part += trit_term(v, s_row, x_ptr, i, rmask, bmask, K, 1, 21846, GROUP_SIZE)
                part += trit_term(v, s_row, x_ptr, i, rmask, bmask, K, 2, 7282, GROUP_SIZE)
                part += trit_term(v, s_row, x_ptr, i, rmask, bmask, K, 3, 2428, GROUP_SIZE)
                part += trit_term(v, s_row, x_ptr, i, rmask, bmask, K, 4, 810, GROUP_SIZE)
                return tl.sum(part, axis=1)
            else:
                # Low nibble = even column, high nibble = odd column; one group scale per 32 bytes.
                lo = (v & 15).to(tl.float32)
                hi = ((v >> 4) & 15).to(tl.float32)
                x0 = tl.load(x_ptr + 2 * i, mask=2 * i < K, other=0.0).to(tl.float32)[None, :]
                x1 = tl.load(x_ptr + 2 * i + 1, mask=2 * i + 1 < K, other=0.0).to(tl.float32)[None, :]
                g_off = (i // (GROUP_SIZE // 2))[None, :]
                s = tl.load(s_row + g_off, mask=bmask, other=0.0).to(tl.float32)
                if FMT == 2:
                    part = s * ((lo - 8.0) * x0 + (hi - 8.0) * x1)
                else:
                    mn = tl.load(m_ptr + slot * stride_se + rows[:, None] * stride_sr + g_off, mask=bmask,
                                 other=0.0).to(tl.float32)
                    part = s * (lo * x0 + hi * x1) + mn * (x0 + x1)
                return tl.sum(part, axis=1)

    @triton.jit
    def gate_up_kernel(x_ptr, ids_ptr, slot_ptr, h_ptr,
                       g_ptr, gs_ptr, gm_ptr, u_ptr, us_ptr, um_ptr,
                       N, K, KB, stride_xt, stride_ht,
                       stride_ge, stride_gr, stride_gse, stride_gsr,
                       stride_ue, stride_ur, stride_use, stride_usr,
                       TOPK: tl.constexpr, FMT: tl.constexpr, HAS_MAP: tl.constexpr,
                       GROUP_SIZE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pair = tl.program_id(0)
        nb = tl.program_id(1)
        e = tl.load(ids_ptr + pair).to(tl.int64)
        if HAS_MAP:
            slot = tl.load(slot_ptr + e).to(tl.int64)
        else:
            slot = e
        if slot >= 0:
            t = pair // TOPK
            rows = nb * BN + tl.arange(0, BN)
            rmask = rows < N
            g = tl.zeros((BN,), dtype=tl.float32)
            u = tl.zeros((BN,), dtype=tl.float32)
            x_row = x_ptr + t * stride_xt
            if FMT <= 1:
                lim = K
            else:
                lim = KB
            for k0 in range(0, lim, BK):
                g += row_dots(g_ptr, gs_ptr, gm_ptr, slot, rows, rmask, x_row, k0, K, KB,
                              stride_ge, stride_gr, stride_gse, stride_gsr, FMT, GROUP_SIZE, BK)
                u += row_dots(u_ptr, us_ptr, um_ptr, slot, rows, rmask, x_row, k0, K, KB,
                              stride_ue, stride_ur, stride_use, stride_usr, FMT, GROUP_SIZE, BK)
            if FMT == 1:
                g = g * tl.load(gs_ptr + slot * stride_gse + rows * stride_gsr, mask=rmask, other=0.0).to(tl.float32)
                u = u * tl.load(us_ptr + slot * stride_use + rows * stride_usr, mask=rmask, other=0.0).to(tl.float32)
            h = g / (1.0 + tl.exp(-g)) * u
            tl.store(h_ptr + pair * stride_ht + rows, h, mask=rmask)

    @triton.jit
    def down_kernel(h_ptr, ids_ptr, wts_ptr, slot_ptr, acc_ptr, out_ptr,
                    d_ptr, ds_ptr, dm_ptr,
                    N, K, KB, stride_ht, stride_at, stride_ot,
                    stride_de, stride_dr, stride_dse, stride_dsr,
                    TOPK: tl.constexpr, FMT: tl.constexpr, HAS_MAP: tl.constexpr, ACC_IN: tl.constexpr,
                    GROUP_SIZE: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        t = tl.program_id(0)
        nb = tl.program_id(1)
        rows = nb * BN + tl.arange(0, BN)
        rmask = rows < N
        if ACC_IN:
            total = tl.load(acc_ptr + t * stride_at + rows, mask=rmask, other=0.0)
        else:
            total = tl.zeros((BN,), dtype=tl.float32)
        if FMT <= 1:
            lim = K
        else:
            lim = KB
        for j in range(TOPK):
            pair = t * TOPK + j
            e = tl.load(ids_ptr + pair).to(tl.int64)
            if HAS_MAP:
                slot = tl.load(slot_ptr + e).to(tl.int64)
            else:
                slot = e
            if slot >= 0:
                y = tl.zeros((BN,), dtype=tl.float32)
                for k0 in range(0, lim, BK):
                    y += row_dots(d_ptr, ds_ptr, dm_ptr, slot, rows, rmask, h_ptr + pair * stride_ht, k0, K, KB,
                                  stride_de, stride_dr, stride_dse, stride_dsr, FMT, GROUP_SIZE, BK)
                if FMT == 1:
                    y = y * tl.load(ds_ptr + slot * stride_dse + rows * stride_dsr, mask=rmask,
                                    other=0.0).to(tl.float32)
                total += tl.load(wts_ptr + pair).to(tl.float32) * y
        tl.store(out_ptr + t * stride_ot + rows, total.to(out_ptr.dtype.element_ty), mask=rmask)


def _scale_args(pm: PackedMatrix):
    """(scale tensor, minimum tensor, stride over slots, stride over rows) for a launch."""
    if pm.scale is None:
        return pm.data, pm.data, 0, 0
    s = pm.scale
    return s, (pm.minimum if pm.minimum is not None else s), s.stride(0), s.stride(1)


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


def fused_moe(x: Tensor, topk_ids: Tensor, topk_w: Tensor, groups: list[ExpertGroup]) -> Tensor:
    """x [T, H]; topk_ids [T, k] (int64/int32); topk_w [T, k] -> [T, H] in x's dtype:
    sum_j topk_w[t, j] * down(silu(gate x) * up x) of expert topk_ids[t, j], every expert in
    exactly one of `groups`. Reads each (token, expert) pair's weights once; no host sync."""
    if not groups:
        raise KernelError("fused_moe: no expert groups")
    gate_up_kernel, down_kernel = _kernels()
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
    for g in groups:
        cfg = get_config("gate_up", g.gate.fmt)
        gs, gm, gse, gsr = _scale_args(g.gate)
        us, um, use, usr = _scale_args(g.up)
        slot = g.slot_of if g.slot_of is not None else ids
        grid = (T * k, -(-inter // cfg["BN"]))
        gate_up_kernel[grid](
            x, ids, slot, h, g.gate.data, gs, gm, g.up.data, us, um,
            inter, H, g.gate.data.shape[-1], x.stride(0), h.stride(0),
            g.gate.data.stride(0), g.gate.data.stride(1), gse, gsr,
            g.up.data.stride(0), g.up.data.stride(1), use, usr,
            TOPK=k, FMT=FORMAT_CODES[g.gate.fmt], HAS_MAP=g.slot_of is not None, GROUP_SIZE=GROUP,
            BN=cfg["BN"], BK=cfg["BK"], num_warps=cfg["num_warps"])
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    acc = torch.empty(T, H, dtype=torch.float32, device=x.device) if len(groups) > 1 else out
    for i, g in enumerate(groups):
        cfg = get_config("down", g.down.fmt)
        ds, dm, dse, dsr = _scale_args(g.down)
        slot = g.slot_of if g.slot_of is not None else ids
        last = i == len(groups) - 1
        target = out if last else acc
        grid = (T, -(-H // cfg["BN"]))
        down_kernel[grid](
            h, ids, wts, slot, acc, target, g.down.data, ds, dm,
            H, inter, g.down.data.shape[-1], h.stride(0), acc.stride(0), target.stride(0),
            g.down.data.stride(0), g.down.data.stride(1), dse, dsr,
            TOPK=k, FMT=FORMAT_CODES[g.down.fmt], HAS_MAP=g.slot_of is not None, ACC_IN=i > 0,
            GROUP_SIZE=GROUP, BN=cfg["BN"], BK=cfg["BK"], num_warps=cfg["num_warps"])
    return out


def dense_group(w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> ExpertGroup:
    """The group for a dense `Experts` module's stacked weights (views, no copy)."""
    return ExpertGroup(PackedMatrix.dense(w_gate), PackedMatrix.dense(w_up), PackedMatrix.dense(w_down),
                       None, "dense")
