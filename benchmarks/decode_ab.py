"""Batch-1 decode rates of one source tree, for a same-call A/B of two trees (before / after a change).

    python benchmarks/decode_ab.py --tree .wt/base --out $OUT/base.json    # the code before
    python benchmarks/decode_ab.py --tree .      --out $OUT/new.json       # the code after
    python benchmarks/decode_ab.py --compare $OUT/base.json $OUT/new.json  # the table: rates, % change, tokens
    python benchmarks/decode_ab.py --tree . --variants bf16 --option-sets '{"er": {"early_weights": ["router"]}}'
                                                                           # one tree, plain and under option sets
    python benchmarks/decode_ab.py --tree . --variants int8 --layers 24    # half the layers: fits an 80 GB GPU

The engine is --tree's: the script copies --tree's moebench package with this checkout's
moebench/bench (the shared benchmark code) into a temporary folder and times it in a child process
that imports moebench from there, so both sides run the same benchmark code, which uses only
engine API both sides have. The model is
benchmarks/decode_h200.py's: Qwen3-30B-A3B-shaped random weights with token-diverse, Zipf-skewed
routing. Each variant is one function in VARIANTS; --variants picks some. Rates are the best of
--reps runs of --tokens tokens on the engine's per-token clock, CUDA graphs on; the greedy tokens
are recorded too, so the comparison also says whether both trees computed the same tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent


@dataclass
class Context:
    hf: object
    device: object
    dtype: object
    prompt: list[int]
    tokens: int
    reps: int
    plans: dict
    options: dict = field(default_factory=dict)      # extra Engine options (--engine-option)
    results: dict = field(default_factory=dict)
    bandwidth: dict = field(default_factory=dict)    # the tier bound's inputs (CUDA only; see run)

    @property
    def max_seq(self) -> int:
        return len(self.prompt) + self.tokens + 8


VARIANTS: dict[str, Callable[[Context], dict]] = {}


def variant(name: str):
    def add(fn):
        VARIANTS[name] = fn
        return fn
    return add


def _rate(ctx: Context, eng) -> dict:
    from moebench.bench.engine_setup import engine_rate
    r = engine_rate(eng, [ctx.prompt], max(2, ctx.tokens // 4), ctx.tokens, ctx.reps)
    return {"tok_s": r["tok_s"], "tokens": r["tokens"]}


@variant("bf16")
def bf16(ctx: Context) -> dict:
    """The dense bf16 experts through the fused Triton kernels."""
    from moebench.bench.engine_setup import build_engine
    return _rate(ctx, build_engine(ctx.hf, max_seq_len=ctx.max_seq, cuda_graphs=ctx.device.type == "cuda",
                                   experts_impl="triton", **ctx.options))


def plan_rate(ctx: Context, name: str, prefetch_early: bool = False) -> dict:
    """A tiered plan (engine_setup.expert_plans); "_a8" plans with int8 activations; prefetch_early:
    also the rate with each layer's host experts staged one layer early, guessed from the previous
    layer's attention input."""
    from moebench.bench.engine_setup import build_engine, tiered_experts
    precision, home = ctx.plans[name]
    experts = tiered_experts(ctx.hf, precision, home, ctx.device, ctx.dtype)
    opts = dict(max_seq_len=ctx.max_seq, cuda_graphs=ctx.device.type == "cuda", experts_impl="triton",
                int8_activations=name.endswith("_a8"), **ctx.options)
    eng = build_engine(ctx.hf, experts=experts, **opts)
    out = _rate(ctx, eng)
    if prefetch_early:
        pre = _rate(ctx, build_engine(ctx.hf, experts=experts, prefetch_host=True, prefetch_early=True, **opts))
        out.update(tok_s_prefetch_early=pre["tok_s"], tokens_prefetch_early=pre["tokens"])
    if ctx.bandwidth and any(h == "host" for row in home for h in row):
        # the plan's tier-aware bound, as decode_h200 computes it: bytes per token from this engine's
        # routing of its own greedy continuation
        from moebench.bench.measure import expert_bytes_per_token, tier_bound
        own = eng.trace(ctx.prompt + out["tokens"], router_logits=False)
        split = expert_bytes_per_token([ids[len(ctx.prompt):] for ids in own.topk_ids], precision, home,
                                       ctx.bandwidth["hidden"], ctx.bandwidth["inter"])
        bound = tier_bound(ctx.bandwidth["non_expert_bytes"], split, ctx.bandwidth["copy_Bps"],
                           ctx.bandwidth["h2d_Bps"])
        out.update(tier_bound_tok_s=bound, pct_of_tier_bound=100 * out["tok_s"] / bound, pcie_bytes_per_token=split["pcie"])
        if prefetch_early:
            out["pct_of_tier_bound_prefetch_early"] = 100 * out["tok_s_prefetch_early"] / bound
    return out


