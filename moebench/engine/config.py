"""Model shape and behaviour read from a Hugging Face `config.json`.

Supported architectures (`model_type`): qwen3_moe, qwen2_moe, mixtral, olmoe. Defaults follow
transformers 5.x for each architecture, because a config.json written by an older or newer
transformers may omit keys that the class fills in.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


class ModelConfigError(ValueError):
    """A config.json the engine cannot run: names the file, the key and what was expected."""


# Per-architecture defaults, copied from the transformers 5.24 config classes.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
                      norm_topk_prob=False, num_experts=128, num_experts_per_tok=8,
                      moe_intermediate_size=768, intermediate_size=6144, num_key_value_heads=4,
                      attention_bias=False, tie_word_embeddings=False, decoder_sparse_step=1),
    "qwen2_moe": dict(rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
                      norm_topk_prob=False, num_experts=60, num_experts_per_tok=4,
                      moe_intermediate_size=1408, intermediate_size=5632,
                      shared_expert_intermediate_size=5632, num_key_value_heads=16, qkv_bias=True,
                      tie_word_embeddings=False, decoder_sparse_step=1),
    "mixtral": dict(rope_theta=1e6, rms_norm_eps=1e-5, max_position_embeddings=4096 * 32,
                    num_local_experts=8, num_experts_per_tok=2, intermediate_size=14336,
                    num_key_value_heads=8, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    "olmoe": dict(rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096,
                  norm_topk_prob=False, num_experts=64, num_experts_per_tok=8, intermediate_size=2048,
                  attention_bias=False, clip_qkv=None, tie_word_embeddings=False, eos_token_id=50279),
}


@dataclass
class ModelConfig:
    """Everything the engine needs to build and run one MoE decoder."""

    arch: str                     # model_type: qwen3_moe | qwen2_moe | mixtral | olmoe
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    norm_topk_prob: bool          # renormalise the top-k softmax weights to sum to 1
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qk_norm: str                  # "none" | "head" (qwen3: per head, width head_dim) | "full" (olmoe: whole q/k)
    qkv_bias: bool                # biases on q/k/v projections
    o_bias: bool                  # bias on the output projection
    max_position_embeddings: int
    shared_expert_intermediate_size: int = 0   # qwen2_moe: a shared expert with a sigmoid gate
    dense_intermediate_size: int = 0           # width of dense (non-MoE) MLP layers where present
    moe_layers: tuple[bool, ...] = ()          # per layer: True = sparse MoE block, False = dense MLP
    clip_qkv: float | None = None              # olmoe: clamp q/k/v to [-clip, clip]
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    source: str = ""              # the file it came from, for error messages
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelConfig":
        """Read `<path>/config.json` (or the file itself when `path` is a file)."""
        p = Path(path)
        file = p / "config.json" if p.is_dir() else p
        if not file.is_file():
            raise ModelConfigError(f"{file}: no config.json (expected a Hugging Face checkpoint directory)")
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ModelConfigError(f"{file}: not valid JSON ({e})") from e
        return cls.from_dict(data, source=str(file))

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        arch = data.get("model_type")
        if arch not in SUPPORTED_ARCHS:
            raise ModelConfigError(
                f"{source}: key 'model_type' is {arch!r}; expected one of {', '.join(SUPPORTED_ARCHS)}")
        d = dict(_DEFAULTS[arch])
        d.update({k: v for k, v in data.items() if v is not None or k in ("bos_token_id", "eos_token_id")})

        def req(key: str, kind: type = int) -> Any:
            if key not in d or d[key] is None:
                raise ModelConfigError(f"{source}: missing key {key!r} ({kind.__name__} expected)")
            v = d[key]
            if kind is int and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ModelConfigError(f"{source}: key {key!r} is {v!r}; expected a positive integer")
            return v

        hidden = req("hidden_size")
        heads = req("num_attention_heads")
        kv_heads = d.get("num_key_value_heads") or heads
        head_dim = d.get("head_dim") or hidden // heads
        if arch == "olmoe":
            head_dim = hidden // heads   # OLMoE ignores head_dim; its q/k norms assume hidden // heads
        if heads % kv_heads:
            raise ModelConfigError(f"{source}: num_attention_heads {heads} is not a multiple of "
                                   f"num_key_value_heads {kv_heads}")
        if head_dim % 2:
            raise ModelConfigError(f"{source}: head_dim {head_dim} must be even for rotary embeddings")
        layers = req("num_hidden_layers")

        # Expert count: qwen3 saves "num_local_experts" (transformers' attribute map), qwen2/olmoe "num_experts".
        if arch == "mixtral":
            n_exp = d.get("num_local_experts")
        else:
            n_exp = data.get("num_experts", data.get("num_local_experts", d.get("num_experts")))
        if not isinstance(n_exp, int) or n_exp <= 0:
            raise ModelConfigError(f"{source}: number of experts is {n_exp!r}; expected a positive integer")
        top_k = req("num_experts_per_tok")
        if top_k > n_exp:
            raise ModelConfigError(f"{source}: num_experts_per_tok {top_k} exceeds the {n_exp} experts")
        if arch == "mixtral":
            expert_i = req("intermediate_size")
            norm_topk = True   # Mixtral always renormalises (softmax over the top-k logits)
        else:
            expert_i = req("moe_intermediate_size") if arch != "olmoe" else req("intermediate_size")
            norm_topk = bool(d.get("norm_topk_prob", False))

        # Dense layers (qwen): mlp_only_layers or decoder_sparse_step > 1 make some layers plain MLPs.
        moe_layers = [True] * layers
        if arch in ("qwen3_moe", "qwen2_moe"):
            step = d.get("decoder_sparse_step", 1) or 1
            only = d.get("mlp_only_layers") or []
            if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
                raise ModelConfigError(f"{source}: key 'mlp_only_layers' is {only!r}; expected a list of ints")
            moe_layers = [(i not in only) and (i + 1) % step == 0 for i in range(layers)]
        dense_i = d.get("intermediate_size", 0) if not all(moe_layers) else 0
        if not all(moe_layers) and not dense_i:
            raise ModelConfigError(f"{source}: dense layers present but no 'intermediate_size'")

        # Sliding-window attention is not implemented: refuse rather than silently attend further.
        if d.get("use_sliding_window") or (arch == "mixtral" and d.get("sliding_window")):
            raise ModelConfigError(f"{source}: sliding-window attention (use_sliding_window / sliding_window="
                                   f"{d.get('sliding_window')!r}) is not supported by the engine")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"{source}: key 'hidden_act' is {act!r}; only 'silu' is supported")

        rope_theta = _rope_theta(d, source)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())

        if arch == "qwen3_moe":
            qk_norm, qkv_bias, o_bias = "head", bool(d.get("attention_bias")), bool(d.get("attention_bias"))
        elif arch == "olmoe":
            qk_norm, qkv_bias, o_bias = "full", bool(d.get("attention_bias")), bool(d.get("attention_bias"))
        elif arch == "qwen2_moe":
            qk_norm, qkv_bias, o_bias = "none", bool(d.get("qkv_bias", True)), False
        else:
            qk_norm, qkv_bias, o_bias = "none", False, False

        return cls(
            arch=arch, vocab_size=req("vocab_size"), hidden_size=hidden, num_layers=layers,
            num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, num_experts=n_exp, top_k=top_k,
            expert_intermediate_size=expert_i, norm_topk_prob=norm_topk, rope_theta=float(rope_theta),
            rms_norm_eps=float(d["rms_norm_eps"]), tie_word_embeddings=bool(d.get("tie_word_embeddings")),
            qk_norm=qk_norm, qkv_bias=qkv_bias, o_bias=o_bias,
            max_position_embeddings=int(d["max_position_embeddings"]),
            shared_expert_intermediate_size=(req("shared_expert_intermediate_size")
                                             if arch == "qwen2_moe" else 0),
            dense_intermediate_size=int(dense_i), moe_layers=tuple(moe_layers),
            clip_qkv=d.get("clip_qkv") if arch == "olmoe" else None,
            bos_token_id=d.get("bos_token_id"), eos_token_ids=eos_ids, pad_token_id=d.get("pad_token_id"),
            source=source, raw=data,
        )


def _rope_theta(d: dict[str, Any], source: str) -> float:
    """RoPE base from `rope_parameters` (transformers 5) or `rope_theta`/`rope_scaling` (4.x files).

    Only the default (unscaled) rotary embedding is implemented; anything else is refused.
    """
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelConfigError(f"{source}: key 'rope_parameters' is {params!r}; expected an object")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ModelConfigError(f"{source}: rope type {rope_type!r} is not supported (only 'default' RoPE)")
    if params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) not in (1, 1.0):
        raise ModelConfigError(f"{source}: partial_rotary_factor is not supported")
    return float(params.get("rope_theta", d.get("rope_theta")))
