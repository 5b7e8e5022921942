"""Runtime placement of quantized experts: a device tier, a host tier and a per-layer LRU cache.

`TieredExperts` is a drop-in for the engine's dense `Experts` module (same forward interface):
  forward(x [T, H], topk_ids [T, k] int64, topk_w [T, k]) -> [T, H]
Experts whose home is "gpu" keep their packed tensors on the compute device and are dequantized on
every call. Experts whose home is "host" keep theirs in CPU memory (pinned when the compute device
is CUDA, since pageable copies run several times slower) and are copied on demand into an LRU cache
of `cache_slots` device slots, on a separate CUDA stream when there is one. On a CPU-only machine the
same code runs with "gpu" meaning the compute device; copies into the cache are then real CPU clones,
so the telemetry still counts them.

Experts whose home is "ssd" live in the artifact's pack file (ssd.py): a pick of one is served from
this layer's device cache when it is there, else from the artifact's host-RAM cache (ssd.HostCache,
shared by all layers), else read from the file by the reader threads. Reads are queued as soon as a
call knows its routing, before any expert runs, and waited for only when their expert's turn comes.
With experts_impl "triton" a layer whose ssd records share one layout runs the fused kernels too:
its ssd experts are served from a device stack of slots (`top_k + cache_slots`, an LRU) that the
call fills before its launches, which needs the routing on the host: one host sync per layer, so
no CUDA graphs. With prefetch_host that path also guesses each layer's experts from an earlier
hidden state (the attention input of up to DecodeConfig.ssd_lookahead layers before it) and starts
the guessed records' disk reads then; a wrong guess costs disk time, never correctness.

Steps beyond the fused path run the picked experts one at a time (the per-expert path) or, where
torch's grouped GEMM runs and DecodeConfig.experts_impl asks for it, dequantized into stacks in
expert-id order and multiplied as three grouped GEMMs (the grouped path: prefill on CUDA); a layer
whose experts all live in GPU memory and fit one stack takes that path without a host sync.

Numbers never depend on placement: every expert's output goes into its own (token, rank) cell and
the weighted sum over ranks happens once at the end in a fixed order, so the order in which the tiers
are computed cannot change the result.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from contextlib import contextmanager, nullcontext as _no_stream

import torch
from torch import nn

from .decode_config import DEFAULT, DecodeConfig
from .quantized_expert import QuantizedExpert
from .ssd_slots import SsdSlots

HOMES = ("gpu", "host", "ssd")
# Counted on the host by the per-expert and grouped paths (prefill, no fused kernels) and the fused
# SSD path. calls counts Python forward calls (a replayed CUDA graph makes none); cache_hits/misses
# count experts per call, tokens_host_hit/miss count picks.
HOST_COUNTERS = ("calls", "tokens_gpu", "tokens_host_hit", "tokens_host_miss", "tokens_skipped",
                 "cache_hits", "cache_misses", "bytes_h2d", "ssd_hits", "ssd_gpu_hits", "ssd_misses", "ssd_skips",
                 "ssd_reads", "bytes_ssd_read", "ssd_wait_s", "ssd_guess_reads", "ssd_guess_hits", "bytes_ssd_needed")
# What telemetry() reports per layer: the host counters, plus figures from the per-expert pick
# histograms (host side for the per-expert path, device side for the fused path, so CUDA-graph
# replays count too):
#   routed = picks_gpu + picks_host                      every (token, rank) pick
#   picks_host = host_hits + host_misses + route_tail_skips + host_direct + prefetch_hits
#   host_direct: fused-path host picks read over PCIe in place; prefetch_hits: fused-path host picks
#   that found their expert staged in HBM by prefetch; stage_copies: experts prefetch copied;
#   route_tail_skips: both paths (the fused path's counted by its skip launch).
#   bytes_h2d: cache fills plus prefetch copies; bytes_host_read: in-place reads (host_direct x the
#   expert's bytes: exact for one-token decode steps, an upper bound for several tokens per call).
#   copy_wait_s: time compute waited for cache fills (CUDA events on the GPU, the copy itself on the CPU).
# The SSD tier (counted on the host, by the per-expert and the fused SSD path), in picks unless said:
#   picks_ssd = ssd_hits + ssd_misses + ssd_skips
#   ssd_hits: served without a file read, from the device cache (ssd_gpu_hits, a part of ssd_hits)
#   or the host-RAM cache; ssd_misses: picks of experts whose record came from the file for that
#   call: read on demand, or read by a guess and used for the first time (ssd_guess_hits, a part of
#   ssd_misses); ssd_skips: route-tail-skips of ssd experts; ssd_reads: records this layer started
#   reading (experts, not picks; ssd_guess_reads of them for guesses, used or not); bytes_ssd_read:
#   bytes those reads moved (records are padded to 4096); bytes_ssd_needed: the bytes of the reads a
#   pick used (demand reads, and guessed reads at their first use); ssd_wait_s: time compute waited
#   for reads.  routed = picks_gpu + picks_host + picks_ssd.
COUNTERS = HOST_COUNTERS + ("routed", "picks_gpu", "picks_host", "host_hits", "host_misses", "host_direct",
                            "prefetch_hits", "route_tail_skips", "stage_copies", "bytes_host_read", "copy_wait_s",
                            "picks_ssd")


class TieredExperts(nn.Module):
    """One layer's experts split over a device tier and a host tier (see the module docstring).

    experts: one QuantizedExpert per expert id (any device; they are moved to their home here).
    homes: "gpu" or "host" per expert.
    cache_slots: how many host experts this layer keeps on the device between calls (0 = stream
        every use, nothing kept).
    skip_tail_from: route-tail-skip, off when None. A host or ssd expert that is not in GPU memory
        when a call starts and is ranked at position >= skip_tail_from (0-based column of topk_ids)
        for a token is skipped for that token: its term is 0 and the other experts' weights are left
        unchanged (no renormalisation). In GPU memory means: on the per-expert path, in this layer's
        LRU cache; on the fused path (which never uses the LRU cache), staged by prefetch for this
        call. The fused path decides it on the device (no host sync, CUDA-graph capturable); a graph
        holds the value it was captured with, so set it before decoding (or reconfigure the engine).
    disk, layer: the artifact's ssd.DiskTier and this layer's index in its pack; needed when a home
        is "ssd" (the experts list then holds None, or anything, at those positions).
    """

    def __init__(self, experts: list[QuantizedExpert | None], homes: list[str], device, dtype=torch.bfloat16,
                 cache_slots: int = 2, skip_tail_from: int | None = None, disk=None, layer: int | None = None):
        super().__init__()
        if len(experts) != len(homes):
            raise ValueError(f"TieredExperts: {len(experts)} experts but {len(homes)} homes")
        bad = [(i, h) for i, h in enumerate(homes) if h not in HOMES]
        if bad:
            raise ValueError(f"TieredExperts: expert {bad[0][0]} has home {bad[0][1]!r}; expected one of {HOMES}")
        if cache_slots < 0:
            raise ValueError(f"TieredExperts: cache_slots must be >= 0, got {cache_slots}")
        if skip_tail_from is not None and skip_tail_from < 1:
            raise ValueError(f"TieredExperts: skip_tail_from must be >= 1 or None, got {skip_tail_from}")
        self.device = torch.device(device)
        self.dtype = dtype
        self.homes = list(homes)
        self.cache_slots = cache_slots
        self.skip_tail_from = skip_tail_from
        self.disk, self.layer = disk, layer
        self.has_ssd = "ssd" in self.homes
        if self.has_ssd:
            if disk is None or layer is None:
                raise ValueError("TieredExperts: experts with home 'ssd' need disk (an ssd.DiskTier) and layer")
            absent = [e for e, h in enumerate(homes) if h == "ssd" and (layer, e) not in disk.pack.entries]
            if absent:
                raise ValueError(f"TieredExperts: {disk.pack.path} has no record for layer {layer} expert {absent[0]}")
        on_cuda = self.device.type == "cuda"
        self._stores: list[QuantizedExpert | None] = []
        for e, h in zip(experts, homes):
            if h == "ssd":
                self._stores.append(None)
            elif h == "gpu":
                self._stores.append(e.to(self.device))
            else:
                cpu = e.to("cpu")
                self._stores.append(cpu.pin_memory() if on_cuda else cpu)
        self._copy_stream = torch.cuda.Stream(self.device) if on_cuda else None
        self._cache: OrderedDict[int, QuantizedExpert] = OrderedDict()
        self._fused_groups = None          # set by use_fused_kernels()
        self._prefetch: list = []          # set by enable_prefetch()
        self._pf_pending = False           # an own-stream prefetch the host lane has not waited for
        self._pf_refs = None               # the tensors a prefetch's copies read, kept until joined
        self.decode: DecodeConfig = DEFAULT      # see configure
        E = len(self._stores)
        self._nbytes = torch.tensor([s.nbytes if s is not None else disk.nbytes((layer, e))
                                     for e, s in enumerate(self._stores)], dtype=torch.float64)
        self._is_host = torch.tensor([h == "host" for h in homes])
        self._is_gpu = torch.tensor([h == "gpu" for h in homes])
        self._host_picks = torch.zeros(E, dtype=torch.int64)     # per-expert path, counted on the host
        # fused path, counted inside its launches: [4, E] int32 picks served from the device and host
        # groups / picks served from prefetch's stage / stage copies / route-tail-skips (None until a
        # fused group counts)
        self._dev_counts = None
        self._wait_events: list = []       # (before, after) CUDA timing events around cache-fill waits
        self._top_k = None                 # set by configure
        self._ssd = None                   # the fused SSD path's state (ssd_slots.SsdSlots), set by use_fused_kernels
        self._ssd_guess = False            # prefetch guesses ssd reads (configure: prefetch_host)
        self.segments = None               # the segmented capture under way (segment_with)
        self.reset_telemetry()

    def configure(self, cfg: DecodeConfig, top_k: int) -> None:
        """The ExpertsModule protocol: decode with `cfg`. experts_impl "triton" builds the fused
        groups (use_fused_kernels), cfg.prefetch_host their HBM stage (enable_prefetch); other impls
        keep the per-expert path."""
        self.decode = cfg
        self._top_k = top_k
        if self.has_ssd:
            # the fused SSD path where the layer's ssd records allow it, else the per-expert path
            if cfg.experts_impl == "triton" and self._fused_groups is None and self.ssd_unfusable() is None:
                self.use_fused_kernels(top_k)
            self._ssd_guess = bool(cfg.prefetch_host and self._ssd is not None)
            if self._ssd_guess and self._ssd.guess_out is None:
                self._ssd.alloc_guess(len(self._stores), top_k, self.device, cfg.router_max_tokens)
            return
        if cfg.experts_impl == "triton" and self._fused_groups is None:
            self.use_fused_kernels()
        if cfg.prefetch_host:
            self.enable_prefetch(top_k)

    def ssd_unfusable(self) -> str | None:
        """Why this layer's ssd experts cannot run the fused kernels (None: they can): their records
        must share one layout (format, size, parts) of a format the kernels decode."""
        from .quant import parse_format
        keys = [(self.layer, e) for e, h in enumerate(self.homes) if h == "ssd"]
        layouts = {self.disk.pack.layout(k) for k in keys}
        if len(layouts) != 1:
            return f"{len(layouts)} record layouts (formats) among its ssd experts; the fused path takes one"
        fmt = next(iter(layouts))[0]
        base, rank = parse_format(fmt)
        if rank or base not in {"bf16", "int8", "int4", "int4_asym", "ternary", "ternary2"}:
            return f"ssd format {fmt!r}: the fused kernels do not decode it"
        return None

    def use_fused_kernels(self, top_k: int | None = None) -> None:
        """Run decode (T <= decode.fused_max_tokens) through kernels.fused_moe: experts are re-stacked per
        (format, home) group, host groups in pinned memory the kernels read over PCIe in place, so
        the step has no host sync and no copy (CUDA-graph capturable). The per-expert stores become
        views into the stacks (no duplicate memory); larger T keeps the per-expert path. The
        per-tier token counters are not updated on the fused path (that would need a host sync); the
        pick histograms are (see telemetry). Route-tail-skip (skip_tail_from) is decided on the
        device by one more launch per call, only where skip_tail_from is set (kernels.TailSkip).
        With decode.int8_activations the int8, int4 and ternary2 groups multiply int8-rounded
        activations (kernels.quantize_activations says what they see). A layer with ssd experts
        (their records of one layout: ssd_unfusable) gets a device stack of top_k + cache_slots slots
        for them (see the module docstring); it needs top_k."""
        from . import kernels
        if self.has_ssd:
            why = self.ssd_unfusable()
            if why is not None:
                raise ValueError(f"TieredExperts.use_fused_kernels: layer {self.layer}: {why}")
            if top_k is None:
                raise ValueError(f"TieredExperts.use_fused_kernels: layer {self.layer} has ssd experts: give top_k "
                                 f"(its device slots hold a call's ssd experts)")
            self._top_k = top_k
        by_key: dict[tuple[str, str], list[int]] = {}
        for e, (store, home) in enumerate(zip(self._stores, self.homes)):
            if home != "ssd":
                by_key.setdefault((store.fmt, home), []).append(e)
        E = len(self._stores)
        # the host groups' slot maps are the rows of one tensor: route-tail-skip reads them in one launch
        host_keys = [key for key in by_key if key[1] == "host"]
        host_maps = torch.full((len(host_keys), E), -1, dtype=torch.int32)
        for row, key in enumerate(host_keys):
            host_maps[row, by_key[key]] = torch.arange(len(by_key[key]), dtype=torch.int32)
        self._host_maps = host_maps.to(self.device)
        fused = []
        for (fmt, home), members in by_key.items():
            pin = home == "host" and self.device.type == "cuda"
            device = "cpu" if home == "host" else self.device
            mats = [kernels.PackedMatrix.stack([getattr(self._stores[e], m) for e in members], device, pin=pin)
                    for m in ("gate", "up", "down")]
            if home == "host":
                slot_of = self._host_maps[host_keys.index((fmt, home))]
            elif members == list(range(E)):
                # A device group of every expert in order needs no map: the kernels then skip a
                # dependent load per program (host groups keep theirs: prefetch rewrites it).
                slot_of = None
            else:
                slot_of = torch.full((E,), -1, dtype=torch.int32)
                slot_of[members] = torch.arange(len(members), dtype=torch.int32)
                slot_of = slot_of.to(self.device)
            fused.append(kernels.ExpertGroup(*mats, slot_of, f"{fmt}@{home}", picks=self.device_counter(0)))
            for i, e in enumerate(members):
                self._stores[e] = QuantizedExpert(*(pm.slot(i) for pm in mats))
        if self.has_ssd:
            self._ssd = SsdSlots(self, min(sum(h == "ssd" for h in self.homes), top_k + self.cache_slots))
            fused.append(self._ssd.group)
        self._cache.clear()
        self._fused_groups = fused
        self._cold_maps = self._host_maps          # the maps of the groups that read over PCIe now
        self._prefetch = []

    def device_counter(self, row: int) -> torch.Tensor | None:
        """Row `row` of the device counters that fused groups count into (see _dev_counts), or None
        when decode.count_tier_picks is off."""
        if not self.decode.count_tier_picks:
            return None
        if self._dev_counts is None:
            self._dev_counts = torch.zeros(4, len(self._stores), dtype=torch.int32, device=self.device)
        return self._dev_counts[row]

    def enable_prefetch(self, top_k: int) -> None:
        """Let `prefetch` stage predicted host experts in HBM (fused path, decode of one token).

        Each host group gets a device stage of top_k slots and two dynamic maps: stage_slot_of
        (expert -> stage slot, -1) and the host group's slot_of (its host slot, or -1 once staged), so
        every expert is in exactly one group whatever was predicted. Until a prefetch has run, nothing
        is staged. Costs top_k experts of HBM per host group."""
        from . import kernels
        if self._fused_groups is None:
            raise ValueError("TieredExperts.enable_prefetch: call use_fused_kernels() first")
        if self._prefetch:
            return
        groups, entries = [], []
        # the dynamic maps are rows of one tensor too, in the static maps' order (route-tail-skip's
        # cold maps once prefetching)
        dynamic_maps = self._host_maps.clone()
        rows = iter(range(len(dynamic_maps)))
        for g in self._fused_groups:
            if not g.label.endswith("@host"):
                groups.append(g)
                continue
            static = g.slot_of
            dynamic = kernels.ExpertGroup(g.gate, g.up, g.down, dynamic_maps[next(rows)], g.label, picks=g.picks)
            stage_slot_of = torch.full_like(static, -1)
            stage = kernels.ExpertGroup(*(pm.empty_like(top_k, self.device) for pm in (g.gate, g.up, g.down)),
                                        stage_slot_of, g.label.replace("@host", "@stage"), host_lane=True,
                                        picks=self.device_counter(1))
            groups += [stage, dynamic]
            entries.append((static, dynamic, stage))
        self._fused_groups = groups
        self._prefetch = entries
        self._cold_maps = dynamic_maps
        self._pf_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None  # own_stream
        self._pf_arrivals = torch.zeros(self.decode.router_max_tokens, dtype=torch.int32, device=self.device)
        # the guess's router outputs: allocated once, not on the side stream in every step
        self._pf_out = (torch.empty(1, len(self._stores), dtype=torch.float32, device=self.device),
                        torch.empty(1, top_k, dtype=torch.long, device=self.device),
                        torch.empty(1, top_k, dtype=torch.float32, device=self.device))

    def prefetch(self, h: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool,
                 own_stream: bool = False, ahead: int = 1) -> None:
        """Predict this layer's experts from an earlier hidden state h [1, H] (the previous layer's
        MoE input) with this layer's router, and stage the predicted host experts in HBM, on the
        host lane (kernels.host_lane): the PCIe reads overlap the previous layer's work, and this
        layer's host launches follow them in stream order. Call it after the previous layer's
        experts ran, or their host launches queue behind these copies. own_stream: copy on a stream
        of this layer's instead, which the lane waits for when this layer runs (for guesses made
        before the previous layer's experts ran). A wrong guess costs PCIe time, never correctness
        (unstaged experts are read from host). A layer on the fused SSD path instead starts the disk
        reads of its guessed ssd experts (ahead: how many layers before this one h comes from)."""
        if self._ssd_guess:
            if h.shape[0] == 1:
                self._ssd.guess(h, gate_weight, top_k, renormalize)
            return
        if not self._prefetch or h.shape[0] != 1 or ahead > 1:
            return
        from . import kernels
        stream = None
        if self.device.type == "cuda":
            stream = self._pf_stream if own_stream else kernels.host_lane(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else _no_stream():
            _, ids, _ = kernels.router_topk(h, gate_weight, top_k, renormalize, arrivals=self._pf_arrivals,
                                            out=self._pf_out, cfg=self.decode)
            for static, dynamic, stage in self._prefetch:
                kernels.stage_experts(ids[0], static, dynamic, stage, stage.slot_of, dynamic.slot_of, cfg=self.decode,
                                      copies=self.device_counter(2))
        self._pf_refs = h                   # kept alive until the main stream has joined the lane
        self._pf_pending = own_stream and stream is not None

    def _fused(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor, **kw) -> torch.Tensor:
        """kernels.fused_moe over this layer's groups, after any pending prefetch: the host lane
        (which runs the stage and host groups) waits for an own-stream prefetch; fused_moe's end
        joins the lane into the main stream, which covers the prefetch's reads of h."""
        from . import kernels
        if self._ssd is not None:
            self._ssd.fill(topk_ids)         # every picked ssd expert into a device slot (a host sync)
        if self._pf_pending:
            kernels.host_lane(self.device).wait_stream(self._pf_stream)
            self._pf_pending = False
        skip = None
        if self.skip_tail_from is not None and len(self._cold_maps):
            skip = kernels.TailSkip(self.skip_tail_from, self._cold_maps, self.device_counter(3))
        out = kernels.fused_moe(x, topk_ids, topk_w, self._fused_groups, cfg=self.decode,
                                after_lane=self._pf_refs is not None, tail_skip=skip, **kw)
        self._pf_refs = None
        return out

    def sync_free_tokens(self) -> int:
        """Up to how many tokens forward runs without host syncs (0 unless the fused path is on)."""
        if self._ssd is not None:
            return 0         # the fused SSD path reads the routing on the host
        return self.decode.fused_max_tokens if self._fused_groups is not None else 0

    def segment_tokens(self) -> int:
        """Up to how many tokens a decode step can be captured as CUDA graphs cut at this layer's
        host syncs (the fused SSD path: one cut per call, where its routing reaches the host);
        sync_free_tokens where there are none."""
        if self._ssd is None:
            return self.sync_free_tokens()
        if self.skip_tail_from is not None:
            return 0
        return min(self.decode.fused_max_tokens, self._ssd.slots_n // self._top_k)

    def segment_with(self, segments) -> None:
        """Capture into `segments` (None: stop): the engine's segmented decode graph, whose cut(fn)
        ends the graph being captured (fn runs on the host after that graph's replay, after a
        stream sync) and add_guess(slots) schedules a guess's reads after the current one's."""
        self.segments = segments

    @property
    def prefetching(self) -> bool:
        """Whether prefetch stages anything (enable_prefetch ran) or guesses ssd reads."""
        return bool(self._prefetch) or self._ssd_guess

    @property
    def num_experts(self) -> int:
        return len(self._stores)

    def resident_bytes(self) -> dict[str, int]:
        """Bytes held per tier now: device tier, host tier, the cache's current content, and (layers
        with ssd experts) the ssd experts' stored bytes in the pack file."""
        gpu = sum(s.nbytes for s, h in zip(self._stores, self.homes) if h == "gpu")
        host = sum(s.nbytes for s, h in zip(self._stores, self.homes) if h == "host")
        out = {"gpu": gpu, "host": host, "cache": sum(c.nbytes for c in self._cache.values())}
        if self.has_ssd:
            out["ssd"] = sum(self.disk.nbytes((self.layer, e)) for e, h in enumerate(self.homes) if h == "ssd")
        return out

    def telemetry(self) -> dict[str, int | float]:
        """This layer's counters (see COUNTERS). Reads the device counters: one host sync."""
        c: dict[str, int | float] = dict(self.counters)
        self._resolve_waits()
        picks = self._host_picks.clone()
        staged = copies = skipped = torch.zeros_like(picks)
        if self._dev_counts is not None:
            dev = self._dev_counts.to("cpu", torch.int64)
            picks, staged, copies, skipped = picks + dev[0] + dev[1] + dev[3], dev[1], dev[2], dev[3]
        host = self._is_host
        c["picks_host"] = int(picks[host].sum())
        c["picks_gpu"] = int(picks[self._is_gpu].sum())
        c["picks_ssd"] = int(picks[~host & ~self._is_gpu].sum())
        c["routed"] = c["picks_host"] + c["picks_gpu"] + c["picks_ssd"]
        c["host_hits"], c["host_misses"] = c["tokens_host_hit"], c["tokens_host_miss"]
        c["route_tail_skips"] = c["tokens_skipped"] + int(skipped.sum())
        c["prefetch_hits"] = int(staged.sum())
        fused_host = picks - self._host_picks
        fused_host[~host] = 0
        direct = fused_host - staged - skipped
        c["host_direct"] = int(direct.sum())
        c["stage_copies"] = int(copies.sum())
        c["bytes_h2d"] = int(c["bytes_h2d"] + float((copies.double() * self._nbytes).sum()))
        c["bytes_host_read"] = int(float((direct.double() * self._nbytes).sum()))
        c["copy_wait_s"] = float(self._copy_wait_s)
        return c

    def reset_telemetry(self) -> None:
        self.counters = {k: 0 for k in HOST_COUNTERS}
        self._host_picks.zero_()
        if self._dev_counts is not None:
            self._dev_counts.zero_()
        self._wait_events = []
        self._copy_wait_s = 0.0

    def counter_state(self) -> tuple:
        """A copy of every counter (Engine restores it around CUDA-graph warm-up and capture runs,
        which are not the user's work)."""
        return (dict(self.counters), self._host_picks.clone(),
                None if self._dev_counts is None else self._dev_counts.clone())

    def restore_counters(self, state: tuple) -> None:
        self.counters, picks, dev = dict(state[0]), state[1], state[2]
        self._host_picks.copy_(picks)
        if dev is not None and self._dev_counts is not None:
            self._dev_counts.copy_(dev)

    def _resolve_waits(self) -> None:
        for before, after in self._wait_events:
            after.synchronize()
            self._copy_wait_s += before.elapsed_time(after) / 1000.0
        self._wait_events = []

    def clear_cache(self) -> None:
        self._cache.clear()

    # -- loading ---------------------------------------------------------------------------------
    def _start_copy(self, expert_id: int, src: QuantizedExpert | None = None):
        """Begin copying a host expert (or `src`, an ssd expert in host RAM) to the device; returns
        (device copy, event or None). On the CPU an ssd expert is used in place (no copy)."""
        if src is not None and self._copy_stream is None:
            return src, None
        src = self._stores[expert_id] if src is None else src
        self.counters["bytes_h2d"] += src.nbytes
        if self._copy_stream is None:
            t0 = time.perf_counter()          # on the CPU the copy is the wait
            dst = src.clone()
            self._copy_wait_s += time.perf_counter() - t0
            return dst, None
        with torch.cuda.stream(self._copy_stream):
            dst = src.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        return dst, event

    def _finish_copy(self, dst: QuantizedExpert, event) -> QuantizedExpert:
        if event is not None:
            compute = torch.cuda.current_stream(self.device)
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record(compute)
            compute.wait_event(event)
            after.record(compute)           # after - before: how long compute stalled on the copy
            self._wait_events.append((before, after))
            if len(self._wait_events) > 4096:
                self._resolve_waits()
            dst.record_stream(compute)  # memory born on the copy stream, used on this one
        return dst

    def _remember(self, expert_id: int, weights: QuantizedExpert) -> None:
        self._cache[expert_id] = weights
        self._cache.move_to_end(expert_id)
        while len(self._cache) > self.cache_slots:
            self._cache.popitem(last=False)

    def count_read(self, nbytes: int, guess: bool = False) -> None:
        """A read this layer started (nbytes > 0; 0: none was needed)."""
        if nbytes:
            c = self.counters
            c["ssd_reads"] += 1
            c["bytes_ssd_read"] += nbytes
            c["ssd_guess_reads"] += int(guess)

    def count_ssd_pick(self, e: int, n: int, from_file: bool) -> None:
        """n picks of ssd expert e served from a record in host RAM: just read on demand
        (from_file), or found in the host-RAM cache, where a record a guess read counts as from
        the file at its first use."""
        c = self.counters
        key = (self.layer, e)
        guessed = self.disk.first_use(key)
        if from_file or guessed:
            c["ssd_misses"] += n
            c["ssd_guess_hits"] += n if guessed else 0
            c["bytes_ssd_needed"] += self.disk.pack.read_bytes(key)
        else:
            c["ssd_hits"] += n

    # -- forward ---------------------------------------------------------------------------------
    def partials_ok(self, tokens: int) -> bool:
        """Whether forward_partials runs for this many tokens (the fused kernels are on and cover them)."""
        if self._ssd is not None and (tokens * self._top_k > self._ssd.slots_n or self.skip_tail_from is not None):
            return False     # more ssd experts than slots could be picked; route-tail-skip: per-expert path
        return self._fused_groups is not None and tokens <= self.decode.fused_max_tokens

    def wants_quantized_x(self) -> bool:
        """Whether a fused group multiplies int8 activations: then the caller can hand
        forward_partials x's int8 rows (kernels.add_rmsnorm_router(quantize_h=True))."""
        from . import kernels
        return kernels.wants_quantized_x(self._fused_groups or [], self.decode)

    def forward_partials(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor,
                         xq: torch.Tensor | None = None) -> torch.Tensor:
        """kernels.fused_moe(reduce=False): the float32 terms [T * k, H]; only where partials_ok.
        xq: x's int8 rows (see wants_quantized_x), or None."""
        self.counters["calls"] += 1
        return self._fused(x, topk_ids, topk_w, reduce=False, xq=xq)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        T, k = topk_ids.shape
        c = self.counters
        c["calls"] += 1
        if self.partials_ok(T):
            return self._fused(x, topk_ids, topk_w)
        if self._grouped_runs(x) and self._grouped_in_one_stack(k, x.dtype):
            with self._stack_memory_named():
                contrib = self._grouped_resident(x, topk_ids)
            return (contrib.float() * topk_w.float()[..., None]).sum(dim=1).to(x.dtype)
        active = torch.ones_like(topk_ids, dtype=torch.bool)
        cached_at_start = dict(self._cache)      # kept: a later chunk's fetches may evict them
        if self.skip_tail_from is not None and self.skip_tail_from < k:
            cold = torch.tensor([h != "gpu" and i not in cached_at_start for i, h in enumerate(self.homes)],
                                device=topk_ids.device)
            tail = torch.arange(k, device=topk_ids.device)[None, :] >= self.skip_tail_from
            skipped = cold[topk_ids] & tail
            active &= ~skipped
            if self.has_ssd:
                on_ssd = torch.tensor([h == "ssd" for h in self.homes], device=topk_ids.device)[topk_ids]
                c["ssd_skips"] += int((skipped & on_ssd).sum())
                c["tokens_skipped"] += int((skipped & ~on_ssd).sum())
            else:
                c["tokens_skipped"] += int(skipped.sum())

        self._host_picks.index_add_(0, topk_ids.reshape(-1).cpu(),
                                    torch.ones(topk_ids.numel(), dtype=torch.int64))
        flat_ids = torch.where(active, topk_ids, -1)
        ids_cpu = flat_ids.cpu()
        picks = torch.bincount(ids_cpu[ids_cpu >= 0], minlength=len(self._stores)).tolist()
        needed = [e for e, n in enumerate(picks) if n]
        counts = {e: picks[e] for e in needed}

        # ssd experts not in the device cache: from the host-RAM cache, or read from the file. The
        # reads are queued first, so the reader threads work while everything else computes.
        ssd_ram: dict[int, QuantizedExpert] = {}
        for e in needed:
            if self.homes[e] == "ssd" and e not in cached_at_start:
                rec = self.disk.cached_record((self.layer, e))
                if rec is not None:
                    ssd_ram[e] = rec.expert
                else:
                    self.count_read(self.disk.request((self.layer, e)))

        if self._grouped_runs(x):
            with self._stack_memory_named():
                contrib = self._grouped(x, flat_ids, needed, counts, cached_at_start, ssd_ram)
        else:
            contrib = x.new_zeros(T, k, x.shape[-1])
            for e, weights in self._acquire(needed, counts, cached_at_start, ssd_ram):
                rows, ranks = (flat_ids == e).nonzero(as_tuple=True)
                contrib[rows, ranks] = weights.apply(x[rows])

        # Weighted sum in float32, as the dense Experts module does, so an all-bf16 tiered model
        # stays within rounding of the dense one.
        return (contrib.float() * topk_w.float()[..., None]).sum(dim=1).to(x.dtype)

    def _acquire(self, experts: list[int], counts: dict[int, int], cached_at_start: dict[int, QuantizedExpert],
                 ssd_ram: dict[int, QuantizedExpert]):
        """Yield (expert, its weights on the compute device) for each of `experts`, counting each
        one's picks (counts) by where it was found: resident ones first, then those in this layer's
        cache when the call started (cached_at_start: the cache's contents then), then host misses
        (fetched in chunks of the cache size, the first chunk's copies started before anything is
        yielded, so they overlap the compute of the ones before), then ssd experts from the
        host-RAM cache (ssd_ram) and last those whose file read forward queued. Fetched experts
        enter the cache."""
        c = self.counters
        resident = [e for e in experts if self.homes[e] == "gpu"]
        hits = [e for e in experts if self.homes[e] != "gpu" and e in cached_at_start]
        misses = [e for e in experts if self.homes[e] == "host" and e not in cached_at_start]
        ssd_reads = [e for e in experts if self.homes[e] == "ssd" and e not in cached_at_start and e not in ssd_ram]
        chunk = max(self.cache_slots, 1)
        pending = [(e, *self._start_copy(e)) for e in misses[:chunk]]
        for e in resident:
            c["tokens_gpu"] += counts[e]
            yield e, self._stores[e]
        for e in hits:
            weights = cached_at_start[e]
            if e in self._cache:
                self._cache.move_to_end(e)
            if self.homes[e] == "ssd":
                c["ssd_hits"] += counts[e]
                c["ssd_gpu_hits"] += counts[e]
            else:
                c["tokens_host_hit"] += counts[e]
                c["cache_hits"] += 1
            yield e, weights
        done = chunk
        while pending:
            for e, dst, event in pending:
                weights = self._finish_copy(dst, event)
                self._remember(e, weights)
                c["tokens_host_miss"] += counts[e]
                c["cache_misses"] += 1
                yield e, weights
            pending = [(e, *self._start_copy(e)) for e in misses[done:done + chunk]]
            done += chunk
        for e in experts:
            if e in ssd_ram:
                weights = self._finish_copy(*self._start_copy(e, ssd_ram[e]))
                self._remember(e, weights)
                self.count_ssd_pick(e, counts[e], from_file=False)
                yield e, weights
        for e in ssd_reads:
            rec, waited = self.disk.take((self.layer, e))
            c["ssd_wait_s"] += waited
            weights = self._finish_copy(*self._start_copy(e, rec.expert))
            self._remember(e, weights)
            self.count_ssd_pick(e, counts[e], from_file=True)
            yield e, weights

    # -- the grouped path ------------------------------------------------------------------------
    def _grouped_runs(self, x: torch.Tensor) -> bool:
        """Whether forward's steps beyond the fused path take the grouped path (DecodeConfig's
        experts_impl says when): torch's grouped GEMM takes bf16 on CUDA with 16-byte aligned rows;
        on the CPU it runs when experts_impl is "grouped_mm"."""
        impl = self.decode.experts_impl
        if impl not in ("grouped_mm", "triton") or not hasattr(torch.nn.functional, "grouped_mm"):
            return False
        if x.device.type == "cuda":
            inter, hidden = self._expert_shape()
            return x.dtype == torch.bfloat16 and inter % 8 == 0 and hidden % 8 == 0
        return impl == "grouped_mm"

    def _expert_shape(self) -> tuple[int, int]:
        """(intermediate, hidden): an expert's gate matrix shape, the same for every expert of a layer."""
        store = next((s for s in self._stores if s is not None), None)
        if store is not None:
            return store.gate.shape
        key = next((self.layer, e) for e, h in enumerate(self.homes) if h == "ssd")
        return tuple(self.disk.pack.entries[key]["shapes"]["gate"])

    def _stack_experts(self, dtype: torch.dtype) -> int:
        """How many experts' dequantized gate, up and down one stack of the grouped path holds
        (DecodeConfig.tiered_stack_bytes; at least one)."""
        inter, hidden = self._expert_shape()
        per_expert = 3 * inter * hidden * dtype.itemsize
        return max(1, self.decode.tiered_stack_bytes // per_expert)

    @contextmanager
    def _stack_memory_named(self):
        """An out-of-memory error on the grouped path says which setting sizes its stacks."""
        try:
            yield
        except torch.OutOfMemoryError as e:
            where = "" if self.layer is None else f", layer {self.layer}"
            raise torch.OutOfMemoryError(
                f"{e}\n(tiered experts' grouped path{where}: a stack holds up to "
                f"{self.decode.tiered_stack_bytes / 2**20:g} MiB of dequantized experts: lower "
                f"DecodeConfig.tiered_stack_bytes, the engine profile's tiered_stack_mib)") from e

    def _grouped_in_one_stack(self, k: int, dtype: torch.dtype) -> bool:
        """Whether the grouped path can run without the routing on the host: every expert in GPU
        memory, no route-tail-skip, and all of the layer's experts fit one stack."""
        return (bool(self._is_gpu.all()) and (self.skip_tail_from is None or self.skip_tail_from >= k)
                and self._stack_experts(dtype) >= len(self._stores))

    def _grouped_resident(self, x: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The grouped path of a layer whose experts are all in GPU memory and fit one stack, with no
        host sync: group sizes are counted on the device (so a step needs no routing on the host,
        as the dense experts' grouped GEMM), and every expert is dequantized, picked or not. The
        GEMMs are those of _grouped's single stack (E groups, empty ones included), so the numbers
        are those of the same experts in other homes. Picks are counted in the device histogram
        (count_tier_picks), not in the host counters (as on the fused path)."""
        T, k = topk_ids.shape
        E = len(self._stores)
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        # histc, not bincount: no host sync (bincount sizes its output from the data)
        sizes = torch.histc(flat.float() if flat.device.type == "cpu" else flat.int(), bins=E, min=0, max=E - 1)
        counted = self.device_counter(0)
        if counted is not None:
            counted.add_(sizes.to(counted.dtype))
        offs = torch.cumsum(sizes, 0, dtype=torch.int32)
        stacks = self._dequantized(list(range(E)), enumerate(self._stores), x.dtype)
        y = x.new_empty(T * k, x.shape[-1])
        y[order] = self._swiglu_grouped(x[order // k], stacks, offs)
        return y.view(T, k, -1)

    def _grouped(self, x: torch.Tensor, flat_ids: torch.Tensor, needed: list[int], counts: dict[int, int],
                 cached_at_start: dict[int, QuantizedExpert], ssd_ram: dict[int, QuantizedExpert]) -> torch.Tensor:
        """Every picked expert's output [T, k, H] (0 where a pick was skipped), through torch's
        grouped GEMM: the (token, rank) pairs sorted by expert; the experts split by id into ranges
        of as many as one stack holds (_stack_experts); for each range with picks, its picked
        experts fetched (_acquire) and dequantized into the range's three stacks (each format's
        experts at once; unpicked slots are left unwritten: their groups are empty) and the range's
        pairs multiplied as three grouped GEMMs. The ranges and the GEMMs' shapes depend only on
        the layer's size and the routing, never on where an expert lives, so neither do the numbers."""
        T, k = flat_ids.shape
        E = len(self._stores)
        per_stack = self._stack_experts(x.dtype)
        # skipped pairs (-1) sort after every expert's and are left out of the groups
        key = torch.where(flat_ids >= 0, flat_ids, E).reshape(-1)
        order = torch.argsort(key, stable=True)
        y = x.new_zeros(T * k, x.shape[-1])
        start = 0
        for first in range(0, E, per_stack):
            ids = list(range(first, min(first + per_stack, E)))
            picked = [e for e in ids if e in counts]
            if not picked:
                continue
            sizes = torch.tensor([counts.get(e, 0) for e in ids], dtype=torch.int32)
            offs = torch.cumsum(sizes, 0, dtype=torch.int32).to(x.device)
            stacks = self._dequantized(ids, self._acquire(picked, counts, cached_at_start, ssd_ram), x.dtype)
            n = int(sizes.sum())
            pairs = order[start:start + n]
            y[pairs] = self._swiglu_grouped(x[pairs // k], stacks, offs)
            start += n
        return y.view(T, k, -1)

    @staticmethod
    def _swiglu_grouped(xs: torch.Tensor, stacks: tuple[torch.Tensor, ...], offs: torch.Tensor) -> torch.Tensor:
        """down(silu(gate xs) * up xs) per group of rows of xs (offs: the groups' ends), group g with
        the stacks' slot g."""
        grouped_mm = torch.nn.functional.grouped_mm
        w_gate, w_up, w_down = stacks
        gate = grouped_mm(xs, w_gate.transpose(1, 2), offs=offs)
        up = grouped_mm(xs, w_up.transpose(1, 2), offs=offs)
        return grouped_mm(torch.nn.functional.silu(gate) * up, w_down.transpose(1, 2), offs=offs)

    @staticmethod
    def _dequantized(ids: list[int], acquired, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The gate, up and down stacks [len(ids), out, in] in `dtype`, slot i for expert ids[i], of
        the experts `acquired` yields (expert, weights); slots of experts it does not yield are left
        unwritten. The experts of one format are dequantized together (quant.dequantize_parts over
        their stacked parts), which gives each the same weight as its own QuantizedTensor.dequantize."""
        from .quant import dequantize_parts
        slot = {e: i for i, e in enumerate(ids)}
        by_fmt: dict[str, list[tuple[int, QuantizedExpert]]] = {}
        for e, weights in acquired:
            by_fmt.setdefault(weights.fmt, []).append((slot[e], weights))
        stacks = []
        for m in ("gate", "up", "down"):
            out = None
            for fmt, members in by_fmt.items():
                members.sort(key=lambda pair: pair[0])
                first = getattr(members[0][1], m)
                parts = {name: torch.stack([getattr(w, m).parts[name] for _, w in members])
                         for name in first.parts}
                deq = dequantize_parts(fmt, first.shape, parts, dtype)
                if len(members) == len(ids):
                    out = deq              # one format, every slot: already in slot order
                    break
                if out is None:
                    out = deq.new_empty(len(ids), *first.shape)
                out[torch.tensor([i for i, _ in members], device=deq.device)] = deq
            stacks.append(out.contiguous())    # rows padded to whole groups come back as a strided view
        return tuple(stacks)


def find_tiered(model: nn.Module) -> list[TieredExperts]:
    """Every TieredExperts module in the model, in module order (one per MoE layer)."""
    return [m for m in model.modules() if isinstance(m, TieredExperts)]


def collect_telemetry(model: nn.Module) -> dict:
    """{"layers": [per-layer counters], "total": summed counters} over the model's tiered layers, and
    "disk": the SSD tier's state (ssd.DiskTier.stats: file, O_DIRECT, host-RAM cache) where there is one."""
    mods = find_tiered(model)
    layers = [m.telemetry() for m in mods]
    total = {k: sum(layer[k] for layer in layers) for k in COUNTERS}
    out = {"layers": layers, "total": total}
    disk = next((m.disk for m in mods if m.disk is not None), None)
    if disk is not None:
        out["disk"] = disk.stats()
    return out


def counter_states(model: nn.Module) -> list:
    return [m.counter_state() for m in find_tiered(model)]


def restore_counter_states(model: nn.Module, states: list) -> None:
    for m, st in zip(find_tiered(model), states):
        m.restore_counters(st)


def reset_telemetry(model: nn.Module) -> None:
    for m in find_tiered(model):
        m.reset_telemetry()
