"""Expert tiering in three steps, with a file between each:

  calibrate(engine, token_batches) -> CalibrationStats   (.save / .load: one safetensors file)
  plan(stats, weights, budgets, ladder) -> Plan          (.save / .load: JSON)
      or plan_hot_cold(stats, hot_fraction, hot, cold)   (the rule-based planner for the demo)
  pack(checkpoint_dir, plan, out_dir)                    (the tiered artifact directory)
  load_tiered(path, model, device, dtype)                (the engine loader's hook for plan.json)

The artifact directory holds config.json and the tokenizer files (copied), `model.safetensors` (the
non-expert weights under their Hugging Face names), `experts.safetensors` (packed experts, tensors
named `layers.{l}.experts.{e}.{gate|up|down}.{part}`) and `plan.json`; when the plan puts experts on
"ssd", those experts are in `experts.ssd` instead (one aligned record each: ssd.py), not in
experts.safetensors.
"""
from __future__ import annotations

import heapq
import json
import math
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from .expert_names import parse_expert_name
from .placement import HOMES, TieredExperts
from .quant import QuantizedTensor, format_nbytes, parse_format, quantize
from .quantized_expert import QuantizedExpert
from .ssd import READ_CHUNK_BYTES, READ_THREADS

__all__ = ["calibrate", "plan", "plan_hot_cold", "pack", "load_tiered", "open_disk_tier", "read_experts", "measure_errors",
           "weights_from_checkpoint", "expert_nbytes", "CalibrationStats", "Plan", "Budgets", "TieringError"]

PLAN_FORMAT = "moebench-tiered-plan"
PLAN_VERSION = 1
MATRICES = ("gate", "up", "down")


class TieringError(ValueError):
    """Bad stats, plan, budget or checkpoint for tiering; the message names the file/key."""


# ================================================================================================
# Step 1: calibration

@dataclass
class CalibrationStats:
    """What a corpus run through the bf16 engine tells about each expert.

    layers: decoder layer index of each MoE layer (row l of every tensor below is layers[l]).
    counts [L, E] int64: how many (token, rank) selections each expert got.
    imatrix_in [L, E, H] float64: sum over routed tokens of x^2 per input channel of gate/up
        (llama.cpp's imatrix, per expert).
    imatrix_mid [L, E, I] float64: the same for the down projection's input silu(gate x) * up x.
    samples [L, E, S, H] float32: up to S real inputs per expert (a uniform reservoir sample);
        sample_count [L, E] says how many rows of each are filled.
    """

    layers: list[int]
    num_experts: int
    top_k: int
    tokens: int
    counts: torch.Tensor
    imatrix_in: torch.Tensor
    imatrix_mid: torch.Tensor
    samples: torch.Tensor
    sample_count: torch.Tensor
    meta: dict[str, Any] = field(default_factory=dict)

    def usage_share(self) -> torch.Tensor:
        """[L, E]: share of each layer's routed (token, rank) pairs taken by each expert."""
        total = self.counts.sum(dim=1, keepdim=True).clamp_min(1)
        return self.counts.double() / total

    def save(self, path: str | Path) -> None:
        tensors = {"counts": self.counts, "imatrix_in": self.imatrix_in, "imatrix_mid": self.imatrix_mid,
                   "samples": self.samples, "sample_count": self.sample_count}
        header = {"layers": self.layers, "num_experts": self.num_experts, "top_k": self.top_k,
                  "tokens": self.tokens, "meta": self.meta}
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path),
                  metadata={"format": "moebench-calibration", "version": "1",
                            "header": json.dumps(header, allow_nan=False)})

    @classmethod
    def load(cls, path: str | Path) -> "CalibrationStats":
        path = Path(path)
        if not path.is_file():
            raise TieringError(f"{path}: no calibration file")
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
            if meta.get("format") != "moebench-calibration":
                raise TieringError(f"{path}: not a calibration file (metadata 'format' is "
                                   f"{meta.get('format')!r}, expected 'moebench-calibration')")
            header = json.loads(meta["header"])
            t = {k: f.get_tensor(k) for k in ("counts", "imatrix_in", "imatrix_mid", "samples", "sample_count")}
        return cls(layers=list(header["layers"]), num_experts=int(header["num_experts"]),
                   top_k=int(header["top_k"]), tokens=int(header["tokens"]), meta=header.get("meta", {}), **t)


def _moe_blocks(model) -> list:
    """The model's MoE blocks (objects with .layer_idx and .experts)."""
    if hasattr(model, "moe_blocks"):
        return list(model.moe_blocks())
    return [m for m in model.modules() if hasattr(m, "experts") and hasattr(m, "layer_idx")]


