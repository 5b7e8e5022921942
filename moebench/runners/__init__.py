"""Runner kinds. Each module defines a settings class (its profile keys, typed: moebench.config.setting),
`SCHEMA` read from it, and a `Runner` subclass.

Modules load lazily so a suite on the HTTP runner never imports torch.
"""
from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from moebench.config import RunnerProfile, RunnerSchema

if TYPE_CHECKING:
    from moebench.runners.base import Runner

# kind -> (module, class name)
RUNNER_KINDS: dict[str, tuple[str, str]] = {
    "http": ("moebench.runners.http", "HttpRunner"),
    "llama-server": ("moebench.runners.llama_server", "LlamaServerRunner"),
    "engine": ("moebench.runners.engine", "EngineRunner"),
}


def runner_schemas() -> dict[str, RunnerSchema]:
    """Each installed kind's profile keys, which carry its settings class."""
    out = {}
    for kind, (module, _) in RUNNER_KINDS.items():
        try:
            out[kind] = importlib.import_module(module).SCHEMA
        except ModuleNotFoundError as e:     # a kind whose module is not there yet / missing extra
            if e.name and e.name.startswith("moebench"):
                continue
            raise
    return out


# Packages a kind needs beyond the base install, and the extra that brings them.
KIND_NEEDS: dict[str, tuple[tuple[str, ...], str]] = {
    "engine": (("torch", "safetensors", "tokenizers"), "engine"),
}


def check_kind_installed(kind: str, where: str) -> None:
    """ProfileError naming the extra to install when `kind` needs packages this install lacks."""
    import importlib.util

    from moebench.config import ProfileError

    needs, extra = KIND_NEEDS.get(kind, ((), ""))
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if missing:
        raise ProfileError(f"{where}: kind {kind!r} needs {', '.join(missing)}, "
                           f"not installed here: pip install 'moebench[{extra}]'")


def load_runner_profile(path: str | os.PathLike[str]) -> RunnerProfile:
    """A runner profile, validated; a kind this install cannot run is refused first, naming its extra
    (before its keys are checked: a missing engine says so rather than that a model path is wrong)."""
    from moebench.config import load_runner, load_toml
    kind = load_toml(Path(path)).get("kind")
    if isinstance(kind, str):
        check_kind_installed(kind, str(path))
    return load_runner(path, runner_schemas())


def make_runner(profile: RunnerProfile) -> Runner:
    """The profile's kind's runner over its typed settings (not started)."""
    check_kind_installed(profile.kind, profile.path or profile.name)
    module, cls = RUNNER_KINDS[profile.kind]
    runner_cls = getattr(importlib.import_module(module), cls)
    return runner_cls(profile.settings, profile.path, name=profile.name)
