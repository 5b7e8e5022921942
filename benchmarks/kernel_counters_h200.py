"""Hardware counters of the fused MoE decode kernels, one launch pair per format, under Nsight Compute.

quant_kernels_h200.py times the kernels; this script gives ncu exactly the launches to read (between
cudaProfilerStart/Stop, after a warm-up that compiles them), so the counters say why a format's
kernel is slow: DRAM throughput against the copy bandwidth, issue stalls, occupancy.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats --section SchedulerStats \\
        python benchmarks/kernel_counters_h200.py --formats dense,int8,int4 > $OUT/ncu.txt

ncu flushes the caches before each kernel (its default cache control), as the weights of a real
decode step are cold: every launch here reads 8 experts no earlier launch read.
"""
from __future__ import annotations

import argparse
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moebench.bench.engine_setup import stacked_group  # noqa: E402
from moebench.engine import kernels  # noqa: E402
from moebench.engine.decode_config import DEFAULT, DecodeConfig, DecodeMode  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--formats", default="dense,int8,int4")
    ap.add_argument("--modes", default="", help="decode modes for int8/int4 (default: the shipped one)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    E, H, I, k = (128, 2048, 768, 8) if cuda else (16, 128, 64, 2)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, H, generator=gen).to(device, torch.bfloat16 if cuda else torch.float32)
    perm = torch.randperm(E, generator=gen)
    w = torch.softmax(torch.rand(1, k, generator=gen), -1).to(device)
    for fmt in args.formats.split(","):
        group, _ = stacked_group(E, H, I, fmt, device, gen)
        modes = [int(m) for m in args.modes.split(",") if m] if fmt in ("int8", "int4") else []
        for mode in modes or [DEFAULT.mode_of(fmt)]:
            cfg = DecodeConfig(mode_by_format={fmt: DecodeMode(mode)})
            warm = perm[:k].view(1, k).to(device)
            cold = perm[k:2 * k].view(1, k).to(device)
            kernels.fused_moe(x, warm, w, [group], cfg=cfg, reduce=False)      # compiles
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.profiler.start()
            kernels.fused_moe(x, cold, w, [group], cfg=cfg, reduce=False)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.profiler.stop()
            a8 = mode == DecodeMode.INT8_ACTIVATIONS
            print(f"profiled: {fmt} mode {int(mode)} launches {cfg.launch_for('gate_up', fmt, a8=a8)} / "
                  f"{cfg.launch_for('down', fmt, a8=a8)}", flush=True)


if __name__ == "__main__":
    main()
