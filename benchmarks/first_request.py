"""What an engine's first request of a new prompt length costs, and where the time goes.

    python benchmarks/first_request.py --out $OUT/first_request.json                  # CUDA, 8 layers
    CUDA_MODULE_LOADING=EAGER python benchmarks/first_request.py --out $OUT/eager.json
    python benchmarks/first_request.py --no-cudnn-sdp --out $OUT/no_cudnn.json       # torch's SDPA without cuDNN
    python benchmarks/first_request.py --device cpu --small --out /tmp/fr.json       # CPU smoke run

Run from the repository root with moebench installed (`setup.sh` installs it editable) or on PYTHONPATH.

The engine is the decode benchmarks' (Qwen3-30B-A3B-shaped random weights, CUDA graphs, the fused
decode path; --layers of them). After the engine runner's warm-up (16 tokens, 8 new) it generates 4
tokens for each prompt length in --lengths in turn, and records per request the time to the first
token, the whole time, the CUDA graphs captured and the Triton kernels compiled (new entries of a
fresh TRITON_CACHE_DIR); the first request of --profile-length runs under torch.profiler, whose ops
by self CPU time go into the JSON. A length's first request against its later ones is the cost of
the new shape; run the script twice on one machine to see what a disk cache (Triton's, the CUDA
driver's JIT cache) takes off it.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time
from pathlib import Path

LENGTHS = (128, 128, 129, 129, 127, 130, 131, 144, 160, 128, 200, 255, 256, 257, 300, 512, 513, 1000,
           4096, 4097, 4100, 4096)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="the small CPU shape (moebench.bench.reference_model.SMALL)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="prompt lengths, in order")
    ap.add_argument("--profile-length", type=int, default=129, help="the first request of this length is profiled")
    ap.add_argument("--no-cudnn-sdp", action="store_true", help="torch.backends.cuda.enable_cudnn_sdp(False)")
    args = ap.parse_args()
    cache = os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="triton-cache-"))
    import torch
    from torch.profiler import ProfilerActivity, profile

    from moebench.bench.engine_setup import build_engine, realistic_routing
    from moebench.bench.reference_model import bench_shape, build_transformers

    if args.no_cudnn_sdp:
        torch.backends.cuda.enable_cudnn_sdp(False)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    hf = build_transformers(bench_shape(args.small, args.layers), device,
                            torch.bfloat16 if cuda else torch.float32, 0)
    realistic_routing(hf, 1.0)
    eng = build_engine(hf, max_seq_len=8192, cuda_graphs=cuda, experts_impl="triton" if cuda else "auto")
    vocab = hf.config.vocab_size

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def compiled() -> set[str]:
        return {p for p in glob.glob(f"{cache}/*/*.json") if "__grp__" not in p}

    requests, profiled, seen = [], None, set()
    for label, n, new in [("warm-up", 16, 8)] + [("request", int(x), 4) for x in args.lengths.split(",")]:
        ids = [(7 * i + 3) % (vocab - 1) + 1 for i in range(n)]
        before, graphs = compiled(), len(eng._graphs)
        prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) \
            if n == args.profile_length and profiled is None else None
        sync()
        t = time.perf_counter()
        if prof is not None:
            with prof:
                out = eng.generate([ids], new, ignore_eos=True)
                sync()
        else:
            out = eng.generate([ids], new, ignore_eos=True)
        sync()
        total = time.perf_counter() - t
        if prof is not None:
            profiled = [{"op": e.key, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3), "calls": e.count}
                        for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:20]]
        row = {"what": label, "prompt_tokens": n, "first_of_length": n not in seen,
               "ttft_ms": round(out[0].token_times[0] * 1e3, 2), "total_ms": round(total * 1e3, 2),
               "graphs_captured": len(eng._graphs) - graphs,
               "triton_compiled": sorted(Path(p).stem for p in compiled() - before)}
        seen.add(n)
        requests.append(row)
        print(f"{label:8s} {n:5d} tokens{' (first)' if row['first_of_length'] else '        '} "
              f"ttft {row['ttft_ms']:8.1f} ms, total {row['total_ms']:8.1f} ms, graphs +{row['graphs_captured']}, "
              f"compiled {row['triton_compiled']}", flush=True)
    doc = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "cuda_module_loading": os.environ.get("CUDA_MODULE_LOADING"), "cudnn_sdp": not args.no_cudnn_sdp,
           "layers": args.layers, "requests": requests, "profiled_length": args.profile_length,
           "profiled_ops": profiled}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    for op in profiled or []:
        print(f"  {op['op'][:60]:60s} {op['self_cpu_ms']:10.3f} ms self CPU, {op['calls']} calls")
    return 0


if __name__ == "__main__":
    sys.exit(main())
