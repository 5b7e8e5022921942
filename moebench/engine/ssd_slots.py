"""The fused SSD path's per-layer state (see placement.py's module docstring): the device slots a
layer's ssd experts are copied into before the fused kernels run, their LRU and expert -> slot map,
and the routing guesses that start disk reads early. A TieredExperts layer with ssd experts on the
fused path owns one (TieredExperts.use_fused_kernels builds it).
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from .quant import parse_format
from .quantized_expert import PART_DTYPES


class SsdSlots:
    """The fused SSD path's state for one layer: a device stack of `n` record-sized slots (an LRU
    over the layer's ssd experts) that one ExpertGroup views part by part, its expert -> slot map,
    and the routing guesses (see TieredExperts.prefetch) whose reads DiskTier runs."""

    def __init__(self, owner, n: int):
        """owner: the layer's placement.TieredExperts (its homes, disk tier, layer, device, decode
        config and counters); n: how many slots."""
        from . import kernels
        self.owner = owner
        self.slots_n = n
        disk, layer = owner.disk, owner.layer
        key = next((layer, e) for e, h in enumerate(owner.homes) if h == "ssd")
        fmt, rb, _ = disk.pack.layout(key)
        entry = disk.pack.entries[key]
        device = owner.device
        self.buf = torch.zeros(n, rb, dtype=torch.uint8, device=device)
        pin = device.type == "cuda"
        E = len(owner.homes)
        self.map_host = torch.full((E,), -1, dtype=torch.int32, pin_memory=pin)
        self.slot_of = torch.full((E,), -1, dtype=torch.int32, device=device)
        self.lru: OrderedDict[int, int] = OrderedDict()      # expert -> slot, least recently used first
        self.ids_host = torch.empty(owner.decode.router_max_tokens * 64, dtype=torch.int64, pin_memory=pin)

        def view(name: str):
            start, dtype, shape = entry["parts"][name]
            dt = PART_DTYPES[dtype]
            count = 1
            for d in shape:
                count *= int(d)
            nbytes = count * torch.empty(0, dtype=dt).element_size()
            return self.buf[:, start:start + nbytes].view(dt).view(n, *shape)

        base, _ = parse_format(fmt)
        mats = []
        for mat in ("gate", "up", "down"):
            rows, cols = entry["shapes"][mat]
            names = {k.split(".", 1)[1] for k in entry["parts"] if k.startswith(mat + ".")}
            if base == "bf16":
                mats.append(kernels.PackedMatrix("dense", view(f"{mat}.w"), rows, cols))
            else:
                mats.append(kernels.PackedMatrix(base, view(f"{mat}.q"), rows, cols, view(f"{mat}.scale"),
                                                 view(f"{mat}.min") if "min" in names else None))
        self.group = kernels.ExpertGroup(*mats, self.slot_of, f"{fmt}@ssd", picks=owner.device_counter(0))
        self.guess_out = None

    def alloc_guess(self, E: int, top_k: int, device, router_max_tokens: int) -> None:
        self.guess_out = (torch.empty(1, E, dtype=torch.float32, device=device),
                          torch.empty(1, top_k, dtype=torch.long, device=device),
                          torch.empty(1, top_k, dtype=torch.float32, device=device))
        self.guess_arrivals = torch.zeros(router_max_tokens, dtype=torch.int32, device=device)
        self.guess_host = torch.empty(top_k, dtype=torch.int64, pin_memory=device.type == "cuda")

    def guess(self, h: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool) -> None:
        """Route h [1, H] with this layer's router and queue the guess: its ids reach the host when
        the next fill syncs (DiskTier.pending_guesses), which starts their reads."""
        from . import kernels
        owner = self.owner
        _, ids, _ = kernels.router_topk(h, gate_weight, top_k, renormalize, arrivals=self.guess_arrivals,
                                        out=self.guess_out, cfg=owner.decode)
        if owner.device.type != "cuda":
            self.guess_host.copy_(ids[0])
        else:
            self.guess_host.copy_(ids[0], non_blocking=True)
            if owner.segments is not None:     # captured: the segment's replay acts on it after its sync
                owner.segments.add_guess(self)
                return
        pending = owner.disk.pending_guesses
        pending[:] = [p for p in pending if p[0] is not self]     # a newer guess replaces an unread one
        event = None
        if owner.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        pending.append((self, event))

    def start_guessed_reads(self) -> None:
        owner = self.owner
        E = len(owner.homes)
        for e in self.guess_host.tolist():
            if 0 <= e < E and owner.homes[e] == "ssd" and e not in self.lru:
                owner.count_read(owner.disk.request((owner.layer, e), guess=True), guess=True)

    def fill(self, topk_ids: torch.Tensor) -> None:
        """Put every ssd expert topk_ids picks into a slot and the map on the device (before the
        call's launches, in stream order). Under a segmented capture (see segment_with) only the
        routing's copy to the host is captured: the segment ends here and its replay runs the rest."""
        owner, disk = self.owner, self.owner.disk
        n = topk_ids.numel()
        if owner.device.type != "cuda":
            ids = topk_ids.reshape(-1).tolist()
        else:
            host = self.ids_host[:n]
            host.copy_(topk_ids.reshape(-1), non_blocking=True)
            if owner.segments is not None:
                owner.segments.cut(lambda: self.fill_host(host.tolist()))
                return
            event = torch.cuda.Event()
            event.record()
            event.synchronize()      # the host sync; earlier guesses' ids are in too
            ids = host.tolist()
        pending, keep = disk.pending_guesses, []
        for slots, ev in pending:
            if ev is None or ev.query():
                slots.start_guessed_reads()
            else:
                keep.append((slots, ev))
        pending[:] = keep
        self.fill_host(ids)

    def fill_host(self, ids: list[int]) -> None:
        """fill's host part, once the routing `ids` (flattened topk_ids) is on the host and the
        guesses made before it have started their reads."""
        owner, disk = self.owner, self.owner.disk
        c = owner.counters
        disk.harvest()
        counts: dict[int, int] = {}
        for e in ids:
            if owner.homes[e] == "ssd":
                counts[e] = counts.get(e, 0) + 1
        load = []
        for e, k in counts.items():
            if e in self.lru:
                self.lru.move_to_end(e)
                c["ssd_hits"] += k
                c["ssd_gpu_hits"] += k
            else:
                load.append(e)
        if not load:
            return
        for e in load:      # reads first, so they run while the host-RAM hits are copied
            if disk.cached_record((owner.layer, e)) is None:
                owner.count_read(disk.request((owner.layer, e)))
        load.sort(key=lambda e: disk.in_flight((owner.layer, e)))
        for e in load:
            key = (owner.layer, e)
            rec = disk.cached_record(key) if not disk.in_flight(key) else None
            from_file = rec is None
            if from_file:
                rec, waited = disk.take(key)
                c["ssd_wait_s"] += waited
            owner.count_ssd_pick(e, counts[e], from_file)
            if len(self.lru) < self.slots_n:
                slot = len(self.lru)
            else:
                victim = next(v for v in self.lru if v not in counts)
                slot = self.lru.pop(victim)
                self.map_host[victim] = -1
            length = int(disk.pack.entries[key]["length"])
            self.buf[slot, :length].copy_(rec.buf[:length], non_blocking=True)
            c["bytes_h2d"] += length
            self.lru[e] = slot
            self.map_host[e] = slot
        self.slot_of.copy_(self.map_host, non_blocking=True)
