"""The fused MoE kernels compiled for sm_90 on a machine without a GPU: registers, spills and the
SASS instruction mix of one gate_up or down launch shape per expert format, and of the fused norm +
router (`--kernels router`: its top-k's warp reductions are the shfl and redux columns) and of the
decode attention (`--kernels attention`: without and with its early KV block, and with
rope_in_attention).

Timing needs the H200 (quant_kernels_h200.py; kernel_counters_h200.py under ncu for stalls); this
says, offline and in seconds, what a kernel change does to the code: how many global loads a K
step issues, how many integer, conversion and float instructions, how many registers. Counts are
static (a loop body once), so compare variants of one kernel, not kernels of other loop shapes.

    TRITON_INTERPRET=0 python benchmarks/kernel_sass.py                      # the shipped shapes and modes
                                                                             # (and base-3's byte decode)
    TRITON_INTERPRET=0 python benchmarks/kernel_sass.py --kernels router,attention,gate_up,down
                                                                             # results/kernel_sass.txt
    TRITON_INTERPRET=0 python benchmarks/kernel_sass.py --kernels gate_up --formats ternary,ternary2 \\
        --launch 4,256,4,3                                                      # one shape for all

TRITON_INTERPRET=0: moebench switches Triton's CPU interpreter on where there is no CUDA, and an
interpreted kernel cannot be compiled. Triton's own ptxas, cuobjdump and nvdisasm do the work.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("kernel_sass.py compiles kernels: run it with TRITON_INTERPRET=0")
os.environ["TRITON_INTERPRET"] = "0"
import triton  # noqa: E402  (before moebench, so its kernels are compiled, not interpreted)
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


from moebench.engine.decode_config import DEFAULT, L2_PREFETCH_SITES, DecodeMode  # noqa: E402
from moebench.engine.kernels import moe_kernels  # noqa: E402

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
E, H, INTER, TOP_K = 128, 2048, 768, 8      # one MoE layer of Qwen3-30B-A3B's shape
NH, NKV, HEAD_DIM = 32, 4, 128              # and its attention


def captured_launches(fmt: str, cfg) -> dict:
    """The (args, kwargs) fused_moe gives each kernel for one decode token on one `fmt` group (CPU
    tensors of the real shapes; nothing runs: the launches are caught)."""
    import torch
    from moebench.engine import kernels
    from moebench.engine.kernels import moe as moe_mod
    from moebench.engine.kernels import runtime
    from moebench.engine.quant import QuantizedTensor, quantize
    g = torch.Generator().manual_seed(0)
    mats = []
    for rows, cols in ((INTER, H), (INTER, H), (H, INTER)):
        w = torch.randn(2 * rows, cols, generator=g) * 0.02           # two experts are enough to stack
        if fmt == "dense":
            mats.append(kernels.PackedMatrix.dense(w.view(2, rows, cols).to(torch.bfloat16)))
            continue
        q = quantize(w, fmt)
        parts = {k: v.reshape(2, rows, *v.shape[1:]) for k, v in q.parts.items()}
        mats.append(kernels.PackedMatrix.stack(
            [QuantizedTensor(q.fmt, (rows, cols), {k: v[e] for k, v in parts.items()}) for e in range(2)], "cpu"))
    slot_of = torch.full((E,), -1, dtype=torch.int32)
    slot_of[:2] = torch.arange(2, dtype=torch.int32)
    group = kernels.ExpertGroup(*mats, slot_of, fmt)
    caught = {}

    def catcher(name):
        def run(*args, grid, warmup, **kwargs):
            caught[name] = (args, kwargs)
        return run
    saved = (runtime.IMPORT_ERROR, moe_kernels.gate_up_kernel.run, moe_kernels.down_kernel.run,
             moe_kernels.expert_ffn_kernel.run, moe_mod.moe_sum_kernel.run, moe_mod.quantize_rows_kernel.run,
             kernels.PackedMatrix.on_host)
    runtime.IMPORT_ERROR = None          # the launches are caught before anything would run
    kernels.PackedMatrix.on_host = property(lambda self: False)      # CPU tensors stand in for HBM ones
    moe_kernels.gate_up_kernel.run = catcher("gate_up")
    moe_kernels.down_kernel.run = catcher("down")
    moe_kernels.expert_ffn_kernel.run = catcher("ffn")
    moe_mod.moe_sum_kernel.run = catcher("moe_sum")
    moe_mod.quantize_rows_kernel.run = catcher("quantize_rows")      # x's int8 rows (INT8_ACTIVATIONS)
    try:
        x = torch.randn(1, H, generator=g).to(torch.bfloat16)
        ids = torch.zeros(1, TOP_K, dtype=torch.long)
        kernels.fused_moe(x, ids, torch.ones(1, TOP_K), [group], cfg=cfg, reduce=False)
    finally:
        (runtime.IMPORT_ERROR, moe_kernels.gate_up_kernel.run, moe_kernels.down_kernel.run,
         moe_kernels.expert_ffn_kernel.run, moe_mod.moe_sum_kernel.run, moe_mod.quantize_rows_kernel.run,
         kernels.PackedMatrix.on_host) = saved
    return caught


def captured_router(cfg) -> tuple[tuple, dict]:
    """The (args, kwargs) add_rmsnorm_router gives its kernel for one decode token of this shape
    (128 experts, top-8, renormalised), as captured_launches does for the expert kernels; with
    cfg.l2_prefetch, the next layer's [q; k; v] matrix as its prefetch weight."""
    import torch
    from moebench.engine import kernels
    from moebench.engine.kernels import norm_router
    x = torch.zeros(1, 1, H, dtype=torch.bfloat16)
    qkv = torch.zeros((NH + 2 * NKV) * HEAD_DIM, H, dtype=torch.bfloat16)
    return captured_one(norm_router, "add_rmsnorm_router_kernel", lambda: kernels.add_rmsnorm_router(
        x, x, torch.ones(H, dtype=torch.bfloat16), 1e-6, torch.zeros(E, H, dtype=torch.bfloat16), TOP_K, True,
        cfg=cfg, prefetch=qkv))


