"""Triton decode attention (moebench/engine/kernels/attention.py) against F.scaled_dot_product_attention.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (small heads, short caches keep it
fast); the CUDA tests run the compiled kernels in bf16 at the Qwen3-30B-A3B shape and in a CUDA graph.
Every test skips when Triton does not import.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton's first import (see kernels.py)
pytest.importorskip("triton")

from dataclasses import replace  # noqa: E402

from moebench.engine.decode_config import DEFAULT, DecodeConfigError  # noqa: E402
from moebench.engine.kernels import KernelError  # noqa: E402
from moebench.engine.kernels import attention as attention_kernel  # noqa: E402
from moebench.engine.kernels.attention import decode_attention, num_splits_for  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BLOCK = DEFAULT.attention.block_s


def make_inputs(B, Bc, NH, NKV, T, D, S, seed, dtype=torch.float32, device=DEV):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, NH, T, D, generator=g)
    k = torch.randn(Bc, NKV, S, D, generator=g)
    v = torch.randn(Bc, NKV, S, D, generator=g)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype)


def reference(q, k, v, positions, kv_len, scale=None):
    """sdpa over slots [0, kv_len) with slot <= positions[b, t], laid out [B, T, NH * D]."""
    B, NH, T, D = q.shape
    slots = torch.arange(kv_len, device=q.device)
    mask = (slots[None, None, :] <= positions[:, :, None]).unsqueeze(1)
    out = F.scaled_dot_product_attention(q, k[:B, :, :kv_len], v[:B, :, :kv_len], attn_mask=mask,
                                         enable_gqa=k.shape[1] != NH, scale=scale)
    return out.transpose(1, 2).reshape(B, T, NH * D)


def check(got, want, atol=1e-5, rtol=1e-5):
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    assert torch.isfinite(got).all()
    assert torch.allclose(got, want, atol=atol, rtol=rtol), (got - want).abs().max()


@pytest.mark.parametrize("nh,nkv", [(4, 4), (4, 2), (8, 2)])
def test_single_query_gqa_ratios(nh, nkv):
    """B=1, T=1 at GQA ratios 1, 2, 4; kv_len 70 is not a multiple of the block."""
    q, k, v = make_inputs(1, 1, nh, nkv, 1, 16, 96, seed=nh * 10 + nkv)
    kv_len = 70
    assert kv_len % BLOCK
    pos = torch.tensor([[kv_len - 1]], device=DEV)
    check(decode_attention(q, k, v, pos, kv_len), reference(q, k, v, pos, kv_len))


def test_rows_with_different_positions_ignore_garbage_slots():
    """B=2 of a B'=3 cache: row 1 is shorter; its slots past its position, and every slot past kv_len,
    hold NaN (stand-ins for stale cache): none may reach the output. Also with 3 KV splits, where the
    short row's later splits see no slot at all."""
    q, k, v = make_inputs(2, 3, 4, 2, 1, 32, 160, seed=1)
    kv_len = 130
    pos = torch.tensor([[129], [40]], device=DEV)
    want = reference(q, k, v, pos, kv_len)          # from the clean cache
    k[1, :, 41:] = float("nan")
    v[1, :, 41:] = float("nan")
    k[:, :, kv_len:] = float("nan")
    v[:, :, kv_len:] = float("nan")
    check(decode_attention(q, k, v, pos, kv_len), want)
    check(decode_attention(q, k, v, pos, kv_len, num_splits=3), want)
    # Large finite garbage also goes through the sdpa reference itself (masked to -inf there).
    k[1, :, 41:], v[1, :, 41:] = 1e4, -1e4
    check(decode_attention(q, k, v, pos, kv_len), want)


def test_prefill_chunk_of_three_queries():
    """T=3 queries at consecutive positions (each sees one more slot than the previous), two rows."""
    q, k, v = make_inputs(2, 2, 8, 2, 3, 16, 80, seed=2)
    kv_len = 77
    pos = torch.tensor([[74, 75, 76], [10, 11, 12]], device=DEV)
    check(decode_attention(q, k, v, pos, kv_len), reference(q, k, v, pos, kv_len))


