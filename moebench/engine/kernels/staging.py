"""Streams and host-tier staging: the side streams fused_moe overlaps work on, the host lane, and
the copy of predicted host experts into an HBM stage (prefetch).

Prefetch copies the host experts a prediction names into a device stage, so the layer that uses
them reads HBM instead of PCIe. Launched on the host lane one layer early (see
placement.TieredExperts.prefetch), the PCIe reads overlap the previous layer's work.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..decode_config import DEFAULT, DecodeConfig
from .packed import ExpertGroup
from .runtime import grid_dependency, next_pow2, pdl_launch, require, tl, triton  # noqa: F401

def side_stream(device, key) -> "torch.cuda.Stream":
    """fused_moe's side stream `key` of a device, made on first use."""
    device = torch.device(device)
    if device.index is None:        # "cuda" and "cuda:0" must name one stream
        device = torch.device(device.type, torch.cuda.current_device())
    return _stream_of(device, key)


@functools.lru_cache(maxsize=None)
def _stream_of(device: torch.device, key) -> "torch.cuda.Stream":
    """One stream per (device, key) for the process; streams hold no setting, only a CUDA handle."""
    return torch.cuda.Stream(device)


def host_lane(device) -> "torch.cuda.Stream":
    """The side stream of a device's host-tier work: fused_moe's host groups and the groups marked
    host_lane (prefetch's HBM stage), and prefetch's stage copies. One stream, so a layer's host
    launches follow its stage copies in stream order: no join per copy, and the main stream never
    waits for a copy, only for the host launches at the layer's end."""
    return side_stream(device, "host")


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
    def stage_maps_kernel(pred_ptr, host_slot_ptr, stage_slot_ptr, host_dyn_ptr, copies_ptr, E,
                          K: tl.constexpr, BLOCK_E: tl.constexpr, COUNT: tl.constexpr = False,
                          PDL: tl.constexpr = False):
        """stage_slot[e] = j if e == pred[j] and e lives in this host group, else -1; host_dyn[e] =
        the host slot of e unless it is staged (-1): the two groups then cover e exactly once.
        COUNT: copies[e] += 1 for every staged e (stage_copy_kernel copied exactly these)."""
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
        if COUNT:      # one program: a plain read-modify-write
            c = tl.load(copies_ptr + offs, mask=m, other=0)
            tl.store(copies_ptr + offs, c + (stage >= 0).to(tl.int32), mask=m)



def _word_view(t: Tensor) -> Tensor:
    """[S, ...] contiguous -> [S, words] (int32 words when the slot size allows, else bytes)."""
    flat = t.reshape(t.shape[0], -1).view(torch.uint8)
    return flat.view(torch.int32) if flat.shape[1] % 4 == 0 else flat


def stage_experts(pred_ids: Tensor, host_slot_of: Tensor, host: ExpertGroup, stage: ExpertGroup,
                  stage_slot_of: Tensor, host_dyn: Tensor, cfg: DecodeConfig = DEFAULT,
                  copies: Tensor | None = None) -> None:
    """Copy the predicted experts (pred_ids [k]) that live in `host` into `stage` (slot j for
    pred_ids[j]) and rewrite the maps (stage.slot_of is stage_slot_of, the host group's dynamic
    slot_of is host_dyn; host_slot_of is its static one). No host sync; graph-capturable.
    copies: int32 [E] on the device: +1 per expert copied (tier telemetry)."""
    require()
    k = pred_ids.numel()
    pdl = pdl_launch(pred_ids.device, cfg)
    pred = pred_ids.reshape(-1)
    for mat in ("gate", "up", "down"):
        src_pm, dst_pm = getattr(host, mat), getattr(stage, mat)
        for src_t, dst_t in ((src_pm.copied, dst_pm.copied), (src_pm.scale, dst_pm.scale),
                             (src_pm.minimum, dst_pm.minimum)):
            if src_t is None:
                continue
            src, dst = _word_view(src_t), _word_view(dst_t)
            block = 4096
            stage_copy_kernel[(k, -(-src.shape[1] // block))](src, dst, pred, host_slot_of, src.shape[1],
                                                                src.stride(0), dst.stride(0), BLOCK=block,
                                                                num_warps=8, **pdl)
    E = host_slot_of.numel()
    stage_maps_kernel[(1,)](pred, host_slot_of, stage_slot_of, host_dyn,
                            copies if copies is not None else host_dyn, E, K=k, BLOCK_E=next_pow2(E),
                            COUNT=copies is not None, num_warps=1, **pdl)
