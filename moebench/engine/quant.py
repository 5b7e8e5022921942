"""Weight quantization formats for expert matrices: pack, unpack, dequantize. Pure torch.

Every format quantizes one 2-D weight W [out, in] (the nn.Linear layout: rows are outputs, the input
dimension is the last one) into a `QuantizedTensor`: a format name, the float shape, and a few plain
tensors that a safetensors file can hold. `dequantize()` gives the float weight back.

Formats (group size 64 runs along the input dimension, padded at the end of each row):
  bf16        the weight in bfloat16                                              2 bytes/weight
  int8        per-output-channel symmetric: q in [-127, 127], one fp16 scale per row
  int4        group-wise symmetric: q in [-7, 7] stored as q+8, two nibbles per byte, fp16 scale/group
  int4_asym   group-wise asymmetric: q in [0, 15], fp16 scale and fp16 minimum per group
  ternary     group-wise {-1, 0, +1} with one fp16 scale per group, FIVE trits per byte (3^5 = 243)
  ternary2    the same codes and scales as ternary, TWO bits per code (four per byte), laid out for
              the GPU kernels' dp4a (see pack_crumbs): 25% more bytes than ternary, but decoded by
              shift + mask instead of base-3 digit extraction (llama.cpp's TQ2_0 against TQ1_0)
Any format may carry a rank-r low-rank compensation of its residual, named with a suffix:
"ternary+r8" stores A [out, r] and B [r, in] (fp16) from a truncated SVD of W - dequant(Q(W)).

`format_nbytes(fmt, out, in)` is the exact storage size; `bytes_per_weight` divides it out.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

GROUP = 64
BASE_FORMATS = ("bf16", "int8", "int4", "int4_asym", "ternary", "ternary2")
_LOWRANK = re.compile(r"^(?P<base>[a-z0-9_]+)\+r(?P<rank>[1-9][0-9]*)$")
_TRIT_POWERS = (1, 3, 9, 27, 81)


class QuantError(ValueError):
    """A format name, shape or packed tensor that does not fit what the format expects."""


def parse_format(fmt: str) -> tuple[str, int]:
    """'int4' -> ('int4', 0); 'ternary+r8' -> ('ternary', 8). Raises QuantError on an unknown name."""
    m = _LOWRANK.match(fmt)
    base, rank = (m["base"], int(m["rank"])) if m else (fmt, 0)
    if base not in BASE_FORMATS:
        raise QuantError(f"unknown quant format {fmt!r}: expected one of {list(BASE_FORMATS)}, "
                         f"optionally with a low-rank suffix like 'ternary+r8'")
    return base, rank


# ----------------------------------------------------------------------------------------------
# Bit packing. Codes are small non-negative integers along the last dimension; odd lengths are
# padded with zero codes, so unpack needs the original length.

def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes in [0, 15] along the last dim -> uint8 [..., ceil(n/2)], low nibble first."""
    codes = codes.to(torch.uint8)
    n = codes.shape[-1]
    if n % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of pack_nibbles: uint8 [..., ceil(n/2)] -> uint8 codes [..., n]."""
    _check_packed_len(packed, n, 2, "nibbles")
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], -1)[..., :n]


def pack_trits(codes: torch.Tensor) -> torch.Tensor:
    """Codes in {0, 1, 2} along the last dim -> uint8 [..., ceil(n/5)]: five base-3 digits per byte."""
    codes = codes.to(torch.uint8)
    n = codes.shape[-1]
    pad = (-n) % 5
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    groups = codes.reshape(*codes.shape[:-1], -1, 5).to(torch.int32)
    value = sum(groups[..., i] * p for i, p in enumerate(_TRIT_POWERS))  # <= 242 fits a byte
    return value.to(torch.uint8)


def unpack_trits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of pack_trits: uint8 [..., ceil(n/5)] -> uint8 codes in {0,1,2} [..., n]."""
    _check_packed_len(packed, n, 5, "trits")
    value = packed.to(torch.int32)
    digits = [(value // p) % 3 for p in _TRIT_POWERS]
    return torch.stack(digits, dim=-1).reshape(*packed.shape[:-1], -1)[..., :n].to(torch.uint8)


def pack_crumbs(codes: torch.Tensor) -> torch.Tensor:
    """Codes in {0, 1, 2, 3} along the last dim (a multiple of 16) -> uint8 [..., n/4], 2 bits each.
    Each 16 codes make one little-endian 32-bit word: code 4j + l (j, l < 4) sits in byte l, bits
    2j..2j+1. So (word >> 2j) & 0x03030303 holds codes 4j..4j+3 one per byte, the order of the four
    int8 activations of one natural word: one mask and one dp4a per 4 weights."""
    n = codes.shape[-1]
    if n % 16:
        raise QuantError(f"pack_crumbs: {n} codes; expected a multiple of 16")
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], n // 16, 4, 4)      # [..., word, j, l]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=codes.device)
    byte = (c << shifts[:, None]).sum(dim=-2)                                  # [..., word, l]
    return byte.reshape(*codes.shape[:-1], n // 4).to(torch.uint8)


def unpack_crumbs(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of pack_crumbs: uint8 [..., n/4] -> uint8 codes [..., n]."""
    _check_packed_len(packed, n, 4, "2-bit codes")
    b = packed.to(torch.int32).reshape(*packed.shape[:-1], -1, 1, 4)          # [..., word, 1, l]
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=packed.device)
    c = (b >> shifts[:, None]) & 3                                             # [..., word, j, l]
    return c.reshape(*packed.shape[:-1], -1)[..., :n].to(torch.uint8)


def _check_packed_len(packed: torch.Tensor, n: int, per_byte: int, what: str) -> None:
    if packed.dtype != torch.uint8:
        raise QuantError(f"packed {what} must be uint8, got {packed.dtype}")
    want = -(-n // per_byte)
    if packed.shape[-1] != want:
        raise QuantError(f"packed {what}: last dim {packed.shape[-1]} does not hold {n} codes "
                         f"(expected {want} bytes)")


# ----------------------------------------------------------------------------------------------

@dataclass
class QuantizedTensor:
    """One quantized 2-D weight. `parts` are plain tensors (names depend on the format)."""

    fmt: str
    shape: tuple[int, int]
    parts: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())

    def to(self, device, non_blocking: bool = False) -> "QuantizedTensor":
        return QuantizedTensor(self.fmt, self.shape,
                               {k: v.to(device, non_blocking=non_blocking) for k, v in self.parts.items()})

    def pin_memory(self) -> "QuantizedTensor":
        return QuantizedTensor(self.fmt, self.shape, {k: v.pin_memory() for k, v in self.parts.items()})

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [out, in] on the parts' device."""
        return dequantize_parts(self.fmt, self.shape, self.parts, dtype)

    def state(self, prefix: str) -> dict[str, torch.Tensor]:
        """Flat tensors for a safetensors file: '<prefix>.<part>'."""
        return {f"{prefix}.{k}": v.contiguous() for k, v in self.parts.items()}

    @classmethod
    def from_state(cls, fmt: str, shape, tensors: dict[str, torch.Tensor], prefix: str) -> "QuantizedTensor":
        """Inverse of state(): picks '<prefix>.<part>' for every part the format needs."""
        want = part_names(fmt)
        missing = [f"{prefix}.{k}" for k in want if f"{prefix}.{k}" not in tensors]
        if missing:
            raise QuantError(f"format {fmt!r} needs tensors {missing} which are absent")
        return cls(fmt, (int(shape[0]), int(shape[1])), {k: tensors[f"{prefix}.{k}"] for k in want})


def dequantize_parts(fmt: str, shape: tuple[int, int], parts: dict[str, torch.Tensor],
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weights [..., out, in] of `parts` in format `fmt`: the parts of one QuantizedTensor,
    or of several of the same format and shape stacked along leading dimensions (each part with the
    same leading dimensions), which gives each one's weight exactly. Every weight is its float32
    value (codes times scales, plus minimum or low-rank product) rounded once into dtype; int8 and
    the signed codes of int4, ternary and ternary2 are multiplied by their float32 scales straight
    into a dtype output (one pass over it, the same products and the same rounding)."""
    base, rank = parse_format(fmt)
    in_f = shape[1]
    p = parts
    to = torch.float32 if rank else dtype       # a low-rank part is added in float32, before the rounding
    if base == "bf16":
        w = p["w"].to(to, copy=True)
    elif base == "int8":
        w = torch.mul(p["q"], p["scale"].float()[..., None], out=torch.empty(p["q"].shape, dtype=to,
                                                                             device=p["q"].device))
    elif base == "int4_asym":
        codes = unpack_nibbles(p["q"], _padded(in_f)).float()
        w = _apply_groups(codes, p["scale"].float(), p["min"].float(), in_f).to(to)
    else:
        unpack, offset = {"int4": (unpack_nibbles, 8), "ternary": (unpack_trits, 1),
                          "ternary2": (unpack_crumbs, 1)}[base]
        signed = unpack(p["q"], _padded(in_f)).to(torch.int8) - offset
        w = _signed_groups(signed, p["scale"], in_f, to)
    if rank:
        w = (w + p["lr_a"].float() @ p["lr_b"].float()).to(dtype)
    return w


def part_names(fmt: str) -> tuple[str, ...]:
    base, rank = parse_format(fmt)
    names = {"bf16": ("w",), "int8": ("q", "scale"), "int4": ("q", "scale"),
             "int4_asym": ("q", "scale", "min"), "ternary": ("q", "scale"), "ternary2": ("q", "scale")}[base]
    return names + (("lr_a", "lr_b") if rank else ())


def _padded(in_f: int) -> int:
    return -(-in_f // GROUP) * GROUP


def _groups(w: torch.Tensor) -> torch.Tensor:
    """[out, in] float -> [out, n_groups, GROUP], zero-padded at the end of each row."""
    out_f, in_f = w.shape
    pad = _padded(in_f) - in_f
    if pad:
        w = torch.nn.functional.pad(w, (0, pad))
    return w.reshape(out_f, -1, GROUP)


def _signed_groups(codes: torch.Tensor, scale: torch.Tensor, in_f: int, dtype: torch.dtype) -> torch.Tensor:
    """Signed int8 codes [..., out, padded in] times their group's scale -> [..., out, in] in dtype,
    each product computed in float32 and rounded as it is stored."""
    lead = codes.shape[:-1]
    out = torch.empty((*lead, codes.shape[-1] // GROUP, GROUP), dtype=dtype, device=codes.device)
    torch.mul(codes.view(*lead, -1, GROUP), scale.float()[..., None], out=out)
    return out.view(*lead, -1)[..., :in_f]


def _apply_groups(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor | None,
                  in_f: int) -> torch.Tensor:
    """Codes [..., out, padded in] times their group's scale (plus minimum) -> [..., out, in]."""
    lead = codes.shape[:-1]
    g = codes.reshape(*lead, -1, GROUP) * scale[..., None]
    if minimum is not None:
        g = g + minimum[..., None]
    return g.reshape(*lead, -1)[..., :in_f]


def quantize(w: torch.Tensor, fmt: str) -> QuantizedTensor:
    """Quantize a 2-D float weight [out, in] into `fmt` (see the module docstring)."""
    if w.dim() != 2:
        raise QuantError(f"quantize expects a 2-D weight [out, in], got shape {tuple(w.shape)}")
    base, rank = parse_format(fmt)
    shape = (int(w.shape[0]), int(w.shape[1]))
    w = w.detach().float()   # stays on its device: quantizing on a GPU is much faster for big models
    if base == "bf16":
        parts = {"w": w.to(torch.bfloat16)}
    elif base == "int8":
        # Scales are rounded to fp16 first, so codes are chosen against the scale actually stored.
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-8).half()
        q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
        parts = {"q": q, "scale": scale}
    elif base == "int4":
        g = _groups(w)
        scale = (g.abs().amax(dim=2) / 7.0).clamp_min(1e-8).half()
        q = torch.round(g / scale.float()[..., None]).clamp(-7, 7) + 8
        parts = {"q": pack_nibbles(q.reshape(shape[0], -1)), "scale": scale}
    elif base == "int4_asym":
        g = _groups(w)
        lo, hi = g.amin(dim=2), g.amax(dim=2)
        scale = ((hi - lo) / 15.0).clamp_min(1e-8).half()
        minimum = lo.half()
        q = torch.round((g - minimum.float()[..., None]) / scale.float()[..., None]).clamp(0, 15)
        parts = {"q": pack_nibbles(q.reshape(shape[0], -1)), "scale": scale, "min": minimum}
    else:
        codes, scale = _quantize_ternary(w, shape)
        parts = {"q": (pack_trits if base == "ternary" else pack_crumbs)(codes), "scale": scale}
    qt = QuantizedTensor(fmt if not rank else base, shape, parts)
    if rank:
        qt = add_lowrank(qt, w, rank)
    return qt


def _quantize_ternary(w: torch.Tensor, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """Ternary weight network rule (Li & Liu 2016): threshold 0.7 * mean|w| per group, then the scale
    that minimises squared error for the chosen signs: the mean |w| of the kept entries.
    Padding zeros are excluded from the group statistics. Returns (codes {0, 1, 2} [out, padded in],
    fp16 scales [out, groups])."""
    g = _groups(w)
    in_f = shape[1]
    valid = _groups(torch.ones(1, in_f, device=w.device)).expand_as(g)
    count = valid.sum(dim=2).clamp_min(1)
    delta = 0.7 * g.abs().sum(dim=2) / count
    keep = (g.abs() > delta[..., None]) & (valid > 0)
    kept = keep.sum(dim=2)
    scale = torch.where(kept > 0, (g.abs() * keep).sum(dim=2) / kept.clamp_min(1), torch.zeros_like(delta))
    scale = scale.clamp_min(1e-8).half()
    q = torch.sign(g) * keep + 1  # {-1, 0, +1} -> {0, 1, 2}
    return q.reshape(shape[0], -1), scale


def add_lowrank(qt: QuantizedTensor, w: torch.Tensor, rank: int) -> QuantizedTensor:
    """Add rank-r compensation of the residual W - dequant(qt): the truncated SVD, which is the
    closed-form best rank-r approximation in Frobenius norm (Eckart-Young). Stored as fp16
    A = U_r diag(S_r) [out, r] and B = V_r^T [r, in]."""
    base, old_rank = parse_format(qt.fmt)
    if old_rank:
        raise QuantError(f"format {qt.fmt!r} already has a low-rank part")
    rank = min(rank, *qt.shape)
    residual = w.float().to(qt.parts[next(iter(qt.parts))].device) - qt.dequantize(torch.float32)
    u, s, vh = torch.linalg.svd(residual, full_matrices=False)
    parts = dict(qt.parts)
    parts["lr_a"] = (u[:, :rank] * s[:rank]).half()
    parts["lr_b"] = vh[:rank].half().contiguous()
    return QuantizedTensor(f"{base}+r{rank}", qt.shape, parts)


def format_nbytes(fmt: str, out_f: int, in_f: int) -> int:
    """Exact bytes `quantize(W[out_f, in_f], fmt)` stores (equals QuantizedTensor.nbytes)."""
    base, rank = parse_format(fmt)
    groups = _padded(in_f) // GROUP
    size = {
        "bf16": 2 * out_f * in_f,
        "int8": out_f * in_f + 2 * out_f,
        "int4": out_f * (_padded(in_f) // 2) + 2 * out_f * groups,
        "int4_asym": out_f * (_padded(in_f) // 2) + 4 * out_f * groups,
        "ternary": out_f * -(-_padded(in_f) // 5) + 2 * out_f * groups,
        "ternary2": out_f * (_padded(in_f) // 4) + 2 * out_f * groups,
    }[base]
    if rank:
        r = min(rank, out_f, in_f)
        size += 2 * r * (out_f + in_f)
    return size


def bytes_per_weight(fmt: str, out_f: int = 4096, in_f: int = 4096) -> float:
    """Storage bytes per weight of `fmt` on a matrix of the given shape (scales included)."""
    return format_nbytes(fmt, out_f, in_f) / (out_f * in_f)
