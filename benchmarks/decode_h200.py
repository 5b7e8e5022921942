"""Engine decode speed on one GPU, every variant in one run: bf16 (the gather path and the fused Triton
kernels; A/Bs of PDL, cuBLAS projections, the deferred MoE sum, decode-ahead), quantized experts
(int4; hot int8 + cold ternary or ternary2; each again with int8 activations, the `*_a8` plans), the
half-experts-in-host-RAM plans against their tier-aware bound (without prefetch, with it, and with
the guess from the attention input; plus how often the guess is right), batch 1/4/16/64 throughput,
prefill at 4,096 tokens, launch sweeps of the expert, GEMV, attention and router kernels (cold
weights), a kernel-time profile of one decode step per plan and, with --timeline, one
graph-replayed step's kernel timeline per plan and prefetch mode.

    python benchmarks/decode_h200.py --out $OUT          # Qwen3-30B-A3B shape, cuda, bf16
    python benchmarks/decode_h200.py --small             # CPU smoke test of every code path
    python benchmarks/decode_h200.py --list              # the variants, in run order

Each variant is one function in VARIANTS (run in that order; --only / --skip pick). The random
model is built once (transformers, on the device) and every engine shares its non-expert tensors;
quantized variants quantize the same expert weights. A variant that fails is recorded and the
others run. The sweeps update the run's own DecodeConfig (`Bench.decode`), which the engines built
after them use; the engine's shipped defaults are never changed. MBU (model bandwidth utilisation)
= tok/s x bytes read per token / measured device copy bandwidth (read + write). Bytes per token use
the routing of the bf16 model on the greedy continuation of the prompt.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from typing import Callable

import torch
import torch.nn.functional as F

if "--small" in sys.argv or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before anything imports triton

from moebench.bench.decode_bench import Bench, Skipped, common_args, pick_variants, run_variants, setup  # noqa: E402
from moebench.bench.engine_setup import dense_expert_weights, quantize_stacked, tiered_experts  # noqa: E402
from moebench.bench.measure import (decode_host_share, expert_bytes_per_token, log, profile_step,  # noqa: E402
                                    step_timeline, sweep_gemv, sweep_kernel_configs, time_graph, tier_bound)
from moebench.bench.reference_model import decode_rate, timed  # noqa: E402
from moebench.engine import Engine, kernels  # noqa: E402
from moebench.engine.decode_config import DecodeConfig  # noqa: E402


VARIANTS: dict[str, Callable[[Bench], dict]] = {}


def variant(name: str):
    def add(fn):
        VARIANTS[name] = fn
        return fn
    return add


# ---- references ------------------------------------------------------------------------------------

@variant("transformers_batched_mm")
def transformers_batched_mm(b: Bench) -> dict:
    b.hf.set_experts_implementation("batched_mm")
    prompt_t = torch.tensor([b.prompt], device=b.device)

    def run_hf(n):
        with torch.inference_mode():
            b.hf.generate(prompt_t, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    # transformers' generate has no per-token clock: the difference of two generate calls
    # (n_long - n_short tokens over the time difference; its prefill time is steady).
    rate = decode_rate(run_hf, b.n_short, b.n_long, b.device, b.args.reps)
    log(f"transformers [batched_mm]: {rate:.2f} tok/s, MBU {b.mbu(rate, b.R['active_bytes']):.1f}%")
    return {"tok_s": rate, "bytes_per_token": b.R["active_bytes"], "mbu_pct": b.mbu(rate, b.R["active_bytes"])}


@variant("engine_bf16_gather_graphs")
def engine_bf16_gather_graphs(b: Bench) -> dict:
    return b.bf16_rate(b.shared("gather", lambda: b.engine(DecodeConfig())), "auto/gather")


# ---- launch sweeps (they update the run's DecodeConfig for the variants after them) -----------------

@variant("kernel_sweep")
def kernel_sweep(b: Bench) -> dict:
    if b.args.no_sweep or b.small:
        raise Skipped
    H, k, E = b.cfg.hidden_size, b.cfg.top_k, b.cfg.num_experts
    elem = torch.finfo(b.dtype).bits // 8
    groups = {"dense": (kernels.dense_group(*dense_expert_weights(b.hf, 0)), 3 * H * b.cfg.expert_intermediate_size * elem)}
    for fmt in ("int8", "int4", "ternary", "ternary2"):
        mats = [kernels.PackedMatrix.stack(quantize_stacked(w, fmt), b.device) for w in dense_expert_weights(b.hf, 0)]
        groups[fmt] = (kernels.ExpertGroup(*mats, None, fmt), sum(m.nbytes_per_slot for m in mats))
    res, b.decode = sweep_kernel_configs(groups, H, k, E, b.device, b.dtype, b.bw, b.decode)
    # The host plans keep their cold (ternary) experts in pinned host memory: sweep that too.
    mats = [kernels.PackedMatrix.stack(quantize_stacked(w, "ternary"), b.device, pin=True)
            for w in dense_expert_weights(b.hf, 0)]
    res["host"], b.decode = sweep_kernel_configs(
        {"ternary": (kernels.ExpertGroup(*mats, None, "ternary@host"), sum(m.nbytes_per_slot for m in mats))},
        H, k, E, b.device, b.dtype, b.bw, b.decode, host=True)
    res["launch"] = b.decode.identity()["launch"]
    return res


@variant("gemv_sweep")
def gemv_sweep(b: Bench) -> dict:
    if b.args.no_sweep:
        raise Skipped
    res, b.decode = sweep_gemv(b.hf, b.device, b.dtype, b.decode)
    return res


@variant("attention_sweep")
def attention_sweep(b: Bench) -> dict:
    """decode_attention (one kernel) against the mask + sdpa + transpose it replaces, one layer's
    shape at batch 1; the run keeps the fastest launch."""
    if b.args.no_sweep or b.small:
        raise Skipped
    NH, NKV, D = b.cfg.num_heads, b.cfg.num_kv_heads, b.cfg.head_dim
    out = {}
    for S in (256, 4096):
        q = torch.randn(1, NH, 1, D, device=b.device, dtype=b.dtype)
        kc = torch.randn(1, NKV, S, D, device=b.device, dtype=b.dtype)
        vc = torch.randn_like(kc)
        pos = torch.full((1, 1), S - 1, device=b.device)

        def torch_path():
            slots = torch.arange(S, device=b.device)
            mask = (slots[None, None, :] <= pos[:, :, None]).unsqueeze(1)
            o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)
            return o.transpose(1, 2).reshape(1, 1, NH * D)
        res = {"torch_us": time_graph(torch_path, b.device) * 1e6, "configs": []}
        for c in ((32, 4, 2), (16, 4, 2), (64, 8, 2), (32, 4, 3), (16, 2, 2)):
            trial = replace(b.decode, attention=replace(b.decode.attention, block_s=c[0], num_warps=c[1],
                                                        num_stages=c[2]))
            try:
                res["configs"].append((c, time_graph(lambda: kernels.decode_attention(q, kc, vc, pos, S, cfg=trial),
                                                     b.device) * 1e6))
            except Exception as e:  # noqa: BLE001
                log(f"  attention {c}: {type(e).__name__}: {e}")
        out[str(S)] = res
    best = min(out["256"]["configs"], key=lambda r: r[1] + dict(out["4096"]["configs"])[r[0]])[0]
    b.decode = replace(b.decode, attention=replace(b.decode.attention, block_s=best[0], num_warps=best[1],
                                                   num_stages=best[2]))
    out["best"] = best
    for S, r in out.items():
        if S != "best":
            log(f"  attention kv_len {S}: torch mask+sdpa+transpose {r['torch_us']:.1f} us; triton "
                + ", ".join(f"{c}: {t:.1f} us" for c, t in r["configs"]))
    log(f"  attention launch kept: BLOCK_S={best[0]} num_warps={best[1]} num_stages={best[2]}")
    return out


@variant("router_sweep")
def router_sweep(b: Bench) -> dict:
    """kernels.router_topk (router GEMV + softmax/top-k, one launch) against F.linear + route_topk,
    layer 0's router at batch 1; the run keeps the fastest router launch."""
    if b.args.no_sweep or b.small:
        raise Skipped
    H, k = b.cfg.hidden_size, b.cfg.top_k
    wr = b.hf.model.layers[0].mlp.gate.weight.detach()
    xr = torch.randn(1, H, device=b.device, dtype=b.dtype)
    out = {"torch_us": time_graph(lambda: kernels.route_topk(F.linear(xr, wr), k, True), b.device) * 1e6,
           "configs": []}
    for c in ((4, 1024, 1), (2, 1024, 1), (2, 2048, 1), (8, 512, 2), (4, 512, 1), (1, 2048, 1)):
        trial = b.decode.with_launch("router", "dense", BN=c[0], BK=c[1], num_warps=c[2], num_stages=2)
        try:
            out["configs"].append((c, time_graph(lambda: kernels.router_topk(xr, wr, k, True, cfg=trial),
                                                 b.device) * 1e6))
        except Exception as e:  # noqa: BLE001
            log(f"  router {c}: {type(e).__name__}: {e}")
    best, t = min(out["configs"], key=lambda r: r[1])
    b.decode = b.decode.with_launch("router", "dense", BN=best[0], BK=best[1], num_warps=best[2], num_stages=2)
    out.update(best=best, fused_faster=t < out["torch_us"])
    log(f"  router: F.linear + route_topk {out['torch_us']:.1f} us; fused " +
        ", ".join(f"{c}: {u:.1f} us" for c, u in out["configs"]))
    return out


