"""The quantized-expert types the placement tiers and the SSD pack share: `QuantizedExpert` (one
expert's three packed SwiGLU matrices) and `PART_DTYPES` (the tensor dtypes a packed part may have,
by name, as the pack file records them). A leaf: it imports only quant, so placement.py, ssd.py
and ssd_slots.py can all import it without importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .quant import QuantizedTensor

# dtype name (as str(torch.dtype) without "torch.") -> dtype, for every dtype a packed part may have
PART_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.uint8, torch.int8, torch.float16, torch.bfloat16,
                                                          torch.float32, torch.int32, torch.int16)}


@dataclass
class QuantizedExpert:
    """The three SwiGLU matrices of one expert: gate [I, H], up [I, H], down [H, I]."""

    gate: QuantizedTensor
    up: QuantizedTensor
    down: QuantizedTensor

    @property
    def fmt(self) -> str:
        return self.gate.fmt

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes

    def to(self, device, non_blocking: bool = False) -> "QuantizedExpert":
        return QuantizedExpert(self.gate.to(device, non_blocking), self.up.to(device, non_blocking),
                               self.down.to(device, non_blocking))

    def pin_memory(self) -> "QuantizedExpert":
        return QuantizedExpert(self.gate.pin_memory(), self.up.pin_memory(), self.down.pin_memory())

    def clone(self) -> "QuantizedExpert":
        def c(q: QuantizedTensor) -> QuantizedTensor:
            return QuantizedTensor(q.fmt, q.shape, {k: v.clone() for k, v in q.parts.items()})
        return QuantizedExpert(c(self.gate), c(self.up), c(self.down))

    def record_stream(self, stream) -> None:
        for q in (self.gate, self.up, self.down):
            for t in q.parts.values():
                t.record_stream(stream)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate x) * up x) for rows x [n, H], computed in x's dtype."""
        wg, wu, wd = (q.dequantize(x.dtype) for q in (self.gate, self.up, self.down))
        return (F.silu(x @ wg.T) * (x @ wu.T)) @ wd.T
