"""`kind = "engine"`: the in-repo tiered torch MoE engine, in process (no server, no GPU needed).

A thin adapter: text <-> token ids with the checkpoint's tokenizer, blocking engine calls in a worker
thread, stop strings cut on the host. Offers full next-token logits and router traces, which the
KLD task and the MoE signals use.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moebench.config import MAX_CLIENTS, MAX_PROMPT_TOKENS, ProfileError, RunnerSettings, positive, setting
from moebench.json_fields import as_integer
from moebench.json_types import JsonObject
from moebench.runners.identity import DecodeChoice, EngineBuild, EngineModel, EngineTelemetry, ModelHash, RunnerIdentity
from moebench.runners.base import Capability, GenerateRequest, GenerateResult, Runner, RunnerError
from moebench.scoring.answers import first_stop

def _true_false_auto(value: Any) -> str | None:
    return None if value in (True, False, "auto") else 'must be true, false or "auto"'


@dataclass(frozen=True)
class EngineSettings(RunnerSettings):
    """A `kind = "engine"` profile's keys (docs/profiles.md), each with its one default."""

    model: str = setting(str, required=True, path="checkpoint directory",
                         doc="a Hugging Face checkpoint directory or a packed tiered artifact")
    dtype: str = setting(str, default="bfloat16", choices=("auto", "float32", "bfloat16", "float16"),
                         doc="auto: float32 on the CPU (exact for bf16 weights, and faster there), bfloat16 on CUDA")
    device: str = setting(str, default="auto", doc="auto | cpu | cuda | cuda:N")
    max_seq_len: int | None = setting(int, check=positive, low=1, high=MAX_PROMPT_TOKENS,
                                      doc="KV cache length (default: the model's, capped)")
    max_batch: int = setting(int, default=1, check=positive, low=1, high=MAX_CLIENTS)
    prefill_chunk: int = setting(int, default=512, check=positive, low=1, high=MAX_PROMPT_TOKENS)
    experts_impl: str = setting(str, default="auto", doc="auto | gather | loop | grouped_mm | triton (see engine "
                                "docs); auto on CUDA: triton (the fused kernels) where Triton runs")
    cuda_graphs: bool | str = setting((bool, str), default="auto", check=_true_false_auto,
                                      doc="replay decode steps as CUDA graphs; auto: on with CUDA")
    prefetch_host: bool | str = setting((bool, str), default="auto", check=_true_false_auto,
                                        doc="tiered artifacts with experts_impl = triton: stage each layer's "
                                        "predicted host experts in GPU memory one layer early; auto: on with "
                                        "CUDA, the fused kernels and an artifact with host or ssd experts "
                                        "(measured faster there), else off")
    prefetch_early: bool | str = setting((bool, str), default="auto", check=_true_false_auto,
                                         doc="with prefetch_host: guess each layer's host experts from the "
                                         "previous layer's attention input instead of its MoE input (a longer "
                                         "copy window, an older guess); auto: on wherever prefetch_host is on "
                                         "with CUDA")
    int8_activations: bool = setting(bool, default=False, doc="tiered artifacts with experts_impl = triton: the "
                                     "int8 and int4 experts' decode rounds its activations to int8 per 64 columns "
                                     "and multiplies with dp4a (W8A8 / W4A8: faster on the GPU, slightly "
                                     "different numbers)")
    tiered_stack_mib: int = setting(int, default=1024, check=positive, low=1, high=1_048_576,
                                    doc="tiered artifacts on the grouped path (prefill with experts_impl = triton "
                                    "on CUDA): the most MiB of dequantized experts one stack holds (a layer's "
                                    "experts run in ranges that fit); lower it where prefill runs out of GPU memory")


SCHEMA = EngineSettings.schema()


