"""Fused Triton MoE kernels (moebench/engine/kernels.py) against the engine's torch paths.

On a machine without CUDA the kernels run in Triton's interpreter on CPU tensors (small shapes keep
it fast); the CUDA tests run the compiled kernels, CUDA graphs and the zero-copy pinned host tier.
Every test skips when Triton does not import.
"""
from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton's first import (see kernels.py)
pytest.importorskip("triton")

from moebench.engine import Engine  # noqa: E402
from moebench.engine.engine import EngineError  # noqa: E402
from moebench.engine import kernels  # noqa: E402
from moebench.engine.decode_config import DecodeConfig, DecodeConfigError, DecodeMode, Format  # noqa: E402
from moebench.engine.model import Experts  # noqa: E402
from moebench.engine.placement import QuantizedExpert, TieredExperts  # noqa: E402
from moebench.engine.quant import GROUP, QuantizedTensor, pack_trits, quantize  # noqa: E402
from moebench.engine.tiering import calibrate, pack, plan_hot_cold  # noqa: E402
from moebench.engine.kernels.expert_rows import row_dots  # noqa: E402
from moebench.engine.kernels.moe_kernels import gate_up_rows  # noqa: E402
from moebench.engine.kernels.runtime import FMT_INT8, tl, triton  # noqa: E402

# Odd sizes on purpose: neither width is a multiple of the block sizes set below.
E, H, I, K = 6, 96, 40, 2
# The small tests run where the kernels run: CUDA when present (compiled), else the CPU interpreter.
DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# Blocks smaller than the widths, so the row and column masks and the K loop are exercised.
SMALL = DecodeConfig().with_launches(dict(BN=16, BK=32))
for _fmt in ("int8", "int4", "ternary2"):                   # INT8_ACTIVATIONS' own launch entries
    for _kernel in ("gate_up", "down"):
        SMALL = SMALL.with_launch(_kernel, _fmt, a8=True, BN=16, BK=32)
GPU_DEFAULT = DecodeConfig(launch={})                      # every kernel at the default launch shape


def small(**kw) -> DecodeConfig:
    """SMALL with other decode settings (experts_impl, int8_activations, ...)."""
    return replace(SMALL, **kw)


def fused_moe(*args, cfg: DecodeConfig = SMALL, **kw):
    return kernels.fused_moe(*args, cfg=cfg, **kw)


def reference(x, ids, w, mats):
    """sum_j w[t, j] * down(silu(gate x) * up x) with float32 weights mats = (gate, up, down) [E, ...]."""
    wg, wu, wd = mats
    out = torch.zeros(x.shape[0], wd.shape[1])
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = F.silu(wg[e] @ x[t]) * (wu[e] @ x[t])
            out[t] += w[t, j] * (wd[e] @ h)
    return out


def routing(T, g):
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids[-1] = ids[0]        # two tokens share their experts: each pair still reads its own rows
    return ids, torch.rand(T, K, generator=g)


def test_dense_experts_triton_matches_loop_on_strided_views():
    g = torch.Generator().manual_seed(0)
    # gate and up as views of one fused [E, 2I, H] tensor, as transformers stores them.
    gate_up = torch.randn(E, 2 * I, H, generator=g) * 0.1
    w_down = torch.randn(E, H, I, generator=g) * 0.1
    m = Experts(E, H, I)
    m.w_gate = torch.nn.Parameter(gate_up[:, :I].to(DEV), requires_grad=False)
    m.w_up = torch.nn.Parameter(gate_up[:, I:].to(DEV), requires_grad=False)
    m.w_down = torch.nn.Parameter(w_down.to(DEV), requires_grad=False)
    x = torch.randn(5, H, generator=g)
    ids, w = routing(5, g)
    xd, idsd, wd = x.to(DEV), ids.to(DEV), w.to(DEV)
    m.configure(small(experts_impl="loop"), K)
    want = m(xd, idsd, wd)
    m.configure(small(experts_impl="triton"), K)
    got = m(xd, idsd, wd)
    assert got.dtype == x.dtype and got.shape == (5, H)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (got - want).abs().max()
    assert torch.allclose(got.cpu(), reference(x, ids, w, (gate_up[:, :I], gate_up[:, I:], w_down)),
                          atol=1e-5, rtol=1e-4)
    # More tokens than fused_max_tokens: the fallback (loop on CPU, grouped_mm on CUDA).
    m.configure(small(experts_impl="triton", fused_max_tokens=2), K)
    if DEV == "cpu":
        assert m.sync_free_tokens() == 2
    assert torch.allclose(m(xd, idsd, wd), want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4", "int4_asym", "ternary", "ternary2"])
def test_tiered_fused_path_matches_per_expert_path(fmt):
    """Two formats in one layer (hot int8, the rest `fmt`) and both homes: the fused kernels give
    what TieredExperts' per-expert dequantize path gives, and that path still works afterwards on
    the re-stacked (view) stores."""
    g = torch.Generator().manual_seed(1)
    fmts = ["int8", "int8"] + [fmt] * (E - 2)
    experts = [QuantizedExpert(*(quantize(torch.randn(*s, generator=g) * 0.1, f) for s in ((I, H), (I, H), (H, I))))
               for f in fmts]
    homes = ["gpu", "host", "gpu", "host", "host", "gpu"]
    m = TieredExperts(experts, homes, DEV, torch.float32, cache_slots=1)
    x = torch.randn(4, H, generator=g)
    ids, w = routing(4, g)
    dequant = tuple(torch.stack([getattr(e, mat).dequantize() for e in experts]) for mat in ("gate", "up", "down"))
    x, ids, w = x.to(DEV), ids.to(DEV), w.to(DEV)
    want = m(x, ids, w)
    assert torch.allclose(want.cpu(), reference(x.cpu(), ids.cpu(), w.cpu(), dequant), atol=1e-5, rtol=1e-4)

    m.configure(small(experts_impl="triton"), K)
    labels = sorted(gr.label for gr in m._fused_groups)
    expected_labels = sorted({f"{f if f != 'bf16' else 'bf16'}@{h}" for f, h in zip(fmts, homes)})
    assert labels == expected_labels
    assert m.sync_free_tokens() == m.decode.fused_max_tokens
    calls = m.telemetry()["calls"]
    got = m(x, ids, w)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (got - want).abs().max()
    assert m.telemetry()["calls"] == calls + 1
    # Stores are views into the group stacks now; the per-expert path (T > fused_max_tokens) agrees.
    m.decode = replace(m.decode, fused_max_tokens=1)
    assert torch.allclose(m(x, ids, w), want, atol=1e-6)


@pytest.mark.parametrize("fmt", ["int4", "int4_asym"])
def test_int4_steps_spanning_several_scale_groups(fmt):
    """BK = 64 bytes = two 64-column groups per K step, each scaled once per (row, group); H = 96
    columns = 48 bytes, so the second group of the only step is half padding (masked)."""
    cfg = SMALL.with_launches(dict(BK=64), formats=[fmt])
    with pytest.raises(DecodeConfigError, match="multiple of 32"):
        cfg.with_launch("down", fmt, BK=48)
    g = torch.Generator().manual_seed(11)
    mats = [[quantize(torch.randn(*s, generator=g) * 0.1, fmt) for _ in range(E)] for s in ((I, H), (I, H), (H, I))]
    group = kernels.ExpertGroup(*(kernels.PackedMatrix.stack(m, DEV) for m in mats), None, fmt)
    x = torch.randn(3, H, generator=g)
    ids, w = routing(3, g)
    got = fused_moe(x.to(DEV), ids.to(DEV), w.to(DEV), [group], cfg=cfg).cpu()
    want = reference(x, ids, w, tuple(torch.stack([q.dequantize() for q in m]) for m in mats))
    assert torch.allclose(got.float(), want, atol=1e-4, rtol=1e-4), (got.float() - want).abs().max()


@pytest.mark.parametrize("a8", [False, True])
def test_ternary2_steps_of_one_scale_group(a8):
    """ternary2 with BK = 16 bytes (one 64-column group, 4 words) per K step: 4 steps over a 256-wide
    row, each group scaled once; BK must be whole groups. Float x matches the dequantized reference;
    int8 x matches quantize_activations' reference."""
    mode = DecodeMode.INT8_ACTIVATIONS if a8 else DecodeMode.WORDS
    cfg = replace(SMALL, mode_by_format={"ternary2": mode})
    for kernel in ("gate_up", "down"):
        cfg = cfg.with_launch(kernel, "ternary2", a8=a8, BN=16, BK=16)
    with pytest.raises(DecodeConfigError, match="multiple of 16"):
        cfg.with_launch("down", "ternary2", BK=24)
    g = torch.Generator().manual_seed(23)
    Hq, Iq = 256, 64
    mats = [[quantize(torch.randn(*s, generator=g) * 0.1, "ternary2") for _ in range(E)]
            for s in ((Iq, Hq), (Iq, Hq), (Hq, Iq))]
    group = kernels.ExpertGroup(*(kernels.PackedMatrix.stack(m, DEV) for m in mats), None, "ternary2")
    assert kernels.group_mode(group, "gate_up", cfg) == mode
    dq = tuple(torch.stack([q.dequantize() for q in m]) for m in mats)
    x = torch.randn(3, Hq, generator=g)
    ids, w = routing(3, g)
    got = fused_moe(x.to(DEV), ids.to(DEV), w.to(DEV), [group], cfg=cfg).cpu()
    want = reference_a8(x, ids, w, dq, qh=16) if a8 else reference(x, ids, w, dq)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4), (got - want).abs().max()


@pytest.mark.parametrize("fmt", ["int8", "int4", "int4_asym"])
def test_word_decode_matches_byte_decode_and_reference(fmt):
    """int8/int4 rows read as int32 words (conversion-free decode, x split in registers) give what
    the byte path gives; an int8 width that is not a whole number of words (H=90) falls back to the
    byte path; a per-format mode wins over the config's decode_mode."""
    words_cfg = SMALL
    bytes_cfg = replace(SMALL, decode_mode=DecodeMode.BYTES)
    per_format = replace(SMALL, mode_by_format={fmt: DecodeMode.BYTES})
    g = torch.Generator().manual_seed(12)
    for hidden in (H, 90):
        mats = [[quantize(torch.randn(*s, generator=g) * 0.1, fmt) for _ in range(E)]
                for s in ((I, hidden), (I, hidden), (hidden, I))]
        group = kernels.ExpertGroup(*(kernels.PackedMatrix.stack(m, DEV) for m in mats), None, fmt)
        x = torch.randn(3, hidden, generator=g)
        ids, w = routing(3, g)
        want = reference(x, ids, w, tuple(torch.stack([q.dequantize() for q in m]) for m in mats))
        words = fused_moe(x.to(DEV), ids.to(DEV), w.to(DEV), [group], cfg=words_cfg).cpu()
        word_rows = fmt != "int8" or hidden % 4 == 0
        assert (kernels.group_mode(group, "gate_up", words_cfg) == DecodeMode.WORDS) == word_rows
        assert kernels.group_mode(group, "gate_up", bytes_cfg) == DecodeMode.BYTES
        byte = fused_moe(x.to(DEV), ids.to(DEV), w.to(DEV), [group], cfg=bytes_cfg).cpu()
        assert kernels.group_mode(group, "gate_up", per_format) == DecodeMode.BYTES
        assert per_format.mode_of(fmt) == DecodeMode.BYTES
        assert torch.allclose(words, want, atol=1e-4, rtol=1e-4), (words - want).abs().max()
        assert torch.allclose(words, byte, atol=1e-5, rtol=1e-5), (words - byte).abs().max()