@torch.no_grad()
def calibrate(engine, token_batches: Iterable, samples_per_expert: int = 32, seed: int = 0) -> CalibrationStats:
    """Run `token_batches` (each a sequence of token ids: list[int] or a 1-D LongTensor) through
    `engine.logits(ids)` and collect per-expert usage, imatrix sums and input samples.

    The engine must hold dense experts (w_gate/w_up/w_down), i.e. a plain bf16 checkpoint: the down
    projection's input is recomputed from the expert's own gate/up weights.
    """
    model = engine.model
    blocks = _moe_blocks(model)
    if not blocks:
        raise TieringError("calibrate: the engine's model has no MoE layers")
    for b in blocks:
        if not all(hasattr(b.experts, w) for w in ("w_gate", "w_up", "w_down")):
            raise TieringError(f"calibrate: layer {b.layer_idx} experts are {type(b.experts).__name__}, "
                               f"not dense stacked Experts; calibrate on the unquantized checkpoint")
    E, I, H = blocks[0].experts.w_gate.shape
    L, S = len(blocks), samples_per_expert
    counts = torch.zeros(L, E, dtype=torch.int64)
    imat_in = torch.zeros(L, E, H, dtype=torch.float64)
    imat_mid = torch.zeros(L, E, I, dtype=torch.float64)
    samples = torch.zeros(L, E, S, H, dtype=torch.float32)
    seen = torch.zeros(L, E, dtype=torch.int64)   # rows offered to each reservoir
    gen = torch.Generator().manual_seed(seed)
    top_k = [0]

    def make_hook(l: int):
        def hook(module, args):
            x, topk_ids = args[0], args[1]
            top_k[0] = topk_ids.shape[1]
            xf = x.float()
            ids = topk_ids.cpu()
            for e in torch.unique(ids).tolist():
                rows = (ids == e).any(dim=1).nonzero(as_tuple=True)[0]
                n_sel = int((ids == e).sum())
                xe = xf[rows.to(x.device)]
                wg, wu = module.w_gate[e].float(), module.w_up[e].float()
                mid = F.silu(xe @ wg.T) * (xe @ wu.T)
                counts[l, e] += n_sel
                imat_in[l, e] += (xe ** 2).sum(0).double().cpu()
                imat_mid[l, e] += (mid ** 2).sum(0).double().cpu()
                _reservoir(samples[l, e], seen, l, e, xe.cpu(), gen)
        return hook

    handles = [b.experts.register_forward_pre_hook(make_hook(l)) for l, b in enumerate(blocks)]
    tokens = 0
    try:
        for batch in token_batches:
            ids = batch.tolist() if isinstance(batch, torch.Tensor) else list(batch)
            if not ids:
                continue
            engine.logits(ids)
            tokens += len(ids)
    finally:
        for h in handles:
            h.remove()
    if tokens == 0:
        raise TieringError("calibrate: token_batches gave no tokens")
    return CalibrationStats(layers=[b.layer_idx for b in blocks], num_experts=E, top_k=top_k[0],
                            tokens=tokens, counts=counts, imatrix_in=imat_in, imatrix_mid=imat_mid,
                            samples=samples, sample_count=seen.clamp(max=S))


def _reservoir(buf: torch.Tensor, seen: torch.Tensor, l: int, e: int, rows: torch.Tensor,
               gen: torch.Generator) -> None:
    """Algorithm R, vectorised over a batch of rows: the i-th row ever offered (0-based) fills slot i
    while i < S, afterwards replaces a uniform slot j in [0, i] when j < S (kept with prob. S/(i+1))."""
    S, m = buf.shape[0], rows.shape[0]
    n0 = int(seen[l, e])
    index = torch.arange(n0, n0 + m)
    slot = torch.where(index < S, index,
                       (torch.rand(m, generator=gen, dtype=torch.float64) * (index + 1)).long())
    keep = slot < S
    # Later rows win a shared slot, as in the sequential algorithm: write in order, last write kept.
    for i in keep.nonzero(as_tuple=True)[0].tolist():
        buf[int(slot[i])] = rows[i]
    seen[l, e] += m


# ================================================================================================
# Expert weights, from a checkpoint directory, a model or a dict


WeightSource = Callable[[int, int], "tuple[torch.Tensor, torch.Tensor, torch.Tensor]"]


def _checkpoint_files(ckpt: Path) -> list[Path]:
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [ckpt / n for n in names]
    files = sorted(ckpt.glob("*.safetensors"))
    if not files:
        raise TieringError(f"{ckpt}: no *.safetensors files (expected a Hugging Face checkpoint directory)")
    return files


def _index_experts(ckpt: Path) -> dict[tuple[int, int, str], tuple[Path, str, slice | None]]:
    """(layer, expert, matrix) -> (file, tensor name, None) or, for fused stacks, the expert index."""
    where: dict = {}
    for file in _checkpoint_files(ckpt):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                t = parse_expert_name(name)
                if t is None:
                    continue
                if not t.fused:
                    where[(t.layer, t.expert, t.matrices[0])] = (file, name, None)
                    continue
                n_exp = f.get_slice(name).get_shape()[0]
                for e in range(n_exp):
                    for mat in t.matrices:
                        where[(t.layer, e, mat)] = (file, name, e)
    return where


