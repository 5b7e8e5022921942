"""Stacked expert weights as the expert kernels read them: `PackedMatrix` (one weight kind of a group
of experts) and `ExpertGroup` (gate, up and down of experts sharing one format and home).

A group's tensors may live in pinned host memory: CUDA maps pinned memory into the device's address
space, so the kernels read host experts over PCIe with no copy and no host sync ("zero-copy"), which
keeps the host tier inside a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..decode_config import WORD_FORMATS, DecodeMode, Format
from ..quant import QuantizedTensor, parse_format
from .runtime import KernelError

# Base-3 ternary stacks pad each row to whole int32 words, which the word decode reads. (Rows on
# 16 bytes with an alignment hint load 4 words per thread as one 128-bit access, but each thread
# then needs x for 80 columns: more instructions and registers, benchmarks/kernel_sass.py.)
ROW_ALIGN = 4


@dataclass
class PackedMatrix:
    """One weight kind (gate, up or down) of a group of experts, stacked along a slot dimension.

    fmt: "dense" (a float tensor) or a quant.py base format. data: [S, rows, row_bytes_or_cols]
    (dense: [S, rows, cols], may be a strided view with a unit last stride). scale / minimum: the
    format's fp16 scales ([S, rows] for int8, [S, rows, groups] otherwise), None for dense.
    rows / cols: the logical [out, in] shape of one expert's matrix.
    storage: base-3 ternary stacks from `stack`: [S, rows, row bytes rounded up to 4], the padded
    tensor `data` is a view of (zero bytes past each row), so that the rows can be read as aligned
    int32 words (`words`); None otherwise (the SSD tier's slots are records' bytes in place, whose
    base-3 rows of 410 or 154 bytes are no whole words: they run the byte decode).
    """

    fmt: str
    data: Tensor
    rows: int
    cols: int
    scale: Tensor | None = None
    minimum: Tensor | None = None
    storage: Tensor | None = None

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
        stacked, storage = {}, None
        for name in names:
            first = mats[0].parts[name]
            row = first.shape[-1]
            pad_rows = base == "ternary" and name == "q"
            # zeros only where there is padding to fill: the other stacks are copied over whole
            alloc = torch.zeros if pad_rows else torch.empty
            out = alloc((len(mats), *first.shape[:-1], -(-row // ROW_ALIGN) * ROW_ALIGN if pad_rows else row),
                        dtype=first.dtype, device="cpu" if pin else device, pin_memory=pin)
            if pad_rows:
                storage, out = out, out[..., :row]
            for i, m in enumerate(mats):
                out[i].copy_(m.parts[name])
            stacked[name] = out
        if base == "bf16":
            return cls("dense", stacked["w"], shape[0], shape[1])
        return cls(base, stacked["q"], shape[0], shape[1], stacked["scale"], stacked.get("min"), storage)

    def empty_like(self, slots: int, device) -> "PackedMatrix":
        """A stack of `slots` uninitialised slots of this one's layout (padding included) on `device`."""
        def like(t):
            return None if t is None else torch.empty((slots, *t.shape[1:]), dtype=t.dtype, device=device)
        if self.storage is None:
            return PackedMatrix(self.fmt, like(self.data), self.rows, self.cols, like(self.scale), like(self.minimum))
        storage = like(self.storage)
        return PackedMatrix(self.fmt, storage[..., :self.data.shape[-1]], self.rows, self.cols, like(self.scale),
                            like(self.minimum), storage)

    @property
    def copied(self) -> Tensor:
        """The tensor a whole-slot copy moves: `storage` where the rows are padded, else `data`."""
        return self.storage if self.storage is not None else self.data

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

    @property
    def on_host(self) -> bool:
        return self.data.device.type == "cpu"

    def words(self, mode: DecodeMode) -> Tensor | None:
        """The rows as an int32 view for the word decode (mode WORDS or above), or None (byte
        path): dense rows, rows not a whole number of aligned words, or mode BYTES. Where `storage`
        pads the rows (base-3 ternary stacks), the words cover the padded rows: the kernels' KB is
        then the padded row length (the word view's), the byte path's the stored one."""
        if Format.of(self.fmt) not in WORD_FORMATS or mode == DecodeMode.BYTES:
            return None
        d = self.copied         # the padded rows where storage pads them
        cached = self.__dict__.get("_words")
        if cached is not None and cached[0] is d:
            return cached[1]
        ok = d.shape[-1] % 4 == 0 and d.stride(0) % 4 == 0 and d.stride(1) % 4 == 0 and d.data_ptr() % 4 == 0
        view = d.view(torch.int32) if ok and d.stride(-1) == 1 else None
        self.__dict__["_words"] = (d, view)
        return view

    def scale_args(self) -> tuple:
        """(scale tensor, minimum tensor, stride over slots, stride over rows) for a launch."""
        if self.scale is None:
            return self.data, self.data, 0, 0
        s = self.scale
        return s, (self.minimum if self.minimum is not None else s), s.stride(0), s.stride(1)


@dataclass
class ExpertGroup:
    """Experts sharing one format and home. slot_of: int32 [E] (slot in this group's stacks, -1 for
    experts of other groups), or None when slot == expert id for every expert. host_lane: an HBM
    group run with the host groups, on the host lane (prefetch's stage). picks: int32 [E] on the
    device, or None: each (token, expert) pair this group serves adds 1 at its expert (tier
    telemetry, counted inside fused_moe's down launch)."""

    gate: PackedMatrix
    up: PackedMatrix
    down: PackedMatrix
    slot_of: Tensor | None = None
    label: str = field(default="")
    host_lane: bool = False
    picks: Tensor | None = None

    @property
    def fmt(self) -> str:
        return self.gate.fmt

    def check(self, hidden: int) -> None:
        g, u, d = self.gate, self.up, self.down
        if not (g.fmt == u.fmt == d.fmt):
            raise KernelError(f"expert group {self.label!r}: gate/up/down formats differ ({g.fmt}, {u.fmt}, {d.fmt})")
        if g.fmt not in {f.key for f in Format}:
            raise KernelError(f"expert group {self.label!r}: format {g.fmt!r} not one of {[f.key for f in Format]}")
        if g.cols != hidden or u.cols != hidden or d.rows != hidden or g.rows != u.rows or d.cols != g.rows:
            raise KernelError(f"expert group {self.label!r}: shapes gate {g.rows}x{g.cols}, up {u.rows}x{u.cols}, "
                              f"down {d.rows}x{d.cols} do not fit hidden size {hidden}")
        for name, pm in (("gate", g), ("up", u), ("down", d)):
            if pm.data.stride(-1) != 1:
                raise KernelError(f"expert group {self.label!r}: {name} weights need a unit last stride")


def dense_group(w_gate: Tensor, w_up: Tensor, w_down: Tensor) -> ExpertGroup:
    """The group for a dense `Experts` module's stacked weights (views, no copy)."""
    return ExpertGroup(PackedMatrix.dense(w_gate), PackedMatrix.dense(w_up), PackedMatrix.dense(w_down),
                       None, "dense")