def reference_a8(x, ids, w, mats, qh, quantized=None):
    """reference() with INT8_ACTIVATIONS' rounding (kernels.quantize_activations): x per 64 columns
    and h per qh columns, for the experts in `quantized` (all when None)."""
    wg, wu, wd = (m.double() for m in mats)
    out = torch.zeros(x.shape[0], wd.shape[1])
    xq = kernels.quantize_activations(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            a8 = quantized is None or e in quantized
            xt = (xq if a8 else x)[t].double()
            h = F.silu((wg[e] @ xt).float()) * (wu[e] @ xt).float()
            if a8:
                h = kernels.quantize_activations(h[None], qh)[0]
            out[t] += w[t, j] * (wd[e] @ h.double()).float()
    return out


@pytest.mark.parametrize("fmt", ["int8", "int4", "ternary2"])
def test_int8_activation_mode_matches_its_reference(fmt):
    """INT8_ACTIVATIONS (x and h quantized to int8 per block, dp4a on the raw weight bytes) computes exactly
    what quantize_activations says, stays within 2% of the unrounded result (int4 weights alone are
    ~10% off), and leaves widths that are not whole 64-column blocks to WORDS. ternary2's h blocks
    are 16 columns at least (a weight word spans 16)."""
    cfg = replace(SMALL, mode_by_format={fmt: DecodeMode.INT8_ACTIVATIONS})
    g = torch.Generator().manual_seed(21)
    Hq, Iq = 128, 64
    mats = [[quantize(torch.randn(*s, generator=g) * 0.1, fmt) for _ in range(E)] for s in ((Iq, Hq), (Iq, Hq), (Hq, Iq))]
    group = kernels.ExpertGroup(*(kernels.PackedMatrix.stack(m, DEV) for m in mats), None, fmt)
    assert kernels.group_mode(group, "gate_up", cfg) == kernels.group_mode(group, "down", cfg) == 3
    dq = tuple(torch.stack([q.dequantize() for q in m]) for m in mats)
    x = torch.randn(3, Hq, generator=g)
    x[1, :64] *= 0.0                       # an all-zero block: scale 1, codes 0
    ids, w = routing(3, g)
    got = fused_moe(x.to(DEV), ids.to(DEV), w.to(DEV), [group], cfg=cfg).cpu()
    want = reference_a8(x, ids, w, dq, qh=16)           # the fixture's BN 16: one h block per program
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    exact = reference(x, ids, w, dq)
    assert (got - exact).norm() / exact.norm() < 0.02
    assert (got - exact).abs().max() > 1e-5       # the rounding is really there
    # INT8_ACTIVATIONS launches take the a8 entry: gate_up BN 8 makes h blocks of 8 columns (ternary2: 16)
    cfg8 = cfg.with_launch("gate_up", fmt, a8=True, BN=8)
    got8 = fused_moe(x.to(DEV), ids.to(DEV), w.to(DEV), [group], cfg=cfg8).cpu()
    want8 = reference_a8(x, ids, w, dq, qh=16 if fmt == "ternary2" else 8)
    assert torch.allclose(got8, want8, atol=1e-5, rtol=1e-5), (got8 - want8).abs().max()
    if fmt == "ternary2":
        assert torch.equal(got8, got)          # BN 8 is raised to 16 for ternary2: the same launch
    else:
        assert not torch.allclose(want8, want, atol=1e-5, rtol=1e-5)
    if fmt == "ternary2":       # h blocks of 32 columns: the rounding changes, the kernel follows
        got32 = fused_moe(x.to(DEV), ids.to(DEV), w.to(DEV), [group],
                          cfg=cfg.with_launch("gate_up", fmt, a8=True, BN=32)).cpu()
        want32 = reference_a8(x, ids, w, dq, qh=32)
        assert torch.allclose(got32, want32, atol=1e-5, rtol=1e-5), (got32 - want32).abs().max()
        assert not torch.allclose(want32, want, atol=1e-5, rtol=1e-5)
    # 96 columns: not whole blocks, so WORDS (exact activations)
    mats = [[quantize(torch.randn(*s, generator=g) * 0.1, fmt) for _ in range(E)] for s in ((I, H), (I, H), (H, I))]
    group = kernels.ExpertGroup(*(kernels.PackedMatrix.stack(m, DEV) for m in mats), None, fmt)
    assert kernels.group_mode(group, "gate_up", cfg) == DecodeMode.WORDS
    x = torch.randn(3, H, generator=g)
    got = fused_moe(x.to(DEV), ids.to(DEV), w.to(DEV), [group], cfg=cfg).cpu()
    want = reference(x, ids, w, tuple(torch.stack([q.dequantize() for q in m]) for m in mats))
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


def format_groups(fmts: list[str], hidden: int, inter: int, g: torch.Generator):
    """Expert e of format fmts[e] (random, quantized), one ExpertGroup per format (in order of first
    use) on DEV, and the dequantized (gate, up, down) stacks [E, ...] of all of them."""
    experts = [tuple(quantize(torch.randn(*s, generator=g) * 0.1, f)
                     for s in ((inter, hidden), (inter, hidden), (hidden, inter))) for f in fmts]
    groups = []
    for fmt in dict.fromkeys(fmts):
        members = [e for e, f in enumerate(fmts) if f == fmt]
        slot_of = torch.full((len(fmts),), -1, dtype=torch.int32)
        slot_of[members] = torch.arange(len(members), dtype=torch.int32)
        groups.append(kernels.ExpertGroup(*(kernels.PackedMatrix.stack([experts[e][j] for e in members], DEV)
                                            for j in range(3)), slot_of.to(DEV), fmt))
    return groups, tuple(torch.stack([experts[e][j].dequantize() for e in range(len(fmts))]) for j in range(3))


@pytest.mark.parametrize("cold", ["ternary", "ternary2"])
def test_int8_activation_group_beside_a_ternary_group(cold):
    """A hot/cold layer: int8 experts in INT8_ACTIVATIONS and ternary ones in one call, on side
    streams on CUDA; each pair gets its own group's arithmetic (ternary: exact activations;
    ternary2: INT8_ACTIVATIONS too)."""
    cfg = small(experts_impl="triton", int8_activations=True)
    g = torch.Generator().manual_seed(22)
    Hq, Iq = 128, 64
    fmts = ["int8", cold, "int8", cold, "int8", "int8"]
    groups, dq = format_groups(fmts, Hq, Iq, g)
    x = torch.randn(4, Hq, generator=g)
    ids, w = routing(4, g)
    got = fused_moe(x.to(DEV), ids.to(DEV), w.to(DEV), groups, cfg=cfg).cpu()
    want = reference_a8(x, ids, w, dq, qh=16, quantized={e for e, f in enumerate(fmts) if f != "ternary"})
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    assert [kernels.group_mode(gr, "gate_up", cfg) for gr in groups] == [3, 3 if cold == "ternary2" else DecodeMode.WORDS]


# expert e's (format, group): three formats, or two groups of one format plus a third group
@pytest.mark.parametrize("layout", [[("int8", 0), ("int8", 0), ("int8", 0), ("ternary", 1), ("ternary", 1), ("int4", 2)],
                                    [("int4", 0), ("int4", 1), ("int4", 0), ("int4", 1), ("int4", 0), ("int8", 2)]])
def test_groups_of_several_formats_each_write_their_pairs(layout):
    """Every pair's row is written by exactly one group, in any group order, whether the groups share a
    launch pair (one format) or get launches of their own."""
    g = torch.Generator().manual_seed(13)
    experts = [tuple(quantize(torch.randn(*s, generator=g) * 0.1, f) for s in ((I, H), (I, H), (H, I)))
               for f, _ in layout]
    groups = []
    for key in sorted({gk for _, gk in layout}):
        members = [e for e, (_, gk) in enumerate(layout) if gk == key]
        slot_of = torch.full((E,), -1, dtype=torch.int32)
        slot_of[members] = torch.arange(len(members), dtype=torch.int32)
        groups.append(kernels.ExpertGroup(*(kernels.PackedMatrix.stack([experts[e][j] for e in members], DEV)
                                            for j in range(3)), slot_of.to(DEV), str(key)))
    dequant = tuple(torch.stack([experts[e][j].dequantize() for e in range(E)]) for j in range(3))
    x = torch.randn(4, H, generator=g)
    ids, w = routing(4, g)
    want = reference(x, ids, w, dequant)
    for order in (groups, groups[::-1]):
        got = fused_moe(x.to(DEV), ids.to(DEV), w.to(DEV), order).cpu()
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


@pytest.mark.parametrize("mode", [DecodeMode.BYTES, DecodeMode.WORDS])
@pytest.mark.parametrize("bk", [None, 8])
def test_ternary_kernel_decodes_every_byte_value(bk, mode):
    """Uniform random trits (every byte value 0..242 occurs) through the kernel vs dequantize(), in
    the byte decode and in the word decode of the stacks' padded rows (asked for by format).
    bk=8: K steps of 8 bytes (40 columns) start inside groups and bytes 12 and 25 straddle two
    groups, so the per-byte (per-word) lo/hi group scales are checked across step boundaries too."""
    cfg = SMALL if bk is None else SMALL.with_launches(dict(BK=bk), formats=["ternary"])
    cfg = replace(cfg, mode_by_format={"ternary": mode})
    g = torch.Generator().manual_seed(2)
    width = 2 * GROUP + 7          # a partial last group, padded like quantize() pads it
    padded = 3 * GROUP

    def random_ternary(rows, cols, pcols):
        codes = torch.randint(0, 3, (rows, pcols), generator=g)
        scale = (torch.rand(rows, pcols // GROUP, generator=g) + 0.5).half()
        return QuantizedTensor("ternary", (rows, cols), {"q": pack_trits(codes), "scale": scale})

    mats = [[random_ternary(I, width, padded) for _ in range(E)] for _ in range(2)]
    downs = [random_ternary(width, I, GROUP) for _ in range(E)]
    assert len(torch.unique(torch.cat([m.parts["q"].flatten() for m in mats[0]]))) == 243
    group = kernels.ExpertGroup(kernels.PackedMatrix.stack(mats[0], DEV), kernels.PackedMatrix.stack(mats[1], DEV),
                                kernels.PackedMatrix.stack(downs, DEV), None, "ternary")
    assert kernels.group_mode(group, "gate_up", cfg) == kernels.group_mode(group, "down", cfg) == mode
    # rows of 39 and 13 bytes, stored padded to whole words; data is the stored rows
    assert group.gate.storage.shape[-1] == 40 and group.down.storage.shape[-1] == 16
    assert torch.equal(group.gate.data[2].cpu(), mats[0][2].parts["q"])
    x = torch.randn(3, width, generator=g)
    ids, w = routing(3, g)
    got = fused_moe(x.to(DEV), ids.to(DEV), w.to(DEV), [group], cfg=cfg).cpu()
    dequant = (torch.stack([m.dequantize() for m in mats[0]]), torch.stack([m.dequantize() for m in mats[1]]),
               torch.stack([m.dequantize() for m in downs]))
    want = reference(x, ids, w, dequant)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


def test_base3_runs_words_by_default_where_rows_are_whole_words():
    """The default decode_mode (WORDS) runs base-3 ternary's word decode where the rows are padded
    stacks, and bytes for rows of no whole words viewed in place (26 bytes here; the SSD tier's
    record buffers) or when BYTES is asked by format; all three give the same sums."""
    g = torch.Generator().manual_seed(5)
    mats = [[quantize(torch.randn(*s, generator=g) * 0.1, "ternary") for _ in range(E)]
            for s in ((I, H), (I, H), (H, I))]
    stacks = [kernels.PackedMatrix.stack(m, DEV) for m in mats]
    group = kernels.ExpertGroup(*stacks, None, "ternary")
    bytes_asked = replace(SMALL, mode_by_format={"ternary": DecodeMode.BYTES})
    assert SMALL.mode_of("ternary") == DecodeMode.WORDS
    assert kernels.group_mode(group, "gate_up", SMALL) == kernels.group_mode(group, "down", SMALL) == DecodeMode.WORDS
    assert kernels.group_mode(group, "gate_up", bytes_asked) == DecodeMode.BYTES
    assert group.gate.words(DecodeMode.WORDS) is group.gate.words(DecodeMode.WORDS)     # the view is cached
    unpadded = [kernels.PackedMatrix("ternary", pm.data.contiguous(), pm.rows, pm.cols, pm.scale) for pm in stacks]
    in_place = kernels.ExpertGroup(*unpadded, None, "ternary")
    assert kernels.group_mode(in_place, "gate_up", SMALL) == DecodeMode.BYTES
    x = torch.randn(2, H, generator=g)
    ids, w = routing(2, g)
    got = [fused_moe(x.to(DEV), ids.to(DEV), w.to(DEV), [gr], cfg=cfg).cpu()
           for gr, cfg in ((group, SMALL), (in_place, SMALL), (group, bytes_asked))]
    assert torch.allclose(got[0], got[1], atol=1e-5, rtol=1e-5) and torch.equal(got[1], got[2])
    with pytest.raises(DecodeConfigError, match="multiple of 4"):
        SMALL.with_launch("gate_up", "ternary", BK=2)


def test_bad_groups_are_rejected_with_a_clear_error():
    g = torch.Generator().manual_seed(3)
    lowrank = [quantize(torch.randn(I, H, generator=g), "int4+r2") for _ in range(2)]
    with pytest.raises(kernels.KernelError, match="low-rank"):
        kernels.PackedMatrix.stack(lowrank, "cpu")
    mixed = [quantize(torch.randn(I, H, generator=g), "int8"), quantize(torch.randn(I, H, generator=g), "int4")]
    with pytest.raises(kernels.KernelError, match="matrix 1 is int4"):
        kernels.PackedMatrix.stack(mixed, "cpu")
    group = kernels.dense_group(torch.zeros(E, I, H), torch.zeros(E, I, H), torch.zeros(E, H, I))
    with pytest.raises(kernels.KernelError, match="do not fit hidden size 64"):
        fused_moe(torch.zeros(1, 64), torch.zeros(1, K, dtype=torch.long), torch.ones(1, K), [group])
    with pytest.raises(DecodeConfigError, match="unknown parameters"):
        SMALL.with_launch("down", "dense", BM=4)


# ---- a real (tiny) checkpoint through the engine, on real text -----------------------------------

def tiny_qwen3moe(tmp_path_factory, name: str, expert_width: int, seed: int):
    """A random 2-layer Qwen3-MoE checkpoint (hidden 64, 8 experts, top-2, byte vocabulary)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=expert_width,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        initializer_range=0.1, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(seed)
    path = tmp_path_factory.mktemp(name)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_qwen3moe(tmp_path_factory, "tiny_qwen3moe_kernels", 48, seed=0)


@pytest.fixture(scope="module")
def wiki_bytes(data_dir):
    # Real text as byte-level tokens (the tiny model's vocabulary is the 256 byte values).
    return list((data_dir / "wikitext2" / "wiki.test.raw").read_bytes()[1000:1600])


def test_engine_triton_decode_matches_default_path(ckpt, wiki_bytes):
    ref = Engine.load(ckpt, device=DEV, dtype="float32", max_seq_len=128)
    fused = Engine.load(ckpt, device=DEV, dtype="float32", max_seq_len=128, decode=small(experts_impl="triton"))
    prompt = wiki_bytes[:12]          # 12 tokens <= fused_max_tokens: the prefill runs the kernels too
    a, b = ref.logits(prompt), fused.logits(prompt)
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()
    out_a = ref.generate([prompt], 6, ignore_eos=True)[0].token_ids
    out_b = fused.generate([prompt], 6, ignore_eos=True)[0].token_ids
    assert out_a == out_b and len(out_b) == 6


@pytest.mark.parametrize("cold, home", [("ternary", "host"), ("ternary2", "gpu")])
def test_engine_triton_on_tiered_artifact_matches_default_path(ckpt, wiki_bytes, tmp_path, cold, home):
    """A packed hot/cold artifact (ternary2: saved and loaded in its own layout) decodes the same
    through the fused kernels as through the per-expert path."""
    stats = calibrate(Engine.load(ckpt, device="cpu", dtype="float32"), [wiki_bytes[:64], wiki_bytes[64:128]])
    art = pack(ckpt, plan_hot_cold(stats, 0.5, hot="int8", cold=cold, cold_home=home), tmp_path / "art")
    ref = Engine.load(art, device=DEV, dtype="float32", max_seq_len=64)
    fused = Engine.load(art, device=DEV, dtype="float32", max_seq_len=64, decode=small(experts_impl="triton"))
    blocks = fused.model.moe_blocks()
    assert all(b.experts._fused_groups is not None for b in blocks)
    assert sorted(gr.label for gr in blocks[0].experts._fused_groups) == ["int8@gpu", f"{cold}@{home}"]
    prompt = wiki_bytes[200:210]
    a, b = ref.logits(prompt), fused.logits(prompt)
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()


# ---- CUDA: compiled kernels, CUDA graphs, zero-copy host tier ------------------------------------

@needs_cuda
def test_cuda_fused_bf16_matches_float_reference():
    g = torch.Generator().manual_seed(4)
    Hc, Ic, Ec = 512, 384, 16
    m = Experts(Ec, Hc, Ic).cuda().to(torch.bfloat16)
    for p in (m.w_gate, m.w_up, m.w_down):
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.05)
    x = (torch.randn(8, Hc, generator=g)).cuda().to(torch.bfloat16)
    ids = torch.stack([torch.randperm(Ec, generator=g)[:4] for _ in range(8)]).cuda()
    w = torch.rand(8, 4, generator=g).cuda()
    m.configure(replace(GPU_DEFAULT, experts_impl="triton"), 4)
    got = m(x, ids, w).float().cpu()
    want = reference(x.float().cpu(), ids.cpu(), w.cpu(), tuple(p.float().cpu() for p in (m.w_gate, m.w_up, m.w_down)))
    assert torch.allclose(got, want, atol=2e-2, rtol=2e-2), (got - want).abs().max()


@needs_cuda
def test_cuda_graph_with_zero_copy_host_experts():
    g = torch.Generator().manual_seed(5)
    Hc, Ic = 256, 192
    fmts = ["int8"] * 4 + ["ternary"] * 4
    experts = [QuantizedExpert(*(quantize(torch.randn(*s, generator=g) * .1, f) for s in ((Ic, Hc), (Ic, Hc), (Hc, Ic))))
               for f in fmts]
    homes = ["gpu"] * 4 + ["host"] * 4
    m = TieredExperts(experts, homes, "cuda", torch.bfloat16)
    want_m = TieredExperts(experts, ["gpu"] * 8, "cuda", torch.bfloat16)
    m.configure(replace(GPU_DEFAULT, experts_impl="triton"), 2)
    host_group = [gr for gr in m._fused_groups if gr.label.endswith("@host")][0]
    assert host_group.gate.data.device.type == "cpu" and host_group.gate.data.is_pinned()
    x = torch.randn(2, Hc, generator=g).cuda().to(torch.bfloat16)
    ids = torch.tensor([[0, 5], [6, 2]], device="cuda")
    w = torch.rand(2, 2, generator=g).cuda()
    want_m.configure(replace(GPU_DEFAULT, experts_impl="triton"), 2)   # (all-GPU groups) warm the kernels
    y = m(x, ids, w)                               # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = m(x, ids, w)
    ids.copy_(torch.tensor([[7, 1], [4, 3]], device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    # Compare with exact float32 math on the same dequantized weights. (The per-expert path rounds h
    # and each expert's contribution to bf16 -- errors ~0.016 at contributions of ~5 -- so against it
    # a small output can differ by ~0.03 with nothing wrong, 0.0344 > atol 0.03 was seen.)
    # The fused path accumulates in float32 and rounds once, to bf16: within 2^-8 relative.
    dequant = tuple(torch.stack([getattr(e, mat).dequantize() for e in experts]) for mat in ("gate", "up", "down"))
    want = reference(x.float().cpu(), ids.cpu(), w.cpu(), dequant)
    assert torch.allclose(out.float().cpu(), want, atol=1e-3, rtol=8e-3), (out.float().cpu() - want).abs().max()
    assert not torch.equal(out, y)


# ---- fused non-expert decode ops -------------------------------------------------------------------

def test_add_rmsnorm_matches_add_then_model_rmsnorm():
    from moebench.engine.model import RMSNorm
    g = torch.Generator().manual_seed(6)
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    norm = RMSNorm(200, 1e-6).to(DEV, dt)
    norm.weight.data.copy_(torch.rand(200, generator=g) + 0.5)
    x = torch.randn(3, 200, generator=g).to(DEV, dt)
    d = torch.randn(3, 200, generator=g).to(DEV, dt)
    res, out = kernels.add_rmsnorm(x, d, norm.weight, norm.eps)
    assert torch.equal(res, x + d)
    want = norm(x + d)
    tol = 1e-2 if dt == torch.bfloat16 else 1e-5
    assert torch.allclose(out.float(), want.float(), atol=tol, rtol=tol), (out.float() - want.float()).abs().max()
    same, out2 = kernels.add_rmsnorm(x, None, norm.weight, norm.eps)
    assert same.data_ptr() == x.data_ptr() and torch.allclose(out2.float(), norm(x).float(), atol=tol, rtol=tol)
    with pytest.raises(kernels.KernelError, match="weight shape"):
        kernels.add_rmsnorm(x, d, norm.weight[:10], norm.eps)


def test_embed_rmsnorm_is_the_embedding_then_add_rmsnorm_bitwise():
    """The embedding lookup inside the first norm's launch: the same residual row (the table's) and
    the same normed row, bit for bit, as nn.Embedding followed by add_rmsnorm; repeated ids too."""
    g = torch.Generator().manual_seed(61)
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    table = torch.randn(50, 200, generator=g).to(DEV, dt)
    w = (torch.rand(200, generator=g) + 0.5).to(DEV, dt)
    tokens = torch.tensor([[7, 49, 0], [7, 3, 3]], device=DEV)
    res, out = kernels.embed_rmsnorm(table, tokens, w, 1e-6)
    x = F.embedding(tokens, table)
    want_res, want_out = kernels.add_rmsnorm(x, None, w, 1e-6)
    assert res.shape == out.shape == (2, 3, 200)
    assert torch.equal(res, x) and torch.equal(out, want_out) and torch.equal(want_res, x)
    with pytest.raises(kernels.KernelError, match=r"embed_rmsnorm: table \(50, 200\).*expected a contiguous"):
        kernels.embed_rmsnorm(table, tokens, w[:10], 1e-6)


@pytest.mark.parametrize("renorm", [True, False])
def test_route_topk_matches_softmax_topk(renorm):
    g = torch.Generator().manual_seed(7)
    logits = (torch.randn(5, 60, generator=g) * 3).to(DEV)      # 60 experts: masked lanes up to 64
    ids, w = kernels.route_topk(logits, 4, renorm)
    probs = torch.softmax(logits.float(), -1)
    want_w, want_ids = torch.topk(probs, 4, dim=-1)
    if renorm:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    assert ids.dtype == torch.long and torch.equal(ids, want_ids)
    assert torch.allclose(w, want_w, atol=1e-6, rtol=1e-5)
    with pytest.raises(kernels.KernelError, match="top_k"):
        kernels.route_topk(logits, 61, renorm)


def test_route_topk_ties_go_to_the_lowest_index():
    """Equal probabilities are picked lowest expert first, in descending order of probability,
    whatever their order in the row (rounds of argmax, the lowest index kept on ties)."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0, 3.0, -1.0],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
                           [-5.0, 2.0, -5.0, 2.0, 7.0, -5.0, 2.0, -5.0]]).to(DEV)
    ids, w = kernels.route_topk(logits, 5, False)
    assert ids.tolist() == [[1, 2, 4, 6, 5], [0, 1, 2, 3, 4], [4, 1, 3, 6, 0]]
    assert w[0, 0] == w[0, 1] == w[0, 2] == w[0, 3] > w[0, 4] and torch.all(w[1] == w[1, 0])
    assert torch.allclose(w, torch.gather(torch.softmax(logits.float(), -1), 1, ids), atol=1e-7, rtol=1e-6)