def _resolve_device(name: str) -> str:
    if name != "auto":
        return name
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def decode_choices(profile: EngineSettings | JsonObject, device: str) -> dict[str, DecodeChoice]:
    """The decode path for this profile on this device: each choice's value and why. The fast path
    is the default where the device has it (CUDA: bf16, fused Triton kernels, CUDA graphs,
    decode-ahead; prefetch for tiered artifacts, prefetch_choices); a key set in the profile wins."""
    settings = EngineSettings.of(profile)
    cuda = device.startswith("cuda")
    out: dict[str, DecodeChoice] = {}
    dtype = settings.dtype
    out["dtype"] = ({"value": "bfloat16" if cuda else "float32", "why": f"auto on {'CUDA' if cuda else 'the CPU'}"}
                    if dtype == "auto" else {"value": dtype, "why": "profile"})
    impl = settings.experts_impl
    if impl == "auto" and cuda:
        from moebench.engine import kernels
        ok = kernels.available()
        out["experts_impl"] = {"value": "triton" if ok else "auto",
                               "why": "auto on CUDA: the fused Triton kernels" if ok else
                               f"auto on CUDA, Triton unavailable ({kernels.unavailable_reason()})"}
    elif impl == "auto":
        out["experts_impl"] = {"value": "auto", "why": "auto on the CPU: torch's experts path"}
    else:
        out["experts_impl"] = {"value": impl, "why": "profile"}
    graphs = settings.cuda_graphs
    out["cuda_graphs"] = ({"value": cuda, "why": f"auto on {'CUDA' if cuda else 'the CPU (no graphs)'}"}
                          if graphs == "auto" else {"value": bool(graphs) and cuda, "why": "profile"})
    return out


def offloaded_homes(model_path: str | Path) -> list[str]:
    """The homes other than "gpu" that a tiered artifact's plan.json gives experts ("host", "ssd"),
    sorted; [] for a plain checkpoint or an all-GPU plan."""
    plan = Path(model_path) / "plan.json"
    if not plan.is_file():
        return []
    from moebench.engine.tiering import Plan
    return sorted({h for row in Plan.load(plan).home for h in row} - {"gpu"})


def prefetch_choices(profile: EngineSettings | JsonObject, device: str, experts_impl: str,
                     offloaded: list[str]) -> dict[str, DecodeChoice]:
    """prefetch_host and prefetch_early, each value and why. "auto" (the default) turns both on where
    prefetch from the attention input measured faster than no prefetch: CUDA, the fused Triton
    experts (`experts_impl`, as chosen) and an artifact with experts off the GPU (`offloaded`, from
    offloaded_homes). On the H200 (docs/engine-speed.md) that took the random hot-half host plan from
    63.9% to 79.5% of its tier-aware bound and the calibrated one from 62.3% to 70.1%; the guess from
    the MoE input alone lost in the calibrated plan, so auto never picks it. An artifact whose only
    experts off the GPU are on the SSD gets no prefetch: there a guess starts disk reads, and the
    SSD plan of benchmarks/tiers_h200.py ran faster without guesses in three of four H200 calls
    (51.52 against 46.49 tok/s in the last), the wasted reads costing the disk time it is bound by.
    Elsewhere auto is off. A value set in the profile is kept (the runner checks it against
    experts_impl)."""
    settings = EngineSettings.of(profile)
    cuda = device.startswith("cuda")
    out: dict[str, DecodeChoice] = {}
    host = settings.prefetch_host
    if host != "auto":
        out["prefetch_host"] = {"value": bool(host), "why": "profile"}
    elif not cuda:
        out["prefetch_host"] = {"value": False, "why": "auto on the CPU: off (prefetch stages experts in GPU memory)"}
    elif experts_impl != "triton":
        out["prefetch_host"] = {"value": False, "why": f"auto: off, experts_impl is {experts_impl!r}, not the fused "
                                f"Triton kernels prefetch works in"}
    elif not offloaded:
        out["prefetch_host"] = {"value": False, "why": "auto: off, every expert of this model is in GPU memory"}
    elif offloaded == ["ssd"]:
        out["prefetch_host"] = {"value": False, "why": "auto: off, the experts off the GPU are all on the SSD (guessed "
                                "disk reads measured slower than reads at the routing)"}
    else:
        out["prefetch_host"] = {"value": True, "why": f"auto on CUDA with the fused kernels and {' and '.join(offloaded)} "
                                f"experts: on (measured faster, with prefetch_early)"}
    early = settings.prefetch_early
    if early != "auto":
        out["prefetch_early"] = {"value": bool(early), "why": "profile"}
    elif not out["prefetch_host"]["value"]:
        out["prefetch_early"] = {"value": False, "why": "auto: off, prefetch_host is off"}
    elif not cuda:
        out["prefetch_early"] = {"value": False, "why": "auto on the CPU: off"}
    else:
        out["prefetch_early"] = {"value": True, "why": "auto with prefetch_host on CUDA: the guess from the attention "
                                 "input (measured faster than from the MoE input)"}
    return out


def _model_hash(path: Path) -> ModelHash:
    """A content hash over the files that define the model (weights, config, plan, tokenizer)."""
    h = hashlib.sha256()
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".json") and p.is_file())
    total = 0
    for p in files:
        h.update(p.name.encode())
        with p.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
                total += len(block)
    return {"sha256": h.hexdigest(), "bytes": total, "files": [p.name for p in files]}