@variant("norm_router_ab")
def norm_router_ab(b: Bench) -> dict:
    """add_rmsnorm + router_topk (two launches) against add_rmsnorm_router (one), layer 0's
    post-attention norm and router at batch 1; the run keeps whichever is faster."""
    if b.small:
        raise Skipped
    H, k = b.cfg.hidden_size, b.cfg.top_k
    layer = b.hf.model.layers[0]
    wr = layer.mlp.gate.weight.detach()
    nw = layer.post_attention_layernorm.weight.detach()
    xr, ar = (torch.randn(1, 1, H, device=b.device, dtype=b.dtype) for _ in range(2))
    cfg = b.decode

    def two():
        _, hn = kernels.add_rmsnorm(xr, ar, nw, 1e-6, cfg=cfg)
        return kernels.router_topk(hn.view(1, H), wr, k, True, cfg=cfg)
    out = {"two_launches_us": time_graph(two, b.device) * 1e6,
           "fused_us": time_graph(lambda: kernels.add_rmsnorm_router(xr, ar, nw, 1e-6, wr, k, True, cfg=cfg),
                                  b.device) * 1e6}
    b.decode = replace(b.decode, fused_norm_router=out["fused_us"] < out["two_launches_us"])
    out["fused_used"] = b.decode.fused_norm_router
    log(f"  post-attention norm + router: add_rmsnorm + router_topk {out['two_launches_us']:.1f} us, "
        f"add_rmsnorm_router {out['fused_us']:.1f} us; the run uses the "
        f"{'fused' if out['fused_used'] else 'two-launch'} path")
    return out


