"""Prefill chunks' attention (moebench/engine/model.py, _tail_causal_attention): a chunk's T queries
are the last T of the kv_len cache slots, so the mask is the lower-right causal one and no mask
tensor is built. It must equal the explicit slot <= position mask it replaces, and on CUDA it must
not take cuDNN's attention, which builds an execution graph for every new (T, kv_len)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton's first import (see kernels.py)

import torch.nn.functional as F  # noqa: E402
from conftest import fused_kernels_or_skip, hf_zoo_dir  # noqa: E402

from moebench.engine import Engine  # noqa: E402
from moebench.engine.model import _tail_causal_attention  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def masked(q, k, v):
    """The explicit mask: query t sits at position kv_len - T + t and sees slots <= its position."""
    T, kv_len = q.shape[-2], k.shape[-2]
    positions = torch.arange(kv_len - T, kv_len, device=q.device)
    mask = torch.arange(kv_len, device=q.device)[None, :] <= positions[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


def inputs(B, NH, NKV, T, kv_len, D, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, s, D, generator=g).to(device, dtype) for n, s in ((NH, T), (NKV, kv_len), (NKV, kv_len))]


@pytest.mark.parametrize("T,kv_len", [(1, 1), (6, 6), (3, 11), (64, 200), (17, 17 + 512)])
@pytest.mark.parametrize("nkv", [4, 1])
def test_tail_causal_equals_the_explicit_mask(T, kv_len, nkv):
    q, k, v = inputs(2, 8, nkv, T, kv_len, 32, torch.float32, "cpu")
    out = _tail_causal_attention(q, k, v, gqa=nkv != 8)
    torch.testing.assert_close(out, masked(q, k, v), rtol=1e-5, atol=1e-5)
    # the first query sees kv_len - T + 1 slots: changing a later slot's value must not move it
    v2 = v.clone()
    v2[..., kv_len - T + 1:, :] += 100.0
    again = _tail_causal_attention(q, k, v2, gqa=nkv != 8)
    torch.testing.assert_close(again[..., 0, :], out[..., 0, :])
    if T > 1:   # ... and the last query sees it
        assert not torch.allclose(again[..., -1, :], out[..., -1, :])


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory):
    return hf_zoo_dir(tmp_path_factory)


def test_chunked_prefill_equals_one_chunk(zoo_dir):
    """A prompt through 20-token chunks (lower-right masks at kv_len 20, 40, 60) gives the logits of
    one chunk (a square causal mask) and of the explicit mask."""
    whole = Engine.load(zoo_dir, max_seq_len=64)
    chunked = Engine.load(zoo_dir, max_seq_len=64, prefill_chunk=20)
    assert chunked.decode.fused_tokens < 20      # the chunks take the sdpa path
    ids = list(range(5, 65))
    ref = whole.logits(ids)
    torch.testing.assert_close(chunked.logits(ids), ref, rtol=1e-4, atol=1e-4)
    h = whole.model(torch.tensor([ids]), torch.arange(60)[None], kv_len=60)     # the explicit mask
    torch.testing.assert_close(whole.model.logits(h[0]).float(), ref, rtol=1e-4, atol=1e-4)


def test_a_small_last_chunk_joins_the_one_before(zoo_dir):
    """A last prefill chunk small enough for the fused decode kernels (here 5 tokens) joins the chunk
    before, so only a prompt that short runs those kernels, over the decode steps' bucketed kv_len
    (it masks by position); the logits are those of the sdpa path either way."""
    fused_kernels_or_skip("cpu")
    ref = Engine.load(zoo_dir, max_seq_len=64, prefill_chunk=20)
    eng = Engine.load(zoo_dir, max_seq_len=64, prefill_chunk=20, experts_impl="triton")
    assert ref.decode.fused_tokens == 0 and 5 <= eng.decode.fused_tokens < 20
    seen, forward = [], eng.model.forward

    def spy(tokens, positions, kv_len, causal_tail=False):
        seen.append((tokens.shape[1], kv_len))
        return forward(tokens, positions, kv_len, causal_tail)
    eng.model.forward = spy
    for ids, chunks in ((list(range(7, 52)), [(20, 20), (25, 45)]),          # 45 tokens: 20 + 20 + 5
                        (list(range(7, 67)), [(20, 20), (20, 40), (20, 60)]),
                        (list(range(7, 12)), [(5, eng._kv_len(5))])):          # a 5-token prompt: fused
        seen.clear()
        torch.testing.assert_close(eng.logits(ids), ref.logits(ids), rtol=1e-3, atol=1e-3)
        assert seen == chunks
    assert eng._kv_len(5) == 64
    seen.clear()
    out = eng.generate([list(range(7, 48)), list(range(9, 50))], 2, ignore_eos=True)  # 41 tokens: 20 + 21
    assert seen[:2] == [(20, 20), (21, 41)] and [len(o.token_ids) for o in out] == [2, 2]
    assert ref.generate([list(range(7, 48)), list(range(9, 50))], 2, ignore_eos=True)[1].token_ids == out[1].token_ids


@needs_cuda
@pytest.mark.parametrize("T,kv_len", [(129, 129), (512, 1024), (1, 4097), (4, 516)])
def test_cuda_tail_causal_uses_no_cudnn_and_matches(T, kv_len):
    q, k, v = inputs(1, 32, 4, T, kv_len, 128, torch.bfloat16, "cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = _tail_causal_attention(q, k, v, gqa=True)
        torch.cuda.synchronize()
    names = [e.name.lower() for e in prof.events()]
    assert names and not any("cudnn" in n for n in names), sorted(set(names))[:20]
    ref = masked(q.float(), k.float(), v.float())
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
