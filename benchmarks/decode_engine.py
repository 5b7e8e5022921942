"""Batch-1 decode speed: the in-repo engine against transformers, same random weights, same device.

Builds transformers' Qwen3MoeForCausalLM of the given shape with random weights directly on the
device (no checkpoint on disk), then an engine model whose parameters ALIAS those tensors (the
experts' w_gate / w_up are views of transformers' fused gate_up_proj), so both run the very same
weights with no extra memory. Prints decode tok/s for transformers (each experts implementation)
and the engine, the bytes a decode step must read (active parameters), and the bandwidth roofline
from a device-to-device copy measured in the same run.

    python benchmarks/decode_engine.py                 # Qwen3-30B-A3B shape, cuda, bf16 (~61 GB)
    python benchmarks/decode_engine.py --small         # a quick CPU check
    python benchmarks/decode_engine.py --json out.json

Decode tok/s is measured as extra tokens over extra time: generate N_short and N_long tokens from
the same prompt and divide (N_long - N_short) by the time difference, which removes prefill and
fixed costs for both systems alike. The engine's own per-token clock, (n - 1) / (t_last - t_first),
is printed too.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from moebench.bench.reference_model import (QWEN3_30B_A3B, SMALL, active_bytes_per_token, build_transformers,
                                             copy_bandwidth, decode_rate, engine_sharing_weights)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--small", action="store_true", help="a small shape on the CPU (quick check)")
    ap.add_argument("--device", default=None, help="default: cuda (cpu with --small)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens in the long run")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--hf-impls", default="eager,grouped_mm,batched_mm",
                    help="transformers experts implementations to time (comma separated)")
    ap.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph engine variants")
    ap.add_argument("--engine-impls", default="auto,grouped_mm",
                    help="engine experts implementations to time: auto (gather in decode), loop, grouped_mm")
    ap.add_argument("--layers", type=int, default=None, help="override the number of layers")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)

    shape = dict(SMALL if args.small else QWEN3_30B_A3B)
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    device = torch.device(args.device or ("cpu" if args.small else "cuda"))
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    elem = torch.finfo(dtype).bits // 8
    n_short, n_long = max(2, args.tokens // 4), args.tokens
    res: dict = {"device": str(device), "dtype": args.dtype, "shape": shape, "prompt_len": args.prompt_len,
                 "tokens": [n_short, n_long], "torch": torch.__version__}
    if device.type == "cuda":
        res["gpu"] = torch.cuda.get_device_name(device)

    t = time.perf_counter()
    hf = build_transformers(shape, device, dtype, seed=0)
    eng = engine_sharing_weights(hf, max_seq_len=args.prompt_len + n_long + 8)
    res["build_s"] = round(time.perf_counter() - t, 1)
    cfg = eng.config
    res.update(active_bytes_per_token(cfg, elem))
    print(f"shape: {cfg.num_layers} layers, {cfg.num_experts} experts top-{cfg.top_k}, hidden {cfg.hidden_size}, "
          f"expert width {cfg.expert_intermediate_size}, vocab {cfg.vocab_size}: "
          f"{res['total_params'] / 1e9:.2f} B params, {res['active_params'] / 1e9:.3f} B active; built in "
          f"{res['build_s']} s on {device}")

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=g).tolist()
    prompt_t = torch.tensor([prompt], device=device)

    # Same weights, same numbers: compare logits and greedy tokens before timing anything.
    with torch.inference_mode():
        ref = hf(prompt_t).logits[0].float().cpu()
    got = eng.logits(prompt)
    res["max_abs_logit_diff"] = (ref - got).abs().max().item()
    res["logit_scale"] = ref.abs().max().item()
    with torch.inference_mode():
        hf_tokens = hf.generate(prompt_t, max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
    eng_tokens = eng.generate([prompt], 16, ignore_eos=True)[0].token_ids
    res["greedy_tokens_agree"] = sum(a == b for a, b in zip(hf_tokens, eng_tokens))
    print(f"parity: max |logit diff| {res['max_abs_logit_diff']:.4g} (logits up to {res['logit_scale']:.3g}); "
          f"greedy tokens agree {res['greedy_tokens_agree']}/16 ({args.dtype}: a late mismatch can be rounding)")

    bw = copy_bandwidth(device, nbytes=(1 << 30) if device.type == "cuda" else (1 << 27))
    res["copy_bandwidth_Bps"] = bw
    res["roofline_tok_s"] = bw / res["active_bytes"]
    print(f"device copy bandwidth {bw / 1e9:.1f} GB/s (read + write); active bytes/token "
          f"{res['active_bytes'] / 1e9:.3f} GB -> roofline {res['roofline_tok_s']:.1f} tok/s")

    res["transformers_tok_s"] = {}
    for impl in [s for s in args.hf_impls.split(",") if s]:
        try:
            hf.set_experts_implementation(impl)
        except Exception as e:  # an implementation this torch cannot run: report and go on
            res["transformers_tok_s"][impl] = f"unavailable: {e}"
            print(f"transformers [{impl}]: unavailable ({e})")
            continue

        def run_hf(n):
            with torch.inference_mode():
                hf.generate(prompt_t, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        rate = decode_rate(run_hf, n_short, n_long, device, args.reps)
        res["transformers_tok_s"][impl] = rate
        print(f"transformers [{impl}]: {rate:.2f} tok/s ({100 * rate / res['roofline_tok_s']:.1f}% of roofline)")

    variants = []
    for impl in [s for s in args.engine_impls.split(",") if s]:
        for graphs in ([False, True] if device.type == "cuda" and not args.no_graphs else [False]):
            label = f"engine[{impl}{'+cudagraphs' if graphs else ''}]"
            variants.append((label, eng if (impl, graphs) == ("auto", False) else
                             engine_sharing_weights(hf, eng.max_seq_len, cuda_graphs=graphs, experts_impl=impl)))
    for label, e in variants:
        last = {}

        def run_engine(n):
            last["out"] = e.generate([prompt], n, ignore_eos=True)[0]
        rate = decode_rate(run_engine, n_short, n_long, device, args.reps)
        tt = last["out"].token_times
        res[f"{label}_tok_s"] = rate
        res[f"{label}_tok_s_token_clock"] = (len(tt) - 1) / (tt[-1] - tt[0])
        res[f"{label}_ttft_s"] = tt[0]
        if e is not eng:
            res[f"{label}_greedy_equal_eager"] = last["out"].token_ids == eng.generate([prompt], n_long,
                                                                                       ignore_eos=True)[0].token_ids
        print(f"{label}: {rate:.2f} tok/s ({100 * rate / res['roofline_tok_s']:.1f}% of roofline); per-token "
              f"clock {res[f'{label}_tok_s_token_clock']:.2f} tok/s; TTFT {tt[0] * 1000:.1f} ms for "
              f"{args.prompt_len} tokens")
    if device.type == "cuda":
        res["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
