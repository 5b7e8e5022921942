"""The engine's batch-1 decode rate by three paths, to find where the speed suite's engine figures
(docs/peers-h200.md) lose against decode_ab.py's (docs/engine-speed.md) on the same GPU.

  views   decode_ab.py's way: a transformers model built in memory, the engine on views of its
          tensors (gate and up rows of an expert side by side in one gate_up_proj block)
  load    the engine loaded from a checkpoint on disk (Engine.load: gate and up in separate stacks)
  runner  that checkpoint through the engine runner and the speed suite (`moebench run`), with and
          without the NVML probe

The same shape everywhere (Qwen3-30B-A3B's, with --experts experts a layer); views and load use
decode_ab.py's clock (engine_rate: the best of --reps of (tokens - 1) / (last token - first token));
the runner rows are the speed suite's median decode_tok_s over its requests. bf16, CUDA graphs.

    MOEBENCH_DATA_DIR=<a copy of shared/datasets> python3 benchmarks/engine_paths_h200.py --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

SUITE = """name = "engine-paths"
[[tasks]]
task = "speed"
prompt_lengths = [{prompt}]
output_tokens = {tokens}
repeats = 5
clients = 1
warmup = 1
seed = 1234
[probes]
nvml = {probe}
interval_ms = 100
idle_s = 1.0
"""


def save(res: dict, out: Path) -> None:
    # after every path: a call cut short by its time limit still brings back what it measured
    (out / "engine_paths.json").write_text(json.dumps(res, indent=1) + "\n")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def rate_of(eng, prompt: list[int], tokens: int, reps: int) -> float:
    from moebench.bench.engine_setup import engine_rate
    return engine_rate(eng, [prompt], 8, tokens, reps)["tok_s"]


def runner_rate(ckpt: Path, out: Path, prompt: int, tokens: int, probe: bool, device: str) -> float:
    """The speed suite's median decode_tok_s through the engine runner (one `moebench run`)."""
    tag = "probe" if probe else "noprobe"
    suite, profile, run = out / f"suite-{tag}.toml", out / "engine.toml", out / f"run-{tag}"
    shutil.rmtree(run, ignore_errors=True)
    suite.write_text(SUITE.format(prompt=prompt, tokens=tokens, probe=str(probe).lower()))
    profile.write_text(f'kind = "engine"\nmodel = "{ckpt}"\ndtype = "auto"\ndevice = "{device}"\nmax_seq_len = 5120\n')
    done = subprocess.run([sys.executable, "-m", "moebench.cli", "run", str(suite), "--runner", str(profile),
                           "--out", str(run)], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"moebench run ({tag}) failed: {done.stdout[-1500:]}{done.stderr[-1500:]}")
    rates = [json.loads(line)["decode_tok_s"] for line in (run / "items.jsonl").read_text().splitlines()
             if line.strip() and json.loads(line).get("status") == "ok"]
    return statistics.median(rates)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--work", type=Path, default=Path("/dev/shm/engine-paths"))
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--skip", default="", help="comma list of views, load, runner")
    ap.add_argument("--small", action="store_true", help="a small shape on the CPU (a check of the script)")
    a = ap.parse_args(argv)
    import torch
    from moebench.bench.engine_setup import build_engine, realistic_routing
    from moebench.bench.reference_model import QWEN3_30B_A3B, SMALL, build_transformers
    from moebench.engine import Engine
    from moebench.bench.checkpoint import SHAPE_KEYS, tokenizer_dir, write_checkpoint
    skip = {s for s in a.skip.split(",") if s}
    a.out.mkdir(parents=True, exist_ok=True)
    shape = dict(SMALL, vocab_size=50304) if a.small else dict(QWEN3_30B_A3B, num_experts=a.experts)
    dev, dtype = ("cpu", "float32") if a.small else ("cuda", "bfloat16")
    prompt = torch.randint(0, min(50000, shape["vocab_size"]), (a.prompt,),
                           generator=torch.Generator().manual_seed(1)).tolist()
    res: dict = {"experts": shape["num_experts"], "prompt": a.prompt, "tokens": a.tokens,
                 "gpu": torch.cuda.get_device_name(0) if dev == "cuda" else None}
    graphs = dev == "cuda"
    if "views" not in skip:
        t = time.monotonic()
        hf = build_transformers(shape, torch.device(dev), getattr(torch, dtype), seed=0)
        realistic_routing(hf, 0.5)
        eng = build_engine(hf, max_seq_len=a.prompt + a.tokens + 64, cuda_graphs=graphs,
                           experts_impl="triton" if graphs else "auto")
        res["views"] = rate_of(eng, prompt, a.tokens, a.reps)
        log(f"views: {res['views']:.2f} tok/s ({time.monotonic() - t:.0f} s)")
        save(res, a.out)
        del eng, hf
        torch.cuda.empty_cache()
    ckpt = a.work / "hf"
    if not {"load", "runner"} <= skip:
        t = time.monotonic()
        write_checkpoint(ckpt, {k: shape[k] for k in SHAPE_KEYS}, 43, dev, tokenizer_dir(HERE.parent))
        log(f"checkpoint: {time.monotonic() - t:.0f} s")
    if "load" not in skip:
        t = time.monotonic()
        eng = Engine.load(ckpt, device=dev, dtype=dtype, max_seq_len=5120, cuda_graphs=graphs,
                          experts_impl="triton" if graphs else "auto")
        res["load"] = rate_of(eng, prompt, a.tokens, a.reps)
        log(f"load: {res['load']:.2f} tok/s ({time.monotonic() - t:.0f} s)")
        save(res, a.out)
        del eng
        torch.cuda.empty_cache()
    if "runner" not in skip:
        for probe in (True, False):
            t = time.monotonic()
            key = "runner_probe" if probe else "runner_no_probe"
            res[key] = runner_rate(ckpt, a.out, a.prompt, a.tokens, probe, dev)
            log(f"{key}: {res[key]:.2f} tok/s ({time.monotonic() - t:.0f} s)")
            save(res, a.out)
    print("| path | decode tok/s |\n|---|---|")
    for k in ("views", "load", "runner_probe", "runner_no_probe"):
        if k in res:
            print(f"| {k} | {res[k]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