# In-chain launch candidates per (kernel, format): (BN, BK, num_warps, num_stages), each tried
# against the config's own shape (timed first, as "current"). Attention: (block_s, num_warps, num_stages).
CHAIN_CANDIDATES = {
    ("norm", "dense"): [(1, 2048, 8, 1), (1, 2048, 16, 1), (1, 2048, 2, 1)],
    ("gemv", "dense"): [(4, 1024, 4, 3), (2, 2048, 4, 2), (4, 512, 4, 4), (8, 512, 8, 3), (1, 2048, 4, 2)],
    ("router", "dense"): [(4, 2048, 1, 2), (2, 2048, 2, 2), (4, 2048, 2, 2), (8, 2048, 4, 2), (1, 2048, 1, 2)],
    ("gate_up", "dense"): [(4, 1024, 4, 3), (1, 2048, 4, 2), (2, 1024, 4, 3), (4, 2048, 8, 2)],
    ("down", "dense"): [(8, 256, 4, 3), (16, 128, 4, 3), (32, 256, 8, 3), (8, 512, 4, 2)],
    ("gate_up", "ternary"): [(1, 512, 1, 2), (2, 512, 2, 2), (1, 512, 2, 2), (2, 512, 4, 3), (8, 512, 4, 3),
                             (4, 256, 4, 3), (2, 256, 2, 2)],
    ("down", "ternary"): [(4, 256, 2, 2), (16, 256, 4, 3), (2, 256, 1, 2), (4, 256, 4, 3), (8, 128, 4, 3)],
    # all-int8 / all-int4 plans, float x and int8 x ("a8"; gate_up BN 8 at least): more programs
    # (BN 4), whole rows per step, more warps
    ("gate_up", "int8"): [(4, 512, 4, 3), (8, 1024, 4, 2), (4, 1024, 4, 2), (8, 2048, 8, 2), (16, 512, 8, 3),
                          (2, 2048, 4, 2)],
    ("down", "int8"): [(8, 256, 4, 3), (16, 128, 4, 3), (8, 128, 4, 3), (32, 256, 8, 3), (16, 512, 4, 2)],
    ("gate_up", "int4"): [(4, 256, 4, 3), (8, 512, 4, 3), (4, 512, 4, 3), (8, 1024, 4, 2), (16, 256, 8, 3),
                          (2, 1024, 4, 2)],
    ("down", "int4"): [(8, 256, 4, 3), (16, 128, 4, 3), (8, 128, 4, 3), (32, 256, 8, 3), (16, 512, 4, 2)],
    ("gate_up", "int8", "a8"): [(8, 512, 4, 3), (8, 2048, 4, 2), (8, 1024, 8, 3), (16, 1024, 8, 3)],
    ("down", "int8", "a8"): [(8, 256, 4, 3), (16, 128, 4, 2), (8, 128, 4, 2), (32, 256, 8, 3)],
    ("gate_up", "int4", "a8"): [(8, 512, 4, 3), (8, 2048, 4, 2), (8, 1024, 8, 2), (16, 1024, 8, 2)],
    ("down", "int4", "a8"): [(8, 128, 4, 2), (16, 256, 4, 2), (32, 128, 8, 2), (8, 256, 4, 3)],
    # DecodeConfig fields: ("decode", field) -> values
    ("decode", "early_weights"): [("router", "gemv", "down", "down_packed", "attention_kv")],
    ("decode", "early_steps"): [1, 3, 4],
}
ATTENTION_CANDIDATES = [(64, 4, 2), (64, 8, 2), (128, 8, 2), (16, 4, 2)]


