"""Measurements the decode benchmarks make: CUDA-graph timing, launch sweeps of the expert and
GEMV kernels, a decode step's kernel profile and timeline, bytes per token and PCIe bandwidth.

Sweeps take a DecodeConfig and return the one with the best launches found; nothing here changes
the engine's defaults.
"""
from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from moebench import jsonout
from moebench.engine import Engine, kernels
from moebench.engine.decode_config import DecodeConfig, DecodeMode
from moebench.engine.model import RouterTracer
from moebench.engine.quant import format_nbytes


def log(msg: str) -> None:
    print(msg, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def tier_bound(non_expert_bytes: float, split: dict, copy_Bps: float, h2d_Bps: float) -> float:
    """The tier-aware bound of a plan with host experts (tok/s): HBM bytes (non-expert weights and
    the HBM experts) at the device copy bandwidth plus the host experts' bytes (expert_bytes_per_token's
    split) at the pinned host-to-device bandwidth, one after the other."""
    return 1.0 / ((non_expert_bytes + split["hbm"]) / copy_Bps + split["pcie"] / h2d_Bps)


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
# down wants many programs (H/BN per token: BN=4 -> 512 for 132 SMs) and K=768 splits evenly into
# BK=256; deeper pipelines (num_stages 4) and 8 warps keep more bytes in flight per program.
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


def sweep_gemv(hf, device, dtype, cfg: DecodeConfig) -> tuple[dict, DecodeConfig]:
    """kernels.linear vs F.linear (cuBLAS) at one token on the [q; k; v] and o_proj shapes; returns
    the results and cfg with the GEMV launch of the least total time.

    Each timed graph runs the projection of EVERY layer once (cold weights, as in a decode step):
    one layer's matrices timed over and over sit in the 50 MB L2 and flatter the kernel."""
    layers = hf.model.layers
    mats = {"qkv": [torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach()
                    for a in (layer.self_attn for layer in layers)],
            "o": [layer.self_attn.o_proj.weight.detach() for layer in layers]}
    xs = {n: torch.randn(1, ws[0].shape[1], device=device, dtype=dtype) for n, ws in mats.items()}

    def per_layer_us(f, n) -> float:
        return time_graph(lambda: [f(xs[n], w) for w in mats[n]], device, iters=1) / len(mats[n]) * 1e6
    out = {"cublas_us": {n: per_layer_us(F.linear, n) for n in mats}}
    times = []
    for params in GEMV_SWEEP:
        trial = cfg.with_launch("gemv", "dense", **params)
        try:
            t = {n: per_layer_us(lambda x, w, trial=trial: kernels.linear(x, w, cfg=trial), n) for n in mats}
            times.append((sum(t.values()), params, t))
        except Exception as e:  # noqa: BLE001 - a config this GPU cannot run
            log(f"  gemv sweep {params}: {type(e).__name__}: {e}")
    total, best, t = min(times, key=lambda x: x[0])
    out.update(best=best, triton_us=t, all=[(c, {n: round(v, 2) for n, v in tt.items()}) for _, c, tt in times])
    for n, ws in mats.items():
        nb = ws[0].numel() * ws[0].element_size()
        log(f"  gemv [{n} {tuple(ws[0].shape)}, cold]: cuBLAS {out['cublas_us'][n]:.1f} us "
            f"({nb / out['cublas_us'][n] / 1e3:.0f} GB/s), triton {t[n]:.1f} us ({nb / t[n] / 1e3:.0f} GB/s) with {best}")
    log("  gemv sweep (qkv + o us): " + ", ".join(
        f"{tuple(c.values())}: {sum(tt.values()):.1f}" for _, c, tt in times))
    del mats
    return out, cfg.with_launch("gemv", "dense", **best)


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
                         bw: float, cfg: DecodeConfig, host: bool = False) -> tuple[dict, DecodeConfig]:
    """For each format, try SWEEP for gate_up then for down (one MoE layer, batch 1); returns the
    results and cfg with the best launches (and, per format, the faster of BYTES and its mode).

    Each timed graph runs num_experts // top_k layer calls on DISJOINT expert sets, so every call
    reads experts no other call read (the same 8 experts re-read sit in the 50 MB L2 and flatter
    the small formats). host: the groups live in pinned host memory; the launches found are for
    host groups only."""
    out = {}
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, hidden, generator=g).to(device, dtype)
    perm = torch.randperm(num_experts, generator=g)
    id_sets = [perm[i:i + top_k].view(1, top_k).to(device) for i in range(0, num_experts - top_k + 1, top_k)]
    w = torch.softmax(torch.rand(1, top_k, generator=g), -1).to(device)

    def layer_time(group, trial: DecodeConfig) -> float:
        return time_graph(lambda: [kernels.fused_moe(x, ids, w, [group], cfg=trial) for ids in id_sets], device,
                          iters=1) / len(id_sets)
    for fmt, (group, nbytes) in groups_by_fmt.items():
        res = {}
        pairs = top_k
        if fmt in ("ternary", "ternary2") and not host:
            # Ternary is the cold format of the hot/cold plans: a layer sends it about one pair of its
            # eight, and that pair's programs set the launch's length. Tune for that: the group holds
            # one expert of each set.
            slot_of = torch.full((num_experts,), -1, dtype=torch.int32)
            firsts = torch.stack([s[0, 0] for s in id_sets]).cpu()
            slot_of[firsts] = firsts.to(torch.int32)
            group = kernels.ExpertGroup(group.gate, group.up, group.down, slot_of.to(device), "ternary, 1 pair of 8")
            pairs = 1
        for kernel in ("gate_up", "down"):
            times = []
            for params in SWEEP:
                try:
                    times.append((layer_time(group, cfg.with_launch(kernel, fmt, host=host, **params)), params))
                except Exception as e:  # noqa: BLE001 - a config this GPU cannot run
                    log(f"  sweep {fmt} {kernel} {params}: {type(e).__name__}: {e}")
            best_t, best = min(times, key=lambda tc: tc[0])
            cfg = cfg.with_launch(kernel, fmt, host=host, **best)
            res[kernel] = {"best": best, "layer_us": best_t * 1e6,
                           "all": [(c, round(t * 1e6, 2)) for t, c in times]}
        t = layer_time(group, cfg)
        res["layer_us"] = t * 1e6
        res["pairs"] = pairs
        res["GBps"] = pairs * nbytes / t / 1e9
        res["pct_of_copy_bw"] = 100 * pairs * nbytes / t / bw
        mode_note = ""
        mode = cfg.mode_of(fmt)
        if kernels.group_mode(group, "gate_up", cfg) == DecodeMode.WORDS and not host and fmt != "ternary2":
            # A/B at the same launches: the byte decode with int-to-float conversions (BYTES); the
            # runs after the sweep keep the faster mode for this format
            bytes_cfg = replace(cfg, mode_by_format={**cfg.mode_by_format, fmt: DecodeMode.BYTES})
            res["bytes_layer_us"] = layer_time(group, bytes_cfg) * 1e6
            if res["bytes_layer_us"] < res["layer_us"]:
                cfg = bytes_cfg
            res["decode_mode"] = cfg.mode_of(fmt).name
            mode_note = (f"; decode mode {mode.name} against BYTES (conversions) {res['bytes_layer_us']:.1f} us: "
                         f"keeps {res['decode_mode']}")
        out[fmt] = res
        where = "host (zero-copy over PCIe)" if host else "HBM"
        log(f"  kernel sweep [{group.label or fmt} in {where}]: gate_up {res['gate_up']['best']}, down "
            f"{res['down']['best']}: one layer {t * 1e6:.1f} us, {res['GBps']:.0f} GB/s of expert bytes "
            f"({res['pct_of_copy_bw']:.0f}% of copy bw){mode_note}")
    return out, cfg