def test_route_topk_softmax_max_is_the_largest_logit_when_all_are_negative():
    """The softmax's max is taken over sortable int32 keys (runtime.sortable_bits): with every
    logit negative and a spread past float32's exp range, any other max than the largest logit
    overflows exp; -0.0 and +0.0 are one value."""
    logits = torch.tensor([[-1.0, -100.0, -2.0, -95.0, -1.5, -3.0, float("-inf"), -90.0],
                           [-0.0, -120.0, 0.0, -110.0, -0.5, -0.0, -130.0, -1.0]]).to(DEV)
    ids, w = kernels.route_topk(logits, 3, False)
    assert ids.tolist() == [[0, 4, 2], [0, 2, 5]]
    want = torch.gather(torch.softmax(logits.float(), -1), 1, ids)
    assert torch.isfinite(w).all() and torch.allclose(w, want, atol=1e-7, rtol=1e-6), (w, want)


@pytest.mark.parametrize("renorm", [True, False])
def test_router_topk_matches_linear_softmax_topk(renorm):
    """The fused router (GEMV slices + last-arriving program does the top-k): same ids and weights
    as F.linear + route_topk, over several calls (the arrival counters reset themselves), with E not
    a multiple of the expert block and H not a multiple of the column block."""
    g = torch.Generator().manual_seed(12)
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    cfg = SMALL.with_launch("router", "dense", BN=8, BK=32)
    weight = (torch.randn(60, 100, generator=g) * 0.3).to(DEV, dt)
    for T in (1, 5, 1):
        x = torch.randn(T, 100, generator=g).to(DEV, dt)
        logits, ids, w = kernels.router_topk(x, weight, 4, renorm, cfg=cfg)
        want_logits = F.linear(x, weight)
        assert torch.allclose(logits, want_logits.float(), atol=2e-2 if dt == torch.bfloat16 else 1e-5)
        # the top-k of the kernel's own logits (on the GPU, bf16 F.linear may round a near-tie the
        # other way, so the ids are compared on the same logits)
        want_ids, want_w = kernels.route_topk(logits if dt == torch.bfloat16 else want_logits, 4, renorm)
        assert torch.equal(ids, want_ids), (ids, want_ids)
        assert torch.allclose(w, want_w, atol=1e-6, rtol=1e-5)
    assert int(kernels.norm_router.shared_arrivals(x.device, cfg).abs().sum()) == 0
    with pytest.raises(kernels.KernelError, match="weight shape"):
        kernels.router_topk(x, weight[:, :50], 4, renorm, cfg=cfg)
    # out=: the same results in the caller's tensors
    out = (torch.empty(T, 60, device=DEV), torch.empty(T, 4, dtype=torch.long, device=DEV),
           torch.empty(T, 4, device=DEV))
    got = kernels.router_topk(x, weight, 4, renorm, out=out, cfg=cfg)
    assert all(a is b for a, b in zip(got, out)) and torch.equal(out[1], ids) and torch.equal(out[2], w)
    with pytest.raises(kernels.KernelError, match=r"router_topk: out .*expected contiguous"):
        kernels.router_topk(x, weight, 4, renorm, out=(out[0], out[1][:, :2], out[2]), cfg=cfg)


@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_rope_cache_matches_torch_attention_ops(qk_norm):
    from moebench.engine.model import RMSNorm, apply_rope, rope_tables
    g = torch.Generator().manual_seed(8)
    B, T, NH, NKV, D, S = 2, 3, 4, 2, 16, 10
    q = torch.randn(B, T, NH * D, generator=g).to(DEV).view(B, T, NH, D)     # views, as in Attention
    kv = torch.randn(B, T, 2 * NKV * D, generator=g).to(DEV)
    k, v = kv[..., :NKV * D].view(B, T, NKV, D), kv[..., NKV * D:].view(B, T, NKV, D)
    qn, kn = RMSNorm(D, 1e-6).to(DEV), RMSNorm(D, 1e-6).to(DEV)
    qn.weight.data.copy_(torch.rand(D, generator=g) + 0.5)
    kn.weight.data.copy_(torch.rand(D, generator=g) + 0.5)
    cos_t, sin_t = rope_tables(D, 10000.0, S, DEV)
    positions = torch.tensor([[2, 3, 4], [5, 6, 7]], device=DEV)
    cos, sin = cos_t[positions], sin_t[positions]
    kc, vc = torch.zeros(3, NKV, S, D, device=DEV), torch.zeros(3, NKV, S, D, device=DEV)
    got_q = kernels.qk_rope_cache(q, k, v, qn.weight if qk_norm else None, kn.weight if qk_norm else None,
                                  1e-6, cos, sin, positions, kc, vc)
    qq, kk = (qn(q), kn(k)) if qk_norm else (q, k)
    want_q = apply_rope(qq.transpose(1, 2), cos, sin)
    want_k = apply_rope(kk.transpose(1, 2), cos, sin)
    assert got_q.shape == (B, NH, T, D) and torch.allclose(got_q, want_q, atol=1e-5, rtol=1e-5)
    for b in range(B):
        assert torch.allclose(kc[b, :, positions[b]], want_k[b], atol=1e-5, rtol=1e-5)
        assert torch.equal(vc[b, :, positions[b]], v[b].transpose(0, 1))
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[positions[0]] = False
    assert not kc[0, :, untouched].any() and not kc[2].any()


