"""The engine: load a checkpoint, score sequences, generate, trace the router.

    eng = Engine.load("models/tiny-moe", device="cpu", dtype="float32")
    eng.logits([1, 2, 3])                 # [3, vocab] float32 next-token logits (CPU)
    eng.generate([[1, 2, 3], [4, 5]], max_new_tokens=16)
    eng.trace([1, 2, 3])                  # RouterTrace: per MoE layer top-k ids / weights

Long inputs are processed in chunks of `prefill_chunk` tokens through the KV cache, so attention
never builds a [T, T] matrix for the whole input. Calls are serialised by a lock (one KV cache).
"""
from __future__ import annotations

import operator
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from .config import ModelConfig
from .decode_config import DecodeConfig, DecodeConfigError
from .loader import load_model, resolve_device, resolve_dtype
from .model import MoETransformer, RouterTracer
from .placement import collect_telemetry, counter_states, find_tiered, reset_telemetry, restore_counter_states
from .tokenizer import Tokenizer

DEFAULT_MAX_SEQ_LEN = 8192   # cap on the config's max_position_embeddings when none is given
KV_BUCKET = 256              # decode attends to a multiple of this many cache slots (few distinct shapes)


class EngineError(ValueError):
    """A request the engine cannot serve (too long, empty prompt, no tokenizer...)."""


@dataclass
class GenerationOutput:
    """One prompt's generation.

    token_ids: generated tokens, excluding the stop/EOS token that ended it (see `stop_token`).
    top_logprobs: per generated step (including a stop step), the `top_logprobs` most likely
        (token id, log-prob) of the model's distribution before temperature.
    finish_reason: "stop" (a stop/EOS id was produced) or "length" (max_new_tokens reached).
    token_times: time.perf_counter() offsets from the call's start at which each generated token
        (and a stop token) was known on the host.
    """

    token_ids: list[int]
    top_logprobs: list[list[tuple[int, float]]]
    finish_reason: str
    token_times: list[float]
    prompt_len: int
    stop_token: int | None = None


@dataclass
class RouterTrace:
    """Router decisions for one sequence, one entry per MoE layer (in layer order).

    layers: decoder layer index of each entry; topk_ids [T, k] int64; topk_weights [T, k] float32
    (after renormalisation where the model does it); router_logits [T, E] float32 or None.
    """

    layers: list[int]
    topk_ids: list[Tensor]
    topk_weights: list[Tensor]
    router_logits: list[Tensor] | None = None
    logits: Tensor | None = field(default=None, repr=False)   # [T, vocab] float32, when asked for


