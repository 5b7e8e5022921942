"""Engine decode speed on one GPU, every variant in one run: bf16 (old gather path and the fused Triton
kernels; A/Bs of PDL, cuBLAS projections, the deferred MoE sum), quantized experts (int4; hot int8 +
cold ternary or ternary2; each again with int8 activations, the `*_a8` plans:
Engine(int8_activations=True)), the half-experts-in-host-RAM plans against their tier-aware bound
(without prefetch, with it, and with the guess from the attention input; plus how often the guess is
right), each plan again with the host taking every token before the next step is queued (the
`step_by_step` figures: Engine.decode_ahead off), batch 1/4/16/64 throughput, prefill at 4,096
tokens, kernel and GEMV config sweeps (cold weights), a kernel-time profile of one decode step per
plan and, with --timeline, one graph-replayed step's kernel timeline per plan and prefetch mode.

    python benchmarks/decode_h200.py --out $OUT          # Qwen3-30B-A3B shape, cuda, bf16
    python benchmarks/decode_h200.py --small             # CPU smoke test of every code path

The random model is built once (transformers, on the device) and every engine variant shares its
non-expert tensors; quantized variants quantize the same expert weights. Each variant runs in its own
try/except, so one failure does not lose the others. MBU (model bandwidth utilisation) = tok/s x
bytes read per token / measured device copy bandwidth (read + write), as in decode_engine.py.
Bytes per token use the routing of the bf16 model on the greedy continuation of the prompt.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

if "--small" in sys.argv or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before anything imports triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode_engine import (QWEN3_30B_A3B, SMALL, active_bytes_per_token, build_transformers,  # noqa: E402
                           copy_bandwidth, decode_rate, sync, timed)

from moebench.engine import Engine, ModelConfig, MoETransformer  # noqa: E402
from moebench.engine import kernels  # noqa: E402
from moebench.engine.model import RouterTracer  # noqa: E402
from moebench.engine.placement import QuantizedExpert, TieredExperts  # noqa: E402
from moebench.engine.quant import QuantizedTensor, format_nbytes, quantize  # noqa: E402

RESULTS: dict = {"variants": {}, "errors": {}, "skipped": []}
OUT_FILE: Path | None = None
SKIP: set[str] = set()          # --skip: variant names (and the short names some variants check)


class Skipped(Exception):
    """A variant left out on purpose (--skip, --no-sweep, --small)."""


def log(msg: str) -> None:
    print(msg, flush=True)


def variant(name: str):
    """Run fn, store its dict under RESULTS['variants'][name]; on failure record the traceback."""
    def wrap(fn):
        t = time.perf_counter()
        try:
            if name in SKIP:
                raise Skipped
            out = fn()
            out["wall_s"] = round(time.perf_counter() - t, 1)
            RESULTS["variants"][name] = out
        except Skipped:
            RESULTS["skipped"].append(name)
        except Exception as e:  # noqa: BLE001 - keep the other variants
            RESULTS["errors"][name] = f"{type(e).__name__}: {e}"
            log(f"[{name}] FAILED: {type(e).__name__}: {e}")
            traceback.print_exc(limit=4)
        if OUT_FILE is not None:   # after every variant: a run cut short keeps what it measured
            OUT_FILE.write_text(json.dumps(RESULTS, indent=2, default=str))
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return fn
    return wrap


# ------------------------------------------------------------------------------------------------
# Engines sharing the transformers model's tensors

def build_engine(hf, *, max_seq_len: int, max_batch: int = 1, cuda_graphs: bool = False,
                 experts_impl: str = "auto", experts=None, prefill_chunk: int = 512,
                 fused_ops: bool | None = None, gemv_max_tokens: int | None = None,
                 int8_activations: bool = False) -> Engine:
    """An Engine whose non-expert parameters are the transformers model's tensors (views). experts:
    None (the dense experts, also views) or {layer: nn.Module} replacing each MoE layer's experts."""
    cfg = ModelConfig.from_dict(hf.config.to_dict(), source="transformers config")
    with torch.device("meta"):
        model = MoETransformer(cfg)
    sd = hf.state_dict()
    inter = cfg.expert_intermediate_size
    for name, module in model.named_modules():
        if experts is not None and name.endswith("mlp.experts"):
            continue
        for pname, _ in list(module.named_parameters(recurse=False)):
            full = f"{name}.{pname}" if name else pname
            if full.endswith("experts.w_gate"):
                t = sd[f"model.{name}.gate_up_proj"][:, :inter]
            elif full.endswith("experts.w_up"):
                t = sd[f"model.{name}.gate_up_proj"][:, inter:]
            elif full.endswith("experts.w_down"):
                t = sd[f"model.{name}.down_proj"]
            elif full == "lm_head.weight":
                t = sd["lm_head.weight"]
            else:
                t = sd[f"model.{full}"]
            setattr(module, pname, torch.nn.Parameter(t, requires_grad=False))
    if experts is not None:
        for block in model.moe_blocks():
            block.experts = experts[block.layer_idx]
    return Engine(model.eval(), None, max_seq_len=max_seq_len, max_batch=max_batch, cuda_graphs=cuda_graphs,
                  experts_impl=experts_impl, prefill_chunk=prefill_chunk, fused_ops=fused_ops,
                  gemv_max_tokens=gemv_max_tokens, int8_activations=int8_activations)


def realistic_routing(hf, alpha: float, seed: int = 5) -> None:
    """Token-dependent, Zipf-skewed routing for the random model.

    A random-init model routes every token alike: its residual stream is dominated by attention
    outputs averaged over positions (o_proj output rms ~1 against embeddings of rms 0.02), so the
    greedy continuation is one token repeated and the same 8 experts serve every step (round 5:
    the calibrated hot half caught 99.9% of picks). Embeddings scaled to rms ~1 and o_proj by 0.02
    keep each token's identity in the residual stream. Then each layer's router row of the expert of
    rank r (a random permutation per layer) is scaled by (r + 1) ** -alpha (mean 1): on Gaussian
    logits, alpha 0.5 gives the most-used half of the experts ~91% of the top-8-of-128 picks. A
    12-layer CPU check: 48 distinct tokens in a 48-token greedy continuation, and the hot half
    (from prompt + continuation) took 90-94% of the decode picks in every layer. Speed does not
    depend on the values; only which experts are read does."""
    g = torch.Generator().manual_seed(seed)
    E = hf.config.num_experts
    s = (torch.arange(E, dtype=torch.float32) + 1) ** -alpha
    s = s / s.mean()
    with torch.no_grad():
        hf.model.embed_tokens.weight.mul_(50.0)
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.02)
            w = layer.mlp.gate.weight
            perm = torch.randperm(E, generator=g)
            w.mul_(s[torch.argsort(perm)].to(w.device, w.dtype)[:, None])


def dense_expert_weights(hf, layer: int):
    inter = hf.config.moe_intermediate_size
    mlp = hf.model.layers[layer].mlp.experts
    return mlp.gate_up_proj[:, :inter], mlp.gate_up_proj[:, inter:], mlp.down_proj