@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_rope_cache_reads_the_rope_tables_like_gathered_rows(qk_norm):
    """cos / sin given as the float32 tables [S, D] (rows read at the positions in the kernel, as
    the fused decode step passes them) give the same queries and cache rows, bit for bit, as the
    rows gathered and cast first; bf16 on CUDA, where the kernel does the rounding itself."""
    from moebench.engine.model import rope_tables
    g = torch.Generator().manual_seed(62)
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    B, T, NH, NKV, D, S = 2, 2, 4, 2, 16, 12
    q = torch.randn(B, T, NH * D, generator=g).to(DEV, dt).view(B, T, NH, D)
    kv = torch.randn(B, T, 2 * NKV * D, generator=g).to(DEV, dt)
    k, v = kv[..., :NKV * D].view(B, T, NKV, D), kv[..., NKV * D:].view(B, T, NKV, D)
    qw, kw = ((torch.rand(D, generator=g) + 0.5).to(DEV, dt) for _ in range(2)) if qk_norm else (None, None)
    cos_t, sin_t = rope_tables(D, 10000.0, S, DEV)
    positions = torch.tensor([[3, 4], [9, 10]], device=DEV)
    caches = [[torch.zeros(B, NKV, S, D, device=DEV, dtype=dt) for _ in range(2)] for _ in range(2)]
    rows = kernels.qk_rope_cache(q, k, v, qw, kw, 1e-6, cos_t[positions].to(dt), sin_t[positions].to(dt),
                                 positions, *caches[0])
    tables = kernels.qk_rope_cache(q, k, v, qw, kw, 1e-6, cos_t, sin_t, positions, *caches[1])
    assert torch.equal(tables, rows)
    assert torch.equal(caches[1][0], caches[0][0]) and torch.equal(caches[1][1], caches[0][1])
    assert caches[1][0][:, :, positions[1]].any()
    with pytest.raises(kernels.KernelError, match=r"expected float32 tables \[S, 16\]"):
        kernels.qk_rope_cache(q, k, v, qw, kw, 1e-6, cos_t[:, :8], sin_t[:, :8], positions, *caches[1])


def count_step_ops(eng, tokens, pos, kv_len) -> int:
    """Ops one decode step launches: torch ops (dispatched aten calls) + Triton kernel launches, not
    counting what a launch does inside (the CPU interpreter runs torch ops of its own)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    state = {"ops": 0, "inside": 0}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not state["inside"] and func.namespace == "aten" and "view" not in func.__name__:
                state["ops"] += 1
            return func(*args, **(kwargs or {}))

    jit_type = type(kernels.moe_kernels.gate_up_kernel)
    run = jit_type.run

    def counted_run(self, *a, **k):
        state["ops"] += 0 if state["inside"] else 1
        state["inside"] += 1
        try:
            return run(self, *a, **k)
        finally:
            state["inside"] -= 1
    jit_type.run = counted_run
    try:
        with Count():
            eng._decode(tokens, pos, kv_len)
    finally:
        jit_type.run = run
    return state["ops"]


def test_fused_decode_ops_cut_ops_per_step(ckpt):
    """The fused ops replace most of a decode step's small torch ops (2 layers, measured here)."""
    counts = {}
    for fused in (False, True):
        eng = Engine.load(ckpt, device=DEV, dtype="float32", max_seq_len=32, decode=small(experts_impl="triton", fused_ops=fused))
        tokens, pos = torch.tensor([[5]], device=DEV), torch.tensor([[3]], device=DEV)
        eng._decode(tokens, pos, 16)
        counts[fused] = count_step_ops(eng, tokens, pos, 16)
    print("ops per decode step (2 layers), torch ops vs fused:", counts)
    assert counts[True] < 0.6 * counts[False], counts


# ---- decode GEMV and the fused [q; k; v] projection ---------------------------------------------------

