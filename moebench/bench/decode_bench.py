"""The decode benchmarks' run: the shared random model and what every variant reads (`Bench`), the
setup that builds it (the model, bandwidths, prompt, reference routing, calibrated hot halves and
expert plans), the variant loop and the options every such script takes. benchmarks/decode_h200.py
and benchmarks/tiers_h200.py are built on it.
"""
from __future__ import annotations

import argparse
import gc
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from moebench import jsonout
from moebench.engine import Engine, ModelConfig
from moebench.engine.decode_config import DecodeConfig

from .engine_setup import build_engine, engine_rate, expert_plans, hot_halves, realistic_routing
from .measure import log, pinned_h2d_bandwidth
from .reference_model import (active_bytes_per_token, bench_shape, build_transformers, copy_bandwidth,
                              non_expert_bytes_per_token)


class Skipped(Exception):
    """A variant left out on purpose (--skip, --no-sweep, --small)."""


@dataclass
class Bench:
    """What the variants share: the model, the prompt, reference routing, the run's DecodeConfig."""

    args: argparse.Namespace
    device: torch.device
    dtype: torch.dtype
    hf: object
    cfg: ModelConfig
    prompt: list[int]
    R: dict                              # the results document (decode_h200.json)
    out_dir: Path
    decode: DecodeConfig = field(default_factory=lambda: DecodeConfig(experts_impl="triton"))
    ref_tokens: list[int] = field(default_factory=list)
    routes: list = field(default_factory=list)       # per layer, the decode positions' topk ids
    hot: list = field(default_factory=list)          # per layer, the calibrated hot half
    plans: dict = field(default_factory=dict)
    plan_tokens: dict = field(default_factory=dict)
    _engines: dict = field(default_factory=dict)

    @property
    def graphs(self) -> bool:
        return self.device.type == "cuda"

    @property
    def small(self) -> bool:
        return self.args.small

    @property
    def n_long(self) -> int:
        return self.args.tokens

    @property
    def n_short(self) -> int:
        return max(2, self.args.tokens // 4)

    @property
    def max_seq(self) -> int:
        return self.args.prompt_len + self.n_long + 8

    @property
    def bw(self) -> float:
        return self.R["copy_bandwidth_Bps"]

    @property
    def non_expert_bytes(self) -> float:
        return non_expert_bytes_per_token(self.cfg, torch.finfo(self.dtype).bits // 8)

    def mbu(self, rate: float, nbytes: float) -> float:
        return 100 * rate * nbytes / self.bw

    def engine(self, decode: DecodeConfig | None = None, **kw) -> Engine:
        """An engine sharing the model's weights, decoding with `decode` (default: the run's)."""
        return build_engine(self.hf, max_seq_len=kw.pop("max_seq_len", self.max_seq),
                            cuda_graphs=kw.pop("cuda_graphs", self.graphs), decode=decode or self.decode, **kw)

    def shared(self, key: str, make: Callable[[], Engine]) -> Engine:
        """An engine built once and reused by several variants."""
        if key not in self._engines:
            self._engines[key] = make()
        return self._engines[key]

    def rate(self, eng: Engine, B: int = 1, n_s: int | None = None, n_l: int | None = None) -> dict:
        prompts = [self.prompt] if B == 1 else [
            torch.randint(0, self.cfg.vocab_size, (self.args.prompt_len,), generator=torch.Generator().manual_seed(b))
            .tolist() for b in range(B)]
        return engine_rate(eng, prompts, n_s or self.n_short, n_l or self.n_long, self.args.reps)

    def bf16_rate(self, eng: Engine, label: str | None) -> dict:
        """rate() of a bf16 engine with its bytes per token and MBU; logged under `label`."""
        r = self.rate(eng)
        r["tokens_equal_reference"] = r.pop("tokens") == self.ref_tokens
        r.update(bytes_per_token=self.R["active_bytes"], mbu_pct=self.mbu(r["tok_s"], self.R["active_bytes"]))
        if label is not None:
            log(f"engine bf16 [{label}{'+graphs' if self.graphs else ''}]: {r['tok_s']:.2f} tok/s, "
                f"MBU {r['mbu_pct']:.1f}%")
        return r


def setup(args) -> Bench:
    """The model, the bandwidths, the reference continuation and its routing, the plans."""
    small = args.small
    device = torch.device("cpu" if small else "cuda")
    dtype = torch.float32 if small else torch.bfloat16
    shape = bench_shape(small, getattr(args, "layers", 0), getattr(args, "experts", 0))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    R = {"variants": {}, "errors": {}, "skipped": [], "device": str(device), "dtype": str(dtype), "shape": shape,
         "torch": torch.__version__, "prompt_len": args.prompt_len}
    try:
        import triton
        R["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        R["triton"] = f"unavailable: {e}"
    if device.type == "cuda":
        R["gpu"] = torch.cuda.get_device_name(device)
    log(f"torch {torch.__version__}, triton {R['triton']}, device {R.get('gpu', device)}")
    t0 = time.perf_counter()
    hf = build_transformers(shape, device, dtype, seed=0)
    if args.router_skew:
        realistic_routing(hf, args.router_skew)
    R["router_skew"] = args.router_skew
    cfg = ModelConfig.from_dict(hf.config.to_dict(), source="transformers config")
    R["build_s"] = round(time.perf_counter() - t0, 1)
    R.update(active_bytes_per_token(cfg, torch.finfo(dtype).bits // 8))
    R["copy_bandwidth_Bps"] = copy_bandwidth(device, nbytes=(1 << 30) if device.type == "cuda" else (1 << 26))
    R["pinned_h2d_Bps"] = pinned_h2d_bandwidth(1 << 30) if device.type == "cuda" else None
    prompt = torch.randint(0, cfg.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    b = Bench(args, device, dtype, hf, cfg, prompt, R, out_dir)
    if small:
        # The interpreter's cost is per program: few, wide programs keep the smoke test short.
        b.decode = b.decode.with_launches(dict(BN=64, BK=256))
    R["tokens"] = [b.n_short, b.n_long]
    log(f"shape: {cfg.num_layers} layers, {cfg.num_experts} experts top-{cfg.top_k}, hidden {cfg.hidden_size}, "
        f"width {cfg.expert_intermediate_size}, vocab {cfg.vocab_size}; built in {R['build_s']} s; copy bw "
        f"{b.bw / 1e9:.1f} GB/s; pinned H2D {(R['pinned_h2d_Bps'] or 0) / 1e9:.1f} GB/s; bf16 bytes/token "
        f"{R['active_bytes'] / 1e9:.3f} GB -> roofline {b.bw / R['active_bytes']:.1f} tok/s")
    gather = b.shared("gather", lambda: b.engine(DecodeConfig()))
    b.ref_tokens = gather.generate([prompt], b.n_long, ignore_eos=True)[0].token_ids
    trace = gather.trace(prompt + b.ref_tokens, router_logits=False)
    b.routes = [ids[len(prompt):] for ids in trace.topk_ids]          # decode positions only
    counts = torch.stack([torch.bincount(ids.flatten(), minlength=cfg.num_experts) for ids in trace.topk_ids])
    b.hot = hot_halves(counts)
    b.plans = expert_plans(cfg.num_layers, cfg.num_experts, b.hot)
    R["routes_decode_tokens"] = b.routes[0].shape[0]
    R["hot_half_share_of_picks"] = float(sum(counts[l, sorted(b.hot[l])].sum() for l in range(cfg.num_layers))
                                         / counts.sum())
    log(f"router skew {args.router_skew}: the most-used half of each layer's experts takes "
        f"{100 * R['hot_half_share_of_picks']:.1f}% of the picks (prompt + greedy continuation)")
    return b


def run_variants(b: Bench, names: list[str], variants: dict, out_name: str = "decode_h200.json") -> None:
    """Each variant of `variants` named in `names`, in order; its dict goes under
    R['variants'][name], a failure under R['errors'] (the others still run); the JSON (out_name
    under the run's directory) is rewritten after every variant."""
    out_file = b.out_dir / out_name
    for name in names:
        t = time.perf_counter()
        try:
            out = variants[name](b)
            out["wall_s"] = round(time.perf_counter() - t, 1)
            b.R["variants"][name] = out
        except Skipped:
            b.R["skipped"].append(name)
        except Exception as e:  # noqa: BLE001 - keep the other variants
            b.R["errors"][name] = f"{type(e).__name__}: {e}"
            log(f"[{name}] FAILED: {type(e).__name__}: {e}")
            traceback.print_exc(limit=4)
        out_file.write_text(jsonout.document_text(b.R, indent=2, default=str))
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def common_args(ap: argparse.ArgumentParser, small_help: str, out_help: str, tokens: int) -> None:
    """The options every decode benchmark built on setup() takes (setup reads small, out, prompt_len,
    tokens, reps, layers, experts and router_skew; main picks variants with only / skip / list)."""
    ap.add_argument("--small", action="store_true", help=small_help)
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help=out_help)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=tokens, help="decode tokens in the long run")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=0,
                    help="decoder layers (default: the shape's own; 24 fits the int8 plans on an 80 GB GPU)")
    ap.add_argument("--experts", type=int, default=0,
                    help="experts a layer (default: the shape's own; the peers' checkpoint has 32)")
    ap.add_argument("--only", default="", help="comma-separated variant names to run (default: all)")
    ap.add_argument("--skip", default="", help="comma-separated variant names to skip")
    ap.add_argument("--list", action="store_true", help="print the variants in run order and exit")
    ap.add_argument("--router-skew", type=float, default=0.5,
                    help="Zipf exponent of expert usage (router row norms; see realistic_routing); 0 = the plain "
                         "random model, whose tokens all route alike")


def pick_variants(args, variants: dict) -> list[str]:
    """The variant names --only / --skip select, in registry order; an unknown name exits."""
    unknown = {n for n in (args.only + "," + args.skip).split(",") if n} - set(variants)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; --list shows them")
    skip = {n for n in args.skip.split(",") if n}
    return [n for n in ([n for n in args.only.split(",") if n] or variants) if n not in skip]
