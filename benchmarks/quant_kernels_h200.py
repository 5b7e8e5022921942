"""Per-kernel times of the fused MoE decode kernels for each expert format and decode mode, one MoE
layer of Qwen3-30B-A3B's shape at batch 1 (8 of 128 experts, hidden 2048, width 768).

decode_h200.py times whole layers; this script splits a layer into its gate_up and down kernels
(torch profiler, CUDA activity) and prints their registers and spills, so a decode change can be
judged kernel by kernel:

    python benchmarks/quant_kernels_h200.py --out $OUT       # on the GPU
    python benchmarks/quant_kernels_h200.py --small          # CPU interpreter smoke test

Decode modes (DecodeConfig.decode_mode, for int8/int4/ternary2): 0 = BYTES, byte loads with
int-to-float conversions; 2 = WORDS, int32 word loads decoded without conversions, x split in
registers; 3 = INT8_ACTIVATIONS, int8 x and dp4a (gate_up's time includes the x quantization launch).
Every call passes its DecodeConfig; nothing here changes the engine's defaults.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

if "--small" in sys.argv or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import replace  # noqa: E402

from moebench.bench.engine_setup import stacked_group  # noqa: E402
from moebench.engine import kernels  # noqa: E402
from moebench.engine.decode_config import DecodeConfig, DecodeMode  # noqa: E402


# (BN, BK, num_warps, num_stages); BK in bytes for the packed formats
SWEEP = [(4, 512, 4, 3), (8, 1024, 8, 3), (4, 1024, 4, 2), (8, 512, 4, 3), (16, 256, 4, 3), (2, 1024, 4, 3),
         (4, 2048, 8, 2), (16, 512, 8, 2), (8, 128, 4, 3), (16, 128, 4, 2), (4, 256, 4, 3)]


def kernel_times(fn, device, calls: int) -> dict[str, float]:
    """Mean device microseconds per call of each kernel fn launches, over `calls` calls of fn."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        if ev.device_type.name == "CUDA" and ev.count:
            out[ev.key] = getattr(ev, "device_time_total", getattr(ev, "cuda_time_total", 0.0)) / calls
    return out


# host configs tried for ternary2 in pinned memory (a8 gate_up takes BN 16..64)
HOST_SWEEP = [(16, 512, 4, 2), (16, 256, 4, 3), (32, 512, 8, 2), (16, 512, 8, 1), (64, 512, 8, 2), (16, 128, 4, 4),
              (8, 256, 4, 3), (4, 512, 4, 3)]


def host_layer(results: dict, g8, perm, half: int, H: int, I: int, k: int, x, w, device, gen) -> None:
    """The calibrated host plan's layer: int8 hot experts in HBM, ternary2 cold ones in pinned host
    memory (about one pair of eight per layer). Wall time in a CUDA graph of: the cold pair alone,
    hot + cold with and without the side-stream overlap, the hot pairs alone; then host launch
    configs for the cold pair (int8 activations), and the PCIe rate the best one reaches."""
    E = 2 * half
    gh, nbytes = stacked_group(half, H, I, "ternary2", device, gen, pin=True)
    gh.slot_of = torch.full((E,), -1, dtype=torch.int32)
    gh.slot_of[perm[half:]] = torch.arange(half, dtype=torch.int32)
    gh.slot_of = gh.slot_of.to(device)
    hot, cold = perm[:half], perm[half:]
    # one cold expert per call, each a different one (no L2 reuse between calls)
    mixed = [torch.cat([hot[i:i + k - 1], cold[j:j + 1]]).view(1, k).to(device)
             for j, i in enumerate(range(0, half - k + 1, k))]
    for mode in (DecodeMode.WORDS, DecodeMode.INT8_ACTIVATIONS):
        cfg = DecodeConfig(decode_mode=mode)

        def run(groups, cfg=cfg):
            def layer():
                for ids in mixed:
                    kernels.fused_moe(x, ids, w, groups, cfg=cfg, reduce=False)
            return graph_us(layer, device) / len(mixed)
        row = {"case": "int8 hot + ternary2 host", "mode": int(mode), "cold_pair_alone_us": run([gh]),
               "hot_alone_us": run([g8]), "together_us": run([g8, gh])}
        row["together_no_overlap_us"] = run([g8, gh], replace(cfg, overlap_host=False))
        row["cold_pair_GBps"] = nbytes / (row["cold_pair_alone_us"] * 1e-6) / 1e9
        if mode == DecodeMode.INT8_ACTIVATIONS:
            best = {}
            for kk in ("gate_up", "down"):
                for c in HOST_SWEEP:
                    us = run([gh], cfg.with_launch(kk, "ternary2", host=True, BN=c[0], BK=c[1], num_warps=c[2],
                                                   num_stages=c[3]))
                    if us < best.get(kk, (1e9,))[0]:
                        best[kk] = (us, c)
            tuned = cfg
            for kk in ("gate_up", "down"):
                b = best[kk][1]
                tuned = tuned.with_launch(kk, "ternary2", host=True, BN=b[0], BK=b[1], num_warps=b[2], num_stages=b[3])
            row["host_sweep_best"] = best
            row["cold_pair_alone_best_us"] = run([gh], tuned)
            row["together_best_us"] = run([g8, gh], tuned)
        results["rows"].append(row)
        print(f"host layer mode {mode}: cold pair alone {row['cold_pair_alone_us']:.2f} us "
              f"({row['cold_pair_GBps']:.1f} GB/s over PCIe), hot alone {row['hot_alone_us']:.2f}, together "
              f"{row['together_us']:.2f} (no overlap {row['together_no_overlap_us']:.2f})"
              + (f"; host sweep best {row['host_sweep_best']['gate_up'][1]} / {row['host_sweep_best']['down'][1]}: "
                 f"cold pair {row['cold_pair_alone_best_us']:.2f} us, together {row['together_best_us']:.2f}"
                 if mode == DecodeMode.INT8_ACTIVATIONS else ""))


