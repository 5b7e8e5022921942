"""Expert tier plans on one GPU against their tier-aware bounds, and the disk under the SSD tier, in one
call:

1. disk_read: sequential and random reads of a pack file of expert-sized records (ssd.write_pack),
   4 KiB-aligned, O_DIRECT where the filesystem allows it, by the engine's own reader
   (ssd.DiskTier: ExpertPack.read on its reader threads) at queue depths 1..N (one whole-record
   read in flight per thread); and "one record": random records read one at a time the way the
   SSD tier reads a lone miss (DiskTier.request/take: the record split into --ssd-chunk-kib chunks
   read by N threads at once).
2. The Qwen3-30B-A3B-shaped random model of decode_h200.py (token-diverse, Zipf-skewed routing;
   the hot half of each layer calibrated on the bf16 model's routing) as three tier plans:
   - plan_gpu_only: int8 hot half / ternary2 cold half, all in HBM;
   - plan_gpu_host: the hot half in HBM, the cold half in pinned host RAM;
   - plan_gpu_host_skip: the same with route-tail-skip from rank --skip-tail-from (changes the numbers);
   - plan_gpu_host_ssd: the hot half in HBM, the cold half on the SSD tier: a pack file behind a
     host-RAM cache that holds --ssd-cache-fraction of the cold records (the rest are read from disk);
     the fused SSD path with the runner's defaults (no guesses for SSD-only offload: each layer's
     reads start at its routing);
   - plan_gpu_host_ssd_guess: the same with the prefetch's guesses (prefetch_host and
     prefetch_early: disk reads also started from the guess one layer ahead);
   - plan_gpu_host_ssd_ahead: the same with guesses from --ssd-lookahead layers ahead
     (DecodeConfig.ssd_lookahead);
   - plan_gpu_host_ssd*_whole: each SSD plan with whole-record reads (chunk_bytes 0) on
     --whole-threads reader threads (4): one read per record, one record per thread, so a comparison
     of the chunked read path against whole-record reads runs in the same call.
3. Each plan decodes with the default settings, the engine runner's choices for the device
   (runners/engine.py decode_choices + prefetch_choices: on CUDA the fused kernels, CUDA graphs where
   every layer is sync-free, decode-ahead, prefetch from the attention input for host or ssd experts),
   and reports tok/s, the tier-aware bound, % of it and per-tier hit rates from the engine's
   telemetry. The bound, per decode token from the measured counters:
       HBM bytes / copy bandwidth + PCIe bytes / pinned H2D bandwidth + disk bytes / disk bandwidth
   HBM bytes: the non-expert weights plus every pick computed from device memory (GPU-tier experts,
   LRU-cache and prefetch-stage hits, host and ssd experts copied in); PCIe bytes: bytes_host_read +
   bytes_h2d; disk bytes: bytes_ssd_needed, the records a pick used (read on demand, or read for a
   guess and then used; a guessed read no pick used is not a byte that had to come from disk, so it
   lowers the measured speed but not the bound); disk bandwidth: disk_read's best random-read figure
   over its thread counts. The three terms are added (no overlap between tiers); `tok_s_overlapped`
   is the bound if they overlapped fully (the slowest tier alone). Counters cover the decode steps of
   one generate of --tokens tokens (its prefill's counters subtracted).
4. The SSD plans also decode one prompt no earlier pass decoded, once, with the page cache dropped
   and decode-ahead off, against that pass's own bound ("unseen_prompt"; the table's last columns):
   the best-of-reps rate repeats one prompt, so their host-RAM cache has seen it before.
   Each SSD plan's row also gives the disk's random-read rate measured in this call (disk_read's
   best, the bound's figure), so calls on different disks can be compared.

    python benchmarks/tiers_h200.py --out $OUT                 # H200 (estimated ~5 min)
    python benchmarks/tiers_h200.py --small --out /tmp/tiers   # CPU smoke run: tiny shape, torch path, tmp pack
    python benchmarks/tiers_h200.py --list

Writes tiers_h200.json and tiers_h200.txt (the table) under --out. Each variant is one function in
VARIANTS (--only / --skip pick); a failing variant is recorded and the others run.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

if "--small" in sys.argv or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before anything imports triton

from moebench.bench import decode_bench  # noqa: E402  (the model, bandwidths, prompt, calibrated hot halves)
from moebench.bench.engine_setup import decode_rate, tiered_experts, write_ssd_pack  # noqa: E402
from moebench.bench.measure import log  # noqa: E402
from moebench.engine.decode_config import DecodeConfig  # noqa: E402
from moebench.engine.placement import QuantizedExpert, counter_states, restore_counter_states  # noqa: E402
from moebench.engine.quant import format_nbytes, quantize  # noqa: E402
from moebench.engine.ssd import READ_CHUNK_BYTES, READ_THREADS, DiskTier, write_pack  # noqa: E402
from moebench.runners.engine import decode_choices, prefetch_choices  # noqa: E402

HOT, COLD = "int8", "ternary2"
VARIANTS: dict[str, Callable] = {}


def variant(name: str):
    def add(fn):
        VARIANTS[name] = fn
        return fn
    return add


def drop_page_cache(path: Path) -> bool:
    """Ask the kernel to drop a just-written file's clean pages (buffered reads then go to the disk
    too); False where it cannot be asked."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    finally:
        os.close(fd)


