"""What a runner records about its model and build (the manifest's `model` and `build`, docs/schema.md),
and what the engine runner chose and measured about itself (`build.choices`, the manifest's `engine`).

TypedDicts, not dataclasses: the store writes them into the manifest as they are, and readers of a
manifest (compare, report, tests) index them as the JSON objects they become. Each runner kind has
its own shape; `RunnerIdentity` holds whichever the runner is.
"""
from __future__ import annotations

import sys
from typing import TypedDict, Union

if sys.version_info >= (3, 11):
    from typing import NotRequired
else:                                   # pyproject installs typing_extensions there
    from typing_extensions import NotRequired

from moebench.json_types import JsonObject


class NamedModel(TypedDict):
    """The model as a runner that knows only its name gives it (the base runner)."""

    name: str | None


class HttpModel(TypedDict):
    """An OpenAI-compatible server's model: the name asked for, where, through which API."""

    name: str
    endpoints: list[str]
    api: str


class GgufSummary(TypedDict):
    """A GGUF's header in brief (llama_server.gguf_metadata); the per-architecture keys where the
    header has them."""

    architecture: str | None
    name: str | None
    file_type: int | None
    file_type_name: str | None
    parameter_count: int
    tensor_count: int
    gguf_version: int
    expert_count: NotRequired[int]
    expert_used_count: NotRequired[int]
    block_count: NotRequired[int]
    context_length: NotRequired[int]
    embedding_length: NotRequired[int]


class GgufUnreadable(TypedDict):
    """A GGUF whose header could not be read: said, the run goes on."""

    error: str


class GgufModel(TypedDict):
    """A llama-server runner's GGUF file."""

    path: str
    name: str
    size_bytes: int
    sha256: str
    gguf: NotRequired[GgufSummary | GgufUnreadable]


class ModelHash(TypedDict):
    """A content hash over the files that define an engine model (weights, config, plan, tokenizer)."""

    sha256: str
    bytes: int
    files: list[str]


class EngineModel(ModelHash):
    """The engine runner's checkpoint folder."""

    path: str
    tiered: bool
    config: NotRequired[str | None]          # config.json's model_type


class GreedySamplers(TypedDict):
    """The sampler chain a llama-server runner's greedy requests name (runners/wire.py greedy_chain)."""

    samplers: list[str]
    top_k: int | None
    backend_sampling: bool | None            # the server's, from /props (None: it did not say)


class LlamaBuild(TypedDict):
    """A llama-server runner's build: its llama.cpp binary (BuildInfo's keys, or the error finding it)
    and the server's arguments once started."""

    kind: str                                # "llama.cpp"
    binary: NotRequired[str]
    build_number: NotRequired[int | None]
    build_commit: NotRequired[str | None]
    source: NotRequired[str]
    version: NotRequired[str]
    built_with: NotRequired[str]
    variant: NotRequired[str | None]
    flags: NotRequired[list[str] | None]
    error: NotRequired[str]
    server_args: NotRequired[list[str] | None]
    server_started: NotRequired[bool]
    greedy_samplers: NotRequired[GreedySamplers | None]


class DecodeChoice(TypedDict):
    """One decode choice of the engine runner as the manifest records it (build.choices): a JSON
    object, so it is a TypedDict; `runs` and `mode` are added once the engine is loaded."""

    value: bool | str
    why: str
    runs: NotRequired[bool]             # cuda_graphs, prefetch_host: whether the loaded engine does it
    mode: NotRequired[str | None]       # cuda_graphs: the engine's graph mode (None: no graphs)


class EngineBuild(TypedDict):
    """The engine runner's build: torch, the device, its decode choices and the engine's DecodeConfig
    (`decode`: moebench.engine.decode_config.DecodeConfig.identity, the engine's own record)."""

    engine: str                              # "moebench"
    torch: str
    device: str
    dtype: bool | str
    choices: dict[str, DecodeChoice]
    int8_activations: NotRequired[bool]
    decode: JsonObject                       # the engine's own record of its DecodeConfig


class EngineTelemetry(TypedDict):
    """What the engine runner measured about itself over the run (the manifest's `engine`): its
    decode choices, load and warm-up seconds, and the engine's own telemetry (Engine.telemetry)."""

    choices: dict[str, DecodeChoice]
    load_s: float | None
    warmup_s: float | None
    torch_memory: JsonObject                 # the engine's torch memory peaks per phase
    decode_steps: int
    tiers: NotRequired[JsonObject]           # the engine's tier counters (tiered models)
    # torch's peaks beside NVML's figures, where torch measured them: the key compare's memory section reads
    torch_peak_allocated_bytes: NotRequired[int | None]
    torch_peak_reserved_bytes: NotRequired[int | None]


class NoBuild(TypedDict):
    """A runner that knows nothing of the build behind it (http, the base runner)."""


ModelIdentity = Union[NamedModel, HttpModel, GgufModel, EngineModel]
BuildIdentity = Union[NoBuild, LlamaBuild, EngineBuild]


class RunnerIdentity(TypedDict):
    """`Runner.identity()`: the manifest's `model` and `build`."""

    model: ModelIdentity
    build: BuildIdentity
