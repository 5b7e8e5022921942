"""One parser for expert tensor names (engine/expert_names.py), used by the checkpoint loader and the
tiering: every name form either accepted, and the zoo checkpoint rewritten into each layout loads to
the same weights through both."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from moebench.engine.expert_names import ExpertTensor, parse_expert_name  # noqa: E402

ZOO = Path(__file__).resolve().parents[1] / "models" / "zoo" / "tiny-moe"


@pytest.mark.parametrize("prefix", ["", "model."])
@pytest.mark.parametrize("block", ["mlp", "block_sparse_moe"])
@pytest.mark.parametrize("matrix,engine", [("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down"),
                                           ("w1", "gate"), ("w3", "up"), ("w2", "down")])
def test_per_expert_names(prefix, block, matrix, engine):
    name = f"{prefix}layers.12.{block}.experts.37.{matrix}.weight"
    t = parse_expert_name(name)
    assert t == ExpertTensor(layer=12, expert=37, matrices=(engine,)) and not t.fused


@pytest.mark.parametrize("prefix", ["", "model."])
@pytest.mark.parametrize("block", ["mlp", "block_sparse_moe"])
@pytest.mark.parametrize("stack,engine", [("gate_up_proj", ("gate", "up")), ("gate_proj", ("gate",)),
                                          ("up_proj", ("up",)), ("down_proj", ("down",))])
def test_fused_stack_names(prefix, block, stack, engine):
    t = parse_expert_name(f"{prefix}layers.3.{block}.experts.{stack}")
    assert t == ExpertTensor(layer=3, expert=None, matrices=engine) and t.fused


@pytest.mark.parametrize("name", [
    "model.layers.0.mlp.gate.weight",                       # the router
    "model.layers.0.mlp.shared_expert.gate_proj.weight",    # a shared expert is a dense MLP
    "model.layers.0.mlp.experts.0.gate_proj.bias",
    "model.layers.0.mlp.experts.0.gate_up_proj.weight",     # fused stacks carry no .weight suffix
    "model.layers.0.mlp.experts.gate_up_proj.weight",
    "model.layers.0.mlp.experts.x.w1.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "lm_head.weight",
    "transformer.layers.0.mlp.experts.0.w1.weight",
    "model.layers.0.mlp.experts.0.w4.weight",
])
def test_other_names_are_not_experts(name):
    assert parse_expert_name(name) is None


def _zoo_tensors() -> dict[str, "torch.Tensor"]:
    if not (ZOO / "model.safetensors").is_file():
        pytest.skip(f"{ZOO}: zoo checkpoint not built (moebench zoo build --hf-only)")
    return safetensors_torch.load_file(str(ZOO / "model.safetensors"))


def _rewrite(sd: dict[str, "torch.Tensor"], layout: str) -> dict[str, "torch.Tensor"]:
    """The zoo's tensors with the experts renamed (mixtral) or stacked (fused) as other checkpoints do."""
    out, per = {}, {}
    names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    for k, v in sd.items():
        t = parse_expert_name(k)
        if t is None:
            out[k] = v
        elif layout == "mixtral":
            matrix = k.rsplit(".", 2)[1]
            out[f"model.layers.{t.layer}.block_sparse_moe.experts.{t.expert}.{names[matrix]}.weight"] = v
        else:
            per[(t.layer, t.expert, t.matrices[0])] = v
    if layout == "fused":
        for layer in sorted({l for l, _, _ in per}):
            n = len({e for l, e, _ in per if l == layer})
            stack = {m: torch.stack([per[(layer, e, m)] for e in range(n)]) for m in ("gate", "up", "down")}
            out[f"layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat([stack["gate"], stack["up"]], dim=1)
            out[f"layers.{layer}.mlp.experts.down_proj"] = stack["down"]
    return out


@pytest.mark.parametrize("layout", ["mixtral", "fused"])
def test_zoo_in_other_layouts_loads_the_same_weights(tmp_path, layout):
    from moebench.engine.loader import load_model
    from moebench.engine.tiering import weights_from_checkpoint

    sd = _zoo_tensors()
    experts = {k: parse_expert_name(k) for k in sd}
    assert sum(t is not None for t in experts.values()) == 4 * 8 * 3     # 4 layers, 8 experts, 3 matrices
    out = tmp_path / layout
    out.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ZOO / f, out / f)
    rewritten = _rewrite(sd, layout)
    assert all(parse_expert_name(k) is not None for k in rewritten if ".experts." in k)
    safetensors_torch.save_file({k: v.contiguous() for k, v in rewritten.items()}, str(out / "model.safetensors"))

    ref, got = load_model(ZOO), load_model(out)
    for (name, a), (_, b) in zip(ref.named_parameters(), got.named_parameters()):
        assert torch.equal(a, b), name
    ref_w, got_w = weights_from_checkpoint(ZOO), weights_from_checkpoint(out)
    for layer, expert in ((0, 0), (1, 5), (3, 7)):
        for a, b in zip(ref_w(layer, expert), got_w(layer, expert)):
            assert torch.equal(a, b), (layout, layer, expert)
