"""Quant formats: exact bit-packing round trips, dequantize error ordering, exact storage sizes."""
from __future__ import annotations

import pytest
import torch

from moebench.engine.quant import (QuantError, QuantizedTensor, bytes_per_weight, dequantize_parts, format_nbytes,
                                   pack_crumbs, pack_nibbles, pack_trits, parse_format, quantize, unpack_crumbs, unpack_nibbles,
                                   unpack_trits)

LENGTHS = [1, 2, 3, 4, 5, 6, 7, 63, 64, 65, 127, 128, 333]


@pytest.mark.parametrize("n", LENGTHS)
def test_nibbles_round_trip_exact(n):
    g = torch.Generator().manual_seed(n)
    codes = torch.randint(0, 16, (3, n), generator=g, dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (3, (n + 1) // 2)
    assert torch.equal(unpack_nibbles(packed, n), codes)


@pytest.mark.parametrize("n", LENGTHS)
def test_trits_round_trip_exact(n):
    g = torch.Generator().manual_seed(100 + n)
    codes = torch.randint(0, 3, (2, 3, n), generator=g, dtype=torch.uint8)
    packed = pack_trits(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3, -(-n // 5))
    assert int(packed.max()) <= 242          # five trits never overflow a byte
    assert torch.equal(unpack_trits(packed, n), codes)


def test_trits_extremes_and_every_byte_value():
    # All 243 five-trit patterns map to distinct bytes and back.
    digits = torch.cartesian_prod(*[torch.arange(3)] * 5).to(torch.uint8)   # [243, 5]
    packed = pack_trits(digits)
    assert packed.shape == (243, 1)
    assert len(set(packed.flatten().tolist())) == 243
    assert torch.equal(unpack_trits(packed, 5), digits)


def test_crumbs_round_trip_and_the_dp4a_word_layout():
    """Four 2-bit codes per byte; in each 32-bit word (16 codes), (word >> 2j) & 0x03030303 holds
    codes 4j..4j+3 in bytes 0..3, the column order of one natural word of int8 activations."""
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 4, (3, 128), generator=g, dtype=torch.uint8)
    packed = pack_crumbs(codes)
    assert packed.shape == (3, 32) and torch.equal(unpack_crumbs(packed, 128), codes)
    words = packed.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF   # little-endian words
    for w in range(8):
        for j in range(4):
            m = (int(words[1, w]) >> (2 * j)) & 0x03030303
            col = 16 * w + 4 * j
            assert [(m >> (8 * lane)) & 255 for lane in range(4)] == codes[1, col:col + 4].tolist()
    with pytest.raises(QuantError, match="multiple of 16"):
        pack_crumbs(codes[:, :40])


def test_ternary2_holds_ternarys_codes_and_scales_in_two_bits():
    w = torch.randn(24, 200, generator=torch.Generator().manual_seed(4))
    a, b = quantize(w, "ternary"), quantize(w, "ternary2")
    assert torch.equal(a.dequantize(), b.dequantize()) and torch.equal(a.parts["scale"], b.parts["scale"])
    assert b.parts["q"].shape == (24, 256 // 4)          # 200 columns padded to 256, four per byte
    assert b.nbytes == format_nbytes("ternary2", 24, 200) > a.nbytes
    assert bytes_per_weight("ternary2") == pytest.approx(0.25 + 2 / 64)


def test_unpack_rejects_wrong_length_and_dtype():
    with pytest.raises(QuantError, match="expected 3 bytes"):
        unpack_trits(torch.zeros(4, dtype=torch.uint8), 11)
    with pytest.raises(QuantError, match="must be uint8"):
        unpack_nibbles(torch.zeros(4, dtype=torch.int32), 8)


ALL_FORMATS = ["bf16", "int8", "int4", "int4_asym", "ternary", "ternary2", "ternary+r8", "int4+r4"]


@pytest.mark.parametrize("fmt", ALL_FORMATS)
@pytest.mark.parametrize("shape", [(48, 100), (33, 64), (7, 5)])
def test_quantized_state_round_trip_and_sizes(fmt, shape):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 0.05
    q = quantize(w, fmt)
    assert q.nbytes == format_nbytes(fmt, *shape)
    again = QuantizedTensor.from_state(q.fmt, q.shape, q.state("x"), "x")
    d1, d2 = q.dequantize(), again.dequantize()
    assert d1.shape == shape
    assert torch.equal(d1, d2)
    # Re-quantizing the packed codes gives back the same bytes (packing is lossless).
    assert all(torch.equal(q.parts[k], again.parts[k]) for k in q.parts)


@pytest.mark.parametrize("fmt", ALL_FORMATS)
def test_stacked_parts_dequantize_to_each_tensors_own_weight(fmt):
    """dequantize_parts over the parts of three tensors stacked along a leading dimension (what the
    tiered experts' grouped path does) gives each tensor's own dequantize, bit for bit."""
    g = torch.Generator().manual_seed(3)
    qs = [quantize(torch.randn(33, 100, generator=g) * 0.05, fmt) for _ in range(3)]
    stacked = {k: torch.stack([q.parts[k] for q in qs]) for k in qs[0].parts}
    for dtype in (torch.float32, torch.bfloat16):
        got = dequantize_parts(qs[0].fmt, qs[0].shape, stacked, dtype)
        assert got.shape == (3, 33, 100) and got.dtype == dtype
        for i, q in enumerate(qs):
            assert torch.equal(got[i], q.dequantize(dtype)), (fmt, i, dtype)


def _float32_weight(q: QuantizedTensor) -> torch.Tensor:
    """The weight as the formats define it, in float32, written out step by step."""
    fmt, (out_f, in_f), p = q.fmt, q.shape, q.parts
    base, rank = parse_format(fmt)
    padded = -(-in_f // 64) * 64
    if base == "bf16":
        w = p["w"].float()
    elif base == "int8":
        w = p["q"].float() * p["scale"].float()[:, None]
    else:
        unpack = {"int4": unpack_nibbles, "int4_asym": unpack_nibbles, "ternary": unpack_trits,
                  "ternary2": unpack_crumbs}[base]
        codes = unpack(p["q"], padded).float() - {"int4": 8.0, "int4_asym": 0.0}.get(base, 1.0)
        g = codes.reshape(out_f, -1, 64) * p["scale"].float()[..., None]
        if base == "int4_asym":
            g = g + p["min"].float()[..., None]
        w = g.reshape(out_f, -1)[:, :in_f]
    if rank:
        w = w + p["lr_a"].float() @ p["lr_b"].float()
    return w


@pytest.mark.parametrize("fmt", ALL_FORMATS + ["int8+r4", "ternary2+r2"])
def test_dequantize_rounds_the_float32_weight_once(fmt):
    """dequantize(dtype), whose int8 / int4 / ternary / ternary2 products go straight into a dtype
    output, equals the float32 weight (the format's definition) rounded to dtype afterwards."""
    q = quantize(torch.randn(40, 300, generator=torch.Generator().manual_seed(4)) * 0.05, fmt)
    want = _float32_weight(q)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        got = q.dequantize(dtype)
        assert got.dtype == dtype and got.shape == (40, 300) and torch.equal(got, want.to(dtype)), dtype
    w = q.dequantize(torch.bfloat16)
    w.add_(1)                                  # a new tensor: the packed parts are untouched
    assert torch.equal(q.dequantize(torch.float32), want)


def test_ternary_levels_per_group():
    w = torch.randn(4, 128, generator=torch.Generator().manual_seed(2))
    q = quantize(w, "ternary")
    d = q.dequantize().reshape(4, 2, 64)
    scale = q.parts["scale"].float()
    ratio = d / scale[..., None]
    assert torch.allclose(ratio, ratio.round(), atol=1e-6)
    assert set(ratio.round().unique().tolist()) <= {-1.0, 0.0, 1.0}
    assert set(ratio.round().unique().tolist()) == {-1.0, 0.0, 1.0}   # all three levels used


def test_int4_codes_are_in_range():
    w = torch.randn(16, 130, generator=torch.Generator().manual_seed(3))
    q = quantize(w, "int4")
    codes = unpack_nibbles(q.parts["q"], 192)
    assert int(codes.min()) >= 1 and int(codes.max()) <= 15     # symmetric: q+8 in [1, 15]
    assert (codes.reshape(16, 192)[:, 130:] == 8).all()          # padding holds zeros


def test_error_ordering_and_lowrank_helps():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(256, 512, generator=g) * 0.02
    err = {f: ((quantize(w, f).dequantize() - w) ** 2).mean().item() for f in
           ["bf16", "int8", "int4", "int4_asym", "ternary", "ternary+r16"]}
    assert err["bf16"] < err["int8"] < err["int4"] < err["ternary"]
    assert err["int4_asym"] < err["ternary"]
    assert err["ternary+r16"] < err["ternary"]
    rel = err["ternary"] / (w ** 2).mean().item()
    assert 0.05 < rel < 0.5      # ternary with per-64 scales keeps most of the signal


def test_lowrank_is_exact_when_rank_is_full():
    w = torch.randn(8, 12, generator=torch.Generator().manual_seed(5))
    q = quantize(w, "ternary+r8")
    # The full-rank SVD of the residual restores W up to fp16 rounding of A and B.
    assert torch.allclose(q.dequantize(), w, atol=5e-3)


def test_bytes_per_weight_figures():
    assert bytes_per_weight("bf16") == 2.0
    assert bytes_per_weight("int8") == pytest.approx(1.0 + 2 / 4096)
    assert bytes_per_weight("int4") == pytest.approx(0.5 + 2 / 64)
    assert bytes_per_weight("int4_asym") == pytest.approx(0.5 + 4 / 64)
    # A 4096-wide row packs into ceil(4096 / 5) = 820 bytes of trits, plus a 2-byte scale per 64.
    assert bytes_per_weight("ternary") == pytest.approx(820 / 4096 + 2 / 64)
    assert bytes_per_weight("ternary") < 0.24


def test_unknown_format_names_the_choices():
    with pytest.raises(QuantError, match="unknown quant format 'int3'"):
        parse_format("int3")
    with pytest.raises(QuantError, match="2-D"):
        quantize(torch.zeros(3), "int8")
    assert parse_format("ternary+r8") == ("ternary", 8)
