"""DecodeConfig: one frozen object per Engine holding every decode switch; engines in one process
decode with their own; no moebench module assigns into another module's globals."""
from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest
import torch

from moebench.engine import Engine
from moebench.engine.decode_config import (DEFAULT, SHIPPED_LAUNCH, DecodeConfig, DecodeConfigError, DecodeMode,
                                           Format, Launch)
from moebench.engine.engine import EngineError
from moebench.engine.experts_protocol import ExpertsModule
from moebench.engine.model import Experts
from moebench.engine.placement import QuantizedExpert, TieredExperts
from moebench.engine.quant import quantize

REPO = Path(__file__).resolve().parent.parent


def test_config_is_frozen_and_variants_are_new_objects():
    cfg = DecodeConfig(experts_impl="triton")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.pdl = False
    with pytest.raises(TypeError):
        cfg.launch[("gate_up", "int4", "")] = Launch()          # read-only view
    other = cfg.with_launch("gate_up", "int4", BN=4)
    assert other.launch_for("gate_up", "int4") == Launch(4, 256, 4, 3)
    assert cfg.launch_for("gate_up", "int4") == SHIPPED_LAUNCH[("gate_up", "int4", "")]
    # host and a8 entries fall back to the format's plain entry
    assert cfg.launch_for("down", "int8", a8=True) == SHIPPED_LAUNCH[("down", "int8", "")]
    assert cfg.launch_for("down", "ternary", host=True) == SHIPPED_LAUNCH[("down", "ternary", "host")]
    assert cfg.mode_of("int4") == DecodeMode.WORDS and cfg.mode_of("ternary2") == DecodeMode.WORDS
    assert cfg.mode_of("ternary") == DecodeMode.WORDS
    # JSON option sets give the attention launch as a dict (benchmarks/decode_ab.py --option-sets)
    from_json = DecodeConfig(**json.loads('{"attention": {"block_s": 64, "split_min_slots": 128}}'))
    assert from_json.attention == dataclasses.replace(DEFAULT.attention, block_s=64, split_min_slots=128)
    bytes_cfg = dataclasses.replace(cfg, decode_mode=DecodeMode.BYTES)
    assert bytes_cfg.mode_of("int4") == DecodeMode.BYTES and bytes_cfg.mode_of("ternary2") == DecodeMode.WORDS
    assert Format.of("int4_asym") == Format.INT4_ASYM and Format.INT4_ASYM.key == "int4_asym"


@pytest.mark.parametrize("kwargs, match", [
    ({"experts_impl": "fast"}, "experts_impl 'fast': expected one of"),
    ({"int8_activations": True}, "int8_activations needs experts_impl 'triton'"),
    ({"experts_impl": "triton", "prefetch_early": True}, "prefetch_early needs prefetch_host"),
    ({"mode_by_format": {"int5": DecodeMode.BYTES}}, "format 'int5'"),
    ({"fused_max_tokens": -1}, "fused_max_tokens must be >= 0"),
    ({"tiered_stack_bytes": 0}, "tiered_stack_bytes must be >= 1, got 0"),
    ({"attention": {"block": 64}}, r"attention \{'block': 64\}: expected fields of \['block_s'"),
    ({"attention": {"block_s": 24}}, "block_s 24 \\(a power of two >= 16\\)"),
    ({"attention": {"split_min_slots": 0}}, "split_min_slots 0 \\(>= 1\\)"),
])
def test_bad_settings_are_refused_by_name(kwargs, match):
    with pytest.raises(DecodeConfigError, match=match):
        DecodeConfig(**kwargs)


def test_launch_validation_names_kernel_format_and_parameter():
    with pytest.raises(DecodeConfigError, match="kernel 'gemm'"):
        DEFAULT.with_launch("gemm", "dense", BN=4)
    with pytest.raises(DecodeConfigError, match="unknown parameters \\['BM'\\]"):
        DEFAULT.with_launch("down", "dense", BM=4)
    with pytest.raises(DecodeConfigError, match="down/int4 BK=48 bytes; expected a multiple of 32"):
        DEFAULT.with_launch("down", "int4", BK=48)


