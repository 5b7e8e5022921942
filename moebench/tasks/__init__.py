"""Task kinds. Each module defines one `Task` subclass named in TASK_KINDS; modules load lazily."""
from __future__ import annotations

import importlib

from moebench.config import Field

TASK_KINDS: dict[str, tuple[str, str]] = {
    "gsm8k": ("moebench.tasks.gsm8k", "Gsm8kTask"),
    "cmmlu": ("moebench.tasks.cmmlu", "CmmluTask"),
    "humaneval": ("moebench.tasks.humaneval", "HumanEvalTask"),
    "kld": ("moebench.kld.task", "KldTask"),
    "needle": ("moebench.tasks.needle", "NeedleTask"),
    "speed": ("moebench.speed.task", "SpeedTask"),
}


def task_class(kind: str):
    module, cls = TASK_KINDS[kind]
    return getattr(importlib.import_module(module), cls)


def task_schemas() -> dict[str, dict[str, Field]]:
    out = {}
    for kind, (module, cls) in TASK_KINDS.items():
        try:
            out[kind] = getattr(importlib.import_module(module), cls).options
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("moebench"):
                continue          # not built yet
            raise
    return out
