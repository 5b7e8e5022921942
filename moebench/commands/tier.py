"""`moebench tier calibrate | plan | pack`: tier an engine checkpoint (api.tier_*), a handler per step."""
from __future__ import annotations

import argparse

from moebench.commands.common import command


def add_args(sub: argparse._SubParsersAction) -> None:
    tier = command(sub, "tier", "tier an engine checkpoint: calibrate -> plan -> pack (files in between)",
                   "moebench tier calibrate models/zoo/tiny-moe --out stats.safetensors\n"
                   "moebench tier plan models/zoo/tiny-moe stats.safetensors --hot-fraction 0.25 --out plan.json\n"
                   "moebench tier pack models/zoo/tiny-moe plan.json --out models/zoo/tiny-moe-tiered")
    tsub2 = tier.add_subparsers(dest="tier_command", required=True, metavar="STEP")
    tc = command(tsub2, "calibrate", "expert usage and input statistics on real text",
                 "moebench tier calibrate models/zoo/tiny-moe --out stats.safetensors")
    tc.add_argument("checkpoint", help="Hugging Face-format checkpoint directory")
    tc.add_argument("--out", required=True, help="statistics file (safetensors)")
    tc.add_argument("--tokens", type=int, default=16384, help="calibration tokens from the haystack text")
    tc.set_defaults(handler=handle_calibrate)
    tp = command(tsub2, "plan", "give every expert a precision and a home within byte budgets",
                 "moebench tier plan CKPT stats.safetensors --gpu-bytes 4000000 --host-bytes 8000000 --out plan.json\n"
                 "moebench tier plan CKPT stats.safetensors --hot-fraction 0.25 --out plan.json\n"
                 "moebench tier plan CKPT stats.safetensors --gpu-bytes 4000000 --host-bytes 2000000 --ssd-gib 1 "
                 "--ssd-cache-bytes 1000000 --out plan.json")
    tp.add_argument("checkpoint", help="Hugging Face-format checkpoint directory")
    tp.add_argument("stats", help="statistics file from `tier calibrate`")
    tp.add_argument("--out", required=True, help="plan.json")
    tp.add_argument("--gpu-bytes", type=int, help="greedy planner: bytes of experts resident on the device")
    tp.add_argument("--host-bytes", type=int, default=0, help="greedy planner: bytes of experts in host RAM")
    tp.add_argument("--ssd-bytes", type=int, help="greedy planner: bytes of experts on local disk (the coldest, "
                    "beyond --host-bytes; packed into experts.ssd); default 0, no disk tier")
    tp.add_argument("--ssd-gib", type=float, help="the same budget in GiB")
    tp.add_argument("--ssd-cache-bytes", type=int, help="host-RAM LRU cache in front of the disk tier, bytes (default 0)")
    tp.add_argument("--ssd-cache-gib", type=float, help="the same cache in GiB")
    tp.add_argument("--ssd-fraction", type=float, default=0.0,
                    help="rule-based planner: the least used share per layer goes to disk")
    tp.add_argument("--ladder", default="bf16,int8,int4,ternary", help="greedy planner: precisions to choose from")
    tp.add_argument("--hot-fraction", type=float, help="rule-based planner instead: the most used share per layer")
    tp.add_argument("--hot", default="int8", help="rule-based planner: precision of the hot experts")
    tp.add_argument("--cold", default="ternary", help="rule-based planner: precision of the cold experts")
    tp.set_defaults(handler=handle_plan)
    tk = command(tsub2, "pack", "write the tiered artifact the engine runner loads",
                 "moebench tier pack models/zoo/tiny-moe plan.json --out models/zoo/tiny-moe-tiered")
    tk.add_argument("checkpoint", help="Hugging Face-format checkpoint directory")
    tk.add_argument("plan", help="plan.json from `tier plan`")
    tk.add_argument("--out", required=True, help="artifact directory")
    tk.set_defaults(handler=handle_pack)


def handle_calibrate(args: argparse.Namespace) -> int:
    from moebench import api
    tokens = api.tier_calibrate(args.checkpoint, args.out, tokens=args.tokens)
    print(f"calibrated on {tokens} tokens; per-layer expert counts in {args.out}")
    print(args.out)
    return 0


def handle_plan(args: argparse.Namespace) -> int:
    from moebench import api
    p = api.tier_plan(args.checkpoint, args.stats, args.out, gpu_bytes=args.gpu_bytes, host_bytes=args.host_bytes,
                      ladder=args.ladder, hot_fraction=args.hot_fraction, hot=args.hot, cold=args.cold,
                      ssd_bytes=api.gib_or_bytes("ssd", args.ssd_bytes, args.ssd_gib),
                      ssd_cache_bytes=api.gib_or_bytes("ssd-cache", args.ssd_cache_bytes, args.ssd_cache_gib),
                      ssd_fraction=args.ssd_fraction)
    print(f"plan: {p.count()}")
    print(args.out)
    return 0


def handle_pack(args: argparse.Namespace) -> int:
    from moebench import api
    print(api.tier_pack(args.checkpoint, args.plan, args.out))
    return 0