def test_identity_is_json_and_resolves_device_defaults():
    cpu = DecodeConfig(experts_impl="triton").resolved("cpu")
    gpu = DecodeConfig(experts_impl="triton").resolved("cuda")
    assert (cpu.fused_ops, cpu.gemv_max_tokens, gpu.gemv_max_tokens) == (True, 0, 1)
    ident = json.loads(json.dumps(gpu.identity()))
    assert ident["experts_impl"] == "triton" and ident["gemv_max_tokens"] == 1
    assert ident["launch"]["router/dense"] == {"BN": 2, "BK": 2048, "num_warps": 1, "num_stages": 2}
    assert ident["attention"]["block_s"] == 32 and ident["decode_mode"] == "WORDS"
    assert DecodeConfig().resolved("cuda").gemv_tokens == 0         # no fused ops: no GEMV either
    assert cpu.is_resolved and not DecodeConfig(experts_impl="triton").is_resolved
    assert cpu.resolved("cuda") == cpu                               # resolving a resolved config changes nothing


def test_both_experts_modules_implement_the_protocol():
    g = torch.Generator().manual_seed(0)
    tiered = TieredExperts([QuantizedExpert(*(quantize(torch.randn(8, 16, generator=g), "int8") for _ in range(2)),
                                            quantize(torch.randn(16, 8, generator=g), "int8"))
                            for _ in range(3)], ["gpu", "host", "gpu"], "cpu", torch.float32)
    for module in (Experts(3, 16, 8), tiered):
        assert isinstance(module, ExpertsModule)
        assert not module.prefetching and not module.wants_quantized_x()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A random 2-layer Qwen3-MoE checkpoint (hidden 64, 8 experts, top-2)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], initializer_range=0.1,
        max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(3)
    path = tmp_path_factory.mktemp("tiny_qwen3moe_decode_config")
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    return path


def test_two_engines_in_one_process_decode_with_their_own_config(ckpt):
    """Two engines on one checkpoint with different experts paths (gather: bmm over copied weights,
    no host sync; loop: grouped per expert, a host sync per layer): each keeps its own config in
    its modules, reports it, and computes what the other computes; reconfiguring one leaves the
    other as it was."""
    path = ckpt
    gather = Engine.load(path, max_seq_len=64, decode=DecodeConfig(experts_impl="gather"))
    assert gather.decode.is_resolved and gather.decode.fused_ops is False   # the engine resolves a config left open
    loop = Engine.load(path, max_seq_len=64, experts_impl="loop")
    assert gather.decode.experts_impl == "gather" and loop.decode.experts_impl == "loop"
    for eng in (gather, loop):
        assert all(b.experts.decode is eng.decode and b.decode is eng.decode for b in eng.model.moe_blocks())
        assert eng.identity()["decode"]["experts_impl"] == eng.decode.experts_impl
    assert gather._graph_batch_limit() == DEFAULT.gather_max_tokens and loop._graph_batch_limit() == 0
    prompt = list(range(5, 17))
    a, b = gather.logits(prompt), loop.logits(prompt)
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()
    # reconfiguring one engine leaves the other as it was
    gather.reconfigure(dataclasses.replace(gather.decode, gather_max_tokens=0))
    assert all(b.decode is gather.decode and layer.self_attn.decode is gather.decode
               for b, layer in zip(gather.model.moe_blocks(), gather.model.layers))
    assert gather._graph_batch_limit() == 0 and loop.decode.experts_impl == "loop"
    assert torch.equal(loop.logits(prompt), b)
    with pytest.raises(EngineError, match="not both"):
        Engine.load(path, max_seq_len=64, decode=DecodeConfig(), experts_impl="loop")
    with pytest.raises(EngineError, match="int8_activations needs experts_impl 'triton'"):
        Engine.load(path, max_seq_len=64, int8_activations=True)


def _module_names(tree: ast.Module) -> set[str]:
    """Names a module binds to imported modules (import x, import x.y as z, from . import kernels)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                # `from pkg import sub` binds a module when sub is one; the ones moebench uses that way
                if a.name in {"kernels", "attention", "moe", "norm_router", "runtime", "staging", "placement",
                              "model", "engine", "tiering", "quant", "config"}:
                    names.add(a.asname or a.name)
    return names


def test_no_module_assigns_into_another_modules_globals():
    offenders = []
    for file in sorted((REPO / "moebench").rglob("*.py")):
        tree = ast.parse(file.read_text(encoding="utf-8"))
        modules = _module_names(tree)
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for t in targets:
                while isinstance(t, ast.Subscript):          # kernels.TABLE[key] = ...
                    t = t.value
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id in modules:
                    offenders.append(f"{file.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert not offenders, offenders