@pytest.mark.parametrize("splits", [2, 3, 5])
def test_forced_splits_use_the_combine_kernel(splits):
    """The KV range split over programs + the combine kernel; split bounds fall on whole blocks (with
    32-slot blocks, 200 slots in 5 requested splits become 4 of 64) and the last split is partial."""
    q, k, v = make_inputs(1, 2, 4, 1, 2, 16, 256, seed=3)
    kv_len = 200
    pos = torch.tensor([[198, 199]], device=DEV)
    check(decode_attention(q, k, v, pos, kv_len, num_splits=splits), reference(q, k, v, pos, kv_len))


MERGES = replace(DEFAULT, attention=replace(DEFAULT.attention, last_split_merges=5))


@pytest.mark.parametrize("splits", [2, 3, 5])
def test_last_split_merges_without_a_combine_launch(splits, monkeypatch):
    """last_split_merges: the last split of each (query row, KV head) to finish merges the partials,
    and the combine kernel is never launched. Two rows of two queries over two KV heads of 4 query
    heads each; the short row's later splits see no slot, and its slots past its position hold NaN.
    The arrival counters are back at zero after each call, so a second call gives the same output."""
    monkeypatch.setattr(attention_kernel, "combine_kernel", None)      # launching it would raise
    q, k, v = make_inputs(2, 2, 8, 2, 2, 16, 256, seed=11)
    kv_len = 200
    pos = torch.tensor([[198, 199], [40, 41]], device=DEV)
    want = reference(q, k, v, pos, kv_len)
    k[1, :, 42:] = float("nan")
    v[1, :, 42:] = float("nan")
    got = decode_attention(q, k, v, pos, kv_len, num_splits=splits, cfg=MERGES)
    check(got, want)
    counters = attention_kernel._arrivals(q.device, 2 * 2 * 2)      # the buffer this launch used
    assert counters.tolist() == [0] * 8
    assert torch.equal(decode_attention(q, k, v, pos, kv_len, num_splits=splits, cfg=MERGES), got)
    # one split: the program writes its output itself
    check(decode_attention(q, k, v, pos, kv_len, num_splits=1, cfg=MERGES), want)


def test_more_splits_than_last_split_merges_take_the_combine_launch(monkeypatch):
    """Past last_split_merges splits the combine kernel merges them (one launch of B*T*NH programs)."""
    grids = []
    real = attention_kernel.combine_kernel

    class Spy:
        def __getitem__(self, grid):
            grids.append(grid)
            return real[grid]
    monkeypatch.setattr(attention_kernel, "combine_kernel", Spy())
    q, k, v = make_inputs(1, 1, 4, 2, 1, 16, 256, seed=12)
    pos = torch.tensor([[230]], device=DEV)
    few = replace(DEFAULT, attention=replace(DEFAULT.attention, last_split_merges=2))
    check(decode_attention(q, k, v, pos, 240, num_splits=2, cfg=few), reference(q, k, v, pos, 240))
    assert grids == []
    check(decode_attention(q, k, v, pos, 240, num_splits=3, cfg=few), reference(q, k, v, pos, 240))
    assert grids == [(4,)]


def test_short_contexts_split_into_short_splits():
    """Below split_from_slots a context gets short_splits splits (at most one per block of slots)."""
    short = replace(DEFAULT.attention, short_splits=4)
    assert num_splits_for(256, 4, launch=short) == 4
    assert num_splits_for(64, 4, launch=short) == 2            # two blocks of 32 slots
    assert num_splits_for(1, 4, launch=short) == 1
    assert num_splits_for(4096, 4, launch=short) == num_splits_for(4096, 4, launch=DEFAULT.attention)
    with pytest.raises(DecodeConfigError, match="short_splits 0"):
        replace(DEFAULT.attention, short_splits=0)
    with pytest.raises(DecodeConfigError, match="last_split_merges -1"):
        replace(DEFAULT.attention, last_split_merges=-1)