def expert_nbytes(fmt: str, hidden: int, inter: int) -> int:
    return 2 * format_nbytes(fmt, inter, hidden) + format_nbytes(fmt, hidden, inter)


# ---- 1. the disk ------------------------------------------------------------------------------------

def read_pack(path: Path, keys: list, threads: int, pin: bool) -> dict:
    """Read `keys` through a DiskTier of `threads` reader threads, `threads` reads in flight (each
    result is dropped as it arrives, so memory stays bounded); bandwidth in bytes/s."""
    tier = DiskTier.open(path, cache_bytes=0, threads=threads, pin=pin)
    try:
        window: collections.deque = collections.deque()
        nbytes, t0 = 0, time.perf_counter()
        for key in keys:
            window.append(tier.submit(key))
            if len(window) >= threads:
                nbytes += window.popleft().result()[1]
        while window:
            nbytes += window.popleft().result()[1]
        seconds = time.perf_counter() - t0
        return {"bytes": nbytes, "seconds": seconds, "Bps": nbytes / seconds, "o_direct": tier.pack.direct,
                "o_direct_reason": tier.pack.direct_reason}
    finally:
        tier.close()


def read_records_chunked(path: Path, keys: list, threads: int, chunk_bytes: int, pin: bool) -> dict:
    """Read `keys` one record at a time the way the SSD tier reads a lone miss (DiskTier.request,
    then take: the record in chunk_bytes chunks on `threads` threads at once); bytes/s."""
    tier = DiskTier.open(path, cache_bytes=0, threads=threads, pin=pin, chunk_bytes=chunk_bytes)
    try:
        nbytes, t0 = 0, time.perf_counter()
        for key in keys:
            nbytes += tier.request(key)
            tier.take(key)
        seconds = time.perf_counter() - t0
        return {"bytes": nbytes, "seconds": seconds, "Bps": nbytes / seconds, "chunk_bytes": chunk_bytes}
    finally:
        tier.close()