def _read_matrix(entry, matrix: str) -> torch.Tensor:
    file, name, e = entry
    with safe_open(str(file), "pt") as f:
        if e is None:
            return f.get_tensor(name)
        t = f.get_slice(name)[e]
        if name.endswith("gate_up_proj"):   # [2I, H]: gate rows first, then up
            half = t.shape[0] // 2
            t = t[:half] if matrix == "gate" else t[half:]
        return t


def weights_from_checkpoint(ckpt: str | Path) -> WeightSource:
    """A (layer, expert) -> (gate [I,H], up [I,H], down [H,I]) reader that opens the checkpoint's
    safetensors lazily, one tensor at a time."""
    ckpt = Path(ckpt)
    where = _index_experts(ckpt)

    def get(layer: int, expert: int):
        out = []
        for mat in MATRICES:
            if (layer, expert, mat) not in where:
                raise TieringError(f"{ckpt}: no {mat} weight for layer {layer} expert {expert}")
            out.append(_read_matrix(where[(layer, expert, mat)], mat))
        return tuple(out)
    return get


def _weight_source(weights) -> WeightSource:
    if isinstance(weights, (str, Path)):
        return weights_from_checkpoint(weights)
    if callable(weights) and not isinstance(weights, torch.nn.Module):
        return weights
    if isinstance(weights, dict):
        return lambda l, e: tuple(weights[l][i][e] for i in range(3))
    model = getattr(weights, "model", weights)   # an Engine or a model
    by_layer = {b.layer_idx: b.experts for b in _moe_blocks(model)}
    return lambda l, e: (by_layer[l].w_gate[e], by_layer[l].w_up[e], by_layer[l].w_down[e])


# ================================================================================================
# Step 2: planning

@dataclass
class Budgets:
    """Byte budgets for expert weights: resident on the compute device, in host RAM, and on local
    disk (the SSD tier; 0: no expert goes to disk)."""

    gpu_bytes: int
    host_bytes: int
    ssd_bytes: int = 0


