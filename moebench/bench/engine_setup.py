"""What the decode benchmarks build: engines aliasing a transformers model's weights, token-diverse
routing for a random model, quantized tiered experts, SSD packs and the expert plans, stacked
random expert groups for the kernel benchmarks, and the decode rate.

Uses only the engine API that the code before and after the DecodeConfig redesign both have
(Engine keyword options, TieredExperts.use_fused_kernels), so benchmarks/decode_ab.py can time two
source trees with it.
"""
from __future__ import annotations

import torch

from moebench.engine import Engine, ModelConfig, MoETransformer
from moebench.engine.placement import QuantizedExpert, TieredExperts
from moebench.engine.quant import QuantizedTensor, quantize


def build_engine(hf, *, max_seq_len: int, max_batch: int = 1, cuda_graphs: bool = False, experts=None,
                 prefill_chunk: int = 512, **decode) -> Engine:
    """An Engine whose non-expert parameters are the transformers model's tensors (views). experts:
    None (the dense experts, also views) or {layer: nn.Module} replacing each MoE layer's experts.
    decode: the Engine's decode options (experts_impl=..., or decode=DecodeConfig(...)); among them
    launch=[[kernel, format, variant, {param: value}], ...] changes launch table entries
    (DecodeConfig.with_launch; variant "", "host" or "a8"), so decode_ab's JSON option sets can."""
    launches = decode.pop("launch", None)
    if launches:
        from moebench.engine.decode_config import DecodeConfig
        cfg = decode.pop("decode", None) or DecodeConfig(**decode)
        for kernel, fmt, variant, params in launches:
            cfg = cfg.with_launch(kernel, fmt, host=variant == "host", a8=variant == "a8", **params)
        decode = {"decode": cfg}
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
                  prefill_chunk=prefill_chunk, **decode)


def realistic_routing(hf, alpha: float, seed: int = 5) -> None:
    """Token-dependent, Zipf-skewed routing for the random model.

    A random-init model routes every token alike: its residual stream is dominated by attention
    outputs averaged over positions (o_proj output rms ~1 against embeddings of rms 0.02), so the
    greedy continuation is one token repeated and the same 8 experts serve every step. Embeddings
    scaled to rms ~1 and o_proj by 0.02 keep each token's identity in the residual stream. Then each
    layer's router row of the expert of rank r (a random permutation per layer) is scaled by
    (r + 1) ** -alpha (mean 1): on Gaussian logits, alpha 0.5 gives the most-used half of the
    experts ~91% of the top-8-of-128 picks. Speed does not depend on the values; only which experts
    are read does."""
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


def tiered_experts(hf, precision: list[list[str]], home: list[list[str]], device, dtype, fused: bool = True,
                   disk=None) -> dict:
    """{layer: TieredExperts} from per-layer per-expert precision/home, the fused kernels on unless
    `fused` is False (then the engine's experts_impl decides). disk: the ssd.DiskTier holding the
    "ssd" experts (write_ssd_pack); layers with ssd experts keep the per-expert path."""
    out = {}
    for layer in range(hf.config.num_hidden_layers):
        ws = dense_expert_weights(hf, layer)
        by_fmt = {}
        for fmt, h in sorted(set(zip(precision[layer], home[layer]))):
            if h != "ssd":
                by_fmt[fmt, h] = [quantize_stacked(w, fmt, pin=h == "host") for w in ws]
        experts = [None if h == "ssd" else QuantizedExpert(*(by_fmt[f, h][m][e] for m in range(3)))
                   for e, (f, h) in enumerate(zip(precision[layer], home[layer]))]
        if "ssd" in home[layer]:
            module = TieredExperts(experts, home[layer], device, dtype, cache_slots=2, disk=disk, layer=layer)
        else:
            module = TieredExperts(experts, home[layer], device, dtype, cache_slots=2)
            if fused:
                module.use_fused_kernels()
        out[layer] = module
        del by_fmt, experts
    return out


def write_ssd_pack(hf, precision: list[list[str]], home: list[list[str]], path) -> dict:
    """Quantize the experts whose home is "ssd" and write them into one pack file (ssd.write_pack);
    returns its index."""
    from moebench.engine.ssd import write_pack

    def records():
        for layer in range(hf.config.num_hidden_layers):
            on_ssd = [e for e, h in enumerate(home[layer]) if h == "ssd"]
            if not on_ssd:
                continue
            ws = dense_expert_weights(hf, layer)
            for fmt in sorted({precision[layer][e] for e in on_ssd}):
                mats = [quantize_stacked(w, fmt) for w in ws]
                for e in on_ssd:
                    if precision[layer][e] == fmt:
                        yield layer, e, QuantizedExpert(*(m[e] for m in mats))
    return write_pack(path, records())