@variant("disk_read")
def disk_read(b, ctx: dict) -> dict:
    """Sequential and random record reads of a pack file of expert-sized records at 1..N threads."""
    c, args = b.cfg, b.args
    g = torch.Generator().manual_seed(4)
    one = QuantizedExpert(*(quantize(torch.randn(*shape, generator=g) * 0.1, COLD)
                            for shape in ((c.expert_intermediate_size, c.hidden_size),) * 2
                            + ((c.hidden_size, c.expert_intermediate_size),)))
    record = -(-one.nbytes // 4096) * 4096
    n = max(8, int(args.disk_gib * (1 << 30)) // record)
    path = ctx["pack_dir"] / "disk_read.ssd"
    t0 = time.perf_counter()
    write_pack(path, ((0, i, one) for i in range(n)))
    write_s = time.perf_counter() - t0
    dropped = drop_page_cache(path)
    keys = [(0, i) for i in range(n)]
    per_run = max(8, min(n, int(args.disk_read_gib * (1 << 30)) // record))
    pin = b.device.type == "cuda"          # the engine's setting: pinned buffers on CUDA
    out = {"file_bytes": path.stat().st_size, "records": n, "record_bytes": record, "expert_bytes": one.nbytes,
           "format": COLD, "write_s": write_s, "page_cache_dropped": dropped, "pinned_buffers": pin,
           "records_per_run": per_run, "sequential": {}, "random": {}, "one_record": {},
           "chunk_bytes": args.ssd_chunk_kib << 10}
    rng = random.Random(5)
    for q in [int(x) for x in args.threads.split(",") if x]:
        start = rng.randrange(0, n - per_run + 1)
        seq = read_pack(path, keys[start:start + per_run], q, pin)
        rand = read_pack(path, rng.sample(keys, per_run), q, pin)
        one = read_records_chunked(path, rng.sample(keys, max(4, per_run // 4)), q, args.ssd_chunk_kib << 10, pin)
        out["sequential"][str(q)], out["random"][str(q)], out["one_record"][str(q)] = seq, rand, one
        log(f"disk read, {record / 1e6:.2f} MB records, {q} threads: sequential {seq['Bps'] / 1e9:.2f} GB/s, "
            f"random {rand['Bps'] / 1e9:.2f} GB/s, one record at a time in {args.ssd_chunk_kib} KiB chunks "
            f"{one['Bps'] / 1e9:.2f} GB/s ({'O_DIRECT' if seq['o_direct'] else seq['o_direct_reason']})")
    path.unlink()
    ctx["disk"] = out
    return out


def disk_bandwidth(ctx: dict) -> tuple[float | None, str]:
    """The best random-read bandwidth disk_read measured (over its thread counts), and where it
    came from: what the disk can do, whatever thread count the tier runs."""
    rand = (ctx.get("disk") or {}).get("random") or {}
    if not rand:
        return None, "no disk_read figure"
    q = max(rand, key=lambda k: rand[k]["Bps"])
    return rand[q]["Bps"], f"disk_read random, best: {q} threads"


# ---- 2-3. the tier plans ----------------------------------------------------------------------------

def default_decode(b, offloaded: list[str]) -> tuple[DecodeConfig, dict]:
    """The engine runner's default choices for this device and artifact, as a DecodeConfig."""
    device = "cuda" if b.device.type == "cuda" else "cpu"
    choices = decode_choices({"dtype": "auto"}, device)        # auto: bf16 on CUDA, float32 on the CPU
    choices.update(prefetch_choices({}, device, choices["experts_impl"]["value"], offloaded))
    cfg = DecodeConfig(experts_impl=choices["experts_impl"]["value"], prefetch_host=choices["prefetch_host"]["value"],
                       prefetch_early=choices["prefetch_early"]["value"])
    return cfg, choices


def decode_counters(eng, prompt: list[int], n: int, rate: bool = False) -> dict:
    """Tier counters (totals over layers) of the decode steps of one generate of n tokens: the
    counters are copied when the first token arrives (decode_ahead off for this generate, so no step
    is queued yet: the copy holds the prefill alone) and subtracted from the final ones. rate: also
    this generate's decode tok/s (engine_rate's measure, from the engine's per-token clock)."""
    snap: list = []

    def first(_index: int, _token: int) -> None:
        if not snap:
            snap.append(counter_states(eng.model))
    eng.reset_telemetry()
    ahead, eng.decode_ahead = eng.decode_ahead, False
    try:
        out = eng.generate([prompt], n, ignore_eos=True, on_token=first)
    finally:
        eng.decode_ahead = ahead
    full = eng.telemetry()
    restore_counter_states(eng.model, snap[0])
    prefill = eng.telemetry()["tiers"]["total"]
    c = {**{k: full["tiers"]["total"][k] - prefill[k] for k in prefill}, "decode_steps": full["decode_steps"]}
    if rate:
        c["tok_s"] = decode_rate(out[0].token_times)
    return c


def hit_rates(c: dict) -> dict:
    """Per tier: its share of the picks and how its picks were served."""
    def share(x, of):
        return x / of if of else None
    routed = c["routed"]
    out = {"gpu": {"share_of_picks": share(c["picks_gpu"], routed)},
           "host": {"share_of_picks": share(c["picks_host"], routed),
                    "served_from_gpu_memory": share(c["host_hits"] + c["prefetch_hits"], c["picks_host"]),
                    "lru_cache_hits": share(c["host_hits"], c["picks_host"]),
                    "prefetch_hits": share(c["prefetch_hits"], c["picks_host"]),
                    "read_over_pcie_in_place": share(c["host_direct"], c["picks_host"]),
                    "copied_on_miss": share(c["host_misses"], c["picks_host"]),
                    "route_tail_skips": share(c["route_tail_skips"], c["picks_host"])},
           "ssd": {"share_of_picks": share(c["picks_ssd"], routed),
                   "gpu_cache_hits": share(c["ssd_gpu_hits"], c["picks_ssd"]),
                   "host_ram_cache_hits": share(c["ssd_hits"] - c["ssd_gpu_hits"], c["picks_ssd"]),
                   "read_from_disk": share(c["ssd_misses"], c["picks_ssd"]),
                   "read_early_for_a_guess": share(c["ssd_guess_hits"], c["picks_ssd"]),
                   "route_tail_skips": share(c["ssd_skips"], c["picks_ssd"])}}
    return out


def tier_bound(b, ctx: dict, c: dict) -> dict:
    """Bytes per decode token by tier (from the counters) and the tok/s bound they give."""
    steps = max(1, c["decode_steps"])
    H, I = b.cfg.hidden_size, b.cfg.expert_intermediate_size
    hot, cold = expert_nbytes(HOT, H, I), expert_nbytes(COLD, H, I)
    from_device = (c["picks_gpu"] * hot + (c["picks_host"] - c["host_direct"] - c["route_tail_skips"]) * cold
                   + (c["picks_ssd"] - c["ssd_skips"]) * cold)
    hbm = b.non_expert_bytes + from_device / steps
    pcie = (c["bytes_host_read"] + c["bytes_h2d"]) / steps
    disk = c["bytes_ssd_needed"] / steps
    h2d = b.R["pinned_h2d_Bps"]
    disk_bw, disk_src = disk_bandwidth(ctx)
    terms = [hbm / b.bw, pcie / (h2d or b.bw)]
    out = {"hbm_bytes_per_token": hbm, "pcie_bytes_per_token": pcie, "disk_bytes_per_token": disk,
           "disk_bytes_read_per_token": c["bytes_ssd_read"] / steps,
           "copy_Bps": b.bw, "pinned_h2d_Bps": h2d, "disk_Bps": disk_bw, "disk_Bps_from": disk_src}
    if h2d is None:
        out["note"] = "no CUDA: host bytes at the copy bandwidth (one memory)"
    if disk:
        if disk_bw is None:
            out["tok_s"] = out["tok_s_overlapped"] = None
            return out
        terms.append(disk / disk_bw)
    out["seconds_per_token_by_tier"] = terms
    out["tok_s"] = 1.0 / sum(terms)
    out["tok_s_overlapped"] = 1.0 / max(terms)
    return out


def run_plan(b, ctx: dict, name: str, precision, home, disk=None, skip_tail_from: int | None = None,
             after: Callable | None = None, **decode_changes) -> dict:
    """One plan's engine with the runner's default choices (and `decode_changes`): its best-of-reps
    rate, its decode counters, bound and hit rates; after(eng): more results (a dict) to add."""
    offloaded = sorted({h for row in home for h in row} - {"gpu"})
    cfg, choices = default_decode(b, offloaded)
    if decode_changes:                         # a variant's own settings over the runner's defaults
        cfg = dataclasses.replace(cfg, **decode_changes)
        for key, value in decode_changes.items():
            choices[key] = {"value": value, "why": f"variant {name}"}
    t = time.perf_counter()
    experts = tiered_experts(b.hf, precision, home, b.device, b.dtype, fused=False, disk=disk)
    for module in experts.values():
        module.skip_tail_from = skip_tail_from       # before the engine captures any graph
    eng = b.engine(cfg, experts=experts, cuda_graphs=choices["cuda_graphs"]["value"])
    build_s = time.perf_counter() - t
    choices["cuda_graphs"]["runs"] = eng.graph_mode(1) is not None
    choices["cuda_graphs"]["mode"] = eng.graph_mode(1)
    choices["prefetch_host"]["runs"] = any(blk.experts.prefetching for blk in eng.model.moe_blocks())
    r = b.rate(eng)
    toks = r.pop("tokens")
    counters = decode_counters(eng, b.prompt, b.n_long)
    bound = tier_bound(b, ctx, counters)
    r.update(build_s=build_s, choices=choices, skip_tail_from=skip_tail_from, decode=cfg.identity(), counters=counters,
             hit_rates=hit_rates(counters), bound=bound,
             pct_of_bound=100 * r["tok_s"] / bound["tok_s"] if bound.get("tok_s") else None,
             greedy_prefix_agree_with_bf16=next((i for i, (x, y) in enumerate(zip(toks, b.ref_tokens)) if x != y),
                                                len(b.ref_tokens)))
    hr = r["hit_rates"]
    msg = (f"{name}: {r['tok_s']:.2f} tok/s; bound {bound['tok_s'] or float('nan'):.1f} tok/s "
           f"(HBM {bound['hbm_bytes_per_token'] / 1e6:.1f} MB, PCIe {bound['pcie_bytes_per_token'] / 1e6:.1f} MB, "
           f"disk {bound['disk_bytes_per_token'] / 1e6:.1f} MB per token)")
    if r["pct_of_bound"] is not None:
        msg += f" -> {r['pct_of_bound']:.1f}% of it"
    msg += f"; picks: gpu {100 * (hr['gpu']['share_of_picks'] or 0):.1f}%"
    if counters["picks_host"]:
        msg += (f", host {100 * hr['host']['share_of_picks']:.1f}% (from GPU memory "
                f"{100 * hr['host']['served_from_gpu_memory']:.1f}%)")
    if counters["picks_ssd"]:
        msg += (f", ssd {100 * hr['ssd']['share_of_picks']:.1f}% (GPU cache {100 * hr['ssd']['gpu_cache_hits']:.1f}%, "
                f"host RAM {100 * hr['ssd']['host_ram_cache_hits']:.1f}%, disk {100 * hr['ssd']['read_from_disk']:.1f}%, "
                f"of those read early for a guess {100 * (hr['ssd']['read_early_for_a_guess'] or 0):.1f}%); disk read "
                f"{bound['disk_bytes_read_per_token'] / 1e6:.1f} MB per token, "
                f"waited {wait_per_token(counters) * 1e3:.2f} ms per token")
    log(msg + f"; graphs {choices['cuda_graphs']['mode'] or 'off'}, prefetch "
        f"{'on' if choices['prefetch_host']['runs'] else 'off'}")
    if after is not None:
        r.update(after(eng))
    del eng, experts
    return r


@variant("plan_gpu_only")
def plan_gpu_only(b, ctx: dict) -> dict:
    """int8 hot half / ternary2 cold half, every expert in HBM."""
    return run_plan(b, ctx, "plan_gpu_only", *b.plans["int8hot_ternary2cold_gpu"])


@variant("plan_gpu_host")
def plan_gpu_host(b, ctx: dict) -> dict:
    """The calibrated hot half int8 in HBM, the cold half ternary2 in pinned host RAM."""
    return run_plan(b, ctx, "plan_gpu_host", *b.plans["int8hot_ternary2cold_host"])


@variant("plan_gpu_host_skip")
def plan_gpu_host_skip(b, ctx: dict) -> dict:
    """plan_gpu_host with route-tail-skip from rank --skip-tail-from: cold picks of lower rank not
    staged by prefetch contribute nothing (on the fused path: decided on the device)."""
    return run_plan(b, ctx, "plan_gpu_host_skip", *b.plans["int8hot_ternary2cold_host"],
                    skip_tail_from=b.args.skip_tail_from or max(1, b.cfg.top_k // 2))


def ssd_pack(b, ctx: dict, home) -> tuple[Path, dict]:
    """The cold half's pack file, written once for every ssd variant (page cache dropped after)."""
    if "ssd_pack" not in ctx:
        precision, _ = b.plans["int8hot_ternary2cold_host"]
        path = ctx["pack_dir"] / "experts.ssd"
        t0 = time.perf_counter()
        index = write_ssd_pack(b.hf, precision, home, path)
        info = {"pack_bytes": path.stat().st_size, "cold_record_bytes": sum(e["read_bytes"] for e in index["experts"]),
                "write_s": time.perf_counter() - t0}
        ctx["ssd_pack"] = (path, info)
    path, info = ctx["ssd_pack"]
    return path, {**info, "page_cache_dropped": drop_page_cache(path)}


def unseen_prompt_pass(b, ctx: dict, eng, path: Path) -> dict:
    """One pass of a prompt no earlier pass of this engine decoded (its own seed; the best-of-reps
    rate repeats one prompt, so its host-RAM cache has seen that sequence before), with the page
    cache dropped first and decode-ahead off (decode_counters): its tok/s, counters, bound and hit
    rates. The caches hold what the earlier passes left, as a server's would after other requests."""
    g = torch.Generator().manual_seed(2026)
    prompt = torch.randint(0, b.cfg.vocab_size, (len(b.prompt),), generator=g).tolist()
    dropped = drop_page_cache(path)
    c = decode_counters(eng, prompt, b.n_long, rate=True)
    bound = tier_bound(b, ctx, c)
    out = {"tok_s": c.pop("tok_s"), "counters": c, "hit_rates": hit_rates(c), "bound": bound,
           "page_cache_dropped": dropped}
    out["pct_of_bound"] = 100 * out["tok_s"] / bound["tok_s"] if bound.get("tok_s") else None
    disk = out["hit_rates"]["ssd"]["read_from_disk"]
    log(f"  unseen prompt, one pass (decode-ahead off, page cache {'dropped' if dropped else 'kept'}): "
        f"{out['tok_s']:.2f} tok/s; bound {bound['tok_s'] or float('nan'):.1f}"
        + (f" -> {out['pct_of_bound']:.1f}% of it" if out["pct_of_bound"] is not None else "")
        + (f"; ssd picks from disk {100 * disk:.1f}%" if disk is not None else ""))
    return out


def run_ssd_plan(b, ctx: dict, name: str, whole: bool = False, **decode_changes) -> dict:
    """The hot half in HBM; the cold half in a pack file on disk behind a host-RAM cache of
    --ssd-cache-fraction of the cold records (a fresh, empty cache per variant), read on
    --ssd-threads threads in --ssd-chunk-kib chunks (whole: on --whole-threads threads, one read per
    record); then unseen_prompt_pass (under "unseen_prompt")."""
    precision, _ = b.plans["int8hot_ternary2cold_host"]
    home = [["gpu" if e in b.hot[l] else "ssd" for e in range(b.cfg.num_experts)] for l in range(b.cfg.num_layers)]
    path, info = ssd_pack(b, ctx, home)
    cache = int(b.args.ssd_cache_fraction * info["cold_record_bytes"])
    threads, chunk = (b.args.whole_threads, 0) if whole else (b.args.ssd_threads, b.args.ssd_chunk_kib << 10)
    disk = DiskTier.open(path, cache_bytes=cache, threads=threads, pin=b.device.type == "cuda", chunk_bytes=chunk)
    try:
        r = run_plan(b, ctx, name, precision, home, disk=disk,
                     after=lambda eng: {"unseen_prompt": unseen_prompt_pass(b, ctx, eng, path)}, **decode_changes)
        r["ssd"] = {**info, "host_cache_fraction": b.args.ssd_cache_fraction, **disk.stats()}
        r["disk_random_Bps"], _ = disk_bandwidth(ctx)
    finally:
        disk.close()
    return r


@variant("plan_gpu_host_ssd")
def plan_gpu_host_ssd(b, ctx: dict) -> dict:
    """The SSD plan with the runner's default choices (on CUDA: the fused SSD path; no guesses, so
    every read starts when its layer's routing is on the host)."""
    return run_ssd_plan(b, ctx, "plan_gpu_host_ssd")


@variant("plan_gpu_host_ssd_whole")
def plan_gpu_host_ssd_whole(b, ctx: dict) -> dict:
    """plan_gpu_host_ssd with whole-record reads on --whole-threads threads."""
    return run_ssd_plan(b, ctx, "plan_gpu_host_ssd_whole", whole=True)


def guesses(b) -> dict:
    """The prefetch settings that make the SSD path guess (CUDA only: prefetch needs the fused
    kernels, so the CPU smoke run's guess variants run without)."""
    return dict(prefetch_host=True, prefetch_early=True) if b.device.type == "cuda" else {}


@variant("plan_gpu_host_ssd_guess")
def plan_gpu_host_ssd_guess(b, ctx: dict) -> dict:
    """The SSD plan with guesses: reads also started from the guess one layer ahead."""
    return run_ssd_plan(b, ctx, "plan_gpu_host_ssd_guess", **guesses(b))


@variant("plan_gpu_host_ssd_guess_whole")
def plan_gpu_host_ssd_guess_whole(b, ctx: dict) -> dict:
    """plan_gpu_host_ssd_guess with whole-record reads on --whole-threads threads."""
    return run_ssd_plan(b, ctx, "plan_gpu_host_ssd_guess_whole", whole=True, **guesses(b))


@variant("plan_gpu_host_ssd_ahead")
def plan_gpu_host_ssd_ahead(b, ctx: dict) -> dict:
    """The SSD plan with guesses from each of the --ssd-lookahead layers before a layer."""
    return run_ssd_plan(b, ctx, "plan_gpu_host_ssd_ahead", **guesses(b), ssd_lookahead=b.args.ssd_lookahead)


@variant("plan_gpu_host_ssd_ahead_whole")
def plan_gpu_host_ssd_ahead_whole(b, ctx: dict) -> dict:
    """plan_gpu_host_ssd_ahead with whole-record reads on --whole-threads threads."""
    return run_ssd_plan(b, ctx, "plan_gpu_host_ssd_ahead_whole", whole=True, **guesses(b),
                        ssd_lookahead=b.args.ssd_lookahead)


# ---- the run ----------------------------------------------------------------------------------------

def wait_per_token(counters: dict) -> float:
    """Seconds a decode step waited on SSD reads, on average."""
    return counters["ssd_wait_s"] / max(1, counters["decode_steps"])


def read_per_wait(r: dict) -> float:
    """An SSD plan's disk bytes per second the decode waited on its reads (B/s; nan without waits)."""
    wait = wait_per_token(r["counters"])
    return r["bound"]["disk_bytes_read_per_token"] / wait if wait > 0 else float("nan")


def table(R: dict) -> str:
    lines = []
    d = R["variants"].get("disk_read")
    if d:
        qs = list(d["sequential"])
        lines.append(f"disk: {d['records']} records of {d['record_bytes'] / 1e6:.2f} MB "
                     f"({'O_DIRECT' if d['sequential'][qs[0]]['o_direct'] else d['sequential'][qs[0]]['o_direct_reason']})")
        lines.append(f"{'threads':>8s} {'seq GB/s':>9s} {'rand GB/s':>10s} "
                     f"{'one record in ' + str(d['chunk_bytes'] >> 10) + ' KiB chunks GB/s':>34s}")
        for q in qs:
            one = d.get("one_record", {}).get(q)
            lines.append(f"{q:>8s} {d['sequential'][q]['Bps'] / 1e9:9.2f} {d['random'][q]['Bps'] / 1e9:10.2f} "
                         + (f"{one['Bps'] / 1e9:34.2f}" if one else f"{'-':>34s}"))
    lines.append("bound: HBM + PCIe + disk times added; overlap: the slowest tier's time alone (tok/s)")
    lines.append(f"{'plan':30s} {'tok/s':>8s} {'bound':>8s} {'% bound':>8s} {'overlap':>8s} {'gpu %':>6s} {'host %':>7s} "
                 f"{'host@gpu %':>10s} {'skipped %':>9s} {'ssd %':>6s} {'ssd@gpu %':>9s} {'ssd@ram %':>9s} "
                 f"{'ssd@disk %':>10s} {'(guessed) %':>11s} {'unseen tok/s':>12s} {'% its bound':>11s}")

    def pct(x):
        return f"{100 * x:.1f}" if x is not None else "-"

    def unseen(r):
        u = r.get("unseen_prompt")
        if not u:
            return f" {'-':>12s} {'-':>11s}"
        return f" {u['tok_s']:12.2f} {(u['pct_of_bound'] or float('nan')):11.1f}"
    for name, r in R["variants"].items():
        if not name.startswith("plan_"):
            continue
        hr = r["hit_rates"]
        lines.append(f"{name:30s} {r['tok_s']:8.2f} {r['bound']['tok_s'] or float('nan'):8.1f} "
                     f"{(r['pct_of_bound'] or float('nan')):8.1f} {r['bound'].get('tok_s_overlapped') or float('nan'):8.1f} "
                     f"{pct(hr['gpu']['share_of_picks']):>6s} "
                     f"{pct(hr['host']['share_of_picks']):>7s} {pct(hr['host']['served_from_gpu_memory']):>10s} "
                     f"{pct(hr['host']['route_tail_skips']):>9s} "
                     f"{pct(hr['ssd']['share_of_picks']):>6s} {pct(hr['ssd']['gpu_cache_hits']):>9s} "
                     f"{pct(hr['ssd']['host_ram_cache_hits']):>9s} {pct(hr['ssd']['read_from_disk']):>10s} "
                     f"{pct(hr['ssd']['read_early_for_a_guess']):>11s}" + unseen(r))
    ssd = {n: r for n, r in R["variants"].items() if n.startswith("plan_") and "ssd" in r}
    if ssd:
        lines.append("SSD plans: reader threads x read chunk (whole: one read per record), the disk's best random-read rate "
                     "in this call, tok/s, % of bound; unseen prompt (page cache dropped); the bytes read from disk "
                     "over the time the decode waited for them (above the disk's rate where reads overlap the decode)")
        lines.append(f"{'plan':30s} {'read path':>13s} {'disk GB/s':>9s} {'tok/s':>7s} {'bound':>6s} {'% bound':>7s} "
                     f"{'unseen tok/s':>12s} {'% bound':>7s} {'read/wait GB/s':>14s}")
        for name, r in ssd.items():
            u = r.get("unseen_prompt") or {}
            chunk = r["ssd"]["read_chunk_bytes"]
            path = f"{r['ssd']['read_threads']} x {f'{chunk >> 10} KiB' if chunk else 'whole'}"
            lines.append(f"{name:30s} {path:>13s} {(r.get('disk_random_Bps') or float('nan')) / 1e9:9.2f} "
                         f"{r['tok_s']:7.2f} {r['bound']['tok_s'] or float('nan'):6.1f} "
                         f"{(r['pct_of_bound'] or float('nan')):7.1f} {u.get('tok_s', float('nan')):12.2f} "
                         f"{(u.get('pct_of_bound') or float('nan')):7.1f} {read_per_wait(r) / 1e9:14.2f}")
    for name, err in R["errors"].items():
        lines.append(f"FAILED {name}: {err}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    decode_bench.common_args(ap, "tiny shape on the CPU (torch path), pack files in a tmp dir",
                            "directory for tiers_h200.json / .txt", 48)
    ap.add_argument("--threads", default="1,2,4,8,16", help="disk_read's reader thread counts (queue depths)")
    ap.add_argument("--disk-gib", type=float, default=4.0, help="disk_read's pack file size")
    ap.add_argument("--disk-read-gib", type=float, default=1.0, help="bytes read per disk_read run")
    ap.add_argument("--ssd-cache-fraction", type=float, default=0.5,
                    help="plan_gpu_host_ssd: host-RAM cache size as a share of the cold records' bytes")
    ap.add_argument("--ssd-threads", type=int, default=8,
                    help="plan_gpu_host_ssd*: the SSD tier's reader threads (the chunked candidate; the engine's "
                         f"default is {READ_THREADS})")
    ap.add_argument("--ssd-chunk-kib", type=int, default=256,
                    help="plan_gpu_host_ssd* and disk_read's one-record reads: the read chunk in KiB (the chunked "
                         f"candidate; the engine's default is {READ_CHUNK_BYTES >> 10}: one read per record)")
    ap.add_argument("--whole-threads", type=int, default=4,
                    help="plan_gpu_host_ssd*_whole: reader threads for whole-record reads (one read per record)")
    ap.add_argument("--ssd-lookahead", type=int, default=3,
                    help="plan_gpu_host_ssd_ahead: DecodeConfig.ssd_lookahead (layers ahead a guess starts reads)")
    ap.add_argument("--skip-tail-from", type=int, default=None,
                    help="plan_gpu_host_skip: the first rank skipped (default: half of top-k)")
    ap.add_argument("--pack-dir", default=None, help="where pack files go (default: ./.tiers_pack; --small: a tmp dir)")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(VARIANTS))
        return {}
    if args.small:
        args.tokens, args.prompt_len, args.reps = 8, 12, 1
        args.threads, args.disk_gib, args.disk_read_gib = "1,2,4", 0.016, 0.008
    names = decode_bench.pick_variants(args, VARIANTS)
    tmp = tempfile.TemporaryDirectory(prefix="tiers_pack_") if args.small and not args.pack_dir else None
    pack_dir = Path(tmp.name if tmp else args.pack_dir or ".tiers_pack")
    pack_dir.mkdir(parents=True, exist_ok=True)
    # decode_bench's setup (decode_h200.py's too): the model, copy and pinned H2D bandwidths, the prompt,
    # bf16 routing and the calibrated hot halves (it writes nothing)
    b = decode_bench.setup(args)
    R = b.R
    R.update(variants={}, errors={}, skipped=[n for n in VARIANTS if n not in names], pack_dir=str(pack_dir),
             run="cpu smoke (--small): tiny shape, torch path; not GPU figures" if args.small else "gpu",
             args=vars(args))
    ctx = {"pack_dir": pack_dir}
    decode_bench.run_variants(b, names, {n: functools.partial(fn, ctx=ctx) for n, fn in VARIANTS.items()},
                              "tiers_h200.json")
    text = table(R)
    (b.out_dir / "tiers_h200.txt").write_text(text + "\n")
    log("")
    log(text)
    if "ssd_pack" in ctx:
        ctx["ssd_pack"][0].unlink(missing_ok=True)
    if tmp:
        tmp.cleanup()
    return R


if __name__ == "__main__":
    main()