@dataclass
class Plan:
    """A precision and a home for every expert of every MoE layer.

    precision[l][e] is a quant format name (see quant.py); home[l][e] is "gpu", "host" or "ssd".
    cache_slots / skip_tail_from are the runtime settings TieredExperts gets by default.
    The SSD tier's runtime settings (written to plan.json only when some expert is on ssd):
    ssd_cache_bytes: the host-RAM LRU cache in front of the pack file, in bytes; ssd_threads: reader
    threads; ssd_chunk_bytes: the size a record's read is split into, read by several threads at
    once (0: one read per record); ssd_direct: O_DIRECT reads (None: where the filesystem allows,
    else buffered); ssd_verify: check every record's CRC-32 as it is read.
    info: what the planner knew and decided (budgets, ladder, bytes per tier, expected error).
    """

    layers: list[int]
    precision: list[list[str]]
    home: list[list[str]]
    cache_slots: int = 2
    skip_tail_from: int | None = None
    info: dict[str, Any] = field(default_factory=dict)
    ssd_cache_bytes: int = 0
    ssd_threads: int = READ_THREADS
    ssd_direct: bool | None = None
    ssd_verify: bool = False
    ssd_chunk_bytes: int = READ_CHUNK_BYTES

    @property
    def has_ssd(self) -> bool:
        return any(h == "ssd" for row in self.home for h in row)

    def to_json(self) -> dict[str, Any]:
        runtime: dict[str, Any] = {"cache_slots": self.cache_slots, "skip_tail_from": self.skip_tail_from}
        if self.has_ssd:
            runtime.update(ssd_cache_bytes=self.ssd_cache_bytes, ssd_threads=self.ssd_threads,
                           ssd_chunk_bytes=self.ssd_chunk_bytes,
                           ssd_direct=self.ssd_direct, ssd_verify=self.ssd_verify)
        return {"format": PLAN_FORMAT, "version": PLAN_VERSION,
                "runtime": runtime,
                "layers": {str(l): {"precision": p, "home": h}
                           for l, p, h in zip(self.layers, self.precision, self.home)},
                "info": self.info}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1, allow_nan=False) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        path = Path(path)
        if path.is_dir():
            path = path / "plan.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise TieringError(f"{path}: no plan file") from None
        except json.JSONDecodeError as e:
            raise TieringError(f"{path}: not valid JSON ({e})") from e
        return cls.from_json(data, source=str(path))

    @classmethod
    def from_json(cls, data: dict[str, Any], source: str = "plan.json") -> "Plan":
        if data.get("format") != PLAN_FORMAT:
            raise TieringError(f"{source}: key 'format' is {data.get('format')!r}; expected {PLAN_FORMAT!r}")
        if data.get("version") != PLAN_VERSION:
            raise TieringError(f"{source}: key 'version' is {data.get('version')!r}; expected {PLAN_VERSION}")
        layers_obj = data.get("layers")
        if not isinstance(layers_obj, dict) or not layers_obj:
            raise TieringError(f"{source}: key 'layers' must be a non-empty object of layer index -> "
                               f"{{precision, home}}")
        layers, precision, home = [], [], []
        for key in sorted(layers_obj, key=lambda s: int(s) if s.isdigit() else -1):
            if not key.isdigit():
                raise TieringError(f"{source}: layers key {key!r} is not a layer index")
            entry = layers_obj[key]
            p, h = entry.get("precision"), entry.get("home")
            if not isinstance(p, list) or not isinstance(h, list) or len(p) != len(h) or not p:
                raise TieringError(f"{source}: layers.{key} needs equal-length non-empty lists "
                                   f"'precision' and 'home'")
            for e, (pe, he) in enumerate(zip(p, h)):
                try:
                    parse_format(pe)
                except ValueError as err:
                    raise TieringError(f"{source}: layers.{key}.precision[{e}]: {err}") from None
                if he not in HOMES:
                    raise TieringError(f"{source}: layers.{key}.home[{e}] is {he!r}; expected one of {HOMES}")
            layers.append(int(key)), precision.append(list(p)), home.append(list(h))
        runtime = data.get("runtime", {})
        slots = runtime.get("cache_slots", 2)
        skip = runtime.get("skip_tail_from")
        if not isinstance(slots, int) or slots < 0:
            raise TieringError(f"{source}: runtime.cache_slots is {slots!r}; expected an integer >= 0")
        if skip is not None and (not isinstance(skip, int) or skip < 1):
            raise TieringError(f"{source}: runtime.skip_tail_from is {skip!r}; expected null or an integer >= 1")
        cache_bytes = runtime.get("ssd_cache_bytes", 0)
        threads = runtime.get("ssd_threads", READ_THREADS)
        chunk = runtime.get("ssd_chunk_bytes", READ_CHUNK_BYTES)
        direct = runtime.get("ssd_direct")
        verify = runtime.get("ssd_verify", False)
        if not isinstance(cache_bytes, int) or isinstance(cache_bytes, bool) or cache_bytes < 0:
            raise TieringError(f"{source}: runtime.ssd_cache_bytes is {cache_bytes!r}; expected an integer >= 0")
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise TieringError(f"{source}: runtime.ssd_threads is {threads!r}; expected an integer >= 1")
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 0:
            raise TieringError(f"{source}: runtime.ssd_chunk_bytes is {chunk!r}; expected an integer >= 0 "
                               f"(0: one read per record)")
        if direct is not None and not isinstance(direct, bool):
            raise TieringError(f"{source}: runtime.ssd_direct is {direct!r}; expected true, false or null")
        if not isinstance(verify, bool):
            raise TieringError(f"{source}: runtime.ssd_verify is {verify!r}; expected true or false")
        return cls(layers, precision, home, slots, skip, data.get("info", {}), cache_bytes, threads, direct, verify,
                   chunk)

    def count(self) -> dict[str, int]:
        """How many experts have each precision and each home."""
        out: dict[str, int] = {}
        for row_p, row_h in zip(self.precision, self.home):
            for p, h in zip(row_p, row_h):
                out[p] = out.get(p, 0) + 1
                out[h] = out.get(h, 0) + 1
        return out


def expert_nbytes(fmt: str, hidden: int, intermediate: int) -> int:
    """Stored bytes of one SwiGLU expert (gate, up [I, H]; down [H, I]) in `fmt`."""
    return 2 * format_nbytes(fmt, intermediate, hidden) + format_nbytes(fmt, hidden, intermediate)


def _expert_forward(w: tuple, x: torch.Tensor) -> torch.Tensor:
    g, u, d = (t.float() for t in w)
    return (F.silu(x @ g.T) * (x @ u.T)) @ d.T


def measure_errors(stats: CalibrationStats, weights, ladder: list[str],
                   metric: str = "output", device="cpu") -> torch.Tensor:
    """[L, E, P] error of each expert at each precision of `ladder`, measured on calibration data.

    metric "output": mean over the expert's sampled real inputs x of ||f_q(x) - f(x)||^2, f the
        whole SwiGLU expert (falls back to "imatrix" for an expert with no samples).
    metric "imatrix": sum over the three matrices of sum_{o,i} (imatrix[i] / n) * dW[o,i]^2, i.e.
        E||dW x||^2 over the calibration inputs when input channels are uncorrelated.
    device: where to quantize and measure ("cuda" makes this step fast on big models).
    """
    if metric not in ("output", "imatrix"):
        raise TieringError(f"measure_errors: metric {metric!r}; expected 'output' or 'imatrix'")
    source = _weight_source(weights)
    L, E = stats.counts.shape
    err = torch.zeros(L, E, len(ladder), dtype=torch.float64)
    for li, layer in enumerate(stats.layers):
        for e in range(E):
            w = tuple(t.to(device, torch.float32) for t in source(layer, e))
            n = int(stats.sample_count[li, e])
            x = stats.samples[li, e, :n].to(device)
            ref = _expert_forward(w, x) if n else None
            rows = max(int(stats.counts[li, e]), 1)
            for pi, fmt in enumerate(ladder):
                wq = tuple(quantize(t, fmt).dequantize(torch.float32) for t in w)
                if metric == "output" and n:
                    err[li, e, pi] = ((_expert_forward(wq, x) - ref) ** 2).sum(1).mean().item()
                else:
                    imp_in = stats.imatrix_in[li, e].to(device, torch.float32) / rows
                    imp_mid = stats.imatrix_mid[li, e].to(device, torch.float32) / rows
                    dg, du, dd = (a - b for a, b in zip(wq, w))
                    err[li, e, pi] = (((dg ** 2 + du ** 2) * imp_in).sum()
                                      + ((dd ** 2) * imp_mid).sum()).item()
    return err