@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear(with_bias):
    """kernels.linear == F.linear on odd sizes (row and column masks, several K steps, 3 tokens)."""
    g = torch.Generator().manual_seed(11)
    N, Kin = 37, 100
    x = torch.randn(1, 3, Kin, generator=g)
    w = torch.randn(N, Kin, generator=g)
    b = torch.randn(N, generator=g) if with_bias else None
    cfg = SMALL.with_launch("gemv", "dense", BN=8, BK=32)
    got = kernels.linear(x.to(DEV), w.to(DEV), b.to(DEV) if b is not None else None, cfg=cfg).cpu()
    assert got.shape == (1, 3, N)
    torch.testing.assert_close(got, F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    with pytest.raises(kernels.KernelError, match="weight shape"):
        kernels.linear(x.to(DEV), w.t().contiguous().to(DEV))


def test_linear_float32_out_is_its_result_rounded_then_widened():
    """out_dtype float32 (the decode step's logits): the values of linear(...).float(), bit for
    bit, with no cast launch; bf16 x and weight (the kernel rounds to bf16 before the store)."""
    g = torch.Generator().manual_seed(63)
    x = torch.randn(1, 96, generator=g).to(DEV, torch.bfloat16)
    w = torch.randn(300, 96, generator=g).to(DEV, torch.bfloat16)
    cfg = SMALL.with_launch("gemv", "dense", BN=8, BK=32)
    got = kernels.linear(x, w, cfg=cfg, out_dtype=torch.float32)
    want = kernels.linear(x, w, cfg=cfg)
    assert got.dtype == torch.float32 and want.dtype == torch.bfloat16
    assert torch.equal(got, want.float())
    assert not torch.equal(got, (x.float() @ w.float().t()))      # the rounding to bf16 is there


def test_greedy_pick_in_the_gemv_is_torch_argmax_and_feeds_the_next_step():
    """The lm_head GEMV's folded pick, decoded by feed_next_step, is torch.argmax of the logits it
    stored: the largest value, the lowest index among equal ones (ties planted across programs and
    inside one, and a run of zero rows above negative ones); the picks go to the row of the step's
    parity and to tokens, positions move on by one, and the keys are left empty for the next step."""
    from moebench.engine.kernels.greedy_pick import EMPTY_KEY, empty_keys, feed_next_step
    g = torch.Generator().manual_seed(64)
    cfg = SMALL.with_launch("gemv", "dense", BN=4, BK=32)
    x = torch.randn(2, 64, generator=g).to(DEV)
    w = torch.randn(203, 64, generator=g).to(DEV)
    w[150] = w[37]                        # token 0's best row copied further on: the first one wins
    w[38] = w[37]                         # and inside one program
    x[0] = w[37] / w[37].norm() * 3
    neg = torch.zeros_like(w)
    neg[:100] = -w[:100].abs() - 0.1      # with x >= 0: values < 0 up to row 99, then exact zeros
    keys = empty_keys(2, DEV)
    tokens = torch.tensor([[5], [6]], device=DEV)
    positions = torch.tensor([[10], [20]], device=DEV)
    picks = torch.full((2, 2), -1, dtype=torch.long, device=DEV)
    for row, (xs, weight, want_pos) in enumerate(((x, w, [11, 21]), (x.abs(), neg, [12, 22]))):
        logits = kernels.linear(xs, weight, cfg=cfg, pick_keys=keys)
        feed_next_step(keys, tokens, positions, picks)
        ids = picks[row]                   # position 10 (even): row 0; then 11: row 1
        want = logits.argmax(dim=-1)
        assert ids.tolist() == want.tolist() and tokens.view(-1).tolist() == want.tolist()
        assert positions.view(-1).tolist() == want_pos and keys.tolist() == [EMPTY_KEY] * 2
        if weight is w:
            assert ids.tolist()[0] == 37
    assert ids.tolist() == [100, 100] and logits[0, 100] == 0     # the zero rows tie: the first one
    assert picks[0].tolist() != picks[1].tolist()                # the first step's row is kept


def test_engine_fused_qkv_and_gemv_decode_match_default_path(ckpt):
    """The fused decode path's one [q; k; v] GEMM (parameters become views into it, values
    unchanged) and the Triton GEMV for the projections give the same logits as the torch path."""
    ref = Engine.load(ckpt, device=DEV, dtype="float32", max_seq_len=32)
    fused = Engine.load(ckpt, device=DEV, dtype="float32", max_seq_len=32, decode=small(experts_impl="triton", gemv_max_tokens=1))
    attn, attn_ref = fused.model.layers[0].self_attn, ref.model.layers[0].self_attn
    assert attn.qkv_weight is not None and attn.decode.gemv_tokens == 1
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    assert attn.v_proj.weight.data_ptr() > attn.k_proj.weight.data_ptr() > attn.q_proj.weight.data_ptr()
    for name in ("q_proj", "k_proj", "v_proj"):
        assert torch.equal(getattr(attn, name).weight, getattr(attn_ref, name).weight)
    prompt = list(range(3, 12))
    a = ref.generate([prompt], 5, ignore_eos=True)[0].token_ids
    b = fused.generate([prompt], 5, ignore_eos=True)[0].token_ids
    assert a == b
    # One decode step's logits, both paths, same cache contents.
    tokens, pos = torch.tensor([[b[-1]]], device=DEV), torch.tensor([[len(prompt) + 4]], device=DEV)
    la = ref._decode(tokens, pos, len(prompt) + 5)[0].float().cpu()
    lb = fused._decode(tokens, pos, len(prompt) + 5)[0].float().cpu()
    torch.testing.assert_close(lb, la, atol=2e-3, rtol=2e-3)


def test_engine_rope_in_attention_decodes_exactly_like_qk_rope_cache(ckpt, monkeypatch):
    """DecodeConfig.rope_in_attention (q/k norm, RoPE and the KV write inside the attention launch
    for one-token steps) decodes the same tokens and the same step logits as the two launches:
    bit for bit in Triton's interpreter; compiled for CUDA, the two kernels contract the RoPE's
    multiply-adds differently, so there the logits agree to rounding."""
    prompt = list(range(3, 12))
    engines = {on: Engine.load(ckpt, device=DEV, dtype="float32", max_seq_len=32,
                               decode=small(experts_impl="triton", rope_in_attention=on)) for on in (False, True)}
    toks = {on: e.generate([prompt], 5, ignore_eos=True)[0].token_ids for on, e in engines.items()}
    assert toks[True] == toks[False]
    tokens, pos = torch.tensor([[toks[True][-1]]], device=DEV), torch.tensor([[len(prompt) + 4]], device=DEV)
    calls = []
    real = kernels.qk_rope_cache
    monkeypatch.setattr(kernels, "qk_rope_cache", lambda *a, **k: calls.append(1) or real(*a, **k))
    la = engines[False]._decode(tokens, pos, len(prompt) + 5)[0].float().cpu()
    n_off = len(calls)
    lb = engines[True]._decode(tokens, pos, len(prompt) + 5)[0].float().cpu()
    # the option's step runs no qk_rope_cache launch; the default's one per layer
    assert n_off == len(engines[False].model.layers) and len(calls) == n_off
    if DEV == "cuda":
        torch.testing.assert_close(lb, la, atol=1e-4, rtol=1e-4)
    else:
        assert torch.equal(la, lb)


@pytest.mark.parametrize("steps", [1, 4])
def test_engine_early_weights_decode_exactly_like_loads_after_the_wait(ckpt, steps):
    """DecodeConfig.early_weights (the router's weight rows, the GEMVs' and down's first
    `early_steps` K steps, the attention's first block of old cache slots, loaded before the PDL
    wait) gives the same tokens and bitwise-equal step logits: the loads move, the sums do not.
    gemv_max_tokens=1 and BK 32 (down: 16): the attention projections run the Triton GEMV here too,
    and both kernels have more K steps than load early.
    On CUDA the early engine also lets every kernel of EARLY_LAUNCH_KERNELS launch its successor
    before its wait (early_launch): the launches overlap more, the numbers stay the same."""
    from moebench.engine.decode_config import EARLY_LAUNCH_KERNELS, EARLY_WEIGHT_KERNELS
    prompt = list(range(3, 12))
    cuda = DEV == "cuda"
    engines = {on: Engine.load(ckpt, device=DEV, dtype="float32", max_seq_len=32,
                               decode=small(experts_impl="triton", gemv_max_tokens=1,
                                            early_weights=EARLY_WEIGHT_KERNELS if on else (),
                                            early_steps=steps if on else 1,
                                            early_launch=EARLY_LAUNCH_KERNELS if on and cuda else (),
                                            ).with_launch("gemv", "dense", BK=32).with_launch("down", "dense", BK=16))
               for on in (False, True)}
    assert engines[True].decode.early_weights == ("router", "gemv", "down", "down_packed", "attention_kv")
    toks = {on: e.generate([prompt], 5, ignore_eos=True)[0].token_ids for on, e in engines.items()}
    assert toks[True] == toks[False]
    tokens, pos = torch.tensor([[toks[True][-1]]], device=DEV), torch.tensor([[len(prompt) + 4]], device=DEV)
    la, lb = (engines[on]._decode(tokens, pos, len(prompt) + 5)[0].float().cpu() for on in (False, True))
    assert torch.equal(la, lb)


# ---- l2_prefetch: extra programs that ask L2 for a dense weight ------------------------------------

def test_l2_prefetch_sites_and_programs_are_checked():
    """l2_prefetch names sites of L2_PREFETCH_SITES (kept in that order), l2_prefetch_programs is 1
    to 1024; prefetch_launch adds the programs only for a listed site with a weight given, and the
    prefetch instruction only on CUDA (never in the interpreter)."""
    from moebench.engine.decode_config import L2_PREFETCH_SITES
    from moebench.engine.kernels.runtime import prefetch_launch
    with pytest.raises(DecodeConfigError, match="l2_prefetch"):
        DecodeConfig(l2_prefetch=("lm_head",))
    for bad in (0, 1025):
        with pytest.raises(DecodeConfigError, match="l2_prefetch_programs"):
            DecodeConfig(l2_prefetch_programs=bad)
    cfg = DecodeConfig(l2_prefetch=["next_qkv", "o_proj"], l2_prefetch_programs=8)
    assert cfg.l2_prefetch == L2_PREFETCH_SITES == ("o_proj", "next_qkv")
    assert DecodeConfig().l2_prefetch == ()                  # off until an H200 A/B measures it
    w = torch.zeros(10, 7, dtype=torch.bfloat16, device=DEV)
    got = prefetch_launch(w, cfg, "o_proj")
    assert got["pf_ptr"] is w and got["pf_bytes"] == 140 and got["PF_PARTS"] == 8
    assert got["PF_ASM"] == (DEV == "cuda")
    assert prefetch_launch(None, cfg, "o_proj") == {} and prefetch_launch(w, DecodeConfig(), "o_proj") == {}
    assert prefetch_launch(w, replace(cfg, l2_prefetch=("o_proj",)), "next_qkv") == {}
    with pytest.raises(kernels.KernelError, match="contiguous"):
        prefetch_launch(w.t(), cfg, "o_proj")


def spy_grids(monkeypatch, module, name: str, keys=("PF_PARTS", "PF_ASM")) -> list:
    """Records each launch of module.<name> as (grid, *its kwargs at keys) and runs it."""
    launched = []
    real = getattr(module, name)

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                launched.append((tuple(grid), *(kwargs.get(k, 0 if k == "PF_PARTS" else None) for k in keys)))
                return real[grid](*args, **kwargs)
            return run
    monkeypatch.setattr(module, name, Spy())
    return launched


@pytest.mark.parametrize("parts", [1, 3])
def test_qk_rope_cache_with_prefetch_programs_is_bitwise_the_same(parts, monkeypatch):
    """l2_prefetch "o_proj": the launch has `parts` more programs on its heads axis, which write
    nothing: the rotated queries and both caches are bitwise those of the launch without them (for
    one token and for 2 x 3 tokens); a weight of fewer lines than programs is covered too."""
    from moebench.engine.kernels import rope_kv
    from moebench.engine.model import rope_tables
    g = torch.Generator().manual_seed(41)
    NH, NKV, D, S = 4, 2, 16, 10
    qw, kw = (torch.rand(D, generator=g) + 0.5).to(DEV), (torch.rand(D, generator=g) + 0.5).to(DEV)
    cos_t, sin_t = rope_tables(D, 10000.0, S, DEV)
    on = replace(SMALL, l2_prefetch=("o_proj",), l2_prefetch_programs=parts)
    launched = spy_grids(monkeypatch, rope_kv, "qk_rope_cache_kernel")
    for B, T, o_proj in ((1, 1, torch.randn(64, NH * D, generator=g)), (2, 3, torch.randn(3, 5))):
        q = torch.randn(B, T, NH, D, generator=g).to(DEV)
        k, v = (torch.randn(B, T, NKV, D, generator=g).to(DEV) for _ in range(2))
        positions = torch.arange(T, device=DEV).expand(B, T) + 2
        outs = []
        for cfg in (SMALL, on):
            kc, vc = torch.zeros(B, NKV, S, D, device=DEV), torch.zeros(B, NKV, S, D, device=DEV)
            qo = kernels.qk_rope_cache(q, k, v, qw, kw, 1e-6, cos_t, sin_t, positions, kc, vc, cfg=cfg,
                                       prefetch=o_proj.to(DEV))
            outs.append((qo, kc, vc))
        assert launched[-2:] == [((B * T, NH + NKV), 0, None), ((B * T, NH + NKV + parts), parts, DEV == "cuda")]
        for a, b in zip(*outs):
            assert torch.equal(a, b)
        assert outs[0][1].any()


@pytest.mark.parametrize("poll", [True, False])
def test_add_rmsnorm_router_with_prefetch_programs_is_bitwise_the_same(poll, monkeypatch):
    """l2_prefetch "next_qkv": the router launch has l2_prefetch_programs more programs on its
    expert-block axis, which write nothing; the last expert block still takes the top-k (by the
    mailbox poll or the arrival counter): res, h, logits, ids, weights and h's int8 rows are bitwise
    those of the launch without them, for 1 and 3 tokens; counters and mailboxes end empty."""
    from moebench.engine.kernels import norm_router
    g = torch.Generator().manual_seed(43)
    base = replace(SMALL.with_launch("router", "dense", BN=8, BK=32), router_poll=poll)
    on = replace(base, l2_prefetch=("next_qkv",), l2_prefetch_programs=4)
    norm_w = (torch.rand(128, generator=g) + 0.5).to(DEV)
    router_w = (torch.randn(60, 128, generator=g) * 0.3).to(DEV)
    qkv = torch.randn(96, 128, generator=g).to(DEV)
    launched = spy_grids(monkeypatch, norm_router, "add_rmsnorm_router_kernel")
    for T in (1, 3):
        x = torch.randn(1, T, 128, generator=g).to(DEV)
        delta = torch.randn(1, T, 128, generator=g).to(DEV)
        want = kernels.add_rmsnorm_router(x, delta, norm_w, 1e-6, router_w, 4, True, quantize_h=True, cfg=base,
                                          prefetch=qkv)
        got = kernels.add_rmsnorm_router(x, delta, norm_w, 1e-6, router_w, 4, True, quantize_h=True, cfg=on,
                                         prefetch=qkv)
        assert launched[-2:] == [((T, 8), 0, None), ((T, 12), 4, DEV == "cuda")]
        for name, a, b in zip(("res", "h", "logits", "ids", "w", "xq"), got, want):
            assert torch.equal(a, b), (name, T)
    assert int(norm_router.shared_arrivals(x.device, on).abs().sum()) == 0
    assert bool((norm_router.shared_mailbox(x.device, on, 60) == norm_router.MAIL_EMPTY).all())


def test_engine_l2_prefetch_decodes_exactly_the_same(ckpt, monkeypatch):
    """Both l2_prefetch sites and experts_evict_first on: the same greedy tokens and bitwise-equal
    step logits; a decode step launches the o_proj prefetch in every layer and the next layer's
    [q; k; v] prefetch in every layer but the last, and its dense expert launches load evict_first."""
    from moebench.engine.kernels import moe, norm_router, rope_kv
    prompt = list(range(3, 12))
    engines = {on: Engine.load(ckpt, device=DEV, dtype="float32", max_seq_len=32,
                               decode=small(experts_impl="triton", l2_prefetch=("o_proj", "next_qkv") if on else (),
                                            experts_evict_first=on))
               for on in (False, True)}
    toks = {on: e.generate([prompt], 5, ignore_eos=True)[0].token_ids for on, e in engines.items()}
    assert toks[True] == toks[False]
    rope = spy_grids(monkeypatch, rope_kv, "qk_rope_cache_kernel")
    router = spy_grids(monkeypatch, norm_router, "add_rmsnorm_router_kernel")
    experts = [spy_grids(monkeypatch, moe, name, keys=("EVICT",)) for name in ("gate_up_kernel", "down_kernel")]
    tokens, pos = torch.tensor([[toks[True][-1]]], device=DEV), torch.tensor([[len(prompt) + 4]], device=DEV)
    la, lb = (engines[on]._decode(tokens, pos, len(prompt) + 5)[0].float().cpu() for on in (False, True))
    assert torch.equal(la, lb)
    layers = len(engines[True].model.layers)
    parts = engines[True].decode.l2_prefetch_programs
    assert [p for _, p, _ in rope] == [0] * layers + [parts] * layers
    assert [p for _, p, _ in router] == [0] * layers + [parts] * (layers - 1) + [0]
    for launched in experts:
        assert [e for _, e in launched] == [None] * layers + ["evict_first"] * layers


@pytest.mark.parametrize("a8", [False, True])
def test_engine_packed_evict_first_decodes_exactly_the_same(ckpt64, wiki_bytes, tmp_path, monkeypatch, a8):
    """packed_evict_first on an int8-hot / int4-cold artifact in HBM, with float or int8 activations:
    the same greedy tokens and bitwise-equal step logits as without, and every expert launch of a
    decode step loads its packed rows evict_first (none without)."""
    from moebench.engine.kernels import moe
    stats = calibrate(Engine.load(ckpt64, device="cpu", dtype="float32"), [wiki_bytes[:64]])
    art = pack(ckpt64, plan_hot_cold(stats, 0.5, hot="int8", cold="int4", cold_home="gpu"), tmp_path / "art")
    engines = {on: Engine.load(art, device=DEV, dtype="float32", max_seq_len=64,
                               decode=small(experts_impl="triton", int8_activations=a8, packed_evict_first=on))
               for on in (False, True)}
    prompt = wiki_bytes[300:310]
    toks = {on: e.generate([prompt], 5, ignore_eos=True)[0].token_ids for on, e in engines.items()}
    assert toks[True] == toks[False]
    experts = [spy_grids(monkeypatch, moe, name, keys=("EVICT",)) for name in ("gate_up_kernel", "down_kernel")]
    tokens, pos = torch.tensor([[toks[True][-1]]], device=DEV), torch.tensor([[len(prompt) + 4]], device=DEV)
    la, lb = (engines[on]._decode(tokens, pos, len(prompt) + 5)[0].float().cpu() for on in (False, True))
    assert torch.equal(la, lb)
    launches = 2 * len(engines[True].model.layers)         # an int8 group and an int4 group per layer
    for launched in experts:
        assert [e for _, e in launched] == [None] * launches + ["evict_first"] * launches


def test_early_steps_and_early_launch_are_checked_and_capped():
    """early_steps outside 1..4 and early_launch names outside EARLY_LAUNCH_KERNELS are refused with
    the setting named; the steps a kernel loads early never exceed its K steps, and are 0 for a
    kernel early_weights does not list."""
    from moebench.engine.decode_config import DecodeConfigError
    from moebench.engine.kernels.runtime import early_steps
    with pytest.raises(DecodeConfigError, match="early_steps"):
        DecodeConfig(early_steps=5)
    with pytest.raises(DecodeConfigError, match="early_launch"):
        DecodeConfig(early_launch=("gate_up",))
    cfg = DecodeConfig(early_weights=("gemv",), early_steps=4, early_launch=("router", "norm"))
    assert cfg.early_launch == ("norm", "router")          # EARLY_LAUNCH_KERNELS' order
    assert early_steps("gemv", 2048, 1024, cfg) == 2 and early_steps("gemv", 4096, 1024, cfg) == 4
    assert early_steps("down", 768, 256, cfg) == 0


def test_fused_moe_early_down_weights_are_exact_with_two_groups():
    """down's early first tile (group A dense) with a second group in the launch, and with pairs in
    no group (zeroed): the same part rows, bit for bit."""
    g = torch.Generator().manual_seed(21)
    x = torch.randn(3, H, generator=g).to(DEV)
    ids, w = routing(3, g)
    mats = [torch.randn(E, *s, generator=g).to(DEV) * 0.1 for s in ((I, H), (I, H), (H, I))]
    groups = []
    for members in (list(range(0, E, 2)), list(range(1, E, 2))):
        slot_of = torch.full((E,), -1, dtype=torch.int32)
        slot_of[members] = torch.arange(len(members), dtype=torch.int32)
        groups.append(kernels.ExpertGroup(*(kernels.PackedMatrix.dense(m[members]) for m in mats),
                                          slot_of.to(DEV), f"dense {members[0]}"))
    early = small(early_weights=("down",))
    for gs in (groups, groups[:1]):
        want = fused_moe(x, ids.to(DEV), w.to(DEV), gs, reduce=False)
        got = fused_moe(x, ids.to(DEV), w.to(DEV), gs, cfg=early, reduce=False)
        assert torch.equal(got, want)
    # the one-group call served the even experts and zeroed the other pairs' rows
    odd = (ids.flatten() % 2 == 1).to(DEV)
    assert odd.any() and torch.all(got[odd] == 0) and torch.all(got[~odd].abs().sum(1) > 0)


@pytest.mark.parametrize("fmt, steps, a8", [("int8", 1, False), ("int8", 4, True), ("int4", 2, True),
                                            ("int4_asym", 4, False), ("ternary2", 4, True)])
def test_fused_moe_early_packed_down_words_are_exact(fmt, steps, a8, monkeypatch):
    """early_weights "down_packed": down's first K steps of packed words (float x, or int8 x where
    the format has it) loaded before the wait give the same part rows, bit for bit, with a second
    group of another format in the call and pairs in no group of the first launch. BK 16 bytes
    (int4: 32, a whole scale group; int8 x: a block's bytes at least): down's rows take 4 to 16
    steps, all early or more than load early. The launch got EARLY for the packed group's down
    only; "down" alone (bf16 rows) leaves packed groups without it."""
    from moebench.engine.kernels import moe
    g = torch.Generator().manual_seed(31)
    Hq, Iq = 64, 256
    fmts = [fmt, "ternary", fmt, fmt, "ternary", fmt]
    groups, _ = format_groups(fmts, Hq, Iq, g)
    x = torch.randn(2, Hq, generator=g).to(DEV)
    ids, w = routing(2, g)
    bk = 32 if fmt.startswith("int4") else 16
    base = small(experts_impl="triton", int8_activations=a8).with_launch("down", fmt, BK=bk)
    if a8:
        base = base.with_launch("down", fmt, a8=True, BK=bk)
    launched = spy_grids(monkeypatch, moe, "down_kernel", keys=("EARLY", "FMT_A"))
    want = fused_moe(x, ids.to(DEV), w.to(DEV), groups, cfg=replace(base, early_weights=("down",)), reduce=False)
    got = fused_moe(x, ids.to(DEV), w.to(DEV), groups, reduce=False,
                    cfg=replace(base, early_weights=("down", "down_packed"), early_steps=steps))
    assert torch.equal(got, want)
    assert torch.all(got.abs().sum(1) > 0)
    packed = int(Format.of(fmt))
    assert [e for _, e, f in launched if f == packed] == [None, steps]
    assert [e for _, e, f in launched if f != packed] == [None, None]       # base-3 ternary: no early words


# ---- fused_experts: gate_up and down in one launch -------------------------------------------------

@pytest.mark.parametrize("fmt, a8", [("dense", False), ("int8", False), ("int8", True), ("int4", False),
                                     ("int4", True), ("ternary2", True), ("ternary", False)])
@pytest.mark.parametrize("T", [1, 3])
def test_expert_ffn_one_launch_is_bitwise_gate_up_then_down(fmt, a8, T, monkeypatch):
    """DecodeConfig.fused_experts: a call whose experts are one group runs expert_ffn_kernel alone (no
    gate_up or down launch) and gives the two launches' part rows bit for bit, with down's early
    words and the group's pick counters (one per pair); its ready counters are back to 0 after the
    call, so the next call starts clean. Several row blocks a pair (gate_up's last one partly masked
    with float x) and more K steps in down than load early."""
    from moebench.engine.kernels import moe
    g = torch.Generator().manual_seed(57)
    Hq, Iq = 128, 192
    if fmt == "dense":
        mats = [kernels.PackedMatrix.dense(torch.randn(E, *s, generator=g).to(DEV) * 0.1)
                for s in ((Iq, Hq), (Iq, Hq), (Hq, Iq))]
        groups = [kernels.ExpertGroup(*mats)]
    else:
        groups, _ = format_groups([fmt] * E, Hq, Iq, g)
    x = torch.randn(T, Hq, generator=g).to(DEV)
    ids, w = routing(T, g)
    base = small(experts_impl="triton", int8_activations=a8, early_weights=("down", "down_packed"))
    base = base.with_launch("gate_up", fmt, BN=128, BK=64).with_launch("down", fmt, BN=32, BK=64)
    if a8:
        base = base.with_launch("gate_up", fmt, a8=True, BN=64, BK=64).with_launch("down", fmt, a8=True, BN=32, BK=64)
    launched = {name: spy_grids(monkeypatch, moe, name, keys=()) for name in
                ("gate_up_kernel", "down_kernel", "expert_ffn_kernel")}
    parts, picks = {}, {}
    for one in (False, True):
        groups[0].picks = torch.zeros(E, dtype=torch.int32, device=DEV)
        before = [len(v) for v in launched.values()]
        parts[one] = fused_moe(x, ids.to(DEV), w.to(DEV), groups, cfg=replace(base, fused_experts=one), reduce=False)
        picks[one] = groups[0].picks.cpu()
        made = [len(v) - n for v, n in zip(launched.values(), before)]
        assert made == ([0, 0, 1] if one else [1, 1, 0])
    assert torch.equal(parts[True], parts[False])
    assert torch.all(parts[True].abs().sum(1) > 0)
    assert torch.equal(picks[True], picks[False]) and int(picks[True].sum()) == T * K
    assert not moe._ready_counters(torch.device(DEV), T * K).any()


def test_expert_ffn_is_not_used_beside_other_groups(monkeypatch):
    """Two groups (a hot/cold layer) keep the launch pairs: expert_ffn_kernel serves one group that
    covers every pair, and the poll is only sound there."""
    from moebench.engine.kernels import moe
    g = torch.Generator().manual_seed(58)
    groups, _ = format_groups(["int8", "int4", "int8", "int4", "int8", "int8"], 64, 128, g)
    x = torch.randn(2, 64, generator=g).to(DEV)
    ids, w = routing(2, g)
    fused = spy_grids(monkeypatch, moe, "expert_ffn_kernel", keys=())
    pairs = spy_grids(monkeypatch, moe, "gate_up_kernel", keys=())
    cfg = small(experts_impl="triton")
    want = fused_moe(x, ids.to(DEV), w.to(DEV), groups, cfg=cfg, reduce=False)
    got = fused_moe(x, ids.to(DEV), w.to(DEV), groups, cfg=replace(cfg, fused_experts=True), reduce=False)
    assert torch.equal(got, want) and not fused and len(pairs) == 4


@pytest.mark.parametrize("fmt", ["dense", "int4"])
def test_engine_fused_experts_decode_exactly_the_same(ckpt64, wiki_bytes, tmp_path, fmt, monkeypatch):
    """The engine with fused_experts decodes the same tokens with bitwise-equal step logits, on the
    bf16-shaped checkpoint (dense experts) and on an all-int4 artifact of it (on CUDA in graphs)."""
    src = ckpt64
    if fmt != "dense":
        stats = calibrate(Engine.load(ckpt64, device="cpu", dtype="float32"), [wiki_bytes[:64]])
        src = pack(ckpt64, plan_hot_cold(stats, 1.0, hot=fmt), tmp_path / fmt)
    prompt = list(range(3, 12))
    engines = {on: Engine.load(src, device=DEV, dtype="float32", max_seq_len=32,
                               decode=small(experts_impl="triton", fused_experts=on)) for on in (False, True)}
    if fmt != "dense":
        assert all(len(b.experts._fused_groups) == 1 for b in engines[True].model.moe_blocks())
    from moebench.engine.kernels import moe
    launched = spy_grids(monkeypatch, moe, "expert_ffn_kernel", keys=())
    toks = {}
    for on, e in engines.items():
        before = len(launched)
        toks[on] = e.generate([prompt], 5, ignore_eos=True)[0].token_ids
        assert (len(launched) > before) == on
    assert toks[True] == toks[False]
    tokens, pos = torch.tensor([[toks[True][-1]]], device=DEV), torch.tensor([[len(prompt) + 4]], device=DEV)
    la, lb = (engines[on]._decode(tokens, pos, len(prompt) + 5)[0].float().cpu() for on in (False, True))
    assert torch.equal(la, lb)


# ---- the MoE sum deferred into the next add_rmsnorm -----------------------------------------------

def test_add_rmsnorm_sums_moe_partials_exactly_like_moe_sum():
    g = torch.Generator().manual_seed(13)
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    x = torch.randn(3, H, generator=g).to(DEV)
    ids, w = routing(3, g)
    mats = [torch.randn(E, *s, generator=g).to(DEV) * 0.1 for s in ((I, H), (I, H), (H, I))]
    group = kernels.dense_group(*mats)
    part = fused_moe(x, ids.to(DEV), w.to(DEV), [group], reduce=False)
    assert part.shape == (3 * K, H) and part.dtype == torch.float32
    summed = fused_moe(x, ids.to(DEV), w.to(DEV), [group])
    resid = torch.randn(3, H, generator=g).to(DEV, dt)
    weight = (torch.rand(H, generator=g) + 0.5).to(DEV, dt)
    want = kernels.add_rmsnorm(resid, summed.to(dt), weight, 1e-6)
    got = kernels.add_rmsnorm(resid, part, weight, 1e-6, delta_rows=K)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(kernels.KernelError, match="row"):
        kernels.add_rmsnorm(resid, part[:-1], weight, 1e-6, delta_rows=K)


def test_engine_decode_with_deferred_moe_sum_is_bitwise_the_same(ckpt):
    """defer_moe_sum moves moe_sum into the next add_rmsnorm: a decode step gives the same bits."""
    eng = Engine.load(ckpt, device=DEV, dtype="float32", max_seq_len=32, decode=small(experts_impl="triton"))
    assert all(b.experts.partials_ok(1) for b in eng.model.moe_blocks())
    tokens, pos = torch.tensor([[7]], device=DEV), torch.tensor([[4]], device=DEV)
    eng.generate([list(range(3, 7))], 1, ignore_eos=True)      # fill slots 0..3
    outs = {}
    for defer in (False, True):
        eng.reconfigure(replace(eng.decode, defer_moe_sum=defer))
        outs[defer] = eng._decode(tokens, pos, 5)[0].cpu()
    assert torch.equal(outs[True], outs[False])


# ---- host-tier prefetch into an HBM stage ------------------------------------------------------------

def test_prefetch_stages_predicted_host_experts_and_keeps_results_exact():
    """enable_prefetch + prefetch: predicted host experts are copied into the stage and mapped there,
    the host group stops serving them, and the layer's output is the same whether the guess was right,
    partly right or absent (a wrong guess costs PCIe time, never correctness)."""
    g = torch.Generator().manual_seed(14)
    fmts = ["int8", "int8", "ternary", "ternary", "ternary", "int8"]
    experts = [QuantizedExpert(*(quantize(torch.randn(*s, generator=g) * 0.1, f) for s in ((I, H), (I, H), (H, I))))
               for f in fmts]
    homes = ["gpu", "gpu", "host", "host", "host", "gpu"]
    m = TieredExperts(experts, homes, DEV, torch.float32)
    x = torch.randn(1, H, generator=g).to(DEV)
    ids = torch.tensor([[3, 0]], device=DEV)
    w = torch.rand(1, K, generator=g).to(DEV)
    dequant = tuple(torch.stack([getattr(e, mat).dequantize() for e in experts]) for mat in ("gate", "up", "down"))
    want = reference(x.cpu(), ids.cpu(), w.cpu(), dequant)
    m.configure(small(experts_impl="triton", prefetch_host=True), K)
    assert m.prefetching
    assert sorted(gr.label for gr in m._fused_groups) == ["int8@gpu", "ternary@host", "ternary@stage"]
    assert torch.allclose(m(x, ids, w).cpu(), want, atol=1e-5, rtol=1e-4)     # nothing staged yet

    # A router whose top-2 for h is experts 3 and 1 (3 is on host and gets staged; 1 is on the GPU).
    gate = torch.zeros(E, H)
    gate[3, 0], gate[1, 0] = 5.0, 4.0
    h = torch.zeros(1, H)
    h[0, 0] = 1.0
    m.prefetch(h.to(DEV), gate.to(DEV), K, True)
    static, dynamic, stage = m._prefetch[0]
    assert stage.slot_of.tolist() == [-1, -1, -1, 0, -1, -1]
    assert dynamic.slot_of.tolist() == [-1, -1, static[2].item(), -1, static[4].item(), -1]
    assert torch.equal(stage.gate.data[0].cpu(), experts[3].gate.parts["q"])
    assert torch.equal(stage.down.scale[0].cpu(), experts[3].down.parts["scale"])
    for route in ([[3, 0]], [[2, 3]], [[4, 5]]):                    # hit, hit + miss, misses only
        r = torch.tensor(route, device=DEV)
        got = m(x, r, w).cpu()
        assert torch.allclose(got, reference(x.cpu(), r.cpu(), w.cpu(), dequant), atol=1e-5, rtol=1e-4), route


def test_route_tail_skip_on_the_fused_path_matches_the_per_expert_path():
    """skip_tail_from on the fused path: a host pick ranked >= skip_tail_from whose expert is not in
    GPU memory contributes nothing, the other weights unchanged. Without prefetch nothing is in GPU
    memory on the fused path, which is the per-expert path with an empty LRU cache (cache_slots=0):
    the same outputs, the same skip counts; with prefetch, a staged expert is kept (torch reference).
    Two host formats (two cold maps), one sharing its format with the GPU group."""
    g = torch.Generator().manual_seed(21)
    k = 3
    fmts = ["int8", "int8", "ternary", "int8", "ternary", "int8"]
    homes = ["gpu", "gpu", "host", "host", "host", "host"]
    experts = [QuantizedExpert(*(quantize(torch.randn(*s, generator=g) * 0.1, f) for s in ((I, H), (I, H), (H, I))))
               for f in fmts]
    dequant = tuple(torch.stack([getattr(e, mat).dequantize() for e in experts]) for mat in ("gate", "up", "down"))
    x = torch.randn(3, H, generator=g)
    ids = torch.tensor([[0, 2, 3], [4, 1, 5], [3, 0, 2]])     # host experts at every rank
    w = torch.rand(3, k, generator=g)
    is_host = torch.tensor([h == "host" for h in homes])
    rank = torch.arange(k)[None, :]

    def want(skip_from: int, staged: frozenset = frozenset()) -> torch.Tensor:
        cold = is_host & ~torch.tensor([e in staged for e in range(E)])
        drop = cold[ids] & (rank >= skip_from)
        return reference(x, ids, w * ~drop, dequant), int(drop.sum())

    for skip_from in (1, 2):
        fused = TieredExperts(experts, homes, DEV, torch.float32, skip_tail_from=skip_from)
        fused.configure(small(experts_impl="triton"), k)
        per_expert = TieredExperts(experts, homes, DEV, torch.float32, cache_slots=0, skip_tail_from=skip_from)
        assert fused.partials_ok(3) and fused.sync_free_tokens() == small().fused_max_tokens
        assert len(fused._cold_maps) == 2
        ref, dropped = want(skip_from)
        a = fused(x.to(DEV), ids.to(DEV), w.to(DEV)).cpu()
        b = per_expert(x.to(DEV), ids.to(DEV), w.to(DEV)).cpu()
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(a, ref, atol=1e-5, rtol=1e-4)
        assert not torch.allclose(a, reference(x, ids, w, dequant), atol=1e-3)        # something was dropped
        # forward_partials (the deferred MoE sum): dropped rows are zero
        part = fused.forward_partials(x.to(DEV), ids.to(DEV), w.to(DEV)).cpu()
        drop = (is_host[ids] & (rank >= skip_from)).reshape(-1)
        assert part.shape == (3 * k, H) and torch.equal(part[drop], torch.zeros(int(drop.sum()), H))
        torch.testing.assert_close(part.view(3, k, H).sum(1), ref, atol=1e-5, rtol=1e-4)
        tf, tp = fused.telemetry(), per_expert.telemetry()
        assert tp["route_tail_skips"] == dropped and tf["route_tail_skips"] == 2 * dropped   # two fused calls
        assert tf["routed"] == 2 * ids.numel() and tf["picks_host"] == 2 * int(is_host[ids].sum())
        assert tf["host_direct"] + tf["route_tail_skips"] == tf["picks_host"] and tf["prefetch_hits"] == 0

    # with prefetch: expert 3 staged (the guess's top-3 is 3, 0, 1), so it stays; 2 and 5 still drop
    fused = TieredExperts(experts, homes, DEV, torch.float32, skip_tail_from=1)
    fused.configure(small(experts_impl="triton", prefetch_host=True), k)
    gate = torch.zeros(E, H)
    gate[3, 0], gate[0, 0], gate[1, 0] = 5.0, 4.0, 3.0
    h = torch.zeros(1, H)
    h[0, 0] = 1.0
    fused.prefetch(h.to(DEV), gate.to(DEV), k, True)
    assert fused._cold_maps[:, 3].tolist() == [-1, -1]          # staged: in neither group's host map
    ref, dropped = want(1, frozenset({3}))
    torch.testing.assert_close(fused(x.to(DEV), ids.to(DEV), w.to(DEV)).cpu(), ref, atol=1e-5, rtol=1e-4)
    tel = fused.telemetry()
    # dropped: 2 (token 0), 5 (token 1), 2 (token 2); expert 3, staged, served at rank 2 and rank 0
    assert tel["route_tail_skips"] == dropped == 3 and tel["prefetch_hits"] == 2
    assert tel["host_direct"] + tel["prefetch_hits"] + tel["route_tail_skips"] == tel["picks_host"]


def test_engine_decode_with_prefetch_gives_the_same_tokens_and_logits(ckpt, wiki_bytes, tmp_path):
    """A tiered artifact with a quarter of each layer's experts on the GPU and the rest on the host
    tier, every layer prefetching its predicted host experts: the same greedy tokens and top
    log-probs as without, and the prefetch did stage experts."""
    stats = calibrate(Engine.load(ckpt, device="cpu", dtype="float32"), [wiki_bytes[:64], wiki_bytes[64:128]])
    art = pack(ckpt, plan_hot_cold(stats, 0.25, hot="int8", cold="ternary", cold_home="host"), tmp_path / "art")
    plain = Engine.load(art, device=DEV, dtype="float32", max_seq_len=64, decode=small(experts_impl="triton"))
    pre = Engine.load(art, device=DEV, dtype="float32", max_seq_len=64, decode=small(experts_impl="triton", prefetch_host=True))
    with pytest.raises(EngineError, match="prefetch_host needs experts_impl 'triton'"):
        Engine.load(art, device=DEV, dtype="float32", max_seq_len=64, prefetch_host=True)
    prompt = wiki_bytes[300:320]          # 20 tokens: a chunked prefill, then one-token decode steps
    a = plain.generate([prompt], 5, ignore_eos=True, top_logprobs=3)[0]
    b = pre.generate([prompt], 5, ignore_eos=True, top_logprobs=3)[0]
    assert a.token_ids == b.token_ids and a.top_logprobs == b.top_logprobs
    staged = [int((blk.experts._prefetch[0][2].slot_of >= 0).sum()) for blk in pre.model.moe_blocks()[1:]]
    assert all(0 < n <= pre.model.moe_blocks()[0].top_k for n in staged), staged
    first = pre.model.moe_blocks()[0].experts._prefetch[0][2].slot_of    # layer 0 has no earlier layer
    assert int((first >= 0).sum()) == 0
    # the guess from each layer's attention input (one sublayer earlier): other experts may be staged,
    # the results stay the same
    with pytest.raises(EngineError, match="prefetch_early needs prefetch_host"):
        Engine.load(art, device=DEV, dtype="float32", max_seq_len=64, experts_impl="triton", prefetch_early=True)
    early = Engine.load(art, device=DEV, dtype="float32", max_seq_len=64, decode=small(experts_impl="triton", prefetch_host=True,
                                                                                   prefetch_early=True))
    assert early.decode.prefetch_early and not pre.decode.prefetch_early
    c = early.generate([prompt], 5, ignore_eos=True, top_logprobs=3)[0]
    assert a.token_ids == c.token_ids and a.top_logprobs == c.top_logprobs
    staged = [int((blk.experts._prefetch[0][2].slot_of >= 0).sum()) for blk in early.model.moe_blocks()[1:]]
    assert all(0 < n <= early.model.moe_blocks()[0].top_k for n in staged), staged
    if DEV == "cuda":
        # captured in CUDA graphs: the copies on the host lane (or their own stream) join the capture
        for kw in ({}, {"prefetch_host": True}, {"prefetch_host": True, "prefetch_early": True}):
            g = Engine.load(art, device=DEV, dtype="float32", max_seq_len=64, cuda_graphs=True,
                            decode=small(experts_impl="triton", **kw))
            d = g.generate([prompt], 5, ignore_eos=True, top_logprobs=3)[0]
            assert g._graphs and a.token_ids == d.token_ids, kw
            assert all(abs(x - y) < 1e-4 for sa, sd in zip(a.top_logprobs, d.top_logprobs)
                       for (_, x), (_, y) in zip(sa, sd)), kw


@pytest.fixture(scope="module")
def ckpt64(tmp_path_factory):
    """Like ckpt, with an expert width of 64: whole 64-column blocks, so int8 activations apply."""
    return tiny_qwen3moe(tmp_path_factory, "tiny_qwen3moe_w64", 64, seed=1)


def test_engine_int8_activations_run_the_int8_and_int4_groups_with_int8_activations(ckpt64, wiki_bytes, tmp_path,
                                                                                   monkeypatch):
    """Engine(int8_activations=True) on an int8-hot / int4-cold artifact: both groups decode in
    INT8_ACTIVATIONS, the log-probs move (the rounding is there) but little, and the option needs the fused kernels."""
    stats = calibrate(Engine.load(ckpt64, device="cpu", dtype="float32"), [wiki_bytes[:64]])
    art = pack(ckpt64, plan_hot_cold(stats, 0.5, hot="int8", cold="int4", cold_home="gpu"), tmp_path / "art")
    plain = Engine.load(art, device=DEV, dtype="float32", max_seq_len=64, decode=small(experts_impl="triton"))
    a8 = Engine.load(art, device=DEV, dtype="float32", max_seq_len=64, decode=small(experts_impl="triton", int8_activations=True))
    with pytest.raises(EngineError, match="int8_activations needs experts_impl 'triton'"):
        Engine.load(art, device=DEV, dtype="float32", max_seq_len=64, int8_activations=True)
    for blk in a8.model.moe_blocks():
        assert blk.experts.wants_quantized_x() and not plain.model.moe_blocks()[0].experts.wants_quantized_x()
        groups = blk.experts._fused_groups
        assert sorted(g.label for g in groups) == ["int4@gpu", "int8@gpu"]
        assert all(kernels.group_mode(g, k, a8.decode) == 3 for g in groups for k in ("gate_up", "down"))
    assert all(kernels.group_mode(g, "gate_up", plain.decode) == plain.decode.mode_of(g.fmt) != 3
               for blk in plain.model.moe_blocks() for g in blk.experts._fused_groups)
    prompt = wiki_bytes[300:320]
    a = plain.generate([prompt], 4, ignore_eos=True, top_logprobs=3)[0]
    # the decode steps take x's int8 rows from add_rmsnorm_router: no quantize_rows launch of their own
    monkeypatch.setattr(kernels.moe, "quantize_rows_kernel", None)
    b = a8.generate([prompt], 4, ignore_eos=True, top_logprobs=3)[0]
    # the 20-token prefill takes the per-expert path (exact activations) in both; the first decode
    # step (one token, the fused kernels) is where the rounding shows
    assert a.top_logprobs[0] == b.top_logprobs[0] and a.token_ids[0] == b.token_ids[0]
    step_a, step_b = dict(a.top_logprobs[1]), dict(b.top_logprobs[1])
    diffs = [abs(step_a[t] - step_b[t]) for t in step_a if t in step_b]
    assert diffs and 0 < max(diffs) < 0.05, (step_a, step_b)     # 0.0115 seen on CPU


# ---- the post-attention add_rmsnorm fused with the router -------------------------------------------

@pytest.mark.parametrize("bk", [32, 2048])
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_add_rmsnorm_router_polling_a_mailbox_is_bitwise_the_arrival_counter(dt, bk, monkeypatch):
    """DecodeConfig.router_poll: each token's last program polls the logits' mailbox instead of an
    arrival counter choosing it: the same res, h, logits, ids and weights, bit for bit, for 1 and 3
    tokens and 60 experts (8 programs a token, the last one partly masked); the mailbox rows are
    empty again after each call (so the next call's poll waits for its own logits)."""
    from moebench.engine.kernels import norm_router
    g = torch.Generator().manual_seed(29)
    counter = replace(SMALL.with_launch("router", "dense", BN=8, BK=bk), router_poll=False)
    poll = replace(counter, router_poll=True)
    norm_w = (torch.rand(100, generator=g) + 0.5).to(DEV, dt)
    router_w = (torch.randn(60, 100, generator=g) * 0.3).to(DEV, dt)
    launched = []
    real = norm_router.add_rmsnorm_router_kernel

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                launched.append((kwargs["POLL"], kwargs.get("mail_ptr")))
                return real[grid](*args, **kwargs)
            return run
    monkeypatch.setattr(norm_router, "add_rmsnorm_router_kernel", Spy())
    for T in (1, 3, 1):
        x = torch.randn(1, T, 100, generator=g).to(DEV, dt)
        delta = torch.randn(1, T, 100, generator=g).to(DEV, dt)
        launched.clear()
        want = kernels.add_rmsnorm_router(x, delta, norm_w, 1e-6, router_w, 4, True, cfg=counter)
        got = kernels.add_rmsnorm_router(x, delta, norm_w, 1e-6, router_w, 4, True, cfg=poll)
        assert launched == [(False, None), (True, norm_router.shared_mailbox(x.device, poll, 60))]
        for name, a, b in zip(("res", "h", "logits", "ids", "w"), got, want):
            assert a.dtype == b.dtype and torch.equal(a, b), (name, T, (a.float() - b.float()).abs().max())
        mail = norm_router.shared_mailbox(x.device, poll, 60)
        assert mail.shape == (poll.router_max_tokens, 60) and bool((mail == norm_router.MAIL_EMPTY).all())
    assert int(norm_router.shared_arrivals(x.device, poll).abs().sum()) == 0


@needs_cuda
def test_add_rmsnorm_router_poll_is_the_counter_on_cuda_at_the_qwen_shape():
    """Compiled, with the programs really concurrent: the mailbox poll gives the arrival counter's
    bits at the Qwen3-30B-A3B router shape (2048 hidden, 128 experts, top 8) for every token count
    up to router_max_tokens, 20 times over."""
    poll = DecodeConfig()
    counter = replace(poll, router_poll=False)
    assert poll.router_poll
    g = torch.Generator(device="cuda").manual_seed(3)
    H, E = 2048, 128
    nw = torch.rand(H, generator=g, device="cuda").bfloat16() + 0.5
    rw = (torch.randn(E, H, generator=g, device="cuda") * 0.02).bfloat16()
    for rep in range(20):
        for T in range(1, poll.router_max_tokens + 1):
            x = torch.randn(1, T, H, generator=g, device="cuda").bfloat16()
            d = torch.randn(1, T, H, generator=g, device="cuda").bfloat16()
            got = kernels.add_rmsnorm_router(x, d, nw, 1e-6, rw, 8, True, cfg=poll)
            want = kernels.add_rmsnorm_router(x, d, nw, 1e-6, rw, 8, True, cfg=counter)
            for name, a, b in zip(("res", "h", "logits", "ids", "w"), got, want):
                assert torch.equal(a, b), (name, rep, T)


def test_add_rmsnorm_router_polls_only_with_fewer_tokens_than_sms(monkeypatch):
    """A polling program spins in its slot, so router_poll applies to calls of fewer tokens than the
    GPU has SMs; a call of as many tokens as SMs takes the arrival counter (the same results)."""
    from moebench.engine.kernels import norm_router
    g = torch.Generator().manual_seed(31)
    cfg = SMALL.with_launch("router", "dense", BN=8, BK=32)
    assert cfg.router_poll                                    # the default
    norm_w = (torch.rand(100, generator=g) + 0.5).to(DEV)
    router_w = (torch.randn(60, 100, generator=g) * 0.3).to(DEV)
    launched = []
    real = norm_router.add_rmsnorm_router_kernel

    class Spy:
        def __getitem__(self, grid):
            def run(*args, **kwargs):
                launched.append(kwargs["POLL"])
                return real[grid](*args, **kwargs)
            return run
    monkeypatch.setattr(norm_router, "add_rmsnorm_router_kernel", Spy())
    monkeypatch.setattr(norm_router, "sm_count", lambda device: 3)
    for T, polls in ((2, True), (3, False)):
        x = torch.randn(1, T, 100, generator=g).to(DEV)
        launched.clear()
        res, h, logits, ids, w = kernels.add_rmsnorm_router(x, None, norm_w, 1e-6, router_w, 4, True, cfg=cfg)
        assert launched == [polls], T
        want_ids, want_w = kernels.route_topk(logits, 4, True)
        assert torch.equal(ids, want_ids) and torch.equal(w, want_w), T


@pytest.mark.parametrize("bk", [32, 2048])      # 32: GEMV in column steps; 2048: one step over the row
@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_add_rmsnorm_router_is_bitwise_add_rmsnorm_then_router_topk(dt, renorm, bk):
    """One launch gives the bits of add_rmsnorm followed by router_topk: res, h, logits, ids,
    weights; 60 experts (not a multiple of the 8-expert block), H = 100 (not a power of two); the
    arrival counters end at zero (reset by each token's last program)."""
    g = torch.Generator().manual_seed(21)
    cfg = SMALL.with_launch("router", "dense", BN=8, BK=bk)
    norm_w = (torch.rand(100, generator=g) + 0.5).to(DEV, dt)
    router_w = (torch.randn(60, 100, generator=g) * 0.3).to(DEV, dt)
    for T in (1, 3):
        x = torch.randn(1, T, 100, generator=g).to(DEV, dt)      # [B, T, H] as in _fused_layers
        delta = torch.randn(1, T, 100, generator=g).to(DEV, dt)
        res, h = kernels.add_rmsnorm(x, delta, norm_w, 1e-6)
        want = (res, h, *kernels.router_topk(h.view(T, 100), router_w, 4, renorm, cfg=cfg))
        got = kernels.add_rmsnorm_router(x, delta, norm_w, 1e-6, router_w, 4, renorm, cfg=cfg)
        assert got[0].shape == x.shape and got[1].shape == x.shape and got[2].shape == (T, 60)
        for name, a, b in zip(("res", "h", "logits", "ids", "w"), got, want):
            assert a.dtype == b.dtype and torch.equal(a, b), (name, T, (a.float() - b.float()).abs().max())
    assert int(kernels.norm_router.shared_arrivals(x.device, cfg).abs().sum()) == 0
    with pytest.raises(kernels.KernelError, match="router weight shape"):
        kernels.add_rmsnorm_router(x, delta, norm_w, 1e-6, router_w[:, :50], 4, renorm)
    with pytest.raises(kernels.KernelError, match="norm weight shape"):
        kernels.add_rmsnorm_router(x, delta, norm_w[:50], 1e-6, router_w, 4, renorm)
    with pytest.raises(kernels.KernelError, match="tokens"):
        many = torch.zeros(cfg.router_max_tokens + 1, 100, device=DEV, dtype=dt)
        kernels.add_rmsnorm_router(many, many, norm_w, 1e-6, router_w, 4, renorm, cfg=cfg)


@pytest.mark.parametrize("H", [128, 192])       # 192: not a power of two (masked tail words)
def test_add_rmsnorm_router_quantizes_h_as_quantize_rows_does(H):
    """quantize_h: the sixth result is bitwise the int8 rows quantize_rows_kernel makes of h (what
    fused_moe would make itself), and the other five are unchanged; hidden sizes that are not whole
    64-column blocks are refused."""
    g = torch.Generator().manual_seed(23)
    norm_w = (torch.rand(H, generator=g) + 0.5).to(DEV)
    router_w = (torch.randn(16, H, generator=g) * 0.3).to(DEV)
    x = torch.randn(1, 2, H, generator=g).to(DEV)
    delta = torch.randn(1, 2, H, generator=g).to(DEV)
    plain = kernels.add_rmsnorm_router(x, delta, norm_w, 1e-6, router_w, 4, True)
    *five, xq = kernels.add_rmsnorm_router(x, delta, norm_w, 1e-6, router_w, 4, True, quantize_h=True)
    for a, b in zip(plain, five):
        assert torch.equal(a, b)
    h = five[1].view(2, H)
    want = torch.empty_like(xq)
    kernels.int8_activations.quantize_rows_kernel[(2,)](h, want, H, h.stride(0), want.stride(0),
                                                        W=kernels.runtime.next_pow2(H // 8), QB=GROUP)
    assert xq.shape == (2, kernels.quant_row_len(H, GROUP)) and torch.equal(xq, want)
    codes = kernels.quantize_activations(h.cpu())            # the natural words hold the same codes
    scale = xq[:, -H // GROUP:].cpu().view(torch.float32).repeat_interleave(GROUP, dim=1)
    nat = xq[:, :H // 4].cpu().contiguous().view(torch.int8).float()
    assert torch.allclose(nat * scale, codes, rtol=1e-6, atol=1e-7)
    with pytest.raises(kernels.KernelError, match="multiple of 64"):
        kernels.add_rmsnorm_router(x[..., :100], delta[..., :100], norm_w[:100], 1e-6, router_w[:, :100], 4, True,
                                   quantize_h=True)


@needs_cuda
def test_cuda_add_rmsnorm_router_is_bitwise_at_model_shapes():
    """The compiled kernel at a real router's shape (H 2048, 128 experts, top-8, bf16, shipped
    configs): bitwise add_rmsnorm + router_topk. The two reference kernels run with their own
    num_warps; a reduction laid out differently would show here as a last-bit difference."""
    g = torch.Generator().manual_seed(22)
    norm_w = (torch.rand(2048, generator=g) + 0.5).to("cuda", torch.bfloat16)
    router_w = (torch.randn(128, 2048, generator=g) * 0.05).to("cuda", torch.bfloat16)
    for T in (1, 4, 1, 16):
        for _ in range(8):
            x = torch.randn(T, 2048, generator=g).to("cuda", torch.bfloat16) * 3
            delta = torch.randn(T, 2048, generator=g).to("cuda", torch.bfloat16)
            res, h = kernels.add_rmsnorm(x, delta, norm_w, 1e-6)
            want = (res, h, *kernels.router_topk(h, router_w, 8, True))
            got = kernels.add_rmsnorm_router(x, delta, norm_w, 1e-6, router_w, 8, True)
            for name, a, b in zip(("res", "h", "logits", "ids", "w"), got, want):
                assert torch.equal(a, b), (name, T, (a.float() - b.float()).abs().max())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_decode_with_norm_router_fused_is_the_same(ckpt, wiki_bytes, dtype):
    """fused_norm_router on and off: the same greedy tokens, the same decode-step logits (bitwise),
    and an attached RouterTracer records the same routes and router logits; with it on, every MoE
    layer of a fused step did route through add_rmsnorm_router (and none with it off)."""
    from moebench.engine.model import RouterTracer
    eng = Engine.load(ckpt, device=DEV, dtype=dtype, max_seq_len=32, decode=small(experts_impl="triton"))
    n_layers = len(eng.model.moe_blocks())
    prompt = wiki_bytes[400:410]           # 10 tokens <= fused_max_tokens: the prefill is fused too
    calls = []
    real = kernels.add_rmsnorm_router

    def counting(*args, **kwargs):
        calls.append(args[0].numel() // args[0].shape[-1])
        return real(*args, **kwargs)

    runs = {}
    try:
        kernels.add_rmsnorm_router = counting
        for on in (False, True):
            eng.reconfigure(replace(eng.decode, fused_norm_router=on))
            calls.clear()
            tokens = eng.generate([prompt], 4, ignore_eos=True)[0].token_ids
            gen_calls = list(calls)
            tracer = RouterTracer(keep_logits=True)
            eng.model.set_tracer(tracer)
            try:
                step = eng._decode(torch.tensor([[tokens[-1]]], device=DEV),
                                   torch.tensor([[len(prompt) + 3]], device=DEV), len(prompt) + 4)[0].cpu()
            finally:
                eng.model.set_tracer(None)
            runs[on] = (tokens, step, tracer, gen_calls)
    finally:
        kernels.add_rmsnorm_router = real
    (tok_off, step_off, tr_off, calls_off), (tok_on, step_on, tr_on, calls_on) = runs[False], runs[True]
    assert calls_off == [] and calls_on == [10] * n_layers + [1] * n_layers * 3   # prefill, 3 decode steps
    assert tok_on == tok_off and len(tok_on) == 4
    assert torch.equal(step_on, step_off)
    assert [r[0] for r in tr_on.records] == [r[0] for r in tr_off.records] == list(range(n_layers))
    for (_, ids_a, w_a), (_, ids_b, w_b) in zip(tr_on.records, tr_off.records):
        assert ids_a.shape == (1, 2) and torch.equal(ids_a, ids_b) and torch.equal(w_a, w_b)
    assert len(tr_on.logits) == len(tr_off.logits) == n_layers
    for (la, a), (lb, b) in zip(tr_on.logits, tr_off.logits):
        assert la == lb and a.shape == (1, 8) and torch.equal(a, b)


@needs_cuda
@pytest.mark.parametrize("switch", ["pdl", "overlap_host"])
def test_cuda_pdl_and_overlap_switches_change_no_output(ckpt, wiki_bytes, tmp_path, switch):
    """DecodeConfig.pdl (programmatic dependent launch) and overlap_host (host and other-format groups
    on side streams) only move work in time: an engine with the switch off, beside one with it on in
    the same process, gives the same greedy tokens and top log-probs, graph-replayed, on a hot/cold
    artifact whose cold half is read from host memory."""
    stats = calibrate(Engine.load(ckpt, device="cpu", dtype="float32"), [wiki_bytes[:64], wiki_bytes[64:128]])
    art = pack(ckpt, plan_hot_cold(stats, 0.25, hot="int8", cold="ternary", cold_home="host"), tmp_path / "art")
    on = Engine.load(art, device=DEV, dtype="float32", max_seq_len=64, cuda_graphs=True,
                     decode=small(experts_impl="triton"))
    off = Engine.load(art, device=DEV, dtype="float32", max_seq_len=64, cuda_graphs=True,
                      decode=replace(small(experts_impl="triton"), **{switch: False}))
    assert getattr(on.decode, switch) and not getattr(off.decode, switch)
    prompt = wiki_bytes[300:320]
    a = on.generate([prompt], 6, ignore_eos=True, top_logprobs=3)[0]
    b = off.generate([prompt], 6, ignore_eos=True, top_logprobs=3)[0]
    assert on._graphs and off._graphs
    assert a.token_ids == b.token_ids
    assert all(abs(x - y) < 1e-5 for sa, sb in zip(a.top_logprobs, b.top_logprobs) for (_, x), (_, y) in zip(sa, sb))


if triton is not None:
    @triton.jit
    def _gate_up_rows_and_per_matrix_steps(x_ptr, h_ptr, ref_ptr, slot, g_ptr, gs_ptr, gm_ptr, u_ptr, us_ptr, um_ptr,
                                           KB, sge, sgr, sgse, sgsr, sue, sur, suse, susr, N, K,
                                           FMT: tl.constexpr, MODE: tl.constexpr, GS: tl.constexpr, BN: tl.constexpr,
                                           BK: tl.constexpr):
        """h of one row block by gate_up_rows (h_ptr) and by row_dots on gate, then up, per K step,
        scaled and combined as gate_up_rows does (ref_ptr)."""
        rows = tl.program_id(0) * BN + tl.arange(0, BN)
        rmask = rows < N
        gate_up_rows(x_ptr, h_ptr, h_ptr, slot, tl.program_id(0), rows, rmask, N, K, KB, g_ptr, gs_ptr, gm_ptr, u_ptr, us_ptr, um_ptr,
                     sge, sgr, sgse, sgsr, sue, sur, suse, susr, FMT, MODE, GS, BN, BK)
        g = tl.zeros((BN,), dtype=tl.float32)
        u = tl.zeros((BN,), dtype=tl.float32)
        lim = K if FMT <= FMT_INT8 else KB
        for k0 in range(0, lim, BK):
            g += row_dots(g_ptr, gs_ptr, gm_ptr, slot, rows, rmask, x_ptr, k0, K, KB, sge, sgr, sgse, sgsr,
                          FMT, MODE, GS, BN, BK, GS)
            u += row_dots(u_ptr, us_ptr, um_ptr, slot, rows, rmask, x_ptr, k0, K, KB, sue, sur, suse, susr,
                          FMT, MODE, GS, BN, BK, GS)
        if FMT == FMT_INT8:
            g = g * tl.load(gs_ptr + slot * sgse + rows * sgsr, mask=rmask, other=0.0).to(tl.float32)
            u = u * tl.load(us_ptr + slot * suse + rows * susr, mask=rmask, other=0.0).to(tl.float32)
        tl.store(ref_ptr + rows, g / (1.0 + tl.exp(-g)) * u, mask=rmask)


@pytest.mark.parametrize("fmt,mode,bk", [("dense", DecodeMode.BYTES, 32), ("dense", DecodeMode.BYTES, 2048),
                                         ("int8", DecodeMode.BYTES, 32), ("int8", DecodeMode.WORDS, 32),
                                         ("ternary", DecodeMode.WORDS, 32), ("ternary", DecodeMode.WORDS, 512)])
def test_gate_up_rows_sums_like_row_dots_per_matrix(fmt, mode, bk):
    """gate_up_rows loads gate's and up's tiles of a step together (dense and int8 bytes: one load
    each before either sum; base-3 words: trit_word_dot_pair, x and both matrices' words and scales
    loaded once; int8: the row scales before the K loop). Its h is row_dots' on gate, then up, step by
    step, bit for bit, whether the row takes one step (bk 2048 dense, 512 ternary) or many."""
    from moebench.engine.kernels.moe import _group_args
    g = torch.Generator().manual_seed(5)
    inter, hidden = 48, 200
    mats = []
    for rows, cols in ((inter, hidden), (inter, hidden), (hidden, inter)):
        ws = [torch.randn(rows, cols, generator=g) * 0.1 for _ in range(3)]
        mats.append(kernels.PackedMatrix.dense(torch.stack(ws).to(DEV)) if fmt == "dense" else
                    kernels.PackedMatrix.stack([quantize(w, fmt) for w in ws], DEV))
    group = kernels.ExpertGroup(*mats, None, fmt)
    cfg = replace(SMALL, mode_by_format={fmt: mode})
    args = _group_args(group, cfg)
    assert args.gate_up_mode == mode
    _, gd, gs, gm, ud, us, um, kb, sge, sgr, sgse, sgsr, sue, sur, suse, susr = args.gate_up(torch.zeros(1))
    x = torch.randn(hidden, generator=g).to(DEV)
    h = torch.full((inter,), float("nan"), device=DEV)
    ref = torch.full((inter,), float("nan"), device=DEV)
    BN = 16
    _gate_up_rows_and_per_matrix_steps[(-(-inter // BN),)](
        x, h, ref, 1, gd, gs, gm, ud, us, um, kb, sge, sgr, sgse, sgsr, sue, sur, suse, susr, inter, hidden,
        FMT=args.constexprs("A", "gate_up", bk)["FMT_A"], MODE=int(mode), GS=GROUP, BN=BN, BK=bk)
    assert not h.isnan().any() and torch.equal(h, ref), (h - ref).abs().max()
