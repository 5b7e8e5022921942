"""Build a `MoETransformer` from a Hugging Face checkpoint directory, tensor by tensor.

The model is created on the meta device (no memory), its parameters are then allocated once on the
target device and dtype, and each checkpoint tensor is read through `safetensors.safe_open` (mmap)
and copied into its place. Per-expert tensors are copied into their slot of the stacked [E, ...]
parameters, so host RAM holds at most one checkpoint tensor at a time, never the state dict.

Expert layouts understood:
  mlp.experts.{e}.gate_proj/up_proj/down_proj.weight       (qwen2_moe, qwen3_moe, olmoe)
  block_sparse_moe.experts.{e}.w1/w3/w2.weight             (mixtral: w1 gate, w3 up, w2 down)
  mlp.experts.gate_up_proj [E, 2I, H] + mlp.experts.down_proj [E, H, I]   (fused, transformers 5
      in-memory layout; `save_pretrained` in 5.24 converts back to per-expert tensors, other
      writers may not)

Tiered artifacts: a directory holding `plan.json` keeps its non-expert weights in `model*.safetensors`
(loaded here) and its experts in its own format; `moebench.engine.tiering.load_tiered` replaces
every layer's `Experts` after the rest is loaded.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ModelConfig
from .expert_names import parse_expert_name
from .model import Experts, MoETransformer


class CheckpointError(ValueError):
    """A checkpoint directory the engine cannot load (names the file and tensor)."""


_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.original_inv_freq)$")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
             "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if dtype not in names:
        raise ValueError(f"dtype {dtype!r}: expected one of {', '.join(names)}")
    return names[dtype]


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def checkpoint_files(path: Path, tiered: bool) -> list[Path]:
    """The safetensors files holding the model's (non-expert, when tiered) weights."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: expected a JSON object with a 'weight_map' ({e})") from e
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("model*.safetensors"))
        if not files and not tiered:
            files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files (expected a Hugging Face checkpoint)")
    for f in files:
        if not f.is_file():
            raise CheckpointError(f"{index}: lists {f.name}, which does not exist")
    return files


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32",
               config: ModelConfig | None = None) -> MoETransformer:
    """Build the model from `path` on `device` in `dtype` (KV caches are set up by the caller)."""
    path = Path(path)
    device, dtype = resolve_device(device), resolve_dtype(dtype)
    cfg = config or ModelConfig.from_pretrained(path)
    tiered = (path / "plan.json").is_file()

    with torch.device("meta"):
        model = MoETransformer(cfg)
    # Allocate real storage for everything but (when tiered) the experts, which load_tiered replaces.
    for module in model.modules():
        if tiered and isinstance(module, Experts):
            continue
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:
                setattr(module, name, torch.nn.Parameter(
                    torch.empty(p.shape, dtype=dtype, device=device), requires_grad=False))
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight

    params = dict(model.named_parameters(remove_duplicate=False))
    filled: set[str] = set()
    expert_filled: dict[str, set[int]] = {}
    n_exp = cfg.num_experts

    for file in checkpoint_files(path, tiered):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                name = hf_name[len("model."):] if hf_name.startswith("model.") else hf_name
                name = name.replace(".block_sparse_moe.", ".mlp.")
                if _IGNORED.search(name):
                    continue
                if cfg.tie_word_embeddings and name == "lm_head.weight":
                    continue   # tied: the embedding is the head
                expert = parse_expert_name(name)
                if expert is not None and tiered:
                    continue
                if expert is not None and not expert.fused:
                    layer, e, kind = expert.layer, expert.expert, f"w_{expert.matrices[0]}"
                    target = f"layers.{layer}.mlp.experts.{kind}"
                    if target not in params or e >= n_exp:
                        raise CheckpointError(f"{file}: tensor {hf_name} does not fit the config "
                                              f"({cfg.num_layers} layers, {n_exp} experts)")
                    _copy(params[target][e], f.get_slice(hf_name), file, hf_name)
                    expert_filled.setdefault(target, set()).add(e)
                elif expert is not None:
                    layer = expert.layer
                    prefix = f"layers.{layer}.mlp.experts."
                    if prefix + "w_gate" not in params:
                        raise CheckpointError(f"{file}: tensor {hf_name} but layer {layer} has no experts")
                    sl = f.get_slice(hf_name)
                    targets = [prefix + f"w_{m}" for m in expert.matrices]
                    if len(targets) == 2:        # gate_up_proj [E, 2I, H]: gate rows first, then up (chunk(2))
                        inter = cfg.expert_intermediate_size
                        _copy(params[targets[0]], sl[:, :inter, :], file, hf_name)
                        _copy(params[targets[1]], sl[:, inter:, :], file, hf_name)
                    else:
                        _copy(params[targets[0]], sl, file, hf_name)
                    for t in targets:
                        expert_filled[t] = set(range(n_exp))
                else:
                    if name not in params:
                        raise CheckpointError(f"{file}: unexpected tensor {hf_name} for a {cfg.arch} model "
                                              f"(no parameter {name})")
                    _copy(params[name], f.get_slice(hf_name), file, hf_name)
                    filled.add(name)

    missing = []
    for name, p in params.items():
        if name.endswith((".w_gate", ".w_up", ".w_down")) and ".experts." in name:
            if not tiered and len(expert_filled.get(name, ())) != n_exp:
                got = sorted(expert_filled.get(name, ()))
                missing.append(f"{name} (experts loaded: {len(got)} of {n_exp})")
        elif name not in filled and not (cfg.tie_word_embeddings and name == "lm_head.weight"):
            missing.append(name)
    if missing:
        raise CheckpointError(f"{path}: checkpoint lacks tensors: {', '.join(missing[:8])}"
                              + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))

    if tiered:
        from . import tiering   # lazy: written separately, only needed for tiered artifacts
        tiering.load_tiered(path, model, device, dtype)
        still_meta = [n for n, p in model.named_parameters() if p.is_meta]
        if still_meta:
            raise CheckpointError(f"{path}: load_tiered left parameters unloaded: {still_meta[:4]}")
    return model.eval()


def _copy(dst: torch.Tensor, src, file: Path, name: str) -> None:
    """Copy one checkpoint tensor (a safetensors slice, read lazily) into `dst`, casting."""
    t = src[:] if not isinstance(src, torch.Tensor) else src
    if tuple(t.shape) != tuple(dst.shape):
        raise CheckpointError(f"{file}: tensor {name} has shape {tuple(t.shape)}; "
                              f"the config implies {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(t)
