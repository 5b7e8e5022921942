"""In-repo MoE inference engine (evaluation-agnostic: imports nothing else from moebench).

Public entry points: `Engine` (load / logits / generate / trace / tokenize), `ModelConfig`,
`GenerationOutput`, `RouterTrace`; `model.Experts` is the swap point for tiered experts.
"""
from .config import ModelConfig, ModelConfigError
from .engine import Engine, EngineError, GenerationOutput, RouterTrace
from .loader import CheckpointError, load_model
from .model import Experts, MoEBlock, MoETransformer, RouterTracer

__all__ = ["Engine", "EngineError", "GenerationOutput", "RouterTrace", "ModelConfig", "ModelConfigError",
           "CheckpointError", "load_model", "Experts", "MoEBlock", "MoETransformer", "RouterTracer"]