def plan(stats: CalibrationStats, weights, budgets: Budgets | dict,
         ladder: list[str] = ("bf16", "int8", "int4", "ternary"), metric: str = "output",
         cache_slots: int = 2, errors: torch.Tensor | None = None, device="cpu") -> Plan:
    """Greedy planner: every expert starts at the cheapest precision of `ladder`; then, while bytes
    remain in gpu_bytes + host_bytes, take the upgrade that removes the most expected error per byte
    (expected error = usage share x measured error, see measure_errors). Homes: experts by usage,
    hottest first, go to "gpu" while they fit gpu_bytes, the rest to "host" within host_bytes.

    weights: a checkpoint directory, an Engine/model with dense experts, a dict {layer: (w_gate,
    w_up, w_down)} of stacked tensors, or a callable (layer, expert) -> (gate, up, down).
    errors: a precomputed [L, E, len(ladder)] error tensor (skips the measurement).
    gpu_bytes covers the resident experts only: the host tier's cache slots (cache_slots per layer,
    each as large as the biggest host expert) come on top of it.
    With budgets.ssd_bytes > 0 the coldest experts go to "ssd": by usage, once an expert no longer
    fits host_bytes, it and every colder one (not placed on the GPU) live on disk within ssd_bytes.
    The SSD tier's host-RAM cache (Plan.ssd_cache_bytes) comes on top of host_bytes.
    """
    if isinstance(budgets, dict):
        budgets = Budgets(**budgets)
    ladder = list(ladder)
    if not ladder:
        raise TieringError("plan: empty precision ladder")
    for fmt in ladder:
        try:
            parse_format(fmt)
        except ValueError as err:
            raise TieringError(f"plan: ladder entry {fmt!r}: {err}") from None
    source = _weight_source(weights)
    L, E = stats.counts.shape
    g0, _, d0 = source(stats.layers[0], 0)
    inter, hidden = g0.shape
    size = [expert_nbytes(f, hidden, inter) for f in ladder]
    order = sorted(range(len(ladder)), key=lambda i: size[i])     # cheapest first
    ladder, size = [ladder[i] for i in order], [size[i] for i in order]
    if errors is None:
        errors = measure_errors(stats, source, ladder, metric, device)
    else:
        errors = errors[:, :, order]
    share = stats.usage_share()
    expected = share[:, :, None] * errors                             # [L, E, P]
    if budgets.ssd_bytes < 0:
        raise TieringError(f"plan: ssd budget {budgets.ssd_bytes} bytes; expected >= 0")
    total_budget = budgets.gpu_bytes + budgets.host_bytes + budgets.ssd_bytes
    floor = L * E * size[0]
    if floor > total_budget:
        raise TieringError(f"plan: infeasible: every expert at the cheapest precision {ladder[0]!r} needs "
                           f"{floor} bytes, budgets give {total_budget} (gpu {budgets.gpu_bytes} + "
                           f"host {budgets.host_bytes}" + (f" + ssd {budgets.ssd_bytes})" if budgets.ssd_bytes else ")"))

    # Homes can fail to pack even when the total fits (an expert straddles the gpu/host boundary):
    # then plan again with the spill taken off the total.
    budget = total_budget
    for _ in range(8):
        level = _greedy_levels(expected, size, budget)
        home, used = _assign_homes(share, level, size, budgets)
        spill = max(used["host"] - budgets.host_bytes, used.get("ssd", 0) - budgets.ssd_bytes)
        if spill <= 0:
            break
        budget -= spill
    else:
        raise TieringError(f"plan: infeasible: could not place experts within gpu {budgets.gpu_bytes}, "
                           f"host {budgets.host_bytes} and ssd {budgets.ssd_bytes} bytes")
    exp_err = float(sum(expected[l, e, level[l][e]] for l in range(L) for e in range(E)))
    shown = {"gpu_bytes": budgets.gpu_bytes, "host_bytes": budgets.host_bytes}
    if budgets.ssd_bytes:
        shown["ssd_bytes"] = budgets.ssd_bytes
    info = {"planner": "greedy", "metric": metric, "ladder": ladder,
            "budgets": shown,
            "bytes": used, "expected_error": exp_err, "calibration_tokens": stats.tokens,
            "expert_bytes": dict(zip(ladder, size))}
    return Plan(list(stats.layers), [[ladder[level[l][e]] for e in range(E)] for l in range(L)],
                home, cache_slots, None, info)