def captured_rope(cfg) -> tuple[tuple, dict]:
    """The (args, kwargs) qk_rope_cache gives its kernel for one decode token of this shape (32 query
    and 4 key/value heads of 128, per-head norms, the float32 RoPE tables); with cfg.l2_prefetch, the
    layer's o_proj as its prefetch weight."""
    import torch
    from moebench.engine import kernels
    from moebench.engine.kernels import rope_kv
    q = torch.zeros(1, 1, NH, HEAD_DIM, dtype=torch.bfloat16)
    kv = torch.zeros(1, 1, NKV, HEAD_DIM, dtype=torch.bfloat16)
    nw = torch.ones(HEAD_DIM, dtype=torch.bfloat16)
    table = torch.zeros(64, HEAD_DIM)
    cache = torch.zeros(1, NKV, 64, HEAD_DIM, dtype=torch.bfloat16)
    o_proj = torch.zeros(H, NH * HEAD_DIM, dtype=torch.bfloat16)
    return captured_one(rope_kv, "qk_rope_cache_kernel", lambda: kernels.qk_rope_cache(
        q, kv, kv, nw, nw, 1e-6, table, table, torch.zeros(1, 1, dtype=torch.long), cache, cache, cfg=cfg,
        prefetch=o_proj))


def captured_attention(cfg, rope: bool = False) -> tuple[tuple, dict]:
    """The (args, kwargs) decode_attention gives its kernel for one decode token of this shape at a
    short context (cfg's short splits: at the defaults four, merged by the last), with PDL on as on
    the GPU. rope: with rope_in_attention's inputs (q/k norms, the float32 RoPE tables)."""
    import torch
    from moebench.engine.kernels import RopeInputs, attention
    from moebench.engine.model import rope_tables
    cache = torch.zeros(1, NKV, 256, HEAD_DIM, dtype=torch.bfloat16)
    if rope:
        q = torch.zeros(1, 1, NH, HEAD_DIM, dtype=torch.bfloat16)
        kv = torch.zeros(1, 1, NKV, HEAD_DIM, dtype=torch.bfloat16)
        norm = torch.ones(HEAD_DIM, dtype=torch.bfloat16)
        rope_in = RopeInputs(kv, kv, norm, norm, 1e-6, *rope_tables(HEAD_DIM, 1e6, 256))
    else:
        q = torch.zeros(1, NH, 1, HEAD_DIM, dtype=torch.bfloat16)
        rope_in = None
    args, kwargs = captured_one(attention, "decode_attention_kernel", lambda: attention.decode_attention(
        q, cache, cache, torch.full((1, 1), 99, dtype=torch.long), 100, cfg=cfg, rope=rope_in))
    return args, {**kwargs, "PDL": True}