class TorchMemory:
    """torch's own peak memory per engine phase (load, prefill, decode, score), read from the CUDA
    caching allocator: peak allocated (tensors) and peak reserved (what the allocator holds from the
    driver, which NVML's "used" includes). Each `record(phase)` closes a phase: it keeps the phase's
    peaks (the largest over its repeats) and resets the allocator's peak counters. Host-side reads,
    no GPU sync. On the CPU torch keeps no such statistics: `peaks()` says so."""

    SOURCE = "torch.cuda.max_memory_allocated / max_memory_reserved (CUDA caching allocator)"

    def __init__(self, device: torch.device):
        self.device = device
        self.on = device.type == "cuda"
        self._peaks: dict[str, dict[str, int]] = {}

    def reset(self) -> None:
        if self.on:
            torch.cuda.reset_peak_memory_stats(self.device)

    def record(self, phase: str) -> None:
        if not self.on:
            return
        got = {"peak_allocated_bytes": int(torch.cuda.max_memory_allocated(self.device)),
               "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(self.device))}
        mine = self._peaks.setdefault(phase, {k: 0 for k in got})
        for k, v in got.items():
            mine[k] = max(mine[k], v)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peaks(self) -> dict:
        if not self.on:
            return {"available": False, "reason": f"torch keeps no allocator statistics on {self.device.type}"}
        phases = {k: dict(v) for k, v in self._peaks.items()}
        return {"available": True, "source": self.SOURCE, "phases": phases,
                "peak_allocated_bytes": max((v["peak_allocated_bytes"] for v in phases.values()), default=None),
                "peak_reserved_bytes": max((v["peak_reserved_bytes"] for v in phases.values()), default=None)}


class Engine:
    """One model, one KV cache, one frozen DecodeConfig (`decode`).

    The decode switches come either as `decode` (a DecodeConfig) or, for convenience, as the
    keyword arguments experts_impl, fused_ops, gemv_max_tokens, prefetch_host, int8_activations and
    prefetch_early (DecodeConfig's fields of those names); not both."""

    def __init__(self, model: MoETransformer, tokenizer: Tokenizer | None = None, *,
                 max_seq_len: int | None = None, max_batch: int = 1, prefill_chunk: int = 512,
                 cache_dtype: torch.dtype | None = None, cuda_graphs: bool = False,
                 decode: DecodeConfig | None = None, **decode_options):
        self.model = model
        self.config: ModelConfig = model.config
        self.tokenizer = tokenizer
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        if max_seq_len is None:
            max_seq_len = min(self.config.max_position_embeddings, DEFAULT_MAX_SEQ_LEN)
        if max_seq_len <= 0 or max_batch <= 0 or prefill_chunk <= 0:
            raise EngineError("max_seq_len, max_batch and prefill_chunk must be positive")
        self.max_seq_len, self.max_batch, self.prefill_chunk = max_seq_len, max_batch, prefill_chunk
        model.setup_caches(max_batch, max_seq_len, cache_dtype or self.dtype, self.device)
        self._lock = threading.Lock()
        # Opt-in: replay each decode step as a CUDA graph (one per batch size and KV bucket). Needs
        # experts modules without host syncs in decode (ExpertsModule.sync_free_tokens).
        self.cuda_graphs = bool(cuda_graphs) and self.device.type == "cuda"
        self._graphs: dict[tuple[int, int], _DecodeGraph] = {}
        self._graph_pool = None
        # per batch size: the (tokens, positions) every graph of that batch reads, so a greedy
        # step's graph feeds the next step whatever KV bucket that one runs in (_graph_step)
        self._graph_inputs: dict[int, tuple[Tensor, Tensor]] = {}
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # Decode one step ahead of the host on CUDA: step n+1 is queued before the host waits for
        # token n, so the host's per-token work (the token's copy and sync, bookkeeping, the next
        # launch) overlaps the GPU's step instead of leaving the GPU idle between steps. A finished
        # generation wastes the one step queued. Off by default on the CPU, where every op is
        # synchronous anyway.
        self.decode_ahead = self.device.type == "cuda"
        if decode is not None and decode_options:
            raise EngineError(f"give the decode settings as decode=DecodeConfig(...) or as keywords "
                              f"({', '.join(sorted(decode_options))}), not both")
        try:
            decode = decode if decode is not None else DecodeConfig(**decode_options)
        except TypeError as err:
            raise EngineError(f"Engine: {err}") from None
        except DecodeConfigError as err:
            raise EngineError(str(err)) from None
        self.torch_memory = TorchMemory(self.device)
        self.decode_steps = 0              # decode steps run (graph replays included)
        self.decode: DecodeConfig = decode
        self.reconfigure(decode)

    def reconfigure(self, decode: DecodeConfig) -> None:
        """Decode with `decode` from now on; drops the captured graphs, which hold the old config's
        launches. A resolved config (the engine runner resolves its own, once) is taken as it is;
        one with device defaults still open (built by hand, or from keywords) is resolved here for
        this engine's device."""
        if not decode.is_resolved:
            decode = decode.resolved(self.device.type)
        impl = decode.experts_impl
        if impl == "triton" or decode.fused_decode:
            from . import kernels
            if not kernels.available():
                raise EngineError(f"experts_impl {impl!r} / fused_ops need Triton, which does not run here")
        if impl == "grouped_mm" and not hasattr(torch.nn.functional, "grouped_mm"):
            raise EngineError(f"experts_impl 'grouped_mm' needs torch.nn.functional.grouped_mm "
                              f"(torch {torch.__version__} lacks it)")
        self.decode = decode
        self.model.configure(decode)
        self._graphs.clear()

    def identity(self) -> dict:
        """What decides how this engine decodes, for a run manifest's build identity."""
        return {"decode": self.decode.identity(), "cuda_graphs": self.cuda_graphs, "decode_ahead": self.decode_ahead}

    @classmethod
    def load(cls, path: str | Path, device: str = "cpu", dtype: str = "float32",
             max_seq_len: int | None = None, max_batch: int = 1, prefill_chunk: int = 512,
             cuda_graphs: bool = False, decode: DecodeConfig | None = None, **decode_options) -> "Engine":
        """Load a Hugging Face checkpoint directory (or a tiered artifact holding plan.json); decode
        settings as in Engine()."""
        path = Path(path)
        memory = TorchMemory(torch.device(resolve_device(device)))
        memory.reset()
        cfg = ModelConfig.from_pretrained(path)
        model = load_model(path, resolve_device(device), resolve_dtype(dtype), config=cfg)
        tok = None
        if (path / "tokenizer.json").is_file():
            tok = Tokenizer.from_dir(path, cfg.bos_token_id, cfg.eos_token_ids)
        eng = cls(model, tok, max_seq_len=max_seq_len, max_batch=max_batch, prefill_chunk=prefill_chunk,
                  cuda_graphs=cuda_graphs, decode=decode, **decode_options)
        eng.torch_memory.record("load")
        return eng

    # ---- what the engine measured about itself ----
    def telemetry(self) -> dict:
        """torch memory per phase, decode steps, and (tiered models) the tier counters per layer and
        in total (see placement.COUNTERS). Reads device counters: one host sync."""
        with self._lock:
            out = {"torch_memory": self.torch_memory.peaks(), "decode_steps": self.decode_steps}
            if find_tiered(self.model):
                out["tiers"] = collect_telemetry(self.model)
            return out

    def reset_telemetry(self) -> None:
        """Zero the tier counters and the step count (torch's memory peaks are kept: they are real)."""
        with self._lock:
            reset_telemetry(self.model)
            self.decode_steps = 0

    # ---- properties the runner reads ----
    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        if self.tokenizer is not None and self.tokenizer.eos_token_ids:
            return self.tokenizer.eos_token_ids
        return self.config.eos_token_ids

    @property
    def eos_token_id(self) -> int | None:
        ids = self.eos_token_ids
        return ids[0] if ids else None

    # ---- text ----
    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        return self._tok().encode(text, add_special=add_special)

    def detokenize(self, ids: list[int], skip_special: bool = True) -> str:
        return self._tok().decode(ids, skip_special=skip_special)

    def _tok(self) -> Tokenizer:
        if self.tokenizer is None:
            raise EngineError("this model directory has no tokenizer.json: pass token ids instead of text")
        return self.tokenizer

    # ---- scoring ----
    @torch.inference_mode()
    def logits(self, token_ids: list[int]) -> Tensor:
        """Next-token logits at every position: [len, vocab] float32 on the CPU."""
        with self._lock:
            return self._score(token_ids, tracer=None)

    @torch.inference_mode()
    def trace(self, token_ids: list[int], router_logits: bool = True, with_logits: bool = False) -> RouterTrace:
        """Run the sequence and return each MoE layer's routing (and, optionally, the logits)."""
        with self._lock:
            tracer = RouterTracer(keep_logits=router_logits)
            self.model.set_tracer(tracer)
            try:
                logits = self._score(token_ids, tracer=tracer, need_logits=with_logits)
            finally:
                self.model.set_tracer(None)
        by_layer: dict[int, list] = {}
        for layer, ids, w in tracer.records:   # chunks arrive in order: concatenate per layer
            by_layer.setdefault(layer, [[], []])
            by_layer[layer][0].append(ids)
            by_layer[layer][1].append(w)
        layers = sorted(by_layer)
        rl = None
        if router_logits:
            per: dict[int, list[Tensor]] = {}
            for layer, lg in tracer.logits:
                per.setdefault(layer, []).append(lg)
            rl = [torch.cat(per[i]) for i in layers]
        return RouterTrace(layers=layers, topk_ids=[torch.cat(by_layer[i][0]) for i in layers],
                           topk_weights=[torch.cat(by_layer[i][1]).float() for i in layers],
                           router_logits=rl, logits=logits if with_logits else None)

    def _score(self, token_ids: list[int], tracer, need_logits: bool = True) -> Tensor | None:
        ids = self._check_ids(token_ids, "token_ids")
        if len(ids) > self.max_seq_len:
            raise EngineError(f"sequence of {len(ids)} tokens exceeds max_seq_len {self.max_seq_len}")
        tokens = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = []
        for s, e, kv_len in self._prefill_chunks(len(ids), rows=1):
            pos = torch.arange(s, e, device=self.device)[None, :]
            h = self.model(tokens[:, s:e], pos, kv_len=kv_len, causal_tail=True)
            if need_logits:
                out.append(self.model.logits(h[0]).cpu())
        self.torch_memory.record("score")
        return torch.cat(out) if need_logits else None

    # ---- generation ----
    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                 seed: int | None = None, stop_ids: list[int] | None = None, ignore_eos: bool = False,
                 top_logprobs: int = 0,
                 on_token: Callable[[int, int], None] | None = None) -> list[GenerationOutput]:
        """Generate for each prompt (token ids). Greedy when temperature <= 0, else sampled with a
        torch.Generator seeded from `seed` (a fresh random seed when None). Prompts beyond
        `max_batch` run in successive batches. `on_token(prompt_index, token_id)` is called as
        each token is known (not for the stop token)."""
        if max_new_tokens < 0:
            raise EngineError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        prompts = [self._check_ids(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        for i, p in enumerate(prompts):
            if not p:
                raise EngineError(f"prompts[{i}] is empty: at least one token is needed")
            if len(p) + max_new_tokens > self.max_seq_len:
                raise EngineError(f"prompts[{i}]: {len(p)} prompt tokens + {max_new_tokens} new tokens "
                                  f"exceed max_seq_len {self.max_seq_len}")
        stops = set(stop_ids or ())
        if not ignore_eos:
            stops |= set(self.eos_token_ids)
        gen = torch.Generator(device=self.device)
        if seed is None:
            gen.seed()
        else:
            gen.manual_seed(seed)
        results: list[GenerationOutput] = []
        with self._lock:
            for start in range(0, len(prompts), self.max_batch):
                batch = prompts[start:start + self.max_batch]
                cb = None
                if on_token is not None:
                    cb = (lambda off: (lambda i, t: on_token(off + i, t)))(start)
                results += self._generate_batch(batch, max_new_tokens, temperature, gen, stops,
                                                top_logprobs, cb)
        return results

    def _generate_batch(self, prompts, max_new, temperature, gen, stops, n_top, on_token):
        t0 = time.perf_counter()
        B = len(prompts)
        lens = [len(p) for p in prompts]
        outs = [GenerationOutput([], [], "length", [], n) for n in lens]
        if max_new == 0:
            return outs
        done = [False] * B
        cur = torch.zeros(B, 1, dtype=torch.long, device=self.device)
        base_pos = torch.tensor(lens, dtype=torch.long).view(B, 1).to(self.device)
        ahead = self.decode_ahead

        greedy = temperature <= 0

        def pick(logits: Tensor, graph_ids: Tensor | None = None):
            """Sample from logits on the device (greedy: a graph's own pick, graph_ids, where there
            is one) and start copying the picks (and top log-probs) to the host; returns (device
            ids, host copies, event marking the copies' end, whether a graph fed the next step)."""
            fed = greedy and graph_ids is not None
            ids = graph_ids if fed else self._sample(logits, temperature, gen)
            outs_dev = [ids] + (list(torch.topk(torch.log_softmax(logits, dim=-1), n_top, dim=-1))
                                if n_top > 0 else [])
            if self.device.type != "cuda":
                return ids, [t.cpu() for t in outs_dev], None, fed
            host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in outs_dev]
            event = torch.cuda.Event()
            if fed and n_top == 0:
                # A graph's own picks: copied on a side stream, so the next step's graph starts
                # without waiting for the copy. The graph after it writes the other row of picks,
                # and the one after that is queued only once the host has waited for this copy.
                done = torch.cuda.Event()
                done.record()
                self._copy_stream.wait_event(done)
                with torch.cuda.stream(self._copy_stream):
                    host[0].copy_(ids, non_blocking=True)
                    event.record()
                return ids, host, event, fed
            for h, t in zip(host, outs_dev):
                h.copy_(t, non_blocking=True)
            event.record()
            return ids, host, event, fed

        def queue_step(step: int, ids: Tensor, fed: bool):
            # Every row decodes (finished ones too: static shapes); row b writes slot lens[b] + step.
            # fed: the step before ran as a graph and left this step's tokens and positions in the
            # graphs' inputs (greedy), so nothing is copied in.
            self.decode_steps += 1
            kv_len = self._kv_len(max(lens) + step + 1)
            if fed:
                return pick(*self._decode(None, None, kv_len, batch=B, first_position=lens[0] + step))
            cur.copy_(ids.view(B, 1))
            return pick(*self._decode(cur, base_pos + step, kv_len, first_position=lens[0] + step))

        nxt = pick(self._prefill(prompts))                               # [B, V] float32 logits
        self.torch_memory.record("prefill")
        for step in range(max_new):
            ids, host, event, fed = nxt
            last = step == max_new - 1
            # The GPU runs step n+1 while the host takes token n, unless step n+1 first captures its
            # graph: the capture runs on the host, and token n (the first token, after a prefill)
            # is read before it rather than after.
            queued = ahead and not last and self._graph_ready(B, self._kv_len(max(lens) + step + 1))
            if queued:
                nxt = queue_step(step, ids, fed)
            if event is not None:
                event.synchronize()                  # one host sync per step, off the GPU's path
            host_ids = host[0].tolist()
            if n_top > 0:
                top_v, top_i = host[1].tolist(), host[2].tolist()
            now = time.perf_counter() - t0
            for b in range(B):
                if done[b]:
                    continue
                tok = host_ids[b]
                outs[b].token_times.append(now)
                if n_top > 0:
                    outs[b].top_logprobs.append(list(zip(top_i[b], top_v[b])))
                if tok in stops:
                    outs[b].finish_reason, outs[b].stop_token, done[b] = "stop", tok, True
                    continue
                outs[b].token_ids.append(tok)
                if on_token is not None:
                    on_token(b, tok)
            if all(done) or last:
                break
            if not queued:
                nxt = queue_step(step, ids, fed)
        self.torch_memory.record("decode")
        return outs

    def _decode(self, tokens: Tensor | None, positions: Tensor | None, kv_len: int,
                batch: int | None = None, first_position: int | None = None) -> tuple[Tensor, Tensor | None]:
        """One decode step for [B, 1] tokens -> ([B, vocab] float32 logits, the greedy picks [B]
        where the step ran as a CUDA graph and first_position (row 0's position) is given, else
        None). tokens and positions None: a graph step whose inputs the step before fed (the
        picks and positions + 1); batch then gives B."""
        B = tokens.shape[0] if tokens is not None else batch
        mode = self.graph_mode(B)
        if mode is not None:
            graph = self._graphs.get((B, kv_len))
            if graph is None:
                if self._graph_pool is None:
                    self._graph_pool = torch.cuda.graph_pool_handle()
                inputs = self._graph_inputs.get(B)
                if inputs is None:
                    inputs = self._graph_inputs[B] = (torch.zeros(B, 1, dtype=torch.long, device=self.device),
                                                      torch.zeros(B, 1, dtype=torch.long, device=self.device))
                # the warm-up and capture runs are no user's work: keep them out of the tier counters
                counters = counter_states(self.model)
                kind = _DecodeGraph if mode == "whole" else _SegmentedGraph
                graph = self._graphs[(B, kv_len)] = kind(self.model, inputs, kv_len, self._graph_pool)
                restore_counter_states(self.model, counters)
            logits, picks = graph.run(tokens, positions)
            return logits, (picks[first_position % 2] if first_position is not None else None)
        if tokens is None:
            raise EngineError("a fed decode step needs CUDA graphs (the graphs feed their inputs)")
        h = self.model(tokens, positions, kv_len)
        return self.model.logits(h[:, -1], decode=True), None

    def graph_mode(self, batch: int = 1) -> str | None:
        """How a decode step of `batch` rows runs as CUDA graphs: "whole" (one graph: every experts
        module is sync-free for it), "segmented" (one graph per stretch between the host syncs of
        layers on the fused SSD path: ExpertsModule.segment_tokens), or None (eager)."""
        if not self.cuda_graphs:
            return None
        if batch <= self._graph_batch_limit():
            return "whole"
        limits = [b.experts.segment_tokens() for b in self.model.moe_blocks()]
        return "segmented" if batch <= min(limits, default=0) else None

    def _graph_ready(self, batch: int, kv_len: int) -> bool:
        """Whether a decode step of `batch` rows over kv_len slots runs without capturing a graph."""
        return (batch, kv_len) in self._graphs or self.graph_mode(batch) is None

    def _graph_batch_limit(self) -> int:
        """Largest decode batch every experts module runs without host syncs (0: none declared)."""
        limits = [b.experts.sync_free_tokens() for b in self.model.moe_blocks()]
        return min(limits, default=1 << 30)

    def _prefill(self, prompts: list[list[int]]) -> Tensor:
        """Run right-padded prompts through the cache in chunks; logits of each row's last token."""
        B, lens = len(prompts), [len(p) for p in prompts]
        T = max(lens)
        pad = self.config.pad_token_id if self.config.pad_token_id is not None else 0
        tokens = torch.tensor([p + [pad] * (T - len(p)) for p in prompts], dtype=torch.long,
                              device=self.device)
        last_h = torch.empty(B, self.config.hidden_size, dtype=self.dtype, device=self.device)
        for s, e, kv_len in self._prefill_chunks(T, rows=B):
            pos = torch.arange(s, e, device=self.device)[None, :].expand(B, -1)
            h = self.model(tokens[:, s:e], pos, kv_len=kv_len, causal_tail=True)
            for b, n in enumerate(lens):
                if s <= n - 1 < e:
                    last_h[b] = h[b, n - 1 - s]
        return self.model.logits(last_h)

    @staticmethod
    def _sample(logits: Tensor, temperature: float, gen: torch.Generator) -> Tensor:
        if temperature <= 0:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=gen).squeeze(-1)

    def _kv_len(self, needed: int) -> int:
        return min(self.max_seq_len, -(-needed // KV_BUCKET) * KV_BUCKET)

    def _prefill_chunks(self, n: int, rows: int) -> list[tuple[int, int, int]]:
        """A prompt of n tokens (in each of `rows` rows) as prefill chunks (s, e, kv_len) of
        prefill_chunk tokens. A last chunk small enough for the fused decode kernels joins the one
        before: those kernels take a chunk's token count and context as launch shapes decode never
        used (Triton compiles them anew, up to a second), and flash attention over the longer chunk
        builds nothing. A chunk still that small (a prompt that short) masks by position, so it
        attends over the decode steps' bucketed kv_len (Triton specialises integer arguments such
        as an exact kv_len); the others attend over exactly [0, e)."""
        small = self.model.decode.fused_tokens
        bounds = [(s, min(n, s + self.prefill_chunk)) for s in range(0, n, self.prefill_chunk)]
        if len(bounds) > 1 and rows * (n - bounds[-1][0]) <= small:
            bounds[-2:] = [(bounds[-2][0], n)]
        return [(s, e, self._kv_len(e) if rows * (e - s) <= small else e) for s, e in bounds]

    def _check_ids(self, ids, what: str) -> list[int]:
        V = self.config.vocab_size
        out = []
        for i, t in enumerate(ids):
            try:
                t = operator.index(t)   # ints, numpy ints, 0-d integer tensors
            except TypeError:
                t = None
            if t is None or isinstance(t, bool) or not 0 <= t < V:
                raise EngineError(f"{what}[{i}] = {ids[i]!r}: expected a token id in [0, {V})")
            out.append(t)
        return out


def _graph_step(model: MoETransformer, tokens: Tensor, positions: Tensor, kv_len: int,
                keys: Tensor | None, picks: Tensor) -> Tensor:
    """What a decode graph runs: the step's logits [B, V] (returned), then its greedy picks, to row
    positions[0] % 2 of picks [2, B] and to the tokens input, and the positions moved on by one, so
    a greedy generation's next step needs no copies in (the engine copies its own picks and
    positions in where it samples). keys (greedy_pick.empty_keys, where the logits run on the
    lm_head GEMV): the GEMV folds the picks into them and one launch feeds the next step; else
    torch's argmax, copies and add."""
    h = model(tokens, positions, kv_len)[:, -1]
    if keys is not None:
        from . import kernels
        logits = model.logits(h, decode=True, pick_keys=keys)
        kernels.feed_next_step(keys, tokens, positions, picks, cfg=model.decode)
        return logits
    logits = model.logits(h, decode=True)
    ids = logits.argmax(dim=-1)
    row = torch.arange(2, device=picks.device) == positions[0, 0] % 2        # no host sync: capturable
    picks.copy_(torch.where(row[:, None], ids[None, :], picks))
    tokens.copy_(ids.view_as(tokens))
    positions.add_(1)
    return logits


def _warmed_inputs(model: MoETransformer, inputs: tuple[Tensor, Tensor], kv_len: int):
    """(tokens, positions, pick keys or None, picks, side stream): a graph's inputs (the engine's per
    batch size), its own pick keys and picks [2, B], after two warm-up steps run on a side stream
    (as CUDA graph capture asks: every kernel compiled); the caller orders its stream after that
    one. The inputs' values are kept: a bucket's graph can be captured between two steps of a
    generation, after the step before fed them."""
    tokens, positions = inputs
    device = tokens.device
    picks = torch.zeros(2, tokens.shape[0], dtype=torch.long, device=device)
    keys = None
    if model.gemv_logits(tokens.shape[0]):
        from .kernels.greedy_pick import empty_keys
        keys = empty_keys(tokens.shape[0], device)      # each step's feed leaves them empty again
    saved = (tokens.clone(), positions.clone())
    # Warm-up writes K/V at the last cache slot, which any row overwrites before it can read it.
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            tokens.zero_()
            positions.fill_(model.max_seq_len - 1)          # each step's feed moves it on
            _graph_step(model, tokens, positions, kv_len, keys, picks)
    torch.cuda.current_stream(device).wait_stream(stream)
    tokens.copy_(saved[0])
    positions.copy_(saved[1])
    stream.wait_stream(torch.cuda.current_stream(device))
    return tokens, positions, keys, picks, stream


class _DecodeGraph:
    """A captured decode step for a fixed batch size and KV length: copy inputs in (unless the step
    before fed them), replay."""

    def __init__(self, model: MoETransformer, inputs: tuple[Tensor, Tensor], kv_len: int, pool):
        self.tokens, self.positions, self.keys, self.picks, stream = _warmed_inputs(model, inputs, kv_len)
        torch.cuda.current_stream(self.tokens.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):      # records only: the inputs keep their values
            self.logits = _graph_step(model, self.tokens, self.positions, kv_len, self.keys, self.picks)

    def run(self, tokens: Tensor | None, positions: Tensor | None) -> tuple[Tensor, Tensor]:
        if tokens is not None:
            self.tokens.copy_(tokens)
            self.positions.copy_(positions)
        self.graph.replay()
        return self.logits, self.picks


class _SegmentedGraph:
    """A decode step captured as a chain of CUDA graphs, cut where a layer on the fused SSD path
    needs its routing on the host (placement.TieredExperts.segment_with): replaying a graph, then
    syncing and running that layer's host part (start the guessed reads captured in the graph,
    fill the slots, copy the slot map), then the next graph. The graphs share one memory pool and
    replay in capture order, so tensors made in one and read by a later one stay valid."""

    def __init__(self, model: MoETransformer, inputs: tuple[Tensor, Tensor], kv_len: int, pool):
        self.pool = pool
        self.tokens, self.positions, self.keys, self.picks, stream = _warmed_inputs(model, inputs, kv_len)
        stream.synchronize()
        self.graphs: list = []
        self.after: list = []          # per graph: (guessing slot stacks, host part or None)
        mods = find_tiered(model)
        for m in mods:
            m.segment_with(self)
        try:
            with torch.cuda.stream(stream):
                self._begin()
                self.logits = _graph_step(model, self.tokens, self.positions, kv_len, self.keys, self.picks)
                self._close(None)
        finally:
            for m in mods:
                m.segment_with(None)
        torch.cuda.current_stream(self.tokens.device).wait_stream(stream)

    def _begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._guesses: list = []
        # thread_local: the SSD tier's reader threads allocate pinned buffers while this captures
        self._graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")

    def _close(self, host) -> None:
        self._graph.capture_end()
        self.graphs.append(self._graph)
        self.after.append((self._guesses, host))

    def cut(self, host) -> None:
        """End the graph being captured (`host` runs after its replay) and begin the next."""
        self._close(host)
        self._begin()

    def add_guess(self, slots) -> None:
        """A guess captured in the current graph: its reads start after the graph's replay."""
        self._guesses.append(slots)

    def run(self, tokens: Tensor | None, positions: Tensor | None) -> tuple[Tensor, Tensor]:
        if tokens is not None:
            self.tokens.copy_(tokens)
            self.positions.copy_(positions)
        for graph, (guesses, host) in zip(self.graphs, self.after):
            graph.replay()
            if host is None and not guesses:
                continue
            event = torch.cuda.Event()
            event.record()
            event.synchronize()
            for slots in guesses:
                slots.start_guessed_reads()
            if host is not None:
                host()
        return self.logits, self.picks