def quantize_stacked(w: torch.Tensor, fmt: str, pin: bool = False) -> list[QuantizedTensor]:
    """[E, out, in] -> E QuantizedTensors (views of one stacked quantization). Every format of
    quant.py is row-wise (per-row or per-row-group scales), so quantizing [E*out, in] at once gives
    exactly what quantizing each expert does, in a handful of kernels instead of thousands.
    pin: the stacks go to pinned host memory (views of pinned memory count as pinned, so
    TieredExperts keeps them as they are instead of pinning thousands of small tensors)."""
    E, rows, cols = w.shape
    q = quantize(w.reshape(E * rows, cols), fmt)
    parts = {k: v.reshape(E, rows, *v.shape[1:]) for k, v in q.parts.items()}
    if pin and torch.cuda.is_available():
        parts = {k: v.to("cpu").pin_memory() for k, v in parts.items()}
    return [QuantizedTensor(q.fmt, (rows, cols), {k: v[e] for k, v in parts.items()}) for e in range(E)]


def tiered_experts(hf, precision: list[list[str]], home: list[list[str]], device, dtype) -> dict:
    """{layer: TieredExperts} with the fused kernels on, from per-layer per-expert precision/home."""
    out = {}
    for layer in range(hf.config.num_hidden_layers):
        ws = dense_expert_weights(hf, layer)
        by_fmt = {}
        for fmt, h in sorted(set(zip(precision[layer], home[layer]))):
            by_fmt[fmt, h] = [quantize_stacked(w, fmt, pin=h == "host") for w in ws]
        experts = [QuantizedExpert(*(by_fmt[f, h][m][e] for m in range(3)))
                   for e, (f, h) in enumerate(zip(precision[layer], home[layer]))]
        module = TieredExperts(experts, home[layer], device, dtype, cache_slots=2)
        module.use_fused_kernels()
        out[layer] = module
        del by_fmt, experts
    return out


# ------------------------------------------------------------------------------------------------

def expert_bytes_per_token(routes: list[torch.Tensor], precision, home, hidden: int, inter: int) -> dict:
    """Mean expert bytes one token reads, split by home, from routing ids [tokens, k] per layer."""
    hbm = pcie = 0.0
    n = routes[0].shape[0]
    for layer, ids in enumerate(routes):
        for e in ids.flatten().tolist():
            fmt = precision[layer][e]
            b = format_nbytes(fmt, inter, hidden) * 2 + format_nbytes(fmt, hidden, inter)
            if home[layer][e] == "host":
                pcie += b
            else:
                hbm += b
    return {"hbm": hbm / n, "pcie": pcie / n}


def pinned_h2d_bandwidth(nbytes: int, iters: int = 10) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return nbytes * iters / (time.perf_counter() - t)


def time_graph(fn, device, iters: int = 20, reps: int = 5) -> float:
    """Seconds per call of fn, replayed from a CUDA graph of `iters` calls (no launch overhead);
    on CPU a plain loop."""
    fn()
    if device.type != "cuda":
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / iters)
    return best


# BK is columns per step for dense/int8 and BYTES per step for int4 (2 columns/byte) and ternary (5).
# Round 2 picked BN 4-16 with 4 warps; down wants many programs (H/BN per token: BN=4 -> 512 for 132
# SMs) and K=768 splits evenly into BK=256; deeper pipelines (num_stages 4) and 8 warps keep more
# bytes in flight per program.
SWEEP = [dict(BN=bn, BK=bk, num_warps=w, num_stages=st) for bn, bk, w, st in
         ((1, 1024, 4, 3), (2, 1024, 4, 3), (2, 1024, 8, 3), (4, 512, 4, 3), (4, 256, 4, 4), (8, 256, 4, 3),
          (4, 1024, 8, 3), (8, 512, 8, 4), (16, 256, 4, 3), (2, 2048, 8, 2), (1, 2048, 4, 2), (2, 2048, 4, 2),
          (16, 512, 8, 3), (4, 2048, 8, 2), (4, 2048, 4, 2), (8, 1024, 8, 3),
          # many short programs, for ternary's one cold pair per layer
          (2, 128, 4, 2), (2, 256, 4, 3), (1, 256, 4, 3), (4, 128, 4, 2), (2, 128, 1, 2))]
GEMV_SWEEP = [dict(BN=bn, BK=bk, num_warps=w, num_stages=st) for bn, bk, w, st in
              ((8, 512, 4, 3), (4, 1024, 4, 3), (16, 256, 4, 4), (8, 1024, 8, 3), (2, 2048, 8, 3),
               (2, 2048, 4, 3), (4, 2048, 8, 2), (1, 2048, 4, 3), (2, 1024, 4, 4), (4, 512, 4, 4),
               (1, 4096, 4, 2), (2, 4096, 8, 2), (1, 1024, 2, 4), (4, 256, 4, 4))]


def sweep_gemv(hf, device, dtype, bw: float) -> dict:
    """kernels.linear vs F.linear (cuBLAS) at one token on the [q; k; v] and o_proj shapes; keeps the
    GEMV config with the least total time.

    Each timed graph runs the projection of EVERY layer once (cold weights, as in a decode step):
    round 7 timed layer 0's matrices 20 times over, and its 21 + 17 MB sat in the 50 MB L2, so the
    sweep said 6.1 + 4.6 us per layer while the decode step's profile said ~15 us."""
    layers = hf.model.layers
    mats = {"qkv": [torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach()
                    for a in (layer.self_attn for layer in layers)],
            "o": [layer.self_attn.o_proj.weight.detach() for layer in layers]}
    xs = {n: torch.randn(1, ws[0].shape[1], device=device, dtype=dtype) for n, ws in mats.items()}

    def per_layer_us(f, n) -> float:
        return time_graph(lambda: [f(xs[n], w) for w in mats[n]], device, iters=1) / len(mats[n]) * 1e6
    out = {"cublas_us": {n: per_layer_us(F.linear, n) for n in mats}}
    times = []
    for cfg in GEMV_SWEEP:
        kernels.set_config("gemv", "dense", **cfg)
        try:
            t = {n: per_layer_us(kernels.linear, n) for n in mats}
            times.append((sum(t.values()), cfg, t))
        except Exception as e:  # noqa: BLE001 - a config this GPU cannot run
            log(f"  gemv sweep {cfg}: {type(e).__name__}: {e}")
    total, best, t = min(times, key=lambda x: x[0])
    kernels.set_config("gemv", "dense", **best)
    out.update(best=best, triton_us=t, all=[(c, {n: round(v, 2) for n, v in tt.items()}) for _, c, tt in times])
    for n, ws in mats.items():
        nb = ws[0].numel() * ws[0].element_size()
        log(f"  gemv [{n} {tuple(ws[0].shape)}, cold]: cuBLAS {out['cublas_us'][n]:.1f} us "
            f"({nb / out['cublas_us'][n] / 1e3:.0f} GB/s), triton {t[n]:.1f} us ({nb / t[n] / 1e3:.0f} GB/s) with {best}")
    log("  gemv sweep (qkv + o us): " + ", ".join(
        f"{tuple(c.values())}: {sum(tt.values()):.1f}" for _, c, tt in times))
    del mats
    return out