def chain_sweep_engine(b: Bench, eng: Engine, keys: list, label: str, attention: bool = False) -> dict:
    """Coordinate descent over launch shapes measured in the decode chain itself (CUDA graphs, PDL:
    the isolated-kernel sweeps above time one kernel alone, which misses how it overlaps its
    neighbours). For each (kernel, format) in `keys`, each candidate is tried with the others at
    the best so far; a candidate replaces the current shape only when it is more than 1% faster
    (the run-to-run spread is ~0.5%). Returns the trials; the engine keeps the best config."""
    cfg = eng.decode
    best = b.rate(eng)["tok_s"]
    trials = [{"config": "current", "tok_s": best}]
    log(f"  chain sweep {label}: current {best:.2f} tok/s")
    steps = [(key, c) for key in keys for c in CHAIN_CANDIDATES[key]]
    if attention:
        steps += [(("attention", ""), c) for c in ATTENTION_CANDIDATES]
    for key, c in steps:
        kernel, fmt, a8 = key[0], key[1], key[2:] == ("a8",)
        if kernel == "attention":
            trial = replace(cfg, attention=replace(cfg.attention, block_s=c[0], num_warps=c[1], num_stages=c[2]))
        elif kernel == "decode":
            trial = replace(cfg, **{fmt: c})
        else:
            trial = cfg.with_launch(kernel, fmt, a8=a8, BN=c[0], BK=c[1], num_warps=c[2], num_stages=c[3])
        try:
            eng.reconfigure(trial)
            rate = b.rate(eng)["tok_s"]
        except Exception as e:  # noqa: BLE001 - a shape that does not compile is a result too
            trials.append({"config": f"{'/'.join(key)} {c}", "error": f"{type(e).__name__}: {e}"[:300]})
            log(f"    {'/'.join(key)} {c}: {trials[-1]['error']}")
            continue
        trials.append({"config": f"{'/'.join(key)} {c}", "tok_s": rate})
        kept = rate > 1.01 * best
        log(f"    {'/'.join(key)} {c}: {rate:.2f} tok/s{' (kept)' if kept else ''}")
        if kept:
            best, cfg = rate, trial
    eng.reconfigure(cfg)
    return {"trials": trials, "best_tok_s": best, "launch": cfg.identity()["launch"],
            "attention": cfg.identity()["attention"],
            "decode": {k[1]: cfg.identity()[k[1]] for k in keys if k[0] == "decode"}}


@variant("chain_sweep")
def chain_sweep(b: Bench) -> dict:
    """chain_sweep_engine on bf16 (early_weights with "attention_kv", norm, GEMV, router, dense
    experts, attention), then on the hot int8 / cold base-3 ternary plan (the ternary launches,
    whose few cold pairs per layer run on a side stream). The run keeps the winners (`Bench.decode`)
    for the variants after it."""
    if b.args.no_sweep or b.small:
        raise Skipped
    eng = b.engine()
    out = {"bf16": chain_sweep_engine(b, eng, [("decode", "early_weights"), ("norm", "dense"), ("gemv", "dense"),
                                               ("router", "dense"), ("gate_up", "dense"), ("down", "dense")],
                                      "bf16", attention=True)}
    b.decode = eng.decode
    del eng
    precision, home = b.plans["int8hot_ternarycold_gpu"]
    eng = b.engine(experts=tiered_experts(b.hf, precision, home, b.device, b.dtype))
    out["int8hot_ternarycold_gpu"] = chain_sweep_engine(b, eng, [("gate_up", "ternary"), ("down", "ternary")],
                                                        "int8hot_ternarycold_gpu")
    b.decode = replace(b.decode, launch=eng.decode.launch)
    return out


@variant("chain_sweep_quant")
def chain_sweep_quant(b: Bench) -> dict:
    """chain_sweep_engine on the all-int8 and all-int4 plans, with float x and with int8 x (their
    shapes were swept one kernel alone, not in the decode chain), after early_weights with
    "attention_kv" and early_steps (how many K steps load before the wait; the GEMVs' too). The run
    keeps the winners."""
    if b.args.no_sweep or b.small:
        raise Skipped
    out = {}
    for name in ("int8", "int4", "int8_a8", "int4_a8"):
        fmt, a8 = name.split("_")[0], name.endswith("_a8")
        precision, home = b.plans[name]
        eng = b.engine(replace(b.decode, int8_activations=a8),
                       experts=tiered_experts(b.hf, precision, home, b.device, b.dtype))
        suffix = ("a8",) if a8 else ()
        out[name] = chain_sweep_engine(b, eng, [("decode", "early_weights"), ("decode", "early_steps"),
                                                ("gate_up", fmt) + suffix, ("down", fmt) + suffix], name)
        b.decode = replace(b.decode, launch=eng.decode.launch)    # early_weights: each plan tries its own
        del eng
    return out


# ---- bf16 through the fused kernels ----------------------------------------------------------------

def fused_bf16(b: Bench) -> Engine:
    return b.shared("fused", lambda: b.engine())