def captured_one(module, name: str, call) -> tuple[tuple, dict]:
    """The (args, kwargs) `call` launches module.<name> with (nothing runs: the launch is caught).
    A prefetch site's PF_ASM is set as on the GPU (the capture's CPU tensors turn it off)."""
    from moebench.engine.kernels import runtime
    caught = {}

    def run(*args, grid, warmup, **kwargs):
        caught["launch"] = (args, kwargs)
    fn = getattr(module, name)
    saved = (runtime.IMPORT_ERROR, fn.run)
    runtime.IMPORT_ERROR = None
    fn.run = run
    try:
        call()
    finally:
        runtime.IMPORT_ERROR, fn.run = saved
    args, kwargs = caught["launch"]
    if kwargs.get("PF_PARTS"):
        kwargs = {**kwargs, "PF_ASM": True}
    return args, kwargs


def compile_captured(fn, args: tuple, kwargs: dict):
    """Compile fn for sm_90 with the signature, constants and alignment attributes its JIT would
    derive from these arguments (triton.runtime.jit's specialization)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend
    params = fn.params
    bound = dict(zip([p.name for p in params], args))
    bound.update({k: v for k, v in kwargs.items() if k in {p.name for p in params}})
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(params):
        value = bound[p.name] if p.name in bound else p.default
        if p.is_constexpr:
            sig[p.name] = "constexpr"
            consts[(i,)] = value
            continue
        ty, key = native_specialize_impl(CUDABackend, value, p.is_const, not p.do_not_specialize,
                                         not p.do_not_specialize_on_alignment)
        sig[p.name] = ty
        if ty == "constexpr":
            consts[(i,)] = value
        elif key:
            attrs[(i,)] = CUDABackend.parse_attr(key)
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    return triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options=options)


def sass_report(compiled) -> dict:
    """Registers, spill bytes and the opcode counts of a compiled kernel's cubin."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([str(TOOLS / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([str(TOOLS / "cuobjdump"), "--dump-resource-usage", str(cubin)],
                               capture_output=True, text=True, check=True).stdout
    ops = collections.Counter()
    evict_first = 0
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\S*)", line)
        if m:
            ops[m.group(1)] += 1
            evict_first += m.group(1) == "LDG" and ".EF" in m.group(2)
    regs = re.search(r"REG:(\d+)", usage)
    spill = re.search(r"STACK:(\d+)", usage)
    return {"registers": int(regs.group(1)) if regs else None, "stack_bytes": int(spill.group(1)) if spill else None,
            "instructions": sum(ops.values()), "ops": dict(ops.most_common()), "ldg_evict_first": evict_first}