def expert_plans(L: int, E: int, hot: list[set[int]], seed: int = 3) -> dict[str, tuple[list, list]]:
    """{name: (precision [L][E], home [L][E])}: int4 / int8 everywhere; int8 for the `hot` experts of each
    layer and ternary / ternary2 for the rest, all in HBM ("_gpu") or the rest in pinned host memory
    ("_host"); "_randomhot": a hot half drawn at random (seeded), which sends about half the picks to
    the host tier. "_a8" plans are the same plans run with int8 activations."""
    gh = torch.Generator().manual_seed(seed)
    rand_hot = [set(torch.randperm(E, generator=gh)[:E // 2].tolist()) for _ in range(L)]

    def hot_cold(hot_sets, cold: str, host: bool):
        return ([["int8" if e in hot_sets[l] else cold for e in range(E)] for l in range(L)],
                [["gpu" if (e in hot_sets[l] or not host) else "host" for e in range(E)] for l in range(L)])
    plans = {fmt: ([[fmt] * E for _ in range(L)], [["gpu"] * E for _ in range(L)]) for fmt in ("int4", "int8")}
    for cold in ("ternary", "ternary2"):
        plans[f"int8hot_{cold}cold_gpu"] = hot_cold(hot, cold, False)
        plans[f"int8hot_{cold}cold_host"] = hot_cold(hot, cold, True)
    plans["int8hot_ternarycold_host_randomhot"] = hot_cold(rand_hot, "ternary", True)
    for base in ("int4", "int8", "int8hot_ternarycold_gpu", "int8hot_ternarycold_host", "int8hot_ternary2cold_gpu",
                 "int8hot_ternary2cold_host"):
        plans[base + "_a8"] = plans[base]
    return plans


def hot_halves(counts: torch.Tensor) -> list[set[int]]:
    """Per layer, the most-used half of the experts (counts [L, E] of routed picks)."""
    E = counts.shape[1]
    return [set(torch.argsort(-counts[l], stable=True)[:E // 2].tolist()) for l in range(counts.shape[0])]


def decode_rate(token_times: list[float]) -> float:
    """Decode tok/s of one generate: (tokens - 1) / (time of the last token - time of the first)."""
    return (len(token_times) - 1) / max(token_times[-1] - token_times[0], 1e-9)


def engine_rate(eng: Engine, prompts: list[list[int]], n_warm: int, n_tokens: int, reps: int) -> dict:
    """Decode tok/s of one sequence: the best over reps of (tokens - 1) / (time of the last token -
    time of the first), from the engine's own per-token clock (decode steps only: a tiered engine's
    prefill runs the per-expert path, whose time varies by tens of ms between calls). A warm-up
    generation compiles the kernels and captures the graphs first."""
    eng.generate(prompts, n_warm, ignore_eos=True)
    best, outs = 0.0, None
    for _ in range(reps):
        o = eng.generate(prompts, n_tokens, ignore_eos=True)
        rate = decode_rate(o[0].token_times)
        if rate > best:
            best, outs = rate, o
    return {"tok_s": best, "tokens": outs[0].token_ids}


def stacked_group(E: int, H: int, I: int, fmt: str, device, gen, pin: bool = False) -> tuple["kernels.ExpertGroup", int]:
    """One layer's experts in `fmt` (random weights), and the bytes of one expert; pin: in pinned
    host memory (the host tier, read over PCIe by the kernels)."""
    from moebench.engine import kernels
    mats = []
    for rows, cols in ((I, H), (I, H), (H, I)):
        w = torch.randn(E * rows, cols, generator=gen) * 0.02
        if fmt == "dense":
            mats.append(kernels.PackedMatrix.dense(w.view(E, rows, cols).to(device, torch.bfloat16)))
            continue
        q = quantize(w, fmt)
        parts = {k: v.reshape(E, rows, *v.shape[1:]) for k, v in q.parts.items()}
        mats.append(kernels.PackedMatrix.stack(
            [QuantizedTensor(q.fmt, (rows, cols), {k: v[e] for k, v in parts.items()}) for e in range(E)], device,
            pin=pin))
    return kernels.ExpertGroup(*mats, None, fmt), sum(m.nbytes_per_slot for m in mats)
