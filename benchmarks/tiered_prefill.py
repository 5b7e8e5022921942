"""Prefill of tiered (packed) experts by the per-expert path and by the grouped path.

Steps beyond the fused decode path (prefill, larger batches) of a tiered artifact run its picked
experts either one at a time (per expert: a host sync for its rows, three dequantizations, three
small GEMMs) or, with experts_impl "triton" on CUDA ("grouped_mm" on the CPU), as one grouped path
(every picked expert dequantized into stacks, three grouped GEMMs; DecodeConfig.tiered_stack_bytes).
This times both on the same artifacts, beside the bf16 checkpoint the plans were packed from:

  int8       every expert int8 in device memory
  int4       every expert int4 in device memory
  mixed      each layer's first half of experts (by id) int8 in device memory, the rest ternary in
             host memory (cache_slots 2): host experts are fetched for every prefill chunk

Each row is the median of --reps prefills (`Engine.generate(prompt, 1)`, synchronized) as prompt
tokens a second, the two paths of a plan taking turns after an untimed round; "agrees" compares
each grouped run's first token and top-5 log-probs with the per-expert run's on the same artifact.
Shapes: Qwen3-30B-A3B's with --experts experts a layer and --layers layers on CUDA (bf16), a small
one on the CPU (float32).

    python3 benchmarks/tiered_prefill.py --out results/tiered-prefill            # the CPU
    PYTHONPATH=$PWD python3 benchmarks/tiered_prefill.py --device cuda --out $OUT  # a device call

The checkpoint takes the zoo's tokenizer, or on a device machine the copy in .peers/tokenizer
(`peers_h200.py stage-source --to .peers`, carried).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PLANS = ("int8", "int4", "mixed")
CPU_SHAPE = dict(num_hidden_layers=4, num_experts=32, num_experts_per_tok=8, hidden_size=512,
                 moe_intermediate_size=256, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                 vocab_size=50304)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def plan_for(name: str, L: int, E: int):
    """The tiering Plan `name` (see the module docstring) for L layers of E experts."""
    from moebench.engine.tiering import Plan
    if name in ("int8", "int4"):
        precision, home = [[name] * E for _ in range(L)], [["gpu"] * E for _ in range(L)]
    else:
        # write_checkpoint's router makes low expert ids no busier than others: the first half is as
        # good a hot half as any, and the same on every machine
        precision = [["int8" if e < E // 2 else "ternary" for e in range(E)] for _ in range(L)]
        home = [["gpu" if e < E // 2 else "host" for e in range(E)] for _ in range(L)]
    return Plan(layers=list(range(L)), precision=precision, home=home, cache_slots=2,
                info={"rule": f"{name} (benchmarks/tiered_prefill.py)"})


def prefill_once(eng, prompt: list[int]) -> tuple[float, list]:
    """(prompt tokens per second of one prefill, the first token's top-5 log-probs)."""
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = eng.generate([prompt], 1, ignore_eos=True, top_logprobs=5)[0]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return len(prompt) / (time.perf_counter() - t), out.top_logprobs[0]


def rounds(engines: dict, prompt: list[int], reps: int) -> dict:
    """{name: (median tok/s, top-5)} of `reps` rounds in which every engine prefills `prompt` once,
    after one untimed round: the engines take turns, so a drift of the machine's speed falls on
    all of them alike."""
    for eng in engines.values():
        prefill_once(eng, prompt)
    rates: dict = {name: [] for name in engines}
    top: dict = {}
    for _ in range(reps):
        for name, eng in engines.items():
            rate, top[name] = prefill_once(eng, prompt)
            rates[name].append(rate)
    return {name: (statistics.median(r), top[name]) for name, r in rates.items()}


def agreement(a: list, b: list) -> dict:
    """Whether two top-5 lists (token, log-prob) pick the same first token, and their largest
    log-prob difference over the tokens both hold."""
    da, db = dict(a), dict(b)
    common = set(da) & set(db)
    return {"same_first": a[0][0] == b[0][0], "shared_top5": len(common),
            "max_logprob_diff": max((abs(da[t] - db[t]) for t in common), default=None)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--work", type=Path, default=None, help="where the checkpoint and artifacts go "
                    "(default: /dev/shm/tiered-prefill on CUDA, a folder under --out on the CPU)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--experts", type=int, default=32, help="experts a layer on CUDA")
    ap.add_argument("--layers", type=int, default=12, help="layers on CUDA")
    ap.add_argument("--prompts", default=None, help="comma list of prompt lengths "
                    "(default 128,512,4096 on CUDA, 128,512 on the CPU)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--plans", default=",".join(PLANS))
    ap.add_argument("--small", action="store_true", help="a tiny shape and one short prompt (a check of the script)")
    a = ap.parse_args(argv)
    import torch
    from moebench.bench.checkpoint import SHAPE_KEYS, tokenizer_dir, write_checkpoint
    from moebench.bench.reference_model import QWEN3_30B_A3B
    from moebench.engine import Engine
    from moebench.engine.tiering import pack
    cuda = a.device == "cuda"
    if cuda:
        shape = {k: QWEN3_30B_A3B[k] for k in SHAPE_KEYS} | {"num_experts": a.experts, "num_hidden_layers": a.layers}
    else:
        shape = dict(CPU_SHAPE, num_hidden_layers=2, num_experts=8, hidden_size=128, moe_intermediate_size=64) \
            if a.small else dict(CPU_SHAPE)
    prompts = [int(p) for p in (a.prompts or ("128,512,4096" if cuda else "128,512")).split(",")]
    dtype = "bfloat16" if cuda else "float32"
    grouped_impl = "triton" if cuda else "grouped_mm"
    work = a.work or (Path("/dev/shm/tiered-prefill") if cuda else a.out / "tiered-prefill-work")
    a.out.mkdir(parents=True, exist_ok=True)
    t = time.monotonic()
    write_checkpoint(work / "hf", shape, 43, a.device, tokenizer_dir(HERE.parent))
    log(f"checkpoint {shape}: {time.monotonic() - t:.0f} s")
    g = torch.Generator().manual_seed(1)
    ids = {n: torch.randint(0, min(50000, shape["vocab_size"]), (n,), generator=g).tolist() for n in prompts}
    res: dict = {"device": a.device, "gpu": torch.cuda.get_device_name(0) if cuda else None, "shape": shape,
                 "dtype": dtype, "prompts": prompts, "reps": a.reps, "grouped_impl": grouped_impl, "rows": []}
    max_seq = max(prompts) + 16

    def measure(model: Path, plan: str, paths: dict[str, str]) -> dict:
        """{path: {prompt: row}} for the engines of `model` by path name -> experts_impl."""
        engines = {path: Engine.load(model, device=a.device, dtype=dtype, max_seq_len=max_seq, experts_impl=impl)
                   for path, impl in paths.items()}
        rows: dict = {path: {} for path in paths}
        for n in prompts:
            for path, (rate, top) in rounds(engines, ids[n], a.reps).items():
                rows[path][n] = {"plan": plan, "path": path, "experts_impl": paths[path], "prompt": n,
                                 "prefill_tok_s": round(rate, 2), "top5": [[tid, round(lp, 5)] for tid, lp in top]}
                log(f"{plan:6s} {path:10s} {n:5d} tokens: {rate:9.1f} tok/s")
        del engines
        if cuda:
            torch.cuda.empty_cache()
        return rows

    dense = measure(work / "hf", "bf16", {"dense": "triton" if cuda else "auto"})["dense"]
    res["rows"] += list(dense.values())
    for name in [p for p in a.plans.split(",") if p]:
        if name not in PLANS:
            raise SystemExit(f"--plans: {name!r}; expected names of {list(PLANS)}")
        art = work / f"art-{name}"
        t = time.monotonic()
        pack(work / "hf", plan_for(name, shape["num_hidden_layers"], shape["num_experts"]), art, device=a.device)
        log(f"pack {name}: {time.monotonic() - t:.0f} s")
        rows = measure(art, name, {"per_expert": "auto", "grouped": grouped_impl})
        per, grouped = rows["per_expert"], rows["grouped"]
        for n in prompts:
            grouped[n]["agrees"] = agreement(per[n]["top5"], grouped[n]["top5"])
            grouped[n]["speedup"] = round(grouped[n]["prefill_tok_s"] / per[n]["prefill_tok_s"], 3)
            res["rows"] += [per[n], grouped[n]]
        shutil.rmtree(art, ignore_errors=True)
        (a.out / "tiered_prefill.json").write_text(json.dumps(res, indent=1) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    (a.out / "tiered_prefill.json").write_text(json.dumps(res, indent=1) + "\n")
    print("| plan | prompt | per-expert tok/s | grouped tok/s | grouped / per-expert | same first token |")
    print("|---|---|---|---|---|---|")
    for r in res["rows"]:
        if r["path"] == "dense":
            print(f"| bf16 checkpoint | {r['prompt']} | – | {r['prefill_tok_s']:.1f} | – | – |")
        elif r["path"] == "grouped":
            base = next(p for p in res["rows"] if p["plan"] == r["plan"] and p["prompt"] == r["prompt"]
                        and p["path"] == "per_expert")
            print(f"| {r['plan']} | {r['prompt']} | {base['prefill_tok_s']:.1f} | {r['prefill_tok_s']:.1f} | "
                  f"{r['speedup']:.2f}x | {r['agrees']['same_first']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