@variant("parity_fused_vs_reference")
def parity_fused_vs_reference(b: Bench) -> dict:
    n = min(16, b.args.prompt_len)   # <= fused_max_tokens: this prefill runs the fused kernels
    with torch.inference_mode():
        ref = b.hf(torch.tensor([b.prompt[:n]], device=b.device)).logits[0].float().cpu()
    eng = fused_bf16(b)
    got = eng.logits(b.prompt[:n])
    old = b.shared("gather", lambda: b.engine(DecodeConfig())).logits(b.prompt[:n])
    new_tokens = eng.generate([b.prompt], b.n_long, ignore_eos=True)[0].token_ids
    agree = next((i for i, (x, y) in enumerate(zip(new_tokens, b.ref_tokens)) if x != y), len(b.ref_tokens))
    r = {"max_abs_diff_vs_transformers": (got - ref).abs().max().item(),
         "max_abs_diff_gather_vs_transformers": (old - ref).abs().max().item(),
         "logit_scale": ref.abs().max().item(), "argmax_agree": (got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
         "greedy_prefix_agree_with_gather": agree, "greedy_tokens": len(b.ref_tokens)}
    log(f"parity (fused vs transformers, {n} tokens): max |diff| {r['max_abs_diff_vs_transformers']:.4g} "
        f"(gather path {r['max_abs_diff_gather_vs_transformers']:.4g}; logits up to {r['logit_scale']:.3g}); argmax "
        f"agree {100 * r['argmax_agree']:.0f}%; greedy decode equals the gather path for {agree}/{len(b.ref_tokens)}")
    return r


@variant("engine_bf16_triton_graphs")
def engine_bf16_triton_graphs(b: Bench) -> dict:
    eng = fused_bf16(b)
    r = b.bf16_rate(eng, "triton")
    if b.args.timeline and b.device.type == "cuda":
        try:
            tl = step_timeline(eng, b.prompt, b.out_dir / "timeline_bf16_plain.json")
        except Exception as e:  # noqa: BLE001 (a diagnostic: never lose the row's figures)
            tl = {"error": f"{type(e).__name__}: {e}"}
        r["timeline"] = {"plain": tl}
        if "error" in tl:
            log(f"  timeline: {tl['error']}")
        else:
            log(f"  timeline: a step every {tl['period_us']:.0f} us, {tl['kernels']} kernels; some kernel ran "
                f"for {tl['busy_us']:.0f} us of it, none for {tl['idle_us']:.0f} us")
    return r


@variant("engine_bf16_triton_graphs_no_pdl")
def engine_bf16_triton_graphs_no_pdl(b: Bench) -> dict:
    """A/B: the same decode without programmatic dependent launch."""
    r = b.bf16_rate(b.engine(replace(b.decode, pdl=False)), "triton, PDL off")
    r["pdl_supported_here"] = kernels.pdl_launch(b.device, b.decode).get("launch_pdl", False)
    return r


@variant("engine_bf16_triton_graphs_step_by_step")
def engine_bf16_triton_graphs_step_by_step(b: Bench) -> dict:
    """A/B: the host takes each token before the next step is queued (Engine.decode_ahead off):
    the GPU idles while the host copies, checks and launches."""
    eng = fused_bf16(b)
    eng.decode_ahead = False
    try:
        return b.bf16_rate(eng, "triton, step by step")
    finally:
        eng.decode_ahead = True


@variant("engine_bf16_triton_graphs_moe_sum_kernel")
def engine_bf16_triton_graphs_moe_sum_kernel(b: Bench) -> dict:
    """A/B: moe_sum as its own launch (defer_moe_sum off)."""
    return b.bf16_rate(b.engine(replace(b.decode, defer_moe_sum=False)), "triton, moe_sum not deferred")


@variant("engine_bf16_triton_cublas_graphs")
def engine_bf16_triton_cublas_graphs(b: Bench) -> dict:
    """A/B: the attention projections through cuBLAS (gemv_max_tokens=0) instead of the GEMV; the
    runs after it use cuBLAS only on a clear win (> 2%)."""
    r = b.bf16_rate(b.engine(replace(b.decode, gemv_max_tokens=0)), None)
    base = b.R["variants"].get("engine_bf16_triton_graphs", {}).get("tok_s", 0.0)
    if r["tok_s"] > 1.02 * base:
        b.decode = replace(b.decode, gemv_max_tokens=0)
    r["used_for_later_runs"] = b.decode.gemv_max_tokens == 0
    log(f"engine bf16 [triton, cuBLAS projections{'+graphs' if b.graphs else ''}]: {r['tok_s']:.2f} tok/s, MBU "
        f"{r['mbu_pct']:.1f}% (GEMV projections: {base:.2f}); later runs use "
        f"{'cuBLAS' if r['used_for_later_runs'] else 'the GEMV'}")
    return r


@variant("profile_bf16_triton_step")
def profile_bf16_triton_step(b: Bench) -> dict:
    p = profile_step(b.engine(cuda_graphs=False), b.prompt, b.device)
    log(f"decode step, fused ops: {p['kernels_per_step']:.0f} kernels/step, {p['kernel_ms_per_step']:.3f} ms kernel "
        f"time/step; top kernels over 5 eager steps (ms, count):")
    for name, count, ms in p["rows"][:20]:
        log(f"  {ms:9.3f} {count:6d}  {name}")
    return p


@variant("engine_bf16_triton_graphs_no_fused_ops")
def engine_bf16_triton_graphs_no_fused_ops(b: Bench) -> dict:
    return b.bf16_rate(b.engine(replace(b.decode, fused_ops=False, gemv_max_tokens=0)), "triton, fused_ops off")


# ---- quantized experts -----------------------------------------------------------------------------

@variant("prefetch_prediction")
def prefetch_prediction(b: Bench) -> dict:
    """How well prefetch's guess (layer l+1's router on layer l's MoE input) names layer l+1's
    picks, on the bf16 model's decode positions: share of all picks, and of the picks of the
    calibrated plan's cold (host) experts, that the guess had in its top k."""
    moe_in: dict[int, torch.Tensor] = {}
    attn_in: dict[int, torch.Tensor] = {}      # one sublayer earlier: layer l's normed attention input
    layers = b.hf.model.layers
    hooks = [layer.mlp.register_forward_hook(lambda m, a, o, i=i: moe_in.__setitem__(i, a[0].detach()))
             for i, layer in enumerate(layers)]
    hooks += [layer.input_layernorm.register_forward_hook(lambda m, a, o, i=i: attn_in.__setitem__(i, o.detach()))
              for i, layer in enumerate(layers)]
    try:
        with torch.inference_mode():
            b.hf(torch.tensor([b.prompt + b.ref_tokens], device=b.device))
    finally:
        for hk in hooks:
            hk.remove()
    n0, k = len(b.prompt), b.cfg.top_k

    def shares(source: dict) -> tuple[int, float, int, float]:
        hit = tot = cold_hit = cold_tot = 0
        for l in range(len(layers) - 1):
            wr = layers[l + 1].mlp.gate.weight.detach().float()     # no autograd (--small's weights want it)
            pred = (source[l][0, n0:].float() @ wr.T).topk(k, dim=-1).indices.tolist()
            act = (moe_in[l + 1][0, n0:].float() @ wr.T).topk(k, dim=-1).indices.tolist()
            for p, a in zip(pred, act):
                for e in a:
                    tot += 1
                    hit += e in p
                    if e not in b.hot[l + 1]:
                        cold_tot += 1
                        cold_hit += e in p
        return tot, hit / max(1, tot), cold_tot, cold_hit / max(1, cold_tot)
    tot, share, cold_tot, cold_share = shares(moe_in)
    _, share_a, _, cold_share_a = shares(attn_in)
    r = {"picks": tot, "predicted_share": share, "cold_picks": cold_tot, "cold_predicted_share": cold_share,
         "from_attention_input": {"predicted_share": share_a, "cold_predicted_share": cold_share_a}}
    log(f"prefetch guess (router l+1 on layer l's MoE input): {100 * share:.1f}% of {tot} decode picks, "
        f"{100 * cold_share:.1f}% of the {cold_tot} cold-expert picks; from layer l's attention input "
        f"(one sublayer earlier): {100 * share_a:.1f}% and {100 * cold_share_a:.1f}%")
    return r


def plan_variant(b: Bench, name: str) -> dict:
    """One expert plan (engine_setup.expert_plans; "_a8": with int8 activations): rate, bytes per
    token from this engine's own routing, a decode step's kernel profile, step by step; host plans
    also without the side-stream overlap, with prefetch and with prefetch from the attention input,
    against their tier-aware bound."""
    precision, home = b.plans[name]
    H, I = b.cfg.hidden_size, b.cfg.expert_intermediate_size
    t = time.perf_counter()
    eng = b.engine(replace(b.decode, int8_activations=name.endswith("_a8")),
                   experts=tiered_experts(b.hf, precision, home, b.device, b.dtype))
    build_s = time.perf_counter() - t
    r = b.rate(eng)
    toks = r.pop("tokens")
    # Bytes per token from THIS engine's routing on its own continuation: quantized experts change
    # the hidden states and so the routing (the bf16 model's routes, also kept, can miss host picks).
    own = eng.trace(b.prompt + toks, router_logits=False)
    split = expert_bytes_per_token([ids[len(b.prompt):] for ids in own.topk_ids], precision, home, H, I)
    split_bf16 = expert_bytes_per_token(b.routes, precision, home, H, I)
    r["pcie_bytes_per_token_bf16_routes"] = split_bf16["pcie"]
    r["host_expert_share_of_picks"] = sum(
        sum(home[l][e] == "host" for e in ids[len(b.prompt):].flatten().tolist())
        for l, ids in enumerate(own.topk_ids)) / max(1, sum(ids[len(b.prompt):].numel() for ids in own.topk_ids))
    nbytes = b.non_expert_bytes + split["hbm"] + split["pcie"]
    r.update(build_s=build_s, bytes_per_token=nbytes, hbm_bytes_per_token=b.non_expert_bytes + split["hbm"],
             pcie_bytes_per_token=split["pcie"], mbu_pct=b.mbu(r["tok_s"], nbytes),
             greedy_prefix_agree_with_bf16=next((i for i, (x, y) in enumerate(zip(toks, b.ref_tokens)) if x != y),
                                                len(b.ref_tokens)))
    msg = (f"engine {name} [triton{'+graphs' if b.graphs else ''}]: {r['tok_s']:.2f} tok/s, "
           f"{nbytes / 1e9:.3f} GB/token, MBU {r['mbu_pct']:.1f}%")
    has_host = "host" in {h for row in home for h in row}
    host_note = ""
    if has_host:
        # the share of picks on host experts in the fused decode steps themselves (the trace above is
        # a prefill through the per-expert path, whose routing can differ slightly)
        r["host_share_of_decode_picks"] = decode_host_share(eng, b.prompt, b.n_short, home)
        host_note = f"host share of decode picks {100 * r['host_share_of_decode_picks']:.1f}%; "
    eng.cuda_graphs = False
    try:
        p = profile_step(eng, b.prompt, b.device, top=10)
    finally:
        eng.cuda_graphs = b.graphs
    r["profile"] = p
    log(f"  {name}: {host_note}{p['kernels_per_step']:.0f} kernels/step, {p['kernel_ms_per_step']:.3f} ms kernel "
        f"time/step:")
    for kname, count, ms in p["rows"][:10]:
        log(f"    {ms:9.3f} {count:6d}  {kname}")

    def timeline(mode: str) -> None:
        if not b.args.timeline or b.device.type != "cuda":
            return
        try:
            tl = step_timeline(eng, b.prompt, b.out_dir / f"timeline_{name}_{mode}.json")
        except Exception as e:  # noqa: BLE001 (a diagnostic: never lose the plan's figures)
            tl = {"error": f"{type(e).__name__}: {e}"}
        r.setdefault("timeline", {})[mode] = tl
        if "error" in tl:
            log(f"  timeline {mode}: {tl['error']}")
            return
        log(f"  timeline {mode}: a step every {tl['period_us']:.0f} us, {tl['kernels']} kernels; some kernel "
            f"ran for {tl['busy_us']:.0f} us of it, none for {tl['idle_us']:.0f} us")
    timeline("plain")
    eng.decode_ahead = False          # A/B: the host takes each token before the next step is queued
    try:
        r["tok_s_step_by_step"] = b.rate(eng)["tok_s"]
    finally:
        eng.decode_ahead = True
    msg += f"; step by step {r['tok_s_step_by_step']:.2f} tok/s"
    plain = eng.decode
    if has_host and b.device.type == "cuda":
        # A/B: host groups on the main stream after the HBM groups (no side-stream overlap)
        eng.reconfigure(replace(plain, overlap_host=False))
        r["tok_s_no_overlap"] = b.rate(eng)["tok_s"]
        eng.reconfigure(plain)
        msg += f"; without the side-stream overlap {r['tok_s_no_overlap']:.2f} tok/s"
    if has_host:
        # prefetch: each layer stages its predicted host experts in HBM one layer early
        eng.reconfigure(replace(plain, prefetch_host=True))
        rp = b.rate(eng)
        timeline("prefetch")
        r["tok_s_prefetch"] = rp["tok_s"]
        r["prefetch_greedy_agree_with_no_prefetch"] = next(
            (i for i, (x, y) in enumerate(zip(rp["tokens"], toks)) if x != y), len(toks))
        msg += (f"; with prefetch {r['tok_s_prefetch']:.2f} tok/s (greedy equals the plan without "
                f"prefetch for {r['prefetch_greedy_agree_with_no_prefetch']}/{len(toks)} tokens)")
        # the guess one sublayer earlier (layer l's attention input): the stage copies overlap layer
        # l's attention too
        eng.reconfigure(replace(plain, prefetch_host=True, prefetch_early=True))
        rq = b.rate(eng)
        timeline("prefetch_early")
        r["tok_s_prefetch_early"] = rq["tok_s"]
        msg += f"; prefetch from the attention input {r['tok_s_prefetch_early']:.2f} tok/s"
    if has_host and b.R["pinned_h2d_Bps"]:
        bound = tier_bound(b.non_expert_bytes, split, b.bw, b.R["pinned_h2d_Bps"])
        r.update(tier_bound_tok_s=bound, pct_of_tier_bound=100 * r["tok_s"] / bound,
                 pcie_achieved_Bps=split["pcie"] * r["tok_s"],
                 pct_of_tier_bound_prefetch=100 * r["tok_s_prefetch"] / bound,
                 pct_of_tier_bound_prefetch_early=100 * r["tok_s_prefetch_early"] / bound)
        msg += (f" (of the bound: with prefetch {r['pct_of_tier_bound_prefetch']:.1f}%, from the attention "
                f"input {r['pct_of_tier_bound_prefetch_early']:.1f}%); PCIe {split['pcie'] / 1e6:.1f} MB/token "
                f"({100 * r['host_expert_share_of_picks']:.0f}% of picks on host experts; bf16 routes would say "
                f"{split_bf16['pcie'] / 1e6:.1f}), achieved {r['pcie_achieved_Bps'] / 1e9:.1f} GB/s of "
                f"{b.R['pinned_h2d_Bps'] / 1e9:.1f}; tier-aware bound {bound:.1f} tok/s -> "
                f"{r['pct_of_tier_bound']:.1f}% of it")
    b.plan_tokens[name] = toks
    base = b.plan_tokens.get(name[:-3]) if name.endswith("_a8") else None
    if base is not None:
        r["greedy_prefix_agree_without_a8"] = next((i for i, (x, y) in enumerate(zip(toks, base)) if x != y),
                                                   len(base))
        msg += f"; greedy equals the plan without a8 for {r['greedy_prefix_agree_without_a8']}/{len(base)} tokens"
    log(msg + f"; greedy equals bf16 for {r['greedy_prefix_agree_with_bf16']} tokens")
    return r


PLANS = ("int4", "int8hot_ternarycold_gpu", "int8hot_ternarycold_host", "int8hot_ternarycold_host_randomhot",
         "int8hot_ternary2cold_gpu", "int8hot_ternary2cold_host", "int4_a8", "int8hot_ternarycold_gpu_a8",
         "int8hot_ternarycold_host_a8", "int8hot_ternary2cold_gpu_a8", "int8hot_ternary2cold_host_a8")
for _plan in PLANS:
    variant(f"engine_{_plan}_triton_graphs")(lambda b, _plan=_plan: plan_variant(b, _plan))


# ---- batch and prefill -----------------------------------------------------------------------------

@variant("batch_throughput_triton_graphs")
def batch_throughput_triton_graphs(b: Bench) -> dict:
    batches = [int(x) for x in b.args.batches.split(",") if x]
    eng = b.engine(max_batch=max(batches))
    out = {}
    for B in batches:
        r = b.rate(eng, B, n_s=max(2, b.n_long // 8), n_l=max(4, b.n_long // 2))
        out[str(B)] = {"tok_s_per_seq": r["tok_s"], "tok_s_total": B * r["tok_s"]}
        log(f"batch {B}: {B * r['tok_s']:.1f} tok/s total ({r['tok_s']:.2f} per sequence)")
    return out


@variant("prefill")
def prefill(b: Bench) -> dict:
    n = b.args.prefill_len
    long_prompt = torch.randint(0, b.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(2)).tolist()
    eng = b.engine(max_seq_len=n + 8, cuda_graphs=False, prefill_chunk=2048)
    eng.generate([long_prompt[:256]], 1, ignore_eos=True)    # warm-up
    t = min(timed(lambda: eng.generate([long_prompt], 1, ignore_eos=True), b.device) for _ in range(2))
    out = {"engine_triton_chunk2048": {"tok_s": n / t, "seconds": t}}
    log(f"prefill {n} tokens [engine, chunks of 2048]: {n / t:.0f} tok/s ({t * 1000:.0f} ms)")
    b.hf.set_experts_implementation("grouped_mm" if b.device.type == "cuda" else "eager")
    lp = torch.tensor([long_prompt], device=b.device)
    with torch.inference_mode():
        b.hf(lp[:, :256])
        t = min(timed(lambda: b.hf(lp), b.device) for _ in range(2))
    out["transformers"] = {"tok_s": n / t, "seconds": t}
    log(f"prefill {n} tokens [transformers]: {n / t:.0f} tok/s ({t * 1000:.0f} ms)")
    return out


# ---- the run ---------------------------------------------------------------------------------------

def print_table(R: dict) -> None:
    v = R["variants"]
    roof = R["copy_bandwidth_Bps"] / R["active_bytes"]
    log("")
    log(f"{'variant':44s} {'tok/s':>9s} {'GB/tok':>7s} {'MBU %':>6s}  note")
    hf_rate = v.get("transformers_batched_mm", {}).get("tok_s")
    for name, r in v.items():
        if "tok_s" not in r:
            continue
        notes = []
        if hf_rate and name.startswith("engine"):
            notes.append(f"{r['tok_s'] / hf_rate:.1f}x transformers")
        if "tok_s_step_by_step" in r:
            notes.append(f"step by step {r['tok_s_step_by_step']:.1f}")
        if "pct_of_tier_bound" in r:
            notes.append(f"{r['pct_of_tier_bound']:.0f}% of tier bound {r['tier_bound_tok_s']:.1f}")
        if "tok_s_prefetch" in r:
            notes.append(f"prefetch {r['tok_s_prefetch']:.1f} tok/s")
            if "pct_of_tier_bound_prefetch" in r:
                notes[-1] += f" = {r['pct_of_tier_bound_prefetch']:.0f}% of it"
            if "pct_of_tier_bound_prefetch_early" in r:
                notes.append(f"early prefetch {r['tok_s_prefetch_early']:.1f} = "
                             f"{r['pct_of_tier_bound_prefetch_early']:.0f}%")
        log(f"{name:44s} {r['tok_s']:9.2f} {r['bytes_per_token'] / 1e9:7.3f} {r['mbu_pct']:6.1f}  {'; '.join(notes)}")
    for B, r in v.get("batch_throughput_triton_graphs", {}).items():
        if isinstance(r, dict):
            log(f"{'batch ' + B + ' (triton)':44s} {r['tok_s_total']:9.1f}")
    for label, r in v.get("prefill", {}).items():
        if isinstance(r, dict):
            log(f"{'prefill ' + label:44s} {r['tok_s']:9.0f}")
    log(f"bf16 roofline {roof:.1f} tok/s; 40% = {0.4 * roof:.1f}")
    for name, err in R["errors"].items():
        log(f"FAILED {name}: {err}")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    common_args(ap, "small shape on the CPU: exercises every code path", "directory for decode_h200.json", 64)
    ap.add_argument("--prefill-len", type=int, default=4096)
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--no-sweep", action="store_true", help="keep the shipped launch shapes")
    ap.add_argument("--timeline", action="store_true",
                    help="expert plans: write one graph-replayed decode step's kernels per plan and prefetch mode "
                         "(timeline_*.json) and log its period and GPU idle time")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(VARIANTS))
        return {}
    if args.small:
        args.tokens, args.prompt_len, args.prefill_len, args.reps, args.batches = 4, 12, 64, 1, "1,4"
    names = pick_variants(args, VARIANTS)
    b = setup(args)
    b.R["skipped"] += [n for n in VARIANTS if n not in names]
    run_variants(b, names, VARIANTS)
    b.R["decode_config"] = b.decode.identity()
    if b.device.type == "cuda":
        b.R["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(b.device)
    (b.out_dir / "decode_h200.json").write_text(json.dumps(b.R, indent=2, default=str))
    print_table(b.R)
    return b.R


if __name__ == "__main__":
    main()