def _greedy_levels(expected: torch.Tensor, size: list[int], budget: int) -> list[list[int]]:
    """Upgrade-by-best-error-per-byte; jumps may skip ladder steps (the error curve need not be convex)."""
    L, E, P = expected.shape
    level = [[0] * E for _ in range(L)]
    left = budget - L * E * size[0]

    def best_move(l: int, e: int, room: int):
        cur = level[l][e]
        best = None
        for p in range(cur + 1, P):
            extra = size[p] - size[cur]
            gain = float(expected[l, e, cur] - expected[l, e, p])
            if extra <= room and gain > 0:
                ratio = gain / max(extra, 1)
                if best is None or ratio > best[0]:
                    best = (ratio, p)
        return best

    heap = []
    for l in range(L):
        for e in range(E):
            mv = best_move(l, e, left)
            if mv:
                heap.append((-mv[0], l, e, level[l][e], mv[1]))
    heapq.heapify(heap)
    while heap:
        _, l, e, frm, to = heapq.heappop(heap)
        if level[l][e] != frm:
            continue
        extra = size[to] - size[frm]
        if extra > left:
            mv = best_move(l, e, left)        # the best jump no longer fits: retry with what fits
            if mv:
                heapq.heappush(heap, (-mv[0], l, e, frm, mv[1]))
            continue
        level[l][e] = to
        left -= extra
        mv = best_move(l, e, left)
        if mv:
            heapq.heappush(heap, (-mv[0], l, e, to, mv[1]))
    return level


def _assign_homes(share: torch.Tensor, level, size, budgets: Budgets):
    """Hottest first: "gpu" while it fits; then "host"; with an ssd budget, from the first expert
    that does not fit host_bytes on, "ssd" (so disk holds the coldest of the non-GPU experts)."""
    L, E = share.shape
    home = [["host"] * E for _ in range(L)]
    used = {"gpu": 0, "host": 0}
    if budgets.ssd_bytes > 0:
        used["ssd"] = 0
    on_disk = False
    by_heat = sorted(((float(share[l, e]), l, e) for l in range(L) for e in range(E)), key=lambda t: -t[0])
    for _, l, e in by_heat:
        b = size[level[l][e]]
        if used["gpu"] + b <= budgets.gpu_bytes:
            home[l][e] = "gpu"
            used["gpu"] += b
        elif "ssd" in used and (on_disk or used["host"] + b > budgets.host_bytes):
            on_disk = True
            home[l][e] = "ssd"
            used["ssd"] += b
        else:
            used["host"] += b
    return home, used


def plan_hot_cold(stats: CalibrationStats, hot_fraction: float, hot: str = "int8", cold: str = "ternary",
                  cold_home: str = "host", cache_slots: int = 2, ssd_fraction: float = 0.0,
                  ssd_cache_bytes: int = 0) -> Plan:
    """Rule-based plan: per layer, the ceil(hot_fraction * E) most used experts get `hot` precision on
    the GPU; the rest get `cold` precision with home `cold_home`, except the floor(ssd_fraction * E)
    least used, which go to "ssd" (behind a host-RAM cache of ssd_cache_bytes)."""
    if not 0.0 <= hot_fraction <= 1.0:
        raise TieringError(f"plan_hot_cold: hot_fraction {hot_fraction} must be within [0, 1]")
    if not 0.0 <= ssd_fraction <= 1.0 - hot_fraction + 1e-12:
        raise TieringError(f"plan_hot_cold: ssd_fraction {ssd_fraction} must be within [0, 1 - hot_fraction]")
    for fmt in (hot, cold):
        try:
            parse_format(fmt)
        except ValueError as err:
            raise TieringError(f"plan_hot_cold: {err}") from None
    if cold_home not in HOMES:
        raise TieringError(f"plan_hot_cold: cold_home {cold_home!r}; expected one of {HOMES}")
    L, E = stats.counts.shape
    n_hot = math.ceil(hot_fraction * E)
    n_ssd = min(int(math.floor(ssd_fraction * E + 1e-9)), E - n_hot)
    precision, home = [], []
    for l in range(L):
        # Ties broken by expert id so the plan is deterministic.
        ranked = sorted(range(E), key=lambda e: (-int(stats.counts[l, e]), e))
        hot_set = set(ranked[:n_hot])
        ssd_set = set(ranked[E - n_ssd:]) if n_ssd else set()
        precision.append([hot if e in hot_set else cold for e in range(E)])
        home.append(["gpu" if e in hot_set else "ssd" if e in ssd_set else cold_home for e in range(E)])
    info = {"planner": "hot_cold", "hot_fraction": hot_fraction, "hot": hot, "cold": cold,
            "calibration_tokens": stats.tokens}
    if n_ssd:
        info["ssd_fraction"] = ssd_fraction
    return Plan(list(stats.layers), precision, home, cache_slots, None, info, ssd_cache_bytes=ssd_cache_bytes)