def profile_step(eng: Engine, prompt: list[int], device, top: int = 20, steps: int = 5) -> dict:
    """Kernel-time table of `steps` eager decode steps alone (no prefill, whose kernels would mix in),
    and kernels launched per step."""
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
        # device totals: the CUDA kernel events only (counting every row not named aten::* or cuda*
        # doubles the first profile of a run)
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
    step runs from the kernel after one step's greedy pick (its feed of the next step, or torch's
    argmax where the logits are not the GEMV's) to the next step's; its
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
    picks = [i for i, e in enumerate(ks) if "feed_kernel" in e["name"]]          # each decode step's
    if len(picks) < 3:
        picks = [i for i, e in enumerate(ks) if "ArgMax" in e["name"]]
    if len(picks) < 3:
        return {"error": f"{len(picks)} greedy picks among {len(ks)} kernels; expected {steps} decode steps"}
    i, j = picks[-3] + 1, picks[-2] + 1
    t0, t1 = ks[i]["ts"], ks[j]["ts"]
    step = ks[i:j]
    busy = sum(min(b, t1) - a for a, b in _union([(e["ts"], e["ts"] + e["dur"]) for e in step]))
    path.write_text(jsonout.dumps([[e["name"][:48], round(e["ts"] - t0, 2), round(e["dur"], 2)] for e in step]))
    return {"period_us": t1 - t0, "kernels": len(step), "busy_us": busy, "idle_us": (t1 - t0) - busy}