def graph_us(fn, device, reps: int = 20) -> float:
    """Wall microseconds of one call of fn, replayed in a CUDA graph (side streams overlap here,
    where kernel_times adds their kernels up)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / reps


def compiled_stats(jit_fn) -> list[dict]:
    """Registers and spills of every compiled specialisation of a Triton kernel (best effort: the
    cache layout is Triton-internal)."""
    rows = []
    for cache in getattr(jit_fn, "device_caches", {}).values():
        table = cache[0] if isinstance(cache, tuple) else cache
        for ck in getattr(table, "values", lambda: [])():
            rows.append({"n_regs": getattr(ck, "n_regs", None), "n_spills": getattr(ck, "n_spills", None)})
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--formats", default="dense,int8,int4,ternary")
    ap.add_argument("--sweep", action="store_true", help="also try SWEEP's launch configs per format and mode")
    ap.add_argument("--modes", default="0,2,3", help="decode modes for int8/int4 (DecodeMode values)")
    args = ap.parse_args(argv)
    small = args.small or not torch.cuda.is_available()
    device = torch.device("cpu" if small else "cuda")
    E, H, I, k = (16, 128, 64, 2) if small else (128, 2048, 768, 8)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, H, generator=gen).to(device, torch.bfloat16 if not small else torch.float32)
    perm = torch.randperm(E, generator=gen)
    id_sets = [perm[i:i + k].view(1, k).to(device) for i in range(0, E - k + 1, k)]  # disjoint experts
    w = torch.softmax(torch.rand(1, k, generator=gen), -1).to(device)
    results = {"shape": {"experts": E, "hidden": H, "width": I, "top_k": k}, "rows": []}
    print(f"{'format':8} {'mode':>4} {'gate_up us':>10} {'down us':>8} {'GB/s':>6}  configs")
    for fmt in args.formats.split(","):
        group, nbytes = stacked_group(E, H, I, fmt, device, gen)
        modes = [0] if fmt in ("dense", "ternary") else [int(m) for m in args.modes.split(",")]
        if fmt == "ternary2":          # words only: its modes are 2 (float x) and 3 (int8 x)
            modes = [m for m in modes if m >= 2]
        for mode in modes:
            cfg = DecodeConfig(decode_mode=DecodeMode(mode))

            def layer(cfg=cfg):
                for ids in id_sets:
                    kernels.fused_moe(x, ids, w, [group], cfg=cfg, reduce=False)
            if small:
                layer()
                row = {"format": fmt, "mode": mode, "ran": True}
            else:
                t = kernel_times(layer, device, calls=5)
                # mode 3's x quantization (quantize_rows_kernel, one launch per layer) counts as gate_up's
                gu = sum(v for n, v in t.items() if "gate_up" in n or "quantize_rows" in n) / len(id_sets)
                dn = sum(v for n, v in t.items() if "down_kernel" in n) / len(id_sets)
                row = {"format": fmt, "mode": mode, "gate_up_us": gu, "down_us": dn,
                       "GBps": k * nbytes / ((gu + dn) * 1e-6) / 1e9,
                       "configs": {kk: cfg.launch_for(kk, fmt, a8=mode == 3).kwargs()
                                   for kk in ("gate_up", "down")}}
                print(f"{fmt:8} {mode:>4} {gu:10.2f} {dn:8.2f} {row['GBps']:6.0f}  "
                      f"{row['configs']['gate_up']} / {row['configs']['down']}")
            if args.sweep and not small:
                best = {}
                for c in SWEEP:
                    trial = cfg
                    for kk in ("gate_up", "down"):
                        trial = trial.with_launch(kk, fmt, a8=mode == 3, BN=c[0], BK=c[1], num_warps=c[2],
                                                  num_stages=c[3])
                    t = kernel_times(lambda trial=trial: layer(trial), device, calls=3)
                    for kk, key in (("gate_up", ("gate_up", "quantize_rows")), ("down", ("down_kernel",))):
                        us = sum(v for n, v in t.items() if any(kn in n for kn in key)) / len(id_sets)
                        if us < best.get(kk, (1e9,))[0]:
                            best[kk] = (us, c)
                row["sweep_best"] = best
                print(f"{'':8} {'':>4} {best['gate_up'][0]:10.2f} {best['down'][0]:8.2f} "
                      f"{k * nbytes / ((best['gate_up'][0] + best['down'][0]) * 1e-6) / 1e9:6.0f}  best of the sweep: "
                      f"{best['gate_up'][1]} / {best['down'][1]}")
            results["rows"].append(row)
    # Maps and mixed groups, as TieredExperts builds them: a slot map costs a dependent load per
    # program; a hot/cold layer launches its two formats together.
    if not small and "int8" in args.formats:
        half = E // 2
        g8, _ = stacked_group(half, H, I, "int8", device, gen)
        gt, _ = stacked_group(half, H, I, "ternary", device, gen)
        gt2, _ = stacked_group(half, H, I, "ternary2", device, gen)
        for grp, members in ((g8, perm[:half]), (gt, perm[half:]), (gt2, perm[half:])):
            grp.slot_of = torch.full((E,), -1, dtype=torch.int32)
            grp.slot_of[members] = torch.arange(half, dtype=torch.int32)
            grp.slot_of = grp.slot_of.to(device)
        full8, _ = stacked_group(E, H, I, "int8", device, gen)
        mapped8 = kernels.ExpertGroup(full8.gate, full8.up, full8.down, torch.arange(E, dtype=torch.int32, device=device))
        hot, cold = perm[:half], perm[half:]
        mixed_sets = [torch.cat([hot[i:i + k - 1], cold[i:i + 1]]).view(1, k).to(device)
                      for i in range(0, half - k + 1, k)]
        hot_sets = [hot[i:i + k].view(1, k).to(device) for i in range(0, half - k + 1, k)]
        cases = {"int8, no map": ([full8], id_sets), "int8, identity map": ([mapped8], id_sets),
                 "int8 + ternary groups, 8 hot picks": ([g8, gt], hot_sets),
                 "int8 + ternary groups, 7 hot + 1 cold": ([g8, gt], mixed_sets),
                 "int8 + ternary2 groups, 7 hot + 1 cold": ([g8, gt2], mixed_sets)}
        for mode in (DecodeMode.WORDS, DecodeMode.INT8_ACTIVATIONS):
            cfg = DecodeConfig(decode_mode=mode)
            for name, (groups, sets) in cases.items():
                def layer(groups=groups, sets=sets, cfg=cfg):
                    for ids in sets:
                        kernels.fused_moe(x, ids, w, groups, cfg=cfg, reduce=False)
                t = kernel_times(layer, device, calls=5)
                gu = sum(v for n, v in t.items() if "gate_up" in n or "quantize_rows" in n) / len(sets)
                dn = sum(v for n, v in t.items() if "down_kernel" in n) / len(sets)
                wall = graph_us(layer, device) / len(sets)
                results["rows"].append({"case": name, "mode": int(mode), "gate_up_us": gu, "down_us": dn,
                                        "layer_wall_us": wall})
                print(f"{name:40} mode {int(mode)}: gate_up {gu:6.2f} us, down {dn:6.2f} us (kernel sums); "
                      f"layer {wall:6.2f} us wall in a CUDA graph")
        try:
            host_layer(results, g8, perm, half, H, I, k, x, w, device, gen)
        except Exception:  # noqa: BLE001 - keep the rows above
            import traceback
            traceback.print_exc()
            results["host_layer_error"] = traceback.format_exc()
    if not small:
        results["compiled"] = {"gate_up": compiled_stats(kernels.moe_kernels.gate_up_kernel),
                               "down": compiled_stats(kernels.moe_kernels.down_kernel)}
        for name, rows in results["compiled"].items():
            regs = [r["n_regs"] for r in rows if r["n_regs"] is not None]
            if regs:
                print(f"  {name}: {len(regs)} compiled variants, {min(regs)}-{max(regs)} registers, "
                      f"{sum(bool(r['n_spills']) for r in rows)} with spills")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "quant_kernels_h200.json").write_text(json.dumps(results, indent=1, default=str))
    return results


if __name__ == "__main__":
    main()