def decode_host_share(eng: Engine, prompt: list[int], n: int, home) -> float:
    """Share of the DECODE steps' expert picks that land on host experts, from the fused decode path
    itself (eager, a tracer attached; steps of one token only)."""
    tracer = RouterTracer()
    saved = eng.cuda_graphs
    eng.cuda_graphs = False
    eng.model.set_tracer(tracer)
    try:
        eng.generate([prompt], n, ignore_eos=True)
    finally:
        eng.model.set_tracer(None)
        eng.cuda_graphs = saved
    picks = [(layer, ids) for layer, ids, _ in tracer.records if ids.shape[0] == 1]
    total = sum(ids.numel() for _, ids in picks)
    return sum(sum(home[layer][e] == "host" for e in ids.flatten().tolist()) for layer, ids in picks) / max(1, total)


def sweep_kernel_configs(groups_by_fmt: dict, hidden: int, top_k: int, num_experts: int, device, dtype,
                         bw: float, host: bool = False) -> dict:
    """For each format, try SWEEP for gate_up then for down (one MoE layer, batch 1); keep the best.

    Each timed graph runs num_experts // top_k layer calls on DISJOINT expert sets, so every call
    reads experts no other call read: round 4's sweep re-read the same 8 experts 20 times, and the
    int4 (19 MB) and ternary (9 MB) layers sat in the 50 MB L2, flattering those formats.
    host: the groups live in pinned host memory; the configs found are set for host groups only."""
    out = {}
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, hidden, generator=g).to(device, dtype)
    perm = torch.randperm(num_experts, generator=g)
    id_sets = [perm[i:i + top_k].view(1, top_k).to(device) for i in range(0, num_experts - top_k + 1, top_k)]
    w = torch.softmax(torch.rand(1, top_k, generator=g), -1).to(device)

    def layer_time(group) -> float:
        return time_graph(lambda: [kernels.fused_moe(x, ids, w, [group]) for ids in id_sets], device,
                          iters=1) / len(id_sets)
    for fmt, (group, nbytes) in groups_by_fmt.items():
        res = {}
        pairs = top_k
        if fmt in ("ternary", "ternary2") and not host:
            # Ternary is the cold format of the hot/cold plans: a layer sends it about one pair of its
            # eight, and that pair's programs set the launch's length. Tune for that: the group holds
            # one expert of each set (round 7 tuned it with all eight pairs ternary: 96 programs of
            # 8 rows each for one pair, ALU-bound, long).
            slot_of = torch.full((num_experts,), -1, dtype=torch.int32)
            firsts = torch.stack([s[0, 0] for s in id_sets]).cpu()
            slot_of[firsts] = firsts.to(torch.int32)
            group = kernels.ExpertGroup(group.gate, group.up, group.down, slot_of.to(device), "ternary, 1 pair of 8")
            pairs = 1
        for kernel in ("gate_up", "down"):
            times = []
            for cfg in SWEEP:
                kernels.set_config(kernel, fmt, host=host, **cfg)
                try:
                    times.append((layer_time(group), cfg))
                except Exception as e:  # noqa: BLE001 - a config this GPU cannot run
                    log(f"  sweep {fmt} {kernel} {cfg}: {type(e).__name__}: {e}")
            best_t, best = min(times, key=lambda tc: tc[0])
            kernels.set_config(kernel, fmt, host=host, **best)
            res[kernel] = {"best": best, "layer_us": best_t * 1e6,
                           "all": [(c, round(t * 1e6, 2)) for t, c in times]}
        t = layer_time(group)
        res["layer_us"] = t * 1e6
        res["pairs"] = pairs
        res["GBps"] = pairs * nbytes / t / 1e9
        res["pct_of_copy_bw"] = 100 * pairs * nbytes / t / bw
        mode_note = ""
        if kernels._words(group.gate) is not None and not host and fmt != "ternary2":   # ternary2: words only
            # A/B at the same configs: the byte decode with int-to-float conversions (mode 0); the
            # engine keeps the faster mode for this format
            mode = kernels.decode_mode(fmt)
            kernels.FAST_BY_FORMAT[fmt] = 0
            res["mode0_layer_us"] = layer_time(group) * 1e6
            kernels.FAST_BY_FORMAT[fmt] = 0 if res["mode0_layer_us"] < res["layer_us"] else mode
            res["decode_mode"] = kernels.FAST_BY_FORMAT[fmt]
            mode_note = (f"; decode mode {mode} against mode 0 (conversions) {res['mode0_layer_us']:.1f} us: "
                         f"keeps mode {res['decode_mode']}")
        out[fmt] = res
        where = "host (zero-copy over PCIe)" if host else "HBM"
        log(f"  kernel sweep [{group.label or fmt} in {where}]: gate_up {res['gate_up']['best']}, down "
            f"{res['down']['best']}: one layer {t * 1e6:.1f} us, {res['GBps']:.0f} GB/s of expert bytes "
            f"({res['pct_of_copy_bw']:.0f}% of copy bw){mode_note}")
    return out


