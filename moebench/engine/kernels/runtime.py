"""Triton's import, the CPU interpreter switch, and what every kernel launch shares.

Triton decides at decoration time whether a kernel is compiled or interpreted, so on a machine
without CUDA the interpreter is switched on (TRITON_INTERPRET=1) before the first `import triton`;
that is how the parity tests run the kernels on CPU tensors. `available()` says whether the kernels
can run here; `require()` raises KernelError where they cannot.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import sys

import torch

from ..decode_config import DecodeConfig, DecodeMode, Format


class KernelError(ValueError):
    """Weights or inputs the fused kernels cannot take; the message says what was expected."""


IMPORT_ERROR: str | None = None
if not torch.cuda.is_available():
    # triton.language's own helpers are decorated when triton is first imported: the switch only
    # works if nobody imported triton before.
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        IMPORT_ERROR = ("no CUDA here, and triton was imported before TRITON_INTERPRET=1 was set; set it "
                        "before the first `import triton` to run the kernels in the interpreter")
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl
except Exception as _err:  # noqa: BLE001 - any import failure means "no Triton here"
    triton = None
    tl = None
    IMPORT_ERROR = f"triton does not import: {_err}"

def available() -> bool:
    """True when Triton imports and can run here (a CUDA device, or the CPU interpreter)."""
    return IMPORT_ERROR is None


def unavailable_reason() -> str | None:
    """Why the kernels cannot run here (None where they can)."""
    return IMPORT_ERROR


def require() -> None:
    if IMPORT_ERROR is not None:
        raise KernelError(f"the fused kernels cannot run here: {IMPORT_ERROR}")


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Called per router and attention launch (eager decode included): read from the device once."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132      # the interpreter: the H200's count, so CPU tests split and launch as the GPU would


# Programmatic dependent launch (PDL, sm_90+): each decode-step kernel is launched with the
# programmatic-serialization attribute, so the GPU starts launching it while the kernel before it in
# the stream is still running; its programs then wait (griddepcontrol.wait) until that kernel has
# finished and its writes are visible, before touching memory an earlier kernel writes (weights,
# which no kernel of a step writes, may be loaded before the wait: early_weights, the norm weights;
# so may a step's positions and the RoPE tables: the positions are written before the step's first
# kernel, and that kernel starts only once everything before it has finished, since what precedes
# it is a graph boundary or a torch op, and neither lets a launch after it start early).
# It saves the launch gap between two dependent kernels (~1.5 us each, a few hundred kernels per
# step). Every program waits, whatever it does after: a kernel whose programs all exited without
# waiting could finish before its predecessor, and the next kernel's wait would then not cover it.
@functools.lru_cache(maxsize=None)
def pdl_supported(device: torch.device) -> bool:
    """Whether PDL can work on a CUDA `device`: compute capability 9+ and a Triton that has
    griddepcontrol and the launch option (asked once per device)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_wait  # noqa: F401 - presence check
        return ("launch_pdl" in {f.name for f in dataclasses.fields(CUDAOptions)}
                and torch.cuda.get_device_capability(device)[0] >= 9)
    except Exception:  # noqa: BLE001 - an older Triton: no PDL
        return False


def pdl_launch(device: torch.device, cfg: DecodeConfig, kernel: str | None = None) -> dict:
    """Keyword arguments for launching a kernel that has the PDL constexpr on `device`: PDL and
    launch_pdl both on where cfg.pdl asks for it and it can work (CUDA, compute capability 9+, a
    Triton that has griddepcontrol and the launch option), else PDL off (the wait compiles away).
    kernel: the launch's name in DecodeConfig.early_launch (its kernel then has the LAUNCH_FIRST
    constexpr), set when the config lists it."""
    if not cfg.pdl or device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return {"PDL": False}
    if not pdl_supported(device):
        return {"PDL": False}
    if kernel is not None and kernel in cfg.early_launch:
        return {"PDL": True, "launch_pdl": True, "LAUNCH_FIRST": True}
    return {"PDL": True, "launch_pdl": True}