for _name, _early in (("int4", False), ("int8", False), ("int4_a8", False), ("int8_a8", False),
                      ("int8hot_ternarycold_gpu", False), ("int8hot_ternary2cold_gpu", False),
                      ("int8hot_ternary2cold_gpu_a8", False),
                      ("int8hot_ternarycold_host_randomhot", True), ("int8hot_ternary2cold_host_a8", True)):
    variant(_name)(lambda ctx, _name=_name, _early=_early: plan_rate(ctx, _name, _early))


def timed_copy(tree: Path, work: Path) -> Path:
    """A copy of `tree`'s moebench package under `work` with this checkout's moebench/bench in it:
    each side of an A/B times its own engine through the same benchmark code (a tree from before
    moebench/bench existed has none)."""
    src = tree.resolve() / "moebench"
    if not (src / "engine" / "engine.py").is_file():
        raise SystemExit(f"decode_ab: --tree {tree}: {src} has no engine/engine.py")
    dst = work / "moebench"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "weights"))
    shutil.rmtree(dst / "bench", ignore_errors=True)
    shutil.copytree(HERE.parent / "moebench" / "bench", dst / "bench", ignore=shutil.ignore_patterns("__pycache__"))
    return work


def run(args) -> dict:
    import moebench
    if not Path(moebench.__file__).resolve().is_relative_to(Path(args.timed_copy).resolve()):
        raise SystemExit(f"moebench imported from {moebench.__file__}, not from the copy of --tree {args.tree}")
    import torch
    from moebench.bench.reference_model import bench_shape, build_transformers
    from moebench.bench.engine_setup import build_engine, expert_plans, hot_halves, realistic_routing
    small = args.small or not torch.cuda.is_available()
    device = torch.device("cpu" if small else "cuda")
    dtype = torch.float32 if small else torch.bfloat16
    hf = build_transformers(bench_shape(small, args.layers, args.experts), device, dtype, seed=0)
    realistic_routing(hf, 0.5)
    cfg = hf.config
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=g).tolist()
    # the calibrated hot half: routing of the prompt and the reference engine's greedy continuation
    ref = build_engine(hf, max_seq_len=args.prompt_len + args.tokens + 8, cuda_graphs=device.type == "cuda")
    cont = ref.generate([prompt], args.tokens, ignore_eos=True)[0].token_ids
    trace = ref.trace(prompt + cont, router_logits=False)
    counts = torch.stack([torch.bincount(ids.flatten(), minlength=cfg.num_experts) for ids in trace.topk_ids])
    del ref
    options = {}
    for item in args.engine_option:
        key, _, value = item.partition("=")
        options[key] = json.loads(value)
    ctx = Context(hf, device, dtype, prompt, args.tokens, args.reps,
                  expert_plans(cfg.num_hidden_layers, cfg.num_experts, hot_halves(counts)), options)
    if device.type == "cuda":
        from moebench.bench.reference_model import active_bytes_per_token, copy_bandwidth, non_expert_bytes_per_token
        from moebench.bench.measure import pinned_h2d_bandwidth
        from moebench.engine import ModelConfig
        mc = ModelConfig.from_dict(cfg.to_dict(), source="transformers config")
        elem = torch.finfo(dtype).bits // 8
        ctx.bandwidth = {"copy_Bps": copy_bandwidth(device, 1 << 30), "h2d_Bps": pinned_h2d_bandwidth(1 << 30),
                         "non_expert_bytes": non_expert_bytes_per_token(mc, elem),
                         "hidden": mc.hidden_size, "inter": mc.expert_intermediate_size,
                         "bf16_bytes_per_token": active_bytes_per_token(mc, elem)["active_bytes"]}
        # the roofline: bf16's bytes per step at the copy bandwidth (decode_h200 prints the same)
        ctx.bandwidth["roofline_tok_s"] = ctx.bandwidth["copy_Bps"] / ctx.bandwidth["bf16_bytes_per_token"]
        print(f"copy bandwidth {ctx.bandwidth['copy_Bps'] / 1e12:.3f} TB/s, bf16 "
              f"{ctx.bandwidth['bf16_bytes_per_token'] / 1e9:.3f} GB/token: roofline "
              f"{ctx.bandwidth['roofline_tok_s']:.1f} tok/s", flush=True)
    out = {"tree": str(args.tree), "layers": cfg.num_hidden_layers, "experts": cfg.num_experts,
           "prompt_len": args.prompt_len, "tokens": args.tokens, "engine_options": options,
           "moebench": moebench.__file__, "device": str(device), "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None, "bandwidth": ctx.bandwidth,
           "variants": {}, "errors": {}}
    names = [n for n in args.variants.split(",") if n] if args.variants else list(VARIANTS)
    # --option-sets: each variant again under each named set of extra options, as "variant+set"
    sets = {"": {}, **json.loads(args.option_sets)} if args.option_sets else {"": {}}
    runs = [(name, tag) for tag in sets for name in names]
    for base_name, tag in runs:
        name = f"{base_name}+{tag}" if tag else base_name
        ctx.options = {**options, **sets[tag]}
        t = time.perf_counter()
        try:
            r = VARIANTS[base_name](ctx)
        except Exception as e:  # noqa: BLE001 - keep the other variants
            out["errors"][name] = f"{type(e).__name__}: {e}"
            print(f"[{name}] FAILED: {out['errors'][name]}", flush=True)
            continue
        r["wall_s"] = round(time.perf_counter() - t, 1)
        if tag:
            r["engine_options"] = ctx.options
        out["variants"][name] = r
        extra = f", prefetch early {r['tok_s_prefetch_early']:.2f}" if "tok_s_prefetch_early" in r else ""
        if base_name == "bf16" and ctx.bandwidth:
            extra += f" ({100 * r['tok_s'] / ctx.bandwidth['roofline_tok_s']:.1f}% of the roofline)"
        if "tier_bound_tok_s" in r:
            extra += f"; tier-aware bound {r['tier_bound_tok_s']:.1f}: {r['pct_of_tier_bound']:.1f}%" + (
                f", prefetch early {r['pct_of_tier_bound_prefetch_early']:.1f}%"
                if "pct_of_tier_bound_prefetch_early" in r else "")
        print(f"[{args.tree}] {name}: {r['tok_s']:.2f} tok/s{extra} ({r['wall_s']} s)", flush=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
        torch.cuda.empty_cache() if device.type == "cuda" else None
    for name, tag in runs:
        got, plain = out["variants"].get(f"{name}+{tag}"), out["variants"].get(name)
        if tag and got and plain:
            print(f"{name}+{tag}: {got['tok_s']:.2f} against {plain['tok_s']:.2f} tok/s "
                  f"({100 * (got['tok_s'] / plain['tok_s'] - 1):+.1f}%), same tokens: {got['tokens'] == plain['tokens']}")
    return out


def compare(a_path: str, b_path: str) -> list[str]:
    """The A/B table: each variant's rates in both runs, the change in %, and whether the greedy
    tokens are the same."""
    a, b = (json.loads(Path(p).read_text())["variants"] for p in (a_path, b_path))
    lines = [f"{'variant':44s} {'A tok/s':>9s} {'B tok/s':>9s} {'B/A-1':>7s}  same tokens"]
    for name in a:
        if name not in b:
            continue
        for key, tok in (("tok_s", "tokens"), ("tok_s_prefetch_early", "tokens_prefetch_early")):
            if key in a[name] and key in b[name]:
                label = name + (" +prefetch early" if key != "tok_s" else "")
                ra, rb = a[name][key], b[name][key]
                lines.append(f"{label:44s} {ra:9.2f} {rb:9.2f} {100 * (rb / ra - 1):+6.1f}%  "
                             f"{a[name][tok] == b[name][tok]}")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", default=str(HERE.parent), help="source tree whose moebench is timed")
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/decode_ab.json")
    ap.add_argument("--variants", default="", help=f"comma-separated, of {', '.join(VARIANTS)} (default: all)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=0,
                    help="decoder layers (default: the shape's own; 24 fits int8 plans on an 80 GB GPU)")
    ap.add_argument("--experts", type=int, default=0,
                    help="experts a layer (default: the shape's own; the peers' checkpoint has 32)")
    ap.add_argument("--engine-option", action="append", default=[], metavar="KEY=JSON",
                    help="an extra Engine option for every engine, e.g. count_tier_picks=false (the tree must know it)")
    ap.add_argument("--option-sets", default="", metavar="JSON",
                    help='named sets of extra Engine options, each variant timed again under each: '
                         '\'{"rope": {"rope_in_attention": true}}\' gives "bf16+rope" beside "bf16"')
    ap.add_argument("--small", action="store_true", help="a small shape on the CPU (a smoke test of the script)")
    ap.add_argument("--compare", nargs=2, metavar=("A_JSON", "B_JSON"), help="print the A/B table of two runs")
    ap.add_argument("--timed-copy", default=None, help=argparse.SUPPRESS)     # set for the child by the parent
    args = ap.parse_args(argv)
    if args.compare:
        print("\n".join(compare(*args.compare)))
        return
    if args.timed_copy is None:
        # this process only copies: the timing runs in a child that imports moebench from the copy
        with tempfile.TemporaryDirectory(prefix="decode_ab_tree_") as work:
            timed_copy(Path(args.tree), Path(work))
            argv = sys.argv[1:] if argv is None else list(argv)
            env = {**os.environ, "PYTHONPATH": work}
            if args.small:
                env.setdefault("TRITON_INTERPRET", "1")
            raise SystemExit(subprocess.run([sys.executable, __file__, *argv, "--timed-copy", work], env=env).returncode)
    run(args)


if __name__ == "__main__":
    main()