def _text_pieces(eng, on_text):
    """An Engine.generate on_token callback that turns tokens into text pieces for on_text.

    Each token decodes only a short window (tokens since the last piece's start), not the whole
    output, so a long generation costs O(n): the new piece is decode(window + new tokens) minus
    decode(window), which keeps byte-level merges across the boundary right. Held back while it
    ends in an incomplete UTF-8 character (decoded as U+FFFD until its last byte arrives)."""
    ids: list[int] = []
    offsets = [0, 0]              # [window start, end of the tokens already sent]

    def on_token(_index: int, token_id: int) -> None:
        ids.append(token_id)
        start, read = offsets
        before = eng.detokenize(ids[start:read])
        text = eng.detokenize(ids[start:])
        if len(text) <= len(before) or text.endswith("\ufffd") or not text.startswith(before):
            return
        offsets[:] = [read, len(ids)]
        on_text(text[len(before):])
    return on_token


class EngineRunner(Runner):
    kind = "engine"
    capabilities = frozenset({Capability.GENERATE, Capability.STREAM, Capability.TOP_LOGPROBS,
                              Capability.FULL_LOGITS, Capability.TOKENIZE, Capability.TOKEN_PROMPTS,
                              Capability.ROUTER_TRACE, Capability.CHOICE_LOGPROBS,
                              Capability.SAMPLED_LOGPROBS})

    settings_class = EngineSettings
    settings: EngineSettings

    def __init__(self, settings: EngineSettings | JsonObject, profile_path: str | None = None,
                 name: str | None = None):
        super().__init__(settings, profile_path, name)
        self.model_path = Path(self.settings.model)
        if not self.model_path.is_dir() or not (self.model_path / "config.json").is_file():
            raise ProfileError(f"{profile_path or 'runner profile'}: key 'model': {self.model_path} is not a "
                               "checkpoint directory with config.json (build the zoo with `moebench zoo build`)")
        self.device = _resolve_device(self.settings.device)
        self.choices = decode_choices(self.settings, self.device)
        self.offloaded = offloaded_homes(self.model_path)
        self._choose_prefetch()
        self.concurrency = 1          # one engine, one request at a time (it holds a lock anyway)
        self.engine = None

    def _choose_prefetch(self) -> None:
        """The prefetch choices for the current experts_impl choice; a key set in the profile that the
        chosen path cannot honour is a ProfileError."""
        where = self.profile_path or "runner profile"
        impl = self.choices["experts_impl"]["value"]
        for key in ("prefetch_host", "int8_activations"):
            if getattr(self.settings, key) is True and impl != "triton":
                raise ProfileError(f"{where}: key '{key}' needs experts_impl = \"triton\" (the fused kernels; "
                                   f"auto picks them on CUDA), got {impl!r}")
        self.choices.update(prefetch_choices(self.settings, self.device, impl, self.offloaded))
        if self.choices["prefetch_early"]["value"] and not self.choices["prefetch_host"]["value"]:
            raise ProfileError(f"{where}: key 'prefetch_early' needs prefetch_host = true "
                               f"(prefetch_host: {self.choices['prefetch_host']['why']})")
        self.decode = self._decode_config()

    async def start(self, run_dir: str | None = None) -> None:
        if self.engine is not None:
            return
        await self._load()

    async def _load(self) -> None:
        from moebench.engine import Engine
        kwargs = {k: getattr(self.settings, k) for k in ("max_seq_len", "max_batch", "prefill_chunk")
                  if getattr(self.settings, k)}
        kwargs["cuda_graphs"] = self.choices["cuda_graphs"]["value"]
        kwargs["decode"] = self.decode
        t0 = time.perf_counter()
        self.engine = await asyncio.to_thread(Engine.load, self.model_path, device=self.device,
                                              dtype=self.choices["dtype"]["value"], **kwargs)
        self.load_s = time.perf_counter() - t0
        eng = self.engine
        self.choices["decode_ahead"] = {"value": eng.decode_ahead, "why": "on with CUDA (the host's per-token work "
                                        "overlaps the next step)" if eng.decode_ahead else "off on the CPU"}
        # cuda_graphs asked for: one graph per step, or segmented graphs cut at the fused SSD path's
        # host syncs, or none (an experts module with host syncs on the per-expert path)
        mode = eng.graph_mode(1)
        self.choices["cuda_graphs"]["runs"] = mode is not None
        self.choices["cuda_graphs"]["mode"] = mode
        # prefetch asked for, but no layer stages or guesses anything (e.g. every offloaded layer has
        # ssd experts on the per-expert path)
        self.choices["prefetch_host"]["runs"] = any(b.experts.prefetching for b in eng.model.moe_blocks())

    async def warmup(self) -> None:
        """A short generation (compiles kernels, captures the first decode graph), then the tier
        counters start from zero, so the run's telemetry is its tasks' alone."""
        eng = self._eng()
        ids = list(range(1, 17)) if eng.tokenizer is None else eng.tokenize("Warm-up: the quick brown fox.")
        t0 = time.perf_counter()
        try:
            await asyncio.to_thread(eng.generate, [ids], 8, ignore_eos=True)
        except Exception as e:
            chosen = self.choices["experts_impl"]
            if not (chosen["value"] == "triton" and chosen["why"].startswith("auto")):
                raise
            if self.settings.prefetch_host is True or self.settings.int8_activations is True:
                raise       # the profile asked for options of the fused kernels: no silent fallback
            # the fused kernels were our choice, not the user's: fall back to the plain path, and say so
            self.choices["experts_impl"] = {"value": "auto", "why": f"the fused kernels failed in the warm-up "
                                            f"({type(e).__name__}: {e}); torch's experts path instead"}
            self._choose_prefetch()
            self.events.append({"event": "fallback", "what": "experts_impl", "error": f"{type(e).__name__}: {e}"})
            self.engine = None
            await self._load()
            eng = self._eng()
            await asyncio.to_thread(eng.generate, [ids], 8, ignore_eos=True)
        self.warmup_s = time.perf_counter() - t0
        eng.reset_telemetry()

    def telemetry(self) -> EngineTelemetry | None:
        if self.engine is None:
            return None
        out: EngineTelemetry = {"choices": self.choices, "load_s": getattr(self, "load_s", None),
                                "warmup_s": getattr(self, "warmup_s", None), **self.engine.telemetry()}
        tm = out.get("torch_memory") or {}
        if tm.get("available"):      # the key compare's memory section reads beside NVML's figures
            out["torch_peak_allocated_bytes"] = tm.get("peak_allocated_bytes")
            out["torch_peak_reserved_bytes"] = tm.get("peak_reserved_bytes")
        return out

    async def close(self) -> None:
        self.engine = None

    def identity(self) -> RunnerIdentity:
        import torch
        model: EngineModel = {"path": str(self.model_path), **_model_hash(self.model_path),
                              "tiered": (self.model_path / "plan.json").is_file()}
        try:
            model["config"] = json.loads((self.model_path / "config.json").read_text()).get("model_type")
        except (OSError, ValueError):
            pass
        build: EngineBuild = {
            "engine": "moebench", "torch": torch.__version__, "device": self.device,
            "dtype": self.choices["dtype"]["value"], "choices": self.choices,
            # changes the numbers: part of what was run
            **({"int8_activations": True} if self.settings.int8_activations is True else {}),
            # every decode switch and launch table of the engine (moebench.engine.decode_config)
            "decode": self.decode.identity()}
        return {"model": model, "build": build}

    def _decode_config(self):
        """The engine's DecodeConfig from the profile and the runner's choices, device defaults
        resolved, built once per choice of experts path (`self.decode`): what the engine decodes
        with and the manifest records."""
        from moebench.engine.decode_config import DecodeConfig
        cfg = DecodeConfig(experts_impl=self.choices["experts_impl"]["value"],
                           int8_activations=self.settings.int8_activations is True,
                           prefetch_host=self.choices["prefetch_host"]["value"],
                           prefetch_early=self.choices["prefetch_early"]["value"],
                           tiered_stack_bytes=self.settings.tiered_stack_mib << 20)
        return cfg.resolved("cuda" if self.device.startswith("cuda") else "cpu")

    def _eng(self):
        if self.engine is None:
            raise RunnerError("engine runner used before start()")
        return self.engine

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        eng = self._eng()
        ids = request.prompt if isinstance(request.prompt, list) else eng.tokenize(request.prompt)
        t0 = time.perf_counter()
        try:
            out = (await asyncio.to_thread(
                eng.generate, [ids], request.max_tokens, temperature=request.temperature, seed=request.seed,
                ignore_eos=request.ignore_eos, top_logprobs=request.top_logprobs,
                on_token=_text_pieces(eng, request.on_text) if request.on_text else None))[0]
        except ValueError as e:          # EngineError: too long, empty prompt, ...
            raise RunnerError(str(e)) from None
        text = eng.detokenize(out.token_ids)
        token_ids, finish = out.token_ids, out.finish_reason
        cut = first_stop(text, request.stop)
        if cut is not None:
            text, finish = text[:cut], "stop"
            token_ids = _tokens_within(eng, token_ids, text)
        top = None
        if request.top_logprobs:
            top = [{eng.detokenize([tid], skip_special=False): lp for tid, lp in step}
                   for step in out.top_logprobs[: max(1, len(token_ids))]]
        return GenerateResult(text=text, token_ids=token_ids, prompt_tokens=len(ids), output_tokens=len(token_ids),
                              finish_reason=finish, top_logprobs=top, token_times=out.token_times[: len(token_ids)],
                              timings={"wall_s": time.perf_counter() - t0}, sent_at=t0)

    @property
    def eos_token_id(self) -> int | None:
        return self._eng().eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return getattr(self._eng().config, "bos_token_id", None)

    def vocab_size(self) -> int | None:
        return self._eng().vocab_size

    def startup_note(self, run_dir: str | None) -> str:
        return f"loading the model {self.model_path} into the engine (device {self.device})"

    def declared_vocab_size(self) -> int | None:
        try:
            v = json.loads((self.model_path / "config.json").read_text(encoding="utf-8")).get("vocab_size")
        except (OSError, ValueError):
            return None
        return as_integer(v)

    def num_experts(self) -> int | None:
        return getattr(self._eng().config, "num_experts", None)

    def bos_policy(self) -> tuple[bool, int | None]:
        """From the engine's tokenizer (tokenizer_config's add_bos_token)."""
        tok = getattr(self._eng(), "tokenizer", None)
        if tok is None:
            return False, None
        return bool(getattr(tok, "add_bos", False)), getattr(tok, "bos_token_id", None)

    async def tokenize(self, text: str) -> list[int]:
        return self._eng().tokenize(text)

    async def detokenize(self, token_ids: list[int]) -> str:
        return self._eng().detokenize(token_ids)

    async def next_logprobs(self, token_ids: list[int]) -> dict[int, float]:
        """Log-probs of every vocabulary entry for the token after `token_ids` (one prefill, no lm_head
        over the whole prompt): exact multiple-choice scoring where top-k would miss a choice."""
        eng = self._eng()
        out = (await asyncio.to_thread(eng.generate, [token_ids], 1, temperature=0.0,
                                       top_logprobs=eng.vocab_size))[0]
        return dict(out.top_logprobs[0])

    async def choice_logprobs(self, prompt, choices):
        eng = self._eng()
        ids = prompt if isinstance(prompt, list) else eng.tokenize(prompt)
        dist = await self.next_logprobs(ids)
        out = {}
        for c in choices:
            t = eng.tokenize(c)
            out[c] = dist.get(t[0]) if len(t) == 1 else None
        return out, "exact"

    async def sampled_logprobs(self, prompt_ids: list[int], max_tokens: int, seed: int) -> tuple[list[int], list[float]]:
        """Sampled by the engine's own seeded generator (temperature 1, no truncation, EOS ignored); the
        log-probs from a teacher-forced pass over prompt + sample (the decode path's agree to ~5e-5)."""
        import torch
        eng = self._eng()
        ids = [int(t) for t in prompt_ids]
        try:
            out = (await asyncio.to_thread(eng.generate, [ids], max_tokens, temperature=1.0, seed=seed,
                                           ignore_eos=True))[0]
        except ValueError as e:
            raise RunnerError(str(e)) from None
        sample = list(out.token_ids)
        logits = await asyncio.to_thread(eng.logits, ids + sample)
        lp = torch.log_softmax(logits[len(ids) - 1:len(ids) - 1 + len(sample)].double(), dim=-1)
        return sample, lp[torch.arange(len(sample)), torch.tensor(sample)].tolist()

    async def logits(self, token_ids: list[int]):
        """[len, vocab] float32 next-token logits at every position (teacher forcing)."""
        return await asyncio.to_thread(self._eng().logits, token_ids)

    async def trace(self, token_ids: list[int], with_logits: bool = True):
        """Router traces (per layer top-k ids and weights) and, optionally, the logits in one pass."""
        return await asyncio.to_thread(self._eng().trace, token_ids, router_logits=False, with_logits=with_logits)


def _tokens_within(eng: Any, token_ids: list[int], text: str) -> list[int]:
    """The shortest prefix of the generated ids whose text covers the kept text."""
    for n in range(len(token_ids) + 1):
        if len(eng.detokenize(token_ids[:n])) >= len(text):
            return token_ids[:n]
    return token_ids