def test_automatic_splits_and_scale():
    """The heuristic picks >1 split once kv_len reaches split_from_slots (both thresholds lowered here
    so a short cache splits), and an explicit scale is used instead of 1/sqrt(D)."""
    cfg = replace(DEFAULT, attention=replace(DEFAULT.attention, split_min_slots=64, split_from_slots=128))
    assert num_splits_for(200, programs=2, launch=cfg.attention) == 3
    q, k, v = make_inputs(1, 1, 4, 2, 1, 16, 200, seed=4)
    pos = torch.tensor([[199]], device=DEV)
    check(decode_attention(q, k, v, pos, 200, scale=0.5, cfg=cfg), reference(q, k, v, pos, 200, scale=0.5))


def test_split_heuristic():
    """short_splits splits (merged in the launch) for short contexts; long ones fill ~programs_per_sm
    programs per SM."""
    qwen_programs = 1 * 1 * 4            # B * T * NKV at batch-1 decode of Qwen3-30B-A3B
    short = DEFAULT.attention.short_splits
    assert 1 < short <= DEFAULT.attention.last_split_merges
    assert num_splits_for(256, qwen_programs) == short
    assert num_splits_for(DEFAULT.attention.first_split_slots - 1, qwen_programs) == short
    assert num_splits_for(DEFAULT.attention.first_split_slots, qwen_programs) == (
        DEFAULT.attention.first_split_slots // DEFAULT.attention.split_min_slots)
    assert num_splits_for(16, qwen_programs) == 1          # one block of slots: one split
    for kv_len in (40000, 173000):
        n = num_splits_for(kv_len, qwen_programs, sm_count=132)
        assert n * qwen_programs >= 132 and kv_len / n >= DEFAULT.attention.split_min_slots
    # Many programs already: no split.
    assert num_splits_for(40000, programs=4 * 132 * 8) == 1
    one = replace(DEFAULT.attention, short_splits=1)
    assert num_splits_for(256, qwen_programs, launch=one) == 1


def test_split_from_slots():
    """split_from_slots sets where the long-context splitting starts apart from how short a split may
    be: short_splits below it, then splits as short as split_min_slots up to ~programs_per_sm
    programs per SM; None puts the threshold at 2 * split_min_slots."""
    fine = replace(DEFAULT.attention, split_min_slots=128, split_from_slots=1024, short_splits=1)
    assert num_splits_for(1023, 4, launch=fine) == 1
    assert num_splits_for(1023, 4, launch=replace(fine, short_splits=3)) == 3
    assert num_splits_for(1024, 4, launch=fine) == 8
    assert num_splits_for(4352, 4, sm_count=132, launch=fine) == 34      # 4352 // 128
    assert num_splits_for(40000, 4, sm_count=132, launch=fine) == 66     # 2 programs per SM
    assert replace(DEFAULT.attention, split_min_slots=512, split_from_slots=None).first_split_slots == 1024
    with pytest.raises(DecodeConfigError, match="split_from_slots 0"):
        replace(DEFAULT.attention, split_from_slots=0)
    q, k, v = make_inputs(1, 1, 4, 2, 1, 16, 300, seed=6)
    pos = torch.tensor([[299]], device=DEV)
    cfg = replace(DEFAULT, attention=replace(DEFAULT.attention, split_min_slots=32, split_from_slots=256))
    assert num_splits_for(300, 2, launch=cfg.attention) == 9
    check(decode_attention(q, k, v, pos, 300, cfg=cfg), reference(q, k, v, pos, 300))


def test_float16_two_part_probabilities():
    """16-bit inputs take the tensor-core path (p split into hi + lo halves): within fp16 rounding of
    the float32 result. (bf16 is CUDA-only: the interpreter's bf16 tl.dot is wrong, see the module.)"""
    q, k, v = make_inputs(1, 1, 8, 2, 1, 32, 300, seed=5, dtype=torch.float16)
    pos = torch.tensor([[299]], device=DEV)
    want = reference(q.float(), k.float(), v.float(), pos, 300)
    got = decode_attention(q, k, v, pos, 300, num_splits=2)
    assert got.dtype == torch.float16
    assert ((got.float() - want).abs() <= want.abs() * 2 ** -10 + 1e-5).all(), (got.float() - want).abs().max()


def test_bad_inputs_name_what_was_expected():
    q, k, v = make_inputs(1, 1, 4, 2, 1, 16, 32, seed=6)
    pos = torch.tensor([[5]], device=DEV)
    with pytest.raises(KernelError, match=r"expected q \[B, NH, T, D\]"):
        decode_attention(q[0], k, v, pos, 8)
    q24, k24, v24 = make_inputs(1, 1, 4, 2, 1, 24, 32, seed=6)
    with pytest.raises(KernelError, match="head_dim 24; expected a power of two"):
        decode_attention(q24, k24, v24, pos, 8)
    q3, k3, v3 = make_inputs(1, 1, 3, 2, 1, 16, 32, seed=6)
    with pytest.raises(KernelError, match="3 query heads, 2 KV heads; expected NH % NKV == 0"):
        decode_attention(q3, k3, v3, pos, 8)
    with pytest.raises(KernelError, match=r"positions \(1, 2\)"):
        decode_attention(q, k, v, torch.tensor([[5, 6]], device=DEV), 8)
    with pytest.raises(KernelError, match="kv_len 33; expected 1..32"):
        decode_attention(q, k, v, pos, 33)
    with pytest.raises(KernelError, match=r"B' >= 2"):
        decode_attention(torch.cat([q, q]), k, v, torch.tensor([[5], [5]], device=DEV), 8)
    with pytest.raises(KernelError, match="expected one dtype"):
        decode_attention(q.double(), k, v, pos, 8)


# ------------------------------------------------------------------------------------------------
# CUDA: compiled kernels, bf16, the Qwen3-30B-A3B attention shape

QWEN = {"NH": 32, "NKV": 4, "D": 128}


@needs_cuda
@pytest.mark.parametrize("kv_len", [256, 40000])
def test_cuda_bf16_qwen3_shape(kv_len):
    """bf16 against exact float32 attention on the same bf16 values: within one bf16 rounding of the
    output (the kernel rounds once); and against bf16 sdpa (which rounds p too) more loosely."""
    S = kv_len + 64
    q, k, v = make_inputs(1, 1, QWEN["NH"], QWEN["NKV"], 1, QWEN["D"], S, seed=7, dtype=torch.bfloat16)
    pos = torch.tensor([[kv_len - 1]], device="cuda")
    k[:, :, kv_len:] = float("nan")
    v[:, :, kv_len:] = float("nan")
    got = decode_attention(q, k, v, pos, kv_len)
    exact = reference(q.float(), k.float(), v.float(), pos, kv_len)
    assert got.dtype == torch.bfloat16 and got.shape == (1, 1, QWEN["NH"] * QWEN["D"])
    err = (got.float() - exact).abs()
    assert (err <= exact.abs() * 2 ** -8 + 1e-5).all(), err.max()
    sdpa = reference(q, k, v, pos, kv_len).float()
    assert torch.allclose(got.float(), sdpa, atol=2e-3, rtol=2e-2), (got.float() - sdpa).abs().max()
    if kv_len == 40000:
        assert num_splits_for(kv_len, QWEN["NKV"], attention_kernel.sm_count(q.device)) > 1


@needs_cuda
@pytest.mark.parametrize("kv_len,cfg", [(256, DEFAULT), (40000, DEFAULT),
                                        (256, replace(DEFAULT, attention=replace(DEFAULT.attention, short_splits=1))),
                                        (1000, replace(MERGES, attention=replace(MERGES.attention, short_splits=5)))])
def test_cuda_graph_capture_and_replay(kv_len, cfg):
    """Captured once, replayed on new queries and positions written into the captured inputs: the same
    output as an eager call on those inputs (bitwise: same kernels, same launch shapes): at the
    defaults (a short context split four ways and merged by the last split, a long one with the
    combine launch), a short context in one split, and five splits merged by the last at 1,000 slots."""
    S = kv_len + 64
    q, k, v = make_inputs(2, 2, QWEN["NH"], QWEN["NKV"], 1, QWEN["D"], S, seed=8, dtype=torch.bfloat16)
    pos = torch.tensor([[kv_len - 1], [kv_len // 2]], device="cuda")
    decode_attention(q, k, v, pos, kv_len, cfg=cfg)           # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, pos, kv_len, cfg=cfg)
    q2, _, _ = make_inputs(2, 2, QWEN["NH"], QWEN["NKV"], 1, QWEN["D"], 1, seed=9, dtype=torch.bfloat16)
    q.copy_(q2)
    pos.copy_(torch.tensor([[kv_len // 3], [kv_len - 2]], device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    eager = decode_attention(q, k, v, pos, kv_len, cfg=cfg)
    assert torch.equal(out, eager)
    exact = reference(q.float(), k.float(), v.float(), pos, kv_len)
    assert ((out.float() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-5).all()


@pytest.mark.parametrize("tables", [False, True])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_rope_in_attention_equals_qk_rope_cache_then_attention(qk_norm, splits, tables):
    """decode_attention(rope=...) on the raw one-token projection gives exactly what qk_rope_cache
    followed by decode_attention gives: the same output and the same caches, every split count (the
    program of the split holding the new slot writes it before reading it), with this step's cos /
    sin rows or with the float32 tables (read at the positions in both launches). Compiled for CUDA with
    q/k norms, the normalised q rounds differently inside the attention launch (measured on the
    H200), so there the output agrees to rounding; the caches stay bitwise equal."""
    from moebench.engine.kernels import RopeInputs, qk_rope_cache
    from moebench.engine.model import rope_tables
    g = torch.Generator().manual_seed(21 + int(qk_norm))
    B, NH, NKV, D, S = 2, 8, 2, 16, 128
    qkv = torch.randn(B, 1, (NH + 2 * NKV) * D, generator=g).to(DEV)      # views, as in Attention
    q = qkv[..., :NH * D].view(B, 1, NH, D)
    k = qkv[..., NH * D:(NH + NKV) * D].view(B, 1, NKV, D)
    v = qkv[..., (NH + NKV) * D:].view(B, 1, NKV, D)
    qw, kw = ((torch.rand(D, generator=g) + 0.5).to(DEV) for _ in range(2)) if qk_norm else (None, None)
    positions = torch.tensor([[100], [41]], device=DEV)
    cos_t, sin_t = rope_tables(D, 10000.0, S, DEV)
    cos, sin = (cos_t, sin_t) if tables else (cos_t[positions], sin_t[positions])
    kc0 = torch.randn(B, NKV, S, D, generator=g).to(DEV)
    vc0 = torch.randn(B, NKV, S, D, generator=g).to(DEV)
    kv_len = 101
    kc, vc = kc0.clone(), vc0.clone()
    qo = qk_rope_cache(q, k, v, qw, kw, 1e-6, cos, sin, positions, kc, vc)
    want = decode_attention(qo, kc, vc, positions, kv_len, num_splits=splits)
    kc2, vc2 = kc0.clone(), vc0.clone()
    got = decode_attention(q, kc2, vc2, positions, kv_len, num_splits=splits,
                           rope=RopeInputs(k, v, qw, kw, 1e-6, cos, sin))
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)
    assert not torch.equal(kc, kc0)                  # the new slots were written
    if DEV == "cuda" and qk_norm:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    else:
        assert torch.equal(got, want)
    with pytest.raises(KernelError, match="one-token"):
        decode_attention(qo, kc2, vc2, positions, kv_len, rope=RopeInputs(k, v, qw, kw, 1e-6, cos, sin))


EARLY_KV = replace(DEFAULT, early_weights=(*DEFAULT.early_weights, "attention_kv"))


@pytest.mark.parametrize("positions,kv_len,splits", [
    ([[20], [5]], 21, None),          # every row's position inside the first block
    ([[129], [40]], 130, 3),          # splits; row 1's later splits see no slot
    ([[199], [63]], 200, 5),          # a position on a block's last slot
    ([[32], [0]], 33, 2),             # a position on a block's first slot; a row at slot 0
])
def test_early_kv_block_gives_the_same_output(positions, kv_len, splits):
    """early_weights "attention_kv": one-token steps load the split's first block of slots before the
    position ahead of the wait. The output equals the plain kernel's bit for bit, before and after
    the slot at the position is rewritten (the output follows it), and slots past each row's
    position hold NaN, so an early load of any of them would reach the output. (Whether the slot
    at the position is read after the wait only shows where a kernel before writes it concurrently:
    the engine's early-weights test on CUDA, where the RoPE launch writes it under PDL.)"""
    pos = torch.tensor(positions, device=DEV)
    q, k, v = make_inputs(2, 2, 8, 2, 1, 16, 256, seed=31 + kv_len)
    for b, p in enumerate(positions):
        k[b, :, p[0] + 1:] = float("nan")
        v[b, :, p[0] + 1:] = float("nan")
    outs = {}
    for name, cfg in (("plain", DEFAULT), ("early", EARLY_KV)):
        kc, vc = k.clone(), v.clone()
        outs[name] = decode_attention(q, kc, vc, pos, kv_len, num_splits=splits, cfg=cfg)
        rows = torch.arange(2, device=DEV)
        kc[rows, :, pos[:, 0]] = kc[rows, :, pos[:, 0]] * -2.0 + 1.0     # this step's new slot, changed
        vc[rows, :, pos[:, 0]] = vc[rows, :, pos[:, 0]] * 3.0 - 1.0
        outs[name + "_new"] = decode_attention(q, kc, vc, pos, kv_len, num_splits=splits, cfg=cfg)
        check(outs[name + "_new"], reference(q, torch.nan_to_num(kc), torch.nan_to_num(vc), pos, kv_len))
    assert torch.equal(outs["early"], outs["plain"])
    assert torch.equal(outs["early_new"], outs["plain_new"])
    assert not torch.equal(outs["plain_new"], outs["plain"])


def test_early_kv_block_with_rope_in_attention():
    """The same with the ROPE path, where the program of the position's split writes the step's key and
    value itself: the early loads skip that slot, the output and the caches equal the plain kernel's."""
    from moebench.engine.kernels import RopeInputs
    from moebench.engine.model import rope_tables
    g = torch.Generator().manual_seed(41)
    B, NH, NKV, D, S = 2, 8, 2, 16, 128
    qkv = torch.randn(B, 1, (NH + 2 * NKV) * D, generator=g).to(DEV)
    q = qkv[..., :NH * D].view(B, 1, NH, D)
    k = qkv[..., NH * D:(NH + NKV) * D].view(B, 1, NKV, D)
    v = qkv[..., (NH + NKV) * D:].view(B, 1, NKV, D)
    positions = torch.tensor([[70], [3]], device=DEV)
    cos_t, sin_t = rope_tables(D, 10000.0, S, DEV)
    cos, sin = cos_t[positions], sin_t[positions]
    kc0 = torch.randn(B, NKV, S, D, generator=g).to(DEV)
    vc0 = torch.randn(B, NKV, S, D, generator=g).to(DEV)
    got = {}
    for name, cfg in (("plain", DEFAULT), ("early", EARLY_KV)):
        kc, vc = kc0.clone(), vc0.clone()
        out = decode_attention(q, kc, vc, positions, 71, num_splits=2, cfg=cfg,
                               rope=RopeInputs(k, v, None, None, 1e-6, cos, sin))
        got[name] = (out, kc, vc)
    assert all(torch.equal(a, b) for a, b in zip(got["early"], got["plain"]))
    assert not torch.equal(got["plain"][1], kc0)
