"""Expert tensor names in Hugging Face MoE checkpoints: one parser for the loader and the tiering.

The forms accepted (an optional `model.` prefix; the block named `mlp` (Qwen-MoE, OLMoE) or
`block_sparse_moe` (Mixtral)):

- per expert: `layers.L.mlp.experts.E.{gate_proj|up_proj|down_proj}.weight`, or Mixtral's
  `w1` (gate), `w3` (up), `w2` (down);
- fused stacks over all experts, `[E, ...]`: `layers.L.mlp.experts.gate_up_proj` (`[E, 2I, H]`,
  gate rows first, then up), `...experts.gate_proj`, `...experts.up_proj`, `...experts.down_proj`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_NAME = re.compile(r"^(?:model\.)?layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\."
                   r"(?:(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight"
                   r"|(gate_up_proj|gate_proj|up_proj|down_proj))$")
# The checkpoint's matrix name -> the engine's matrices it holds, in row order.
_MATRICES = {"gate_proj": ("gate",), "w1": ("gate",), "up_proj": ("up",), "w3": ("up",),
             "down_proj": ("down",), "w2": ("down",), "gate_up_proj": ("gate", "up")}


@dataclass(frozen=True)
class ExpertTensor:
    """What an expert tensor's name says about it.

    layer: the decoder layer index.
    expert: the expert index, or None for a fused stack holding every expert along dimension 0.
    matrices: the engine matrices ("gate", "up", "down") it holds, in row order: one, or
        ("gate", "up") for a fused gate_up_proj.
    """

    layer: int
    expert: int | None
    matrices: tuple[str, ...]

    @property
    def fused(self) -> bool:
        return self.expert is None


def parse_expert_name(name: str) -> ExpertTensor | None:
    """The expert tensor `name` names, or None when it is not an expert weight."""
    m = _NAME.match(name)
    if m is None:
        return None
    layer, expert, per_expert, fused = m.groups()
    if fused is not None:
        return ExpertTensor(int(layer), None, _MATRICES[fused])
    return ExpertTensor(int(layer), int(expert), _MATRICES[per_expert])