def early_steps(kernel: str, K: int, BK: int, cfg: DecodeConfig) -> int:
    """How many K steps of weights `kernel`'s programs load before their PDL wait: 0 unless
    cfg.early_weights lists it, else cfg.early_steps, at most the K / BK steps there are."""
    if kernel not in cfg.early_weights:
        return 0
    return min(cfg.early_steps, -(-K // BK))


def prefetch_launch(weight: "torch.Tensor | None", cfg: DecodeConfig, site: str) -> dict:
    """Keyword arguments for a kernel with prefetch programs (prefetch_l2's PF_* constexprs): none
    unless cfg.l2_prefetch lists `site` and a contiguous `weight` is given; the prefetch instruction
    itself only on CUDA (the interpreter runs the programs without it)."""
    if weight is None or site not in cfg.l2_prefetch:
        return {}
    if not weight.is_contiguous():
        raise KernelError(f"l2_prefetch {site}: the weight needs to be contiguous, got strides {weight.stride()}")
    asm = weight.device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
    return {"pf_ptr": weight, "pf_bytes": weight.numel() * weight.element_size(),
            "PF_PARTS": cfg.l2_prefetch_programs, "PF_ASM": asm}


if triton is not None:
    @triton.jit
    def prefetch_l2(ptr, n_bytes, part, PARTS: tl.constexpr, ASM: tl.constexpr, CHUNK: tl.constexpr = 1024):
        """Share `part` of PARTS of the n_bytes at ptr: asks L2 for its 128-byte lines with
        `prefetch.global.L2::evict_last` (DecodeConfig.l2_prefetch), fire and forget: no register
        waits for them, so the program ends as soon as the requests are issued. ASM off (the CPU
        interpreter, which has no inline PTX): the addresses only. Only weights, which no kernel of
        a step writes, are prefetched, so a program may do it before its PDL wait."""
        base = ptr.to(tl.pointer_type(tl.int8))
        n_lines = (n_bytes + 127) // 128
        per = (n_lines + PARTS - 1) // PARTS
        start = part * per
        end = tl.minimum(start + per, n_lines)
        for c in range(start, end, CHUNK):
            lines = c + tl.arange(0, CHUNK)
            addr = base + tl.where(lines < end, lines, start).to(tl.int64) * 128
            if ASM:
                tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [addr],
                                          dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def grid_dependency(PDL: tl.constexpr, LAUNCH_FIRST: tl.constexpr = False):
        """With PDL: wait for the previous kernel in the stream to finish (its writes visible), then
        let the next one start launching. Must run before the program touches memory written by
        an earlier launch. LAUNCH_FIRST (DecodeConfig.early_launch): let the next kernel start
        launching before the wait, so its programs are resident (and can load their weights) while
        this one waits and runs; the trigger only schedules, the next kernel's own wait still
        covers this one's writes."""
        if PDL:
            if LAUNCH_FIRST:
                tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
            if not LAUNCH_FIRST:
                tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def sortable_bits(x):
        """float32 x's bits as int32 keys whose signed order is x's order (-0.0 just below +0.0),
        and back: negative floats get their 31 low bits flipped (an involution). Integer maxima
        of them are one warp instruction (REDUX) where a float max is a shuffle tree."""
        bits = x.to(tl.int32, bitcast=True)
        return bits ^ ((bits >> 31) & 0x7FFFFFFF)

    @triton.jit
    def word_tile(base, rmask, k0, KB, BK: tl.constexpr, EVICT: tl.constexpr = tl.constexpr("")):
        """The int32 words [BN, BK/4] of rows `base` (one pointer per row) for the K step from byte
        k0 (expert_rows.word_dots, int8_activations.a8_word_dots, moe_kernels' early
        loads); 0 past the row's KB bytes and in masked rows."""
        wi = k0 // 4 + tl.arange(0, BK // 4)
        return tl.load(base + wi[None, :], mask=rmask[:, None] & (wi < KB // 4)[None, :], other=0,
                       eviction_policy=EVICT)

    # Format and DecodeMode values as the kernels compare them (FMT and MODE constexprs)
    FMT_DENSE = tl.constexpr(int(Format.DENSE))
    FMT_INT8 = tl.constexpr(int(Format.INT8))
    FMT_INT4 = tl.constexpr(int(Format.INT4))
    FMT_INT4_ASYM = tl.constexpr(int(Format.INT4_ASYM))
    FMT_TERNARY = tl.constexpr(int(Format.TERNARY))
    FMT_TERNARY2 = tl.constexpr(int(Format.TERNARY2))
    MODE_BYTES = tl.constexpr(int(DecodeMode.BYTES))
    MODE_WORDS = tl.constexpr(int(DecodeMode.WORDS))
    MODE_INT8_ACT = tl.constexpr(int(DecodeMode.INT8_ACTIVATIONS))
else:
    FMT_DENSE = FMT_INT8 = FMT_INT4 = FMT_INT4_ASYM = FMT_TERNARY = FMT_TERNARY2 = None
    MODE_BYTES = MODE_WORDS = MODE_INT8_ACT = None
    grid_dependency = sortable_bits = prefetch_l2 = word_tile = None