# ================================================================================================
# Step 3: packing and loading

_SKIP_COPY = re.compile(r"(\.safetensors|\.bin|\.pt|\.pth|\.gguf|model\.safetensors\.index\.json|plan\.json|"
                        r"\.ssd|\.ssd\.tmp)$")


def pack(checkpoint_dir: str | Path, plan: Plan, out_dir: str | Path, device="cpu") -> Path:
    """Write the tiered artifact for `plan` from a Hugging Face checkpoint directory; returns out_dir.

    Tensors are read one at a time (safe_open); experts are quantized one at a time, on `device`.
    The packed experts are held in host memory until experts.safetensors (and, for experts the plan
    puts on "ssd", the pack file experts.ssd) is written.
    """
    src, out = Path(checkpoint_dir), Path(out_dir)
    if not (src / "config.json").is_file():
        raise TieringError(f"{src}: no config.json (expected a Hugging Face checkpoint directory)")
    if out.resolve() == src.resolve():
        raise TieringError(f"pack: out_dir {out} is the source checkpoint; choose another directory")
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not _SKIP_COPY.search(f.name):
            shutil.copy2(f, out / f.name)

    where = _index_experts(src)
    ckpt_layers = sorted({l for l, _, _ in where})
    if sorted(plan.layers) != ckpt_layers:
        raise TieringError(f"pack: plan covers layers {plan.layers}, checkpoint {src} has experts in "
                           f"layers {ckpt_layers}")
    non_expert: dict[str, torch.Tensor] = {}
    for file in _checkpoint_files(src):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                if parse_expert_name(name) is None:
                    non_expert[name] = f.get_tensor(name)
    save_file(non_expert, str(out / "model.safetensors"), metadata={"format": "pt"})
    del non_expert

    packed: dict[str, torch.Tensor] = {}
    on_disk: list[tuple[int, int, QuantizedExpert]] = []
    shapes: dict[str, list[int]] = {}
    by_home = {h: 0 for h in HOMES if h != "ssd" or plan.has_ssd}
    for layer, precs in zip(plan.layers, plan.precision):
        n_exp = len({e for l, e, _ in where if l == layer})
        if len(precs) != n_exp:
            raise TieringError(f"pack: plan gives {len(precs)} experts for layer {layer}, checkpoint has {n_exp}")
        for e, fmt in enumerate(precs):
            home = plan.home[plan.layers.index(layer)][e]
            mats = []
            for mat in MATRICES:
                if (layer, e, mat) not in where:
                    raise TieringError(f"{src}: no {mat} weight for layer {layer} expert {e}")
                w = _read_matrix(where[(layer, e, mat)], mat)
                q = quantize(w.to(device), fmt).to("cpu")
                mats.append(q)
                if home != "ssd":
                    packed.update(q.state(f"layers.{layer}.experts.{e}.{mat}"))
                by_home[home] += q.nbytes
                shapes.setdefault(mat, list(w.shape))
            if home == "ssd":
                on_disk.append((layer, e, QuantizedExpert(*mats)))
    save_file(packed, str(out / "experts.safetensors"),
              metadata={"format": "moebench-tiered-experts", "version": str(PLAN_VERSION)})
    data = plan.to_json()
    data["artifact"] = {"source": str(src), "expert_shapes": shapes,
                        "expert_bytes": sum(by_home.values()),
                        "expert_bytes_by_home": by_home}
    from .ssd import PACK_NAME, write_pack
    if on_disk:
        index = write_pack(out / PACK_NAME, on_disk)
        data["artifact"]["ssd_file"] = PACK_NAME
        data["artifact"]["ssd_file_bytes"] = index["file_bytes"]
    elif (out / PACK_NAME).is_file():
        (out / PACK_NAME).unlink()        # an earlier pack's file; this plan keeps nothing on disk
    (out / "plan.json").write_text(json.dumps(data, indent=1, allow_nan=False) + "\n", encoding="utf-8")
    return out