# opcode families worth a column: memory, integer, conversion, float
COLUMNS = {"LDG": ("LDG",), "LDS/STS": ("LDS", "STS"), "int": ("IMAD", "IADD3", "SHF", "LOP3", "LEA", "SGXT",
           "PRMT", "VIADD", "ISETP", "IMNMX"), "cvt": ("I2F", "I2FP", "F2I", "F2F", "I2I"),
           "float": ("FFMA", "FADD", "FMUL", "FMNMX", "HADD2", "HFMA2", "HMUL2"), "dp4a": ("IDP",),
           "shfl": ("SHFL",), "redux": ("REDUX",), "cctl": ("CCTL",)}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernels", default="gate_up,down",
                    help="of gate_up, down, ffn (both in one launch: DecodeConfig.fused_experts), router "
                         "(the fused norm + router), rope (q/k norm + RoPE + KV write) and attention (decode "
                         "attention: a row without and one with early_weights \"attention_kv\", format "
                         "early_kv, and one with rope_in_attention, format rope): router, rope and attention "
                         "ignore the formats")
    ap.add_argument("--formats", default="dense,int8,int4,ternary,ternary:bytes,ternary2",
                    help="formats, each optionally with a decode mode by name (ternary:bytes)")
    ap.add_argument("--mode", type=int, default=None, help="DecodeConfig.decode_mode value (default: the shipped one)")
    ap.add_argument("--launch", default=None, metavar="BN,BK,WARPS,STAGES", help="one shape for every format")
    ap.add_argument("--no-evict-first", action="store_true",
                    help="gate_up and down without DecodeConfig.experts_evict_first (on by default: the bf16 "
                         "weight loads carry L2's evict-first hint, ldg_evict_first in --json)")
    ap.add_argument("--packed-evict-first", action="store_true",
                    help="gate_up and down with DecodeConfig.packed_evict_first (off by default): the packed "
                         "formats' word and byte loads carry the evict-first hint too")
    ap.add_argument("--l2-prefetch", action="store_true",
                    help="router and rope with DecodeConfig.l2_prefetch's programs (the cctl column: L2 prefetches)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    rows = []
    print(f"{'kernel':9s} {'format':9s} mode  {'launch':18s} regs stack  instr " +
          " ".join(f"{c:>7s}" for c in COLUMNS))
    kernel_names = args.kernels.split(",")

    def add_row(kernel: str, fmt: str, mode: int, shape: tuple, rep: dict) -> None:
        cols = {c: sum(rep["ops"].get(o, 0) for o in opcodes) for c, opcodes in COLUMNS.items()}
        rows.append({"kernel": kernel, "format": fmt, "mode": mode, "launch": shape, **rep, "columns": cols})
        launch = "(" + ",".join(map(str, shape)) + ")"
        print(f"{kernel:9s} {fmt:9s} {mode:4d}  {launch:18s} {rep['registers']!s:>4s} {rep['stack_bytes']!s:>5s} "
              f"{rep['instructions']:6d} " + " ".join(f"{cols[c]:7d}" for c in COLUMNS), flush=True)

    sites = replace(DEFAULT, l2_prefetch=L2_PREFETCH_SITES) if args.l2_prefetch else DEFAULT
    if "router" in kernel_names:
        from moebench.engine.kernels import norm_router
        kargs, kkw = captured_router(sites)
        add_row("router", "dense", 0, (kkw["BE"], kkw["BH"], kkw.get("num_warps"), kkw.get("num_stages")),
                sass_report(compile_captured(norm_router.add_rmsnorm_router_kernel, kargs, kkw)))
        kernel_names.remove("router")
    if "rope" in kernel_names:
        from moebench.engine.kernels import rope_kv
        kargs, kkw = captured_rope(sites)
        add_row("rope", "dense", 0, (kkw["D"], kkw.get("num_warps")),
                sass_report(compile_captured(rope_kv.qk_rope_cache_kernel, kargs, kkw)))
        kernel_names.remove("rope")
    if "attention" in kernel_names:
        from moebench.engine.kernels import attention
        early_kv = replace(sites, early_weights=(*sites.early_weights, "attention_kv"))
        for fmt, cfg, rope in (("dense", sites, False), ("early_kv", early_kv, False), ("rope", sites, True)):
            kargs, kkw = captured_attention(cfg, rope)
            add_row("attention", fmt, 0, (kkw["BLOCK_S"], kkw.get("num_warps"), kkw.get("num_stages")),
                    sass_report(compile_captured(attention.decode_attention_kernel, kargs, kkw)))
        kernel_names.remove("attention")
    for spec in args.formats.split(",") if kernel_names else []:
        fmt, _, mode_name = spec.partition(":")
        cfg = replace(DEFAULT, experts_evict_first=not args.no_evict_first, packed_evict_first=args.packed_evict_first)
        if args.mode is not None:
            cfg = replace(cfg, decode_mode=DecodeMode(args.mode))
        elif mode_name:
            cfg = replace(cfg, mode_by_format={fmt: DecodeMode[mode_name.upper()]})
        if args.launch:
            bn, bk, warps, stages = map(int, args.launch.split(","))
            cfg = cfg.with_launches(dict(BN=bn, BK=bk, num_warps=warps, num_stages=stages), formats=[fmt])
        caught = captured_launches(fmt, cfg)
        if "ffn" in kernel_names:
            caught.update(captured_launches(fmt, replace(cfg, fused_experts=True)))
        for kernel in kernel_names:
            kargs, kkw = caught[kernel]
            if kernel == "ffn":
                add_row(kernel, fmt, kkw["MODE_GU"], (kkw["BN_GU"], kkw["BK_GU"], kkw["BN_DN"], kkw["BK_DN"],
                                                      kkw.get("num_warps"), kkw.get("num_stages")),
                        sass_report(compile_captured(moe_kernels.expert_ffn_kernel, kargs, kkw)))
                continue
            fn = moe_kernels.gate_up_kernel if kernel == "gate_up" else moe_kernels.down_kernel
            add_row(kernel, fmt, kkw["MODE_A"], (kkw["BN"], kkw["BK_A"], kkw.get("num_warps"), kkw.get("num_stages")),
                    sass_report(compile_captured(fn, kargs, kkw)))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