def profile_step(eng: Engine, prompt: list[int], device, top: int = 20, steps: int = 5) -> dict:
    """Kernel-time table of `steps` eager decode steps alone (no prefill: round 1's table mixed in a
    64-token prefill, whose grouped_mm argsort was the radix sort), and kernels launched per step."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    eng.generate([prompt], 2, ignore_eos=True)      # fills the cache, compiles the kernels
    tokens = torch.tensor([[prompt[-1]]], device=device)
    kv_len = eng._kv_len(len(prompt) + 1)
    pos = torch.tensor([[len(prompt)]], device=device)
    with torch.inference_mode():
        eng._decode(tokens, pos, kv_len)
        sync(device)
        with profile(activities=acts) as prof:
            for _ in range(steps):
                eng._decode(tokens, pos, kv_len)
            sync(device)
    key = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, key, None)
        if t is None and key == "device_time_total":
            t = getattr(ev, "cuda_time_total", 0)
        if t:
            rows.append((ev.key[:70], ev.count, t / 1e3))
    rows.sort(key=lambda r: -r[2])
    if device.type == "cuda":
        # device totals: the CUDA kernel events only (was: every row not named aten::* or cuda*). In
        # rounds 8 and 9 the first profile of each run counted about twice the kernels of later ones
        # (the same plan: 971 kernels/step when profiled first, 489 otherwise; its top rows were the
        # same). With this filter the first plan profiled in round 10 (int4) read 393, as later ones do.
        kernel_keys = {ev.key[:70] for ev in prof.key_averages()
                       if getattr(getattr(ev, "device_type", None), "name", "") == "CUDA"}
        rows = [r for r in rows if r[0] in kernel_keys]
        kernels_total = sum(r[1] for r in rows)
        ms_total = sum(r[2] for r in rows)
    else:                       # CPU: count top-level aten ops instead
        rows = [r for r in rows if r[0].startswith("aten::")]
        kernels_total = sum(r[1] for r in rows)
        ms_total = sum(r[2] for r in rows)
    return {"rows": rows[:top], "kernels_per_step": kernels_total / steps, "kernel_ms_per_step": ms_total / steps}


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def step_timeline(eng: Engine, prompt: list[int], path: Path, steps: int = 6) -> dict:
    """Kernel timeline of graph-replayed decode steps (torch.profiler's CUDA activity records). One
    step runs from one decode forward's first kernel (the embedding lookup) to the next one's; its
    kernels, with times in us from its start, go to `path`. Returns the step's period, the time
    some kernel ran, and the rest: the GPU idle between and inside the step's kernels (host work
    between steps, launch gaps, waits). Stream ids are not reported: in graph replays they name the
    graph's internal streams, not the ones the code used."""
    import tempfile
    from torch.profiler import ProfilerActivity, profile
    eng.generate([prompt], 2, ignore_eos=True)       # graphs captured
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng.generate([prompt], steps, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        trace = json.loads(Path(f"{tmp}/trace.json").read_text())
    ks = sorted((e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    starts = [i for i, e in enumerate(ks) if "indexSel" in e["name"]]      # prefill, then each decode step
    if len(starts) < 3:
        return {"error": f"{len(starts)} embedding lookups among {len(ks)} kernels; expected a prefill and "
                         f"{steps - 1} decode steps"}
    i, j = starts[-3], starts[-2]
    t0, t1 = ks[i]["ts"], ks[j]["ts"]
    step = ks[i:j]
    busy = sum(min(b, t1) - a for a, b in _union([(e["ts"], e["ts"] + e["dur"]) for e in step]))
    path.write_text(json.dumps([[e["name"][:48], round(e["ts"] - t0, 2), round(e["dur"], 2)] for e in step]))
    return {"period_us": t1 - t0, "kernels": len(step), "busy_us": busy, "idle_us": (t1 - t0) - busy}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="small shape on the CPU: exercises every code path")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for decode_h200.json")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens in the long run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prefill-len", type=int, default=4096)
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--skip", default="", help="comma-separated variant names to skip")
    ap.add_argument("--no-sweep", action="store_true", help="keep the default kernel configs")
    ap.add_argument("--timeline", action="store_true",
                    help="expert plans: write one graph-replayed decode step's kernels per plan and prefetch mode "
                         "(timeline_*.json) and log its period and GPU idle time")
    ap.add_argument("--router-skew", type=float, default=0.5,
                    help="Zipf exponent of expert usage (router row norms; see realistic_routing); 0 = the plain "
                         "random model, whose tokens all route alike")
    args = ap.parse_args(argv)

    small = args.small
    device = torch.device("cpu" if small else "cuda")
    dtype = torch.float32 if small else torch.bfloat16
    shape = dict(SMALL if small else QWEN3_30B_A3B)
    if small:
        args.tokens, args.prompt_len, args.prefill_len, args.reps = 4, 12, 64, 1
        args.batches = "1,4"
        # The interpreter's cost is per program: few, wide programs keep the smoke test short.
        for kernel in ("gate_up", "down"):
            for fmt in kernels.FORMAT_CODES:
                kernels.set_config(kernel, fmt, BN=64, BK=256)
    n_short, n_long = max(2, args.tokens // 4), args.tokens
    skip = set(s for s in args.skip.split(",") if s)
    SKIP.update(skip)
    batches = [int(b) for b in args.batches.split(",") if b]
    graphs = device.type == "cuda"
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    global OUT_FILE
    OUT_FILE = out_dir / "decode_h200.json"
    R = RESULTS
    R.update(device=str(device), dtype=str(dtype), shape=shape, torch=torch.__version__,
             tokens=[n_short, n_long], prompt_len=args.prompt_len)
    try:
        import triton
        R["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        R["triton"] = f"unavailable: {e}"
    if device.type == "cuda":
        R["gpu"] = torch.cuda.get_device_name(device)
    log(f"torch {torch.__version__}, triton {R['triton']}, device {R.get('gpu', device)}")

    t0 = time.perf_counter()
    hf = build_transformers(shape, device, dtype, seed=0)
    if args.router_skew:
        realistic_routing(hf, args.router_skew)
    R["router_skew"] = args.router_skew
    cfg = ModelConfig.from_dict(hf.config.to_dict(), source="transformers config")
    R["build_s"] = round(time.perf_counter() - t0, 1)
    elem = torch.finfo(dtype).bits // 8
    R.update(active_bytes_per_token(cfg, elem))
    H, I, k = cfg.hidden_size, cfg.expert_intermediate_size, cfg.top_k
    expert_active = cfg.num_layers * k * 3 * H * I * elem
    non_expert = R["active_bytes"] - expert_active
    bw = copy_bandwidth(device, nbytes=(1 << 30) if device.type == "cuda" else (1 << 26))
    R["copy_bandwidth_Bps"] = bw
    R["pinned_h2d_Bps"] = pinned_h2d_bandwidth(1 << 30) if device.type == "cuda" else None
    log(f"shape: {cfg.num_layers} layers, {cfg.num_experts} experts top-{k}, hidden {H}, width {I}, vocab "
        f"{cfg.vocab_size}; built in {R['build_s']} s; copy bw {bw / 1e9:.1f} GB/s; pinned H2D "
        f"{(R['pinned_h2d_Bps'] or 0) / 1e9:.1f} GB/s; bf16 bytes/token {R['active_bytes'] / 1e9:.3f} GB "
        f"(experts {expert_active / 1e9:.3f}) -> roofline {bw / R['active_bytes']:.1f} tok/s")

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=g).tolist()
    prompt_t = torch.tensor([prompt], device=device)
    max_seq = args.prompt_len + n_long + 8

    def mbu(rate: float, nbytes: float) -> float:
        return 100 * rate * nbytes / bw

    def engine_rate(eng: Engine, B: int = 1, n_s: int = n_short, n_l: int = n_long) -> dict:
        prompts = [prompt] if B == 1 else [torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=g).tolist()
                                          for _ in range(B)]
        # Rate = the best over reps of (tokens - 1) / (time of the last token - time of the first),
        # from the engine's own per-token clock: decode steps only. Round 5 showed why not the
        # difference of two generate() calls: a tiered engine's 64-token prefill runs the per-expert
        # path (host copies, LRU) whose time varies by tens of ms between calls, which moved the
        # difference-based rate of the random-hot host plan from 102 to 48 tok/s.
        eng.generate(prompts, n_s, ignore_eos=True)     # warm-up: kernels compiled, graphs captured
        best, outs = 0.0, None
        for _ in range(args.reps):
            o = eng.generate(prompts, n_l, ignore_eos=True)
            tt = o[0].token_times
            rate = (len(tt) - 1) / max(tt[-1] - tt[0], 1e-9)
            if rate > best:
                best, outs = rate, o
        return {"tok_s": best, "tokens": outs[0].token_ids}

    def bf16_rate(eng: Engine, label: str | None) -> dict:
        """engine_rate of a bf16 engine with its bytes per token and MBU; logged under `label`
        (None: the caller logs)."""
        r = engine_rate(eng)
        r["tokens_equal_reference"] = r.pop("tokens") == ref_tokens
        r.update(bytes_per_token=R["active_bytes"], mbu_pct=mbu(r["tok_s"], R["active_bytes"]))
        if label is not None:
            log(f"engine bf16 [{label}{'+graphs' if graphs else ''}]: {r['tok_s']:.2f} tok/s, MBU {r['mbu_pct']:.1f}%")
        return r

    # ---- reference engines and routing (for bytes per token of every plan) -----------------------
    eng_old = build_engine(hf, max_seq_len=max_seq, cuda_graphs=graphs, experts_impl="auto")
    ref_tokens = eng_old.generate([prompt], n_long, ignore_eos=True)[0].token_ids
    trace = eng_old.trace(prompt + ref_tokens, router_logits=False)
    routes = [ids[len(prompt):] for ids in trace.topk_ids]          # decode positions only
    counts = torch.stack([torch.bincount(ids.flatten(), minlength=cfg.num_experts) for ids in trace.topk_ids])
    hot = [set(torch.argsort(-counts[l], stable=True)[:cfg.num_experts // 2].tolist()) for l in range(cfg.num_layers)]
    R["routes_decode_tokens"] = routes[0].shape[0]
    R["hot_half_share_of_picks"] = float(sum(counts[l, sorted(hot[l])].sum() for l in range(cfg.num_layers)) / counts.sum())
    log(f"router skew {args.router_skew}: the most-used half of each layer's experts takes "
        f"{100 * R['hot_half_share_of_picks']:.1f}% of the picks (prompt + greedy continuation)")

    @variant("transformers_batched_mm")
    def _():
        if "transformers" in skip:
            raise Skipped
        hf.set_experts_implementation("batched_mm")

        def run_hf(n):
            with torch.inference_mode():
                hf.generate(prompt_t, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        # transformers' generate has no per-token clock: the difference of two generate calls
        # (n_long - n_short tokens over the time difference; its prefill time is steady).
        rate = decode_rate(run_hf, n_short, n_long, device, args.reps)
        log(f"transformers [batched_mm]: {rate:.2f} tok/s, MBU {mbu(rate, R['active_bytes']):.1f}%")
        return {"tok_s": rate, "bytes_per_token": R["active_bytes"], "mbu_pct": mbu(rate, R["active_bytes"])}

    @variant("engine_bf16_old_gather_graphs")
    def _():
        return bf16_rate(eng_old, "auto/gather")

    # ---- the fused path: kernel sweep, parity, speed ---------------------------------------------
    eng_new = build_engine(hf, max_seq_len=max_seq, cuda_graphs=graphs, experts_impl="triton")

    @variant("kernel_sweep")
    def _():
        if args.no_sweep or small:
            raise Skipped
        groups = {"dense": (kernels.dense_group(*dense_expert_weights(hf, 0)), 3 * H * I * elem)}
        for fmt in ("int8", "int4", "ternary", "ternary2"):
            mats = [kernels.PackedMatrix.stack(quantize_stacked(w, fmt), device) for w in dense_expert_weights(hf, 0)]
            groups[fmt] = (kernels.ExpertGroup(*mats, None, fmt), sum(m.nbytes_per_slot for m in mats))
        res = sweep_kernel_configs(groups, H, k, cfg.num_experts, device, dtype, bw)
        # The host plans keep their cold (ternary) experts in pinned host memory: sweep that too.
        mats = [kernels.PackedMatrix.stack(quantize_stacked(w, "ternary"), device, pin=True)
                for w in dense_expert_weights(hf, 0)]
        res["host"] = sweep_kernel_configs({"ternary": (kernels.ExpertGroup(*mats, None, "ternary@host"),
                                                        sum(m.nbytes_per_slot for m in mats))},
                                           H, k, cfg.num_experts, device, dtype, bw, host=True)
        res["configs"] = {"/".join(key): v for key, v in kernels.CONFIG.items()}
        return res

    # Triton GEMV for the attention projections (the engine's default on CUDA): the runs below use
    # cuBLAS instead only if the end-to-end bf16 rate says cuBLAS is clearly faster.
    choice = {"gemv_max_tokens": None}

    @variant("gemv_sweep")
    def _():
        if args.no_sweep:
            raise Skipped
        return sweep_gemv(hf, device, dtype, bw)

    @variant("attention_sweep")
    def _():
        """decode_attention (one kernel) against the mask + sdpa + transpose it replaces, one layer's
        shape at batch 1; keeps the fastest config for the runs below."""
        if args.no_sweep or small:
            raise Skipped
        from moebench.engine import attention_kernel as ak
        NH, NKV, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        out = {}
        for S in (256, 4096):
            q = torch.randn(1, NH, 1, D, device=device, dtype=dtype)
            kc = torch.randn(1, NKV, S, D, device=device, dtype=dtype)
            vc = torch.randn_like(kc)
            pos = torch.full((1, 1), S - 1, device=device)

            def torch_path():
                slots = torch.arange(S, device=device)
                mask = (slots[None, None, :] <= pos[:, :, None]).unsqueeze(1)
                o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True)
                return o.transpose(1, 2).reshape(1, 1, NH * D)
            res = {"torch_us": time_graph(torch_path, device) * 1e6, "configs": []}
            for c in ((32, 4, 2), (16, 4, 2), (64, 8, 2), (32, 4, 3), (16, 2, 2)):
                ak.CONFIG.update(BLOCK_S=c[0], num_warps=c[1], num_stages=c[2])
                try:
                    res["configs"].append((c, time_graph(lambda: ak.decode_attention(q, kc, vc, pos, S), device) * 1e6))
                except Exception as e:  # noqa: BLE001
                    log(f"  attention {c}: {type(e).__name__}: {e}")
            out[str(S)] = res
        best = min(out["256"]["configs"], key=lambda r: r[1] + dict(out["4096"]["configs"])[r[0]])[0]
        ak.CONFIG.update(BLOCK_S=best[0], num_warps=best[1], num_stages=best[2])
        out["best"] = best
        for S, r in out.items():
            if S != "best":
                log(f"  attention kv_len {S}: torch mask+sdpa+transpose {r['torch_us']:.1f} us; triton "
                    + ", ".join(f"{c}: {t:.1f} us" for c, t in r["configs"]))
        log(f"  attention config kept: BLOCK_S={best[0]} num_warps={best[1]} num_stages={best[2]}")
        return out

    @variant("router_sweep")
    def _():
        """kernels.router_topk (router GEMV + softmax/top-k, one launch) against F.linear +
        route_topk, layer 0's router at batch 1; the engine uses whichever is faster."""
        if args.no_sweep or small:
            raise Skipped
        wr = hf.model.layers[0].mlp.gate.weight.detach()
        xr = torch.randn(1, H, device=device, dtype=dtype)
        out = {"torch_us": time_graph(lambda: kernels.route_topk(F.linear(xr, wr), k, True), device) * 1e6, "configs": []}
        for c in ((4, 1024, 1), (2, 1024, 1), (2, 2048, 1), (8, 512, 2), (4, 512, 1), (1, 2048, 1)):
            kernels.set_config("router", "dense", BN=c[0], BK=c[1], num_warps=c[2], num_stages=2)
            try:
                out["configs"].append((c, time_graph(lambda: kernels.router_topk(xr, wr, k, True), device) * 1e6))
            except Exception as e:  # noqa: BLE001
                log(f"  router {c}: {type(e).__name__}: {e}")
        best, t = min(out["configs"], key=lambda r: r[1])
        kernels.set_config("router", "dense", BN=best[0], BK=best[1], num_warps=best[2], num_stages=2)
        kernels.FUSED_ROUTER = t < out["torch_us"]
        out.update(best=best, fused_used=kernels.FUSED_ROUTER)
        log(f"  router: F.linear + route_topk {out['torch_us']:.1f} us; fused " +
            ", ".join(f"{c}: {u:.1f} us" for c, u in out["configs"]) +
            f"; engine uses the {'fused' if kernels.FUSED_ROUTER else 'torch + route_topk'} router")
        return out

    @variant("norm_router_ab")
    def _():
        """add_rmsnorm + router_topk (two launches) against add_rmsnorm_router (one), layer 0's
        post-attention norm and router at batch 1; the engine keeps whichever is faster."""
        if small:
            raise Skipped
        layer = hf.model.layers[0]
        wr = layer.mlp.gate.weight.detach()
        nw = layer.post_attention_layernorm.weight.detach()
        xr, ar = (torch.randn(1, 1, H, device=device, dtype=dtype) for _ in range(2))

        def two():
            _, hn = kernels.add_rmsnorm(xr, ar, nw, 1e-6)
            return kernels.router_topk(hn.view(1, H), wr, k, True)
        out = {"two_launches_us": time_graph(two, device) * 1e6,
               "fused_us": time_graph(lambda: kernels.add_rmsnorm_router(xr, ar, nw, 1e-6, wr, k, True), device) * 1e6}
        kernels.FUSED_NORM_ROUTER = out["fused_us"] < out["two_launches_us"]
        out["fused_used"] = kernels.FUSED_NORM_ROUTER
        log(f"  post-attention norm + router: add_rmsnorm + router_topk {out['two_launches_us']:.1f} us, "
            f"add_rmsnorm_router {out['fused_us']:.1f} us; engine uses the "
            f"{'fused' if kernels.FUSED_NORM_ROUTER else 'two-launch'} path")
        return out

    @variant("parity_new_vs_reference")
    def _():
        n = min(16, args.prompt_len)   # <= triton_max_tokens: this prefill runs the fused kernels
        with torch.inference_mode():
            ref = hf(prompt_t[:, :n]).logits[0].float().cpu()
        got = eng_new.logits(prompt[:n])
        old = eng_old.logits(prompt[:n])
        new_tokens = eng_new.generate([prompt], n_long, ignore_eos=True)[0].token_ids
        agree = next((i for i, (a, b) in enumerate(zip(new_tokens, ref_tokens)) if a != b), len(ref_tokens))
        r = {"max_abs_diff_vs_transformers": (got - ref).abs().max().item(),
             "max_abs_diff_old_vs_transformers": (old - ref).abs().max().item(),
             "logit_scale": ref.abs().max().item(),
             "argmax_agree": (got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
             "greedy_prefix_agree_with_old": agree, "greedy_tokens": len(ref_tokens)}
        log(f"parity (fused vs transformers, {n} tokens): max |diff| {r['max_abs_diff_vs_transformers']:.4g} "
            f"(old path {r['max_abs_diff_old_vs_transformers']:.4g}; logits up to {r['logit_scale']:.3g}); argmax "
            f"agree {100 * r['argmax_agree']:.0f}%; greedy decode equals old path for {agree}/{len(ref_tokens)} tokens")
        return r

    @variant("engine_bf16_triton_graphs")
    def _():
        return bf16_rate(eng_new, "triton")

    @variant("engine_bf16_triton_graphs_no_pdl")
    def _():
        """A/B: the same engine without programmatic dependent launch (kernels.PDL off)."""
        kernels.PDL = False
        eng_new._graphs.clear()
        try:
            r = bf16_rate(eng_new, "triton, PDL off")
        finally:
            kernels.PDL = True
            eng_new._graphs.clear()
        r["pdl_supported_here"] = kernels.pdl_launch(device).get("launch_pdl", False)
        return r

    @variant("engine_bf16_triton_graphs_step_by_step")
    def _():
        """A/B: the same engine with the host taking each token before the next step is queued
        (Engine.decode_ahead off): the GPU idles while the host copies, checks and launches."""
        eng_new.decode_ahead = False
        try:
            return bf16_rate(eng_new, "triton, step by step")
        finally:
            eng_new.decode_ahead = True

    @variant("engine_bf16_triton_graphs_moe_sum_kernel")
    def _():
        """A/B: the same engine with moe_sum as its own launch (kernels.DEFER_MOE_SUM off)."""
        kernels.DEFER_MOE_SUM = False
        eng_new._graphs.clear()
        try:
            return bf16_rate(eng_new, "triton, moe_sum not deferred")
        finally:
            kernels.DEFER_MOE_SUM = True
            eng_new._graphs.clear()

    @variant("engine_bf16_triton_cublas_graphs")
    def _():
        """A/B: the attention projections through cuBLAS (gemv_max_tokens=0) instead of the GEMV."""
        eng = build_engine(hf, max_seq_len=max_seq, cuda_graphs=graphs, experts_impl="triton", gemv_max_tokens=0)
        r = bf16_rate(eng, None)
        base = R["variants"].get("engine_bf16_triton_graphs", {}).get("tok_s", 0.0)
        if r["tok_s"] > 1.02 * base:   # a clear win, not run-to-run noise
            choice["gemv_max_tokens"] = 0
        r["used_for_later_runs"] = choice["gemv_max_tokens"] == 0
        log(f"engine bf16 [triton, cuBLAS projections{'+graphs' if graphs else ''}]: {r['tok_s']:.2f} tok/s, MBU "
            f"{r['mbu_pct']:.1f}% (GEMV projections: {base:.2f}); later runs use "
            f"{'cuBLAS' if choice['gemv_max_tokens'] == 0 else 'the GEMV'}")
        return r

    @variant("profile_bf16_triton_step_fused_ops_on")
    def _():
        p = profile_step(build_engine(hf, max_seq_len=max_seq, experts_impl="triton", **choice), prompt, device)
        log(f"decode step, fused_ops=on, gemv={choice['gemv_max_tokens'] != 0}: {p['kernels_per_step']:.0f} kernels/step, "
            f"{p['kernel_ms_per_step']:.3f} ms kernel time/step; top kernels over 5 eager steps (ms, count):")
        for name, count, ms in p["rows"][:20]:
            log(f"  {ms:9.3f} {count:6d}  {name}")
        return p

    @variant("engine_bf16_triton_graphs_no_fused_ops")
    def _():
        eng = build_engine(hf, max_seq_len=max_seq, cuda_graphs=graphs, experts_impl="triton", fused_ops=False)
        return bf16_rate(eng, "triton, fused_ops off")

    # ---- quantized experts --------------------------------------------------------------------------
    L, E = cfg.num_layers, cfg.num_experts
    plans = {
        "int4": ([["int4"] * E for _ in range(L)], [["gpu"] * E for _ in range(L)]),
        "int8hot_ternarycold_gpu": ([["int8" if e in hot[l] else "ternary" for e in range(E)] for l in range(L)],
                                    [["gpu"] * E for _ in range(L)]),
        "int8hot_ternarycold_host": ([["int8" if e in hot[l] else "ternary" for e in range(E)] for l in range(L)],
                                     [["gpu" if e in hot[l] else "host" for e in range(E)] for l in range(L)]),
    }
    # The calibrated hot set catches nearly every pick of this random model's repetitive greedy
    # continuation (round 2: 0% of picks on host), so the PCIe path was never exercised. A hot set
    # drawn at random (seeded) sends about half the picks to the host tier: the zero-copy path under load.
    gh = torch.Generator().manual_seed(3)
    rand_hot = [set(torch.randperm(E, generator=gh)[:E // 2].tolist()) for _ in range(L)]
    plans["int8hot_ternarycold_host_randomhot"] = (
        [["int8" if e in rand_hot[l] else "ternary" for e in range(E)] for l in range(L)],
        [["gpu" if e in rand_hot[l] else "host" for e in range(E)] for l in range(L)])
    # The hot/cold plans with ternary2 cold experts: ternary's codes in 2 bits (25% more bytes than
    # base 3), decoded by shift + mask (+ dp4a with int8 activations) instead of base-3 digit chains.
    for base in ("int8hot_ternarycold_gpu", "int8hot_ternarycold_host"):
        precision, home = plans[base]
        plans[base.replace("ternary", "ternary2")] = ([["ternary2" if p == "ternary" else p for p in row]
                                                       for row in precision], home)
    # The same plans with int8 activations (kernels mode 3: x and h rounded to int8 per block, dp4a).
    for base in ("int4", "int8hot_ternarycold_gpu", "int8hot_ternarycold_host", "int8hot_ternary2cold_gpu",
                 "int8hot_ternary2cold_host"):
        plans[base + "_a8"] = plans[base]
    @variant("prefetch_prediction")
    def _():
        """How well prefetch's guess (layer l+1's router on layer l's MoE input) names layer l+1's
        picks, on the bf16 model's decode positions: share of all picks, and of the picks of the
        calibrated plan's cold (host) experts, that the guess had in its top k."""
        moe_in: dict[int, torch.Tensor] = {}
        attn_in: dict[int, torch.Tensor] = {}      # one sublayer earlier: layer l's normed attention input
        layers = hf.model.layers
        hooks = [layer.mlp.register_forward_hook(lambda m, a, o, i=i: moe_in.__setitem__(i, a[0].detach()))
                 for i, layer in enumerate(layers)]
        hooks += [layer.input_layernorm.register_forward_hook(lambda m, a, o, i=i: attn_in.__setitem__(i, o.detach()))
                  for i, layer in enumerate(layers)]
        try:
            with torch.inference_mode():
                hf(torch.tensor([prompt + ref_tokens], device=device))
        finally:
            for hk in hooks:
                hk.remove()
        n0 = len(prompt)

        def shares(source: dict) -> tuple[int, float, int, float]:
            hit = tot = cold_hit = cold_tot = 0
            for l in range(L - 1):
                wr = layers[l + 1].mlp.gate.weight.detach().float()     # no autograd (--small's weights want it)
                pred = (source[l][0, n0:].float() @ wr.T).topk(k, dim=-1).indices.tolist()
                act = (moe_in[l + 1][0, n0:].float() @ wr.T).topk(k, dim=-1).indices.tolist()
                for p, a in zip(pred, act):
                    for e in a:
                        tot += 1
                        hit += e in p
                        if e not in hot[l + 1]:
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

    plan_tokens: dict[str, list[int]] = {}
    for name, (precision, home) in plans.items():
        @variant(f"engine_{name}_triton_graphs")
        def _(precision=precision, home=home, name=name):
            if name in skip:
                raise Skipped
            t = time.perf_counter()
            # *_a8: int8 activations for the int8/int4 experts (kernels' decode mode 3, dp4a)
            eng = build_engine(hf, max_seq_len=max_seq, cuda_graphs=graphs, experts_impl="triton",
                               experts=tiered_experts(hf, precision, home, device, dtype),
                               int8_activations=name.endswith("_a8"), **choice)
            build_s = time.perf_counter() - t
            r = engine_rate(eng)
            toks = r.pop("tokens")
            # Bytes per token from THIS engine's routing on its own continuation: quantized experts
            # change the hidden states and so the routing; round 1 used the bf16 model's routes, on
            # which (a repetitive greedy continuation, its experts all "hot") no host expert was
            # ever picked: "PCIe 0.0 MB/token". Both are kept.
            own = eng.trace(prompt + toks, router_logits=False)
            split = expert_bytes_per_token([ids[len(prompt):] for ids in own.topk_ids], precision, home, H, I)
            split_bf16 = expert_bytes_per_token(routes, precision, home, H, I)
            r["pcie_bytes_per_token_bf16_routes"] = split_bf16["pcie"]
            r["host_expert_share_of_picks"] = sum(
                sum(home[l][e] == "host" for e in ids[len(prompt):].flatten().tolist())
                for l, ids in enumerate(own.topk_ids)) / max(1, sum(ids[len(prompt):].numel() for ids in own.topk_ids))
            nbytes = non_expert + split["hbm"] + split["pcie"]
            r.update(build_s=build_s, bytes_per_token=nbytes, hbm_bytes_per_token=non_expert + split["hbm"],
                     pcie_bytes_per_token=split["pcie"], mbu_pct=mbu(r["tok_s"], nbytes),
                     greedy_prefix_agree_with_bf16=next((i for i, (a, b) in enumerate(zip(toks, ref_tokens))
                                                         if a != b), len(ref_tokens)))
            msg = (f"engine {name} [triton{'+graphs' if graphs else ''}]: {r['tok_s']:.2f} tok/s, "
                   f"{nbytes / 1e9:.3f} GB/token, MBU {r['mbu_pct']:.1f}%")
            has_host = "host" in {h for row in home for h in row}
            # Where a plan's step spends its time (the round-2 host plan ran at 201 tok/s vs 359 for the
            # same plan all on GPU; round 7's int4 plan was slower than its kernel times said): kernel
            # table of eager decode steps, for every plan.
            host_note = ""
            if has_host:
                # The share of picks on host experts in the fused decode steps themselves (the trace
                # above is a prefill through the per-expert path, whose routing can differ slightly).
                r["host_share_of_decode_picks"] = decode_host_share(eng, prompt, n_short, home)
                host_note = f"host share of decode picks {100 * r['host_share_of_decode_picks']:.1f}%; "
            saved = eng.cuda_graphs
            eng.cuda_graphs = False
            try:
                p = profile_step(eng, prompt, device, top=10)
            finally:
                eng.cuda_graphs = saved
            r["profile"] = p
            log(f"  {name}: {host_note}{p['kernels_per_step']:.0f} kernels/step, "
                f"{p['kernel_ms_per_step']:.3f} ms kernel time/step:")
            for kname, count, ms in p["rows"][:10]:
                log(f"    {ms:9.3f} {count:6d}  {kname}")

            def timeline(mode: str) -> None:
                if not args.timeline or device.type != "cuda":
                    return
                try:
                    t = step_timeline(eng, prompt, out_dir / f"timeline_{name}_{mode}.json")
                except Exception as e:  # noqa: BLE001 (a diagnostic: never lose the plan's figures)
                    t = {"error": f"{type(e).__name__}: {e}"}
                r.setdefault("timeline", {})[mode] = t
                if "error" in t:
                    log(f"  timeline {mode}: {t['error']}")
                    return
                log(f"  timeline {mode}: a step every {t['period_us']:.0f} us, {t['kernels']} kernels; some kernel "
                    f"ran for {t['busy_us']:.0f} us of it, none for {t['idle_us']:.0f} us")
            timeline("plain")
            # A/B: the host takes each token before the next step is queued (Engine.decode_ahead off)
            eng.decode_ahead = False
            try:
                r["tok_s_step_by_step"] = engine_rate(eng)["tok_s"]
            finally:
                eng.decode_ahead = True
            msg += f"; step by step {r['tok_s_step_by_step']:.2f} tok/s"
            if has_host and device.type == "cuda":
                # A/B: host groups on the main stream after the HBM groups (no side-stream overlap).
                kernels.OVERLAP_HOST = False
                eng._graphs.clear()
                try:
                    r["tok_s_no_overlap"] = engine_rate(eng)["tok_s"]
                finally:
                    kernels.OVERLAP_HOST = True
                    eng._graphs.clear()
                msg += f"; without the side-stream overlap {r['tok_s_no_overlap']:.2f} tok/s"
            if has_host:
                # Prefetch: each layer stages its predicted host experts in HBM one layer early.
                for blk in eng.model.moe_blocks():
                    blk.experts.enable_prefetch(blk.top_k)
                eng._graphs.clear()
                rp = engine_rate(eng)
                timeline("prefetch")
                r["tok_s_prefetch"] = rp["tok_s"]
                r["prefetch_greedy_agree_with_no_prefetch"] = next(
                    (i for i, (a, b) in enumerate(zip(rp["tokens"], toks)) if a != b), len(toks))
                msg += (f"; with prefetch {r['tok_s_prefetch']:.2f} tok/s (greedy equals the plan without "
                        f"prefetch for {r['prefetch_greedy_agree_with_no_prefetch']}/{len(toks)} tokens)")
                # A/B: the guess made one sublayer earlier (layer l's attention input), so the stage
                # copies overlap layer l's attention too (round 9: copies issued at layer l's MoE
                # input took about as long as the window they had, and the plan gained nothing)
                eng.model.prefetch_early = True
                eng._graphs.clear()
                try:
                    rq = engine_rate(eng)
                    timeline("prefetch_early")
                finally:
                    eng.model.prefetch_early = False
                    eng._graphs.clear()
                r["tok_s_prefetch_early"] = rq["tok_s"]
                msg += f"; prefetch from the attention input {r['tok_s_prefetch_early']:.2f} tok/s"
            if has_host and R["pinned_h2d_Bps"]:
                bound = 1.0 / ((non_expert + split["hbm"]) / bw + split["pcie"] / R["pinned_h2d_Bps"])
                r.update(tier_bound_tok_s=bound, pct_of_tier_bound=100 * r["tok_s"] / bound,
                         pcie_achieved_Bps=split["pcie"] * r["tok_s"])
                if "tok_s_prefetch" in r:
                    r["pct_of_tier_bound_prefetch"] = 100 * r["tok_s_prefetch"] / bound
                    r["pct_of_tier_bound_prefetch_early"] = 100 * r["tok_s_prefetch_early"] / bound
                    msg += (f" (of the bound: with prefetch {r['pct_of_tier_bound_prefetch']:.1f}%, from the attention "
                            f"input {r['pct_of_tier_bound_prefetch_early']:.1f}%)")
                msg += (f"; PCIe {split['pcie'] / 1e6:.1f} MB/token ({100 * r['host_expert_share_of_picks']:.0f}% of "
                        f"picks on host experts; bf16 routes would say {split_bf16['pcie'] / 1e6:.1f}), achieved "
                        f"{r['pcie_achieved_Bps'] / 1e9:.1f} GB/s of {R['pinned_h2d_Bps'] / 1e9:.1f}; tier-aware bound "
                        f"{bound:.1f} tok/s -> {r['pct_of_tier_bound']:.1f}% of it")
            plan_tokens[name] = toks
            base = plan_tokens.get(name[:-3]) if name.endswith("_a8") else None
            if base is not None:
                r["greedy_prefix_agree_without_a8"] = next((i for i, (a, b) in enumerate(zip(toks, base)) if a != b),
                                                           len(base))
                msg += f"; greedy equals the plan without a8 for {r['greedy_prefix_agree_without_a8']}/{len(base)} tokens"
            log(msg + f"; greedy equals bf16 for {r['greedy_prefix_agree_with_bf16']} tokens")
            del eng
            return r

    # ---- batch throughput (fused path; > triton_max_tokens tokens use grouped_mm) -------------------
    @variant("batch_throughput_triton_graphs")
    def _():
        if "batch" in skip:
            raise Skipped
        eng = build_engine(hf, max_seq_len=max_seq, max_batch=max(batches), cuda_graphs=graphs, experts_impl="triton")
        out = {}
        for B in batches:
            r = engine_rate(eng, B, n_s=max(2, n_long // 8), n_l=max(4, n_long // 2))
            out[str(B)] = {"tok_s_per_seq": r["tok_s"], "tok_s_total": B * r["tok_s"]}
            log(f"batch {B}: {B * r['tok_s']:.1f} tok/s total ({r['tok_s']:.2f} per sequence)")
        return out

    # ---- prefill ----------------------------------------------------------------------------------
    @variant("prefill")
    def _():
        if "prefill" in skip:
            raise Skipped
        n = args.prefill_len
        long_prompt = torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()
        out = {}
        for label, impl, chunk in (("engine_triton_chunk2048", "triton", 2048),):
            eng = build_engine(hf, max_seq_len=n + 8, experts_impl=impl, prefill_chunk=chunk)
            eng.generate([long_prompt[:256]], 1, ignore_eos=True)    # warm-up
            t = min(timed(lambda: eng.generate([long_prompt], 1, ignore_eos=True), device) for _ in range(2))
            out[label] = {"tok_s": n / t, "seconds": t}
            log(f"prefill {n} tokens [{label}]: {n / t:.0f} tok/s ({t * 1000:.0f} ms)")
            del eng
        hf.set_experts_implementation("grouped_mm" if device.type == "cuda" else "eager")
        lp = torch.tensor([long_prompt], device=device)
        with torch.inference_mode():
            hf(lp[:, :256])
            t = min(timed(lambda: hf(lp), device) for _ in range(2))
        out["transformers"] = {"tok_s": n / t, "seconds": t}
        log(f"prefill {n} tokens [transformers]: {n / t:.0f} tok/s ({t * 1000:.0f} ms)")
        return out

    if device.type == "cuda":
        R["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    OUT_FILE.write_text(json.dumps(R, indent=2, default=str))
    print_table(R)
    return R


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


if __name__ == "__main__":
    main()