def read_experts(path: str | Path, plan: Plan | None = None) -> dict[int, list[QuantizedExpert]]:
    """{layer: [QuantizedExpert per expert]} from an artifact directory (CPU tensors); experts the
    plan puts on "ssd" are None (they stay in the pack file)."""
    path = Path(path)
    data = json.loads((path / "plan.json").read_text(encoding="utf-8"))
    plan = plan or Plan.from_json(data, source=str(path / "plan.json"))
    shapes = data.get("artifact", {}).get("expert_shapes")
    if not shapes or any(m not in shapes for m in MATRICES):
        raise TieringError(f"{path / 'plan.json'}: key 'artifact.expert_shapes' missing or incomplete "
                           f"(was the directory written by pack()?)")
    file = path / "experts.safetensors"
    if not file.is_file():
        raise TieringError(f"{file}: missing (a tiered artifact needs experts.safetensors)")
    out: dict[int, list[QuantizedExpert]] = {}
    with safe_open(str(file), "pt") as f:
        names = set(f.keys())
        for layer, precs in zip(plan.layers, plan.precision):
            experts = []
            homes = plan.home[plan.layers.index(layer)]
            for e, fmt in enumerate(precs):
                if homes[e] == "ssd":
                    experts.append(None)
                    continue
                mats = []
                for mat in MATRICES:
                    prefix = f"layers.{layer}.experts.{e}.{mat}"
                    tensors = {f"{prefix}.{k}": f.get_tensor(f"{prefix}.{k}")
                               for k in _part_names_present(names, prefix)}
                    try:
                        mats.append(QuantizedTensor.from_state(fmt, shapes[mat], tensors, prefix))
                    except ValueError as err:
                        raise TieringError(f"{file}: {err}") from None
                experts.append(QuantizedExpert(*mats))
            out[layer] = experts
    return out


def _part_names_present(names: set[str], prefix: str) -> list[str]:
    return [n[len(prefix) + 1:] for n in names if n.startswith(prefix + ".")]


def open_disk_tier(path: str | Path, plan: Plan, shapes: dict | None, device, ssd_cache_bytes: int | None = None):
    """The artifact's ssd.DiskTier for `plan`, after checking that its pack file holds exactly the
    experts the plan puts on "ssd", each in the plan's format and the artifact's shapes."""
    from .ssd import PACK_NAME, DiskTier, PackError
    file = Path(path) / PACK_NAME
    try:
        disk = DiskTier.open(file, cache_bytes=plan.ssd_cache_bytes if ssd_cache_bytes is None else ssd_cache_bytes,
                             threads=plan.ssd_threads, pin=torch.device(device).type == "cuda",
                             direct=plan.ssd_direct, verify=plan.ssd_verify, chunk_bytes=plan.ssd_chunk_bytes)
    except PackError as err:
        raise TieringError(str(err)) from None
    want = {(l, e): plan.precision[i][e] for i, l in enumerate(plan.layers)
            for e, h in enumerate(plan.home[i]) if h == "ssd"}
    entries = disk.pack.entries
    for key, fmt in want.items():
        entry = entries.get(key)
        if entry is None:
            disk.close()
            raise TieringError(f"{file}: no record for layer {key[0]} expert {key[1]}; plan.json puts it on ssd "
                               f"as {fmt!r}")
        if entry["format"] != fmt or (shapes and any(list(entry["shapes"].get(m, [])) != list(shapes[m])
                                                      for m in MATRICES)):
            disk.close()
            raise TieringError(f"{file}: layer {key[0]} expert {key[1]} is {entry['format']!r} with shapes "
                               f"{entry['shapes']}; plan.json expects {fmt!r} with shapes {shapes}")
    extra = sorted(set(entries) - set(want))
    if extra:
        disk.close()
        raise TieringError(f"{file}: holds layer {extra[0][0]} expert {extra[0][1]}, which plan.json does not put "
                           f"on ssd ({len(extra)} such records); expected the pack written with this plan")
    return disk


def load_tiered(path: str | Path, model, device, dtype, cache_slots: int | None = None,
                skip_tail_from: int | None = None, ssd_cache_bytes: int | None = None) -> list[TieredExperts]:
    """Replace every MoE layer's experts in `model` with TieredExperts built from the artifact at
    `path` (plan.json + experts.safetensors, and experts.ssd when the plan puts experts on "ssd").
    cache_slots / skip_tail_from / ssd_cache_bytes override plan.json's runtime section. Returns the
    new modules in layer order."""
    path = Path(path)
    plan = Plan.load(path / "plan.json")
    blocks = {b.layer_idx: b for b in _moe_blocks(model)}
    if sorted(blocks) != sorted(plan.layers):
        raise TieringError(f"{path / 'plan.json'}: plan covers layers {plan.layers}, the model has MoE "
                           f"layers {sorted(blocks)}")
    experts = read_experts(path, plan)
    slots = plan.cache_slots if cache_slots is None else cache_slots
    skip = plan.skip_tail_from if skip_tail_from is None else skip_tail_from
    disk = None
    if plan.has_ssd:
        shapes = json.loads((path / "plan.json").read_text(encoding="utf-8")).get("artifact", {}).get("expert_shapes")
        disk = open_disk_tier(path, plan, shapes, device, ssd_cache_bytes)
    modules = []
    for layer, homes in zip(plan.layers, plan.home):
        block = blocks[layer]
        n_model = getattr(block.experts, "num_experts", len(homes))
        if n_model != len(homes):
            raise TieringError(f"{path / 'plan.json'}: layer {layer} has {len(homes)} experts, the model {n_model}")
        module = TieredExperts(experts[layer], homes, device, dtype, cache_slots=slots, skip_tail_from=skip,
                               disk=disk, layer=layer)
        block.experts = module
        modules.append(module)
    return modules
