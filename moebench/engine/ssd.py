"""The SSD tier: experts kept in one packed file on local disk, a host-RAM LRU cache in front of
it, and reader threads that fetch records while the engine computes.

Pack file (`experts.ssd` in a tiered artifact; written by `write_pack`, read by `ExpertPack`):

    bytes 0..31    header: magic b"MOEBPACK", u32 version, u32 alignment (4096), u64 index length,
                   u64 data start (all little-endian)
    bytes 32..     the index, UTF-8 JSON: {"format", "version", "alignment", "file_bytes", "experts": [
                       {"layer", "expert", "format", "offset", "length", "read_bytes", "crc32",
                        "shapes": {"gate": [I, H], "up": [I, H], "down": [H, I]},
                        "parts": {"gate.q": [offset in record, dtype, shape], ...}}, ...]}
    data start..   one record per expert, each starting on a 4096-byte boundary and padded to a
                   multiple of 4096 (`read_bytes`), so a record is one aligned read with O_DIRECT;
                   inside a record each tensor part starts on a 64-byte boundary. `length` is the
                   record's meaningful bytes, `crc32` their zlib CRC-32.

Reads: `os.preadv` into a caller-owned aligned buffer (pinned when the compute device is CUDA, so
the later host-to-device copy runs at full speed; plain memory on the CPU). The file is opened with
O_DIRECT where the filesystem allows it, so reads go to the device and not the page cache (the page
cache would otherwise hold a second copy of every expert and make the measured tier a RAM tier);
where O_DIRECT is refused (tmpfs, some network filesystems, a non-Linux OS) the open or the first
read fails with EINVAL and the pack falls back to buffered reads, recorded in `ExpertPack.direct`
and `direct_reason`. preadv rather than os.pread: pread returns a new, unaligned bytes object,
which O_DIRECT rejects and which would need one more copy. Both release the GIL while they read, so
the reader threads overlap the engine's compute; several threads keep several requests in flight
(NVMe drives need a queue depth above one for their bandwidth). A record is read in chunks
(`chunk_ranges`, DiskTier's chunk_bytes) that several reader threads (`ReaderPool`) read at once,
so even a layer that misses one record keeps the disk's queue deep.

`HostCache` is an LRU over whole expert records, sized in bytes (the records' read sizes). It is
touched only by the thread that runs the model; reader threads only fill buffers. `DiskTier` keeps
one read in flight per record (a `RecordRead`), whoever asked for it: a layer's routing (on demand) or a guess of it
from an earlier hidden state (placement's fused SSD path), and says which reads guesses made and
whether a pick used them.
"""
from __future__ import annotations

import errno
import functools
import json
import os
import struct
import threading
import time
import zlib
from collections import OrderedDict, deque
from concurrent.futures import Future
from pathlib import Path
from typing import Iterable

import torch

from .quant import QuantizedTensor
from .quantized_expert import PART_DTYPES, QuantizedExpert

PACK_NAME = "experts.ssd"
PACK_FORMAT = "moebench-expert-pack"
PACK_VERSION = 1
MAGIC = b"MOEBPACK"
ALIGN = 4096            # record alignment: the logical block size O_DIRECT needs on common devices
PART_ALIGN = 64         # a tensor part's alignment inside its record
_HEADER = struct.Struct("<8sIIQQ")
MATRICES = ("gate", "up", "down")
# DiskTier's defaults: whole-record reads on 4 threads, the read path of the H200 figures of record;
# chunked reads (e.g. 256 KiB on 8 threads: a 1.3 MB record as 6 reads at once) are opt-in until
# benchmarks/tiers_h200.py times them against it on the H200.
READ_THREADS = 4
READ_CHUNK_BYTES = 0



class PackError(ValueError):
    """A pack file that cannot be read as written; the message names the file and what was expected."""


def _up(n: int, a: int) -> int:
    return -(-n // a) * a


# ================================================================================================
# Writing

def _record(expert: QuantizedExpert) -> tuple[bytes, dict, dict]:
    """(payload bytes, parts {name: [offset, dtype, shape]}, shapes {matrix: shape})."""
    chunks, parts, pos = [], {}, 0
    for mat in MATRICES:
        q: QuantizedTensor = getattr(expert, mat)
        for name, t in q.parts.items():
            t = t.detach().to("cpu").contiguous()
            dtype = str(t.dtype).removeprefix("torch.")
            if dtype not in PART_DTYPES:
                raise PackError(f"write_pack: part {mat}.{name} has dtype {t.dtype}; expected one of {sorted(PART_DTYPES)}")
            start = _up(pos, PART_ALIGN)
            if start > pos:
                chunks.append(b"\0" * (start - pos))
            raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
            chunks.append(raw)
            parts[f"{mat}.{name}"] = [start, dtype, list(t.shape)]
            pos = start + len(raw)
    shapes = {mat: list(getattr(expert, mat).shape) for mat in MATRICES}
    return b"".join(chunks), parts, shapes


def write_pack(path: str | Path, experts: Iterable[tuple[int, int, QuantizedExpert]]) -> dict:
    """Write (layer, expert, QuantizedExpert) records into one pack file at `path` (see the module
    docstring); returns the index. Records are written in the order given."""
    path = Path(path)
    records = []
    for layer, e, qe in experts:
        payload, parts, shapes = _record(qe)
        records.append(({"layer": int(layer), "expert": int(e), "format": qe.fmt, "length": len(payload),
                         "read_bytes": _up(max(len(payload), 1), ALIGN), "crc32": zlib.crc32(payload),
                         "shapes": shapes, "parts": parts}, payload))
    seen = set()
    for entry, _ in records:
        key = (entry["layer"], entry["expert"])
        if key in seen:
            raise PackError(f"write_pack {path}: layer {key[0]} expert {key[1]} given twice")
        seen.add(key)
    # The index holds absolute offsets, which depend on where the data starts: grow the reserved
    # header until the index fits in front of the data.
    data_start = ALIGN
    while True:
        pos = data_start
        for entry, _ in records:
            entry["offset"] = pos
            pos += entry["read_bytes"]
        index = {"format": PACK_FORMAT, "version": PACK_VERSION, "alignment": ALIGN, "file_bytes": pos,
                 "experts": [entry for entry, _ in records]}
        blob = json.dumps(index, separators=(",", ":"), allow_nan=False).encode("utf-8")
        if _HEADER.size + len(blob) <= data_start:
            break
        data_start = _up(_HEADER.size + len(blob), ALIGN)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(_HEADER.pack(MAGIC, PACK_VERSION, ALIGN, len(blob), data_start))
        f.write(blob)
        f.write(b"\0" * (data_start - _HEADER.size - len(blob)))
        for entry, payload in records:
            f.write(payload)
            f.write(b"\0" * (entry["read_bytes"] - len(payload)))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return index


# ================================================================================================
# Reading

def aligned_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """A uint8 tensor of nbytes whose first byte sits on an ALIGN boundary (pinned when `pin`)."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    skip = (-raw.data_ptr()) % ALIGN
    return raw[skip:skip + nbytes]


class ExpertPack:
    """An open pack file: its index, validated on open, and aligned reads of whole records.

    direct: True forces O_DIRECT (an error where refused), False forces buffered reads, None tries
    O_DIRECT and falls back (see the module docstring). verify: check each record's CRC-32 on read.
    """

    def __init__(self, path: str | Path, direct: bool | None = None, verify: bool = False):
        self.path = Path(path)
        self.verify = verify
        if not self.path.is_file():
            raise PackError(f"{self.path}: no pack file (the plan puts experts on ssd; expected the file "
                            f"`moebench tier pack` writes)")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(_HEADER.size)
            if len(head) < _HEADER.size:
                raise PackError(f"{self.path}: {size} bytes, shorter than the {_HEADER.size}-byte pack header")
            magic, version, align, n_index, data_start = _HEADER.unpack(head)
            if magic != MAGIC:
                raise PackError(f"{self.path}: starts with {magic!r}; expected the pack magic {MAGIC!r}")
            if version != PACK_VERSION:
                raise PackError(f"{self.path}: pack version {version}; expected {PACK_VERSION}")
            if align != ALIGN or data_start % ALIGN or _HEADER.size + n_index > data_start:
                raise PackError(f"{self.path}: header says alignment {align}, index {n_index} bytes, data at "
                                f"{data_start}; expected alignment {ALIGN} and the index before the data")
            blob = f.read(n_index)
        try:
            index = json.loads(blob.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise PackError(f"{self.path}: index is not valid JSON ({err})") from None
        if not isinstance(index, dict) or index.get("format") != PACK_FORMAT or not isinstance(index.get("experts"), list):
            raise PackError(f"{self.path}: index has format {index.get('format') if isinstance(index, dict) else None!r};"
                            f" expected {PACK_FORMAT!r} with an 'experts' list")
        if size < index.get("file_bytes", 0):
            raise PackError(f"{self.path}: {size} bytes, the index expects {index['file_bytes']} (truncated?)")
        self.entries: dict[tuple[int, int], dict] = {}
        for i, entry in enumerate(index["experts"]):
            try:
                key = (int(entry["layer"]), int(entry["expert"]))
                off, n, rb = int(entry["offset"]), int(entry["length"]), int(entry["read_bytes"])
                entry["format"], entry["parts"], entry["shapes"]   # noqa: B018 - presence check
            except (KeyError, TypeError, ValueError) as err:
                raise PackError(f"{self.path}: index entry {i} lacks {err}; expected layer, expert, format, "
                                f"offset, length, read_bytes, parts, shapes") from None
            if off % ALIGN or rb % ALIGN or n > rb or off < data_start or off + rb > size:
                raise PackError(f"{self.path}: layer {key[0]} expert {key[1]}: record at {off} (+{rb} bytes, {n} "
                                f"used) is not an aligned record inside the {size}-byte file")
            self.entries[key] = entry
        self.direct, self.direct_reason = False, "buffered reads asked for"
        self._fd_lock = threading.Lock()
        self._fd = self._open(direct)

    def _open(self, direct: bool | None) -> int:
        flag = getattr(os, "O_DIRECT", 0)
        if direct is False:
            return os.open(self.path, os.O_RDONLY)
        if not flag:
            if direct:
                raise PackError(f"{self.path}: O_DIRECT asked for, but this OS has no O_DIRECT")
            self.direct_reason = "this OS has no O_DIRECT"
            return os.open(self.path, os.O_RDONLY)
        try:
            fd = os.open(self.path, os.O_RDONLY | flag)
        except OSError as err:
            if direct or err.errno != errno.EINVAL:
                raise PackError(f"{self.path}: open with O_DIRECT failed ({err})") from None
            self.direct_reason = f"the filesystem refused O_DIRECT ({err.strerror})"
            return os.open(self.path, os.O_RDONLY)
        self.direct, self.direct_reason = True, "O_DIRECT"
        return fd

    def close(self) -> None:
        with self._fd_lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __del__(self):  # noqa: D105
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def keys(self) -> list[tuple[int, int]]:
        return list(self.entries)

    def read_bytes(self, key: tuple[int, int]) -> int:
        """Bytes one read of this record moves (its aligned, padded size)."""
        return int(self.entries[key]["read_bytes"])

    def _pread_into(self, view: memoryview, offset: int) -> None:
        got = 0
        while got < len(view):
            n = os.preadv(self._fd, [view[got:]], offset + got)
            if n <= 0:
                raise PackError(f"{self.path}: read at {offset + got} returned {n} bytes; expected "
                                f"{len(view) - got} more (file shrunk?)")
            got += n

    def read(self, key: tuple[int, int], pin: bool = False) -> tuple[QuantizedExpert, int]:
        """Read one record (from a reader thread or the caller's); returns the expert, whose tensors
        are views into one aligned buffer, and the bytes read."""
        buf, rb = self.read_raw(key, pin)
        return self.expert(key, buf), rb

    def expert(self, key: tuple[int, int], buf: torch.Tensor) -> QuantizedExpert:
        """The expert whose tensors view a record's buffer (as read_raw gave it)."""
        return self._expert(key, self.entries[key], buf)

    def read_raw(self, key: tuple[int, int], pin: bool = False) -> tuple[torch.Tensor, int]:
        """Read one record into a new aligned buffer (uint8 [read_bytes]) with one read; returns it
        and the bytes read. The least Python a reader thread can run: it holds the GIL the model's
        thread needs."""
        entry = self._entry(key)
        rb = int(entry["read_bytes"])
        buf = aligned_buffer(rb, pin)
        self.read_into(key, memoryview(buf.numpy()).cast("B"), 0)
        self.check(key, buf)
        return buf, rb

    def _entry(self, key: tuple[int, int]) -> dict:
        entry = self.entries.get(key)
        if entry is None:
            raise PackError(f"{self.path}: no record for layer {key[0]} expert {key[1]}")
        return entry

    def read_into(self, key: tuple[int, int], view: memoryview, start: int) -> None:
        """Read bytes [start, start + len(view)) of a record into `view` (aligned, as are `start`
        and the length unless the read ends the record): one chunk of a record read by several
        threads (DiskTier), or the whole record. Errors name the file, record and offset."""
        off = int(self._entry(key)["offset"]) + start
        try:
            self._pread_into(view, off)
        except OSError as err:
            if not (self.direct and err.errno == errno.EINVAL):
                raise PackError(f"{self.path}: reading layer {key[0]} expert {key[1]} at {off} "
                                f"(+{len(view)} bytes) failed ({err})") from None
            # the open accepted O_DIRECT but the read did not: reopen buffered, once, for everyone
            with self._fd_lock:
                if self.direct:
                    os.close(self._fd)
                    self._fd = os.open(self.path, os.O_RDONLY)
                    self.direct, self.direct_reason = False, f"the filesystem refused O_DIRECT reads ({err.strerror})"
            self._pread_into(view, off)

    def check(self, key: tuple[int, int], buf: torch.Tensor) -> None:
        """With verify: the CRC-32 of a whole record read into buf, against the index's."""
        if not self.verify:
            return
        entry = self.entries[key]
        n = int(entry["length"])
        crc = zlib.crc32(memoryview(buf.numpy()).cast("B")[:n])
        if crc != int(entry["crc32"]):
            raise PackError(f"{self.path}: layer {key[0]} expert {key[1]}: CRC-32 {crc:#010x} of its {n} bytes "
                            f"at {int(entry['offset'])}; the index expects {int(entry['crc32']):#010x} (corrupt file)")

    def layout(self, key: tuple[int, int]) -> tuple:
        """What fixes where a record's parts sit: (format, read_bytes, parts). Records of equal
        layout can share one device slot stack (placement's fused SSD path)."""
        entry = self.entries[key]
        return (entry["format"], int(entry["read_bytes"]),
                tuple(sorted((name, int(v[0]), v[1], tuple(v[2])) for name, v in entry["parts"].items())))

    def _expert(self, key, entry: dict, buf: torch.Tensor) -> QuantizedExpert:
        mats = {}
        for mat in MATRICES:
            prefix = mat + "."
            parts = {}
            for name, (start, dtype, shape) in entry["parts"].items():
                if not name.startswith(prefix):
                    continue
                dt = PART_DTYPES.get(dtype)
                if dt is None:
                    raise PackError(f"{self.path}: layer {key[0]} expert {key[1]} part {name}: dtype {dtype!r}; "
                                    f"expected one of {sorted(PART_DTYPES)}")
                count = 1
                for s in shape:
                    count *= int(s)
                nbytes = count * torch.empty(0, dtype=dt).element_size()
                if start % PART_ALIGN or start + nbytes > int(entry["length"]):
                    raise PackError(f"{self.path}: layer {key[0]} expert {key[1]} part {name} at {start} (+{nbytes}) "
                                    f"lies outside its {entry['length']}-byte record")
                parts[name[len(prefix):]] = buf[start:start + nbytes].view(dt).view(*shape)
            mats[mat] = QuantizedTensor(entry["format"], tuple(entry["shapes"][mat]), parts)
        return QuantizedExpert(mats["gate"], mats["up"], mats["down"])


# ================================================================================================
# The host-RAM cache and the tier

class HostCache:
    """LRU of expert records in host RAM, at most `capacity` bytes (a record's read size counts).
    A record larger than the whole capacity is not kept."""

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"HostCache: capacity must be >= 0 bytes, got {capacity}")
        self.capacity = int(capacity)
        self._items: OrderedDict[tuple[int, int], tuple[QuantizedExpert, int]] = OrderedDict()
        self.resident = 0
        self.peak = 0
        self.evictions = 0
        self.inserts = 0
        self.evicted: list = []     # keys evicted since the owner last cleared this list

    def __contains__(self, key) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list:
        """Keys from least to most recently used."""
        return list(self._items)

    def get(self, key) -> QuantizedExpert | None:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def put(self, key, expert: QuantizedExpert, nbytes: int) -> bool:
        """Insert as most recently used, evicting the least recently used until it fits; False when
        it is larger than the capacity (then nothing is evicted)."""
        if key in self._items:
            self._items.move_to_end(key)
            return True
        if nbytes > self.capacity:
            return False
        while self.resident + nbytes > self.capacity:
            gone, (_, n) = self._items.popitem(last=False)
            self.resident -= n
            self.evictions += 1
            self.evicted.append(gone)
        self._items[key] = (expert, nbytes)
        self.resident += nbytes
        self.inserts += 1
        self.peak = max(self.peak, self.resident)
        return True

    def clear(self) -> None:
        self._items.clear()
        self.resident = 0


class Record:
    """One expert record in host RAM: its aligned buffer (None for an expert the per-expert path
    kept) and the expert viewing it, made on first use (on the model's thread, not a reader's)."""

    __slots__ = ("buf", "_pack", "_key", "_expert")

    def __init__(self, buf: torch.Tensor | None, pack: ExpertPack | None = None, key=None,
                 expert: QuantizedExpert | None = None):
        self.buf, self._pack, self._key, self._expert = buf, pack, key, expert

    @property
    def expert(self) -> QuantizedExpert:
        if self._expert is None:
            self._expert = self._pack.expert(self._key, self.buf)
        return self._expert


def chunk_ranges(nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Split a record of nbytes (a multiple of ALIGN) into about equal [start, end) chunks of at
    most chunk_bytes (rounded up to ALIGN), each starting on an ALIGN boundary; chunk_bytes 0: one
    chunk, the whole record."""
    if chunk_bytes <= 0 or nbytes <= chunk_bytes:
        return [(0, nbytes)]
    n = -(-nbytes // _up(chunk_bytes, ALIGN))
    step = _up(-(-nbytes // n), ALIGN)
    return [(s, min(s + step, nbytes)) for s in range(0, nbytes, step)]


class RecordRead:
    """One record being read into its aligned buffer, in chunks that reader threads take one by
    one; the thread that ends the last chunk checks the CRC (when the pack verifies) and sets `done`."""

    __slots__ = ("pack", "key", "buf", "view", "chunks", "left", "error", "done", "t0", "seconds", "lock", "guess")

    def __init__(self, pack: ExpertPack, key: tuple[int, int], chunk_bytes: int, pin: bool, guess: bool):
        rb = int(pack._entry(key)["read_bytes"])
        self.pack, self.key, self.guess = pack, key, guess
        self.buf = aligned_buffer(rb, pin)
        self.view = memoryview(self.buf.numpy()).cast("B")
        self.chunks = chunk_ranges(rb, chunk_bytes)
        self.left = len(self.chunks)
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.t0 = time.perf_counter()
        self.seconds = 0.0

    def run(self, i: int) -> None:
        """Read chunk i (on a reader thread)."""
        start, end = self.chunks[i]
        try:
            if self.error is None:
                self.pack.read_into(self.key, self.view[start:end], start)
        except BaseException as err:     # noqa: BLE001 - handed to the waiting thread
            self.error = self.error or err
        with self.lock:
            self.left -= 1
            last = self.left == 0
        if last:
            try:
                if self.error is None:
                    self.pack.check(self.key, self.buf)
            except BaseException as err:  # noqa: BLE001
                self.error = err
            self.seconds = time.perf_counter() - self.t0
            self.done.set()

    def cancel(self, why: str) -> None:
        """Chunks that will never run (the pool closed): wake whoever waits, with an error."""
        self.error = self.error or PackError(f"{self.pack.path}: read of layer {self.key[0]} expert "
                                             f"{self.key[1]} cancelled ({why})")
        self.done.set()

    def result(self) -> torch.Tensor:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.buf


class ReaderPool:
    """Reader threads taking jobs (callables) from two FIFO queues: reads a decode waits for first,
    then reads for guesses. A guessed record asked for on demand moves its queued chunks to the
    first queue (promote), so an on-demand read waits behind at most the chunks already running."""

    def __init__(self, threads: int, name: str = "moebench-ssd"):
        self._cv = threading.Condition()
        self._urgent: deque = deque()
        self._guess: deque = deque()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for t in self._threads:
            t.start()

    def put(self, jobs: list, urgent: bool = True) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError("ReaderPool: closed")
            (self._urgent if urgent else self._guess).extend(jobs)
            self._cv.notify(len(jobs))

    def promote(self, owner) -> None:
        """Move the queued guess jobs of `owner` (a job's __self__, the RecordRead) to the first queue."""
        def of(job) -> bool:
            return getattr(getattr(job, "func", None), "__self__", None) is owner
        with self._cv:
            mine = [j for j in self._guess if of(j)]
            if mine:
                rest = [j for j in self._guess if not of(j)]
                self._guess.clear()
                self._guess.extend(rest)
                self._urgent.extend(mine)

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._urgent and not self._guess and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._urgent.popleft() if self._urgent else self._guess.popleft()
            job()

    def close(self, join: bool = True) -> list:
        """Stop the threads after the jobs now running (join: wait for them); returns the jobs
        that never ran."""
        with self._cv:
            self._closed = True
            left = list(self._urgent) + list(self._guess)
            self._urgent.clear()
            self._guess.clear()
            self._cv.notify_all()
        if join:
            for t in self._threads:
                t.join()
        return left


class DiskTier:
    """One artifact's SSD tier: the pack, the host-RAM cache in front of it and the reader threads.
    Shared by every layer's TieredExperts (keys are (layer, expert)).

    Reads go through `request` (on demand, or from a routing guess: `guess=True`), which keeps one
    read in flight per record and splits it into chunks of `chunk_bytes` (0: one read per record)
    that the `threads` reader threads run in parallel, so a lone record read keeps several requests
    in flight on the disk; every record a layer misses is requested before any is waited for, so a
    layer's misses are all in the disk's queue at once. `take` waits for one and puts it in the
    host-RAM cache; `harvest` moves finished reads there without waiting. On-demand chunks run
    before guessed ones (ReaderPool); guessed records are kept to `threads - 1` in flight. A record
    a guess read and no pick has used yet is in `guessed`: its first use counts as a guessed read
    used (`guess_used`); one evicted unused is wasted. Every method is for the model's thread; the
    reader threads only fill buffers."""

    def __init__(self, pack: ExpertPack, cache_bytes: int = 0, threads: int = READ_THREADS, pin: bool = False,
                 chunk_bytes: int = READ_CHUNK_BYTES):
        if threads < 1:
            raise ValueError(f"DiskTier: threads must be >= 1, got {threads}")
        if chunk_bytes < 0:
            raise ValueError(f"DiskTier: chunk_bytes must be >= 0 (0: whole records), got {chunk_bytes}")
        self.pack = pack
        self.cache = HostCache(cache_bytes)
        self.pin = pin
        self.threads = threads
        self.chunk_bytes = chunk_bytes
        self._pool = ReaderPool(threads)
        self._inflight: dict[tuple[int, int], RecordRead] = {}
        self.guessed: set[tuple[int, int]] = set()
        self.guess_reads = self.guess_used = self.guess_dropped = 0
        self.pending_guesses: list = []    # (TieredExperts, host ids, event): placement's guesses to act on

    @classmethod
    def open(cls, path: str | Path, cache_bytes: int = 0, threads: int = READ_THREADS, pin: bool = False,
             direct: bool | None = None, verify: bool = False, chunk_bytes: int = READ_CHUNK_BYTES) -> "DiskTier":
        return cls(ExpertPack(path, direct=direct, verify=verify), cache_bytes, threads, pin, chunk_bytes)

    def nbytes(self, key: tuple[int, int]) -> int:
        """The expert's stored bytes (its parts; the record read is padded to ALIGN)."""
        return int(self.pack.entries[key]["length"])

    def cached(self, key: tuple[int, int]) -> QuantizedExpert | None:
        """The expert from the host-RAM cache (marked most recently used), or None."""
        rec = self.cache.get(key)
        return None if rec is None else rec.expert

    def cached_record(self, key: tuple[int, int]) -> Record | None:
        """The record from the host-RAM cache (marked most recently used), or None."""
        return self.cache.get(key)

    def submit(self, key: tuple[int, int]) -> Future:
        """Queue one whole-record read of `key` on the reader threads, outside the host-RAM cache
        and the in-flight reads; the future gives (expert, bytes read, seconds)."""
        fut: Future = Future()

        def job():
            t0 = time.perf_counter()
            try:
                expert, n = self.pack.read(key, pin=self.pin)
            except BaseException as err:  # noqa: BLE001 - handed to the future
                fut.set_exception(err)
            else:
                fut.set_result((expert, n, time.perf_counter() - t0))
        self._pool.put([job])
        return fut

    def keep(self, key: tuple[int, int], expert, nbytes: int) -> None:
        """Put a record just read into the host-RAM cache (the model's thread only): an expert
        (the per-expert path's) or a Record."""
        if not isinstance(expert, Record):
            expert = Record(None, expert=expert)
        self._put(key, expert, nbytes)

    def _put(self, key, rec: Record, nbytes: int) -> None:
        self.cache.put(key, rec, nbytes)
        if self.cache.evicted:
            self.guessed.difference_update(self.cache.evicted)      # evicted unused: wasted
            self.cache.evicted.clear()

    # -- reads by request (the fused path) ------------------------------------------------------
    def in_flight(self, key: tuple[int, int]) -> bool:
        return key in self._inflight

    def request(self, key: tuple[int, int], guess: bool = False) -> int:
        """Make sure a read of `key` is under way unless it is in the host-RAM cache or already in
        flight (a guessed read asked for on demand moves up the readers' queue); returns the bytes
        of the read started (0: none). A guess finding `threads - 1` guessed reads in flight is
        dropped (counted in guess_dropped)."""
        read = self._inflight.get(key)
        if read is not None:
            if read.guess and not guess:
                read.guess = False
                self._pool.promote(read)
            return 0
        if key in self.cache:
            return 0
        if guess:
            if sum(r.guess for r in self._inflight.values()) >= self.threads - 1:
                self.guess_dropped += 1
                return 0
            self.guess_reads += 1
            self.guessed.add(key)
        read = RecordRead(self.pack, key, self.chunk_bytes, self.pin, guess)
        self._inflight[key] = read
        self._pool.put([functools.partial(read.run, i) for i in range(len(read.chunks))], urgent=not guess)
        return self.pack.read_bytes(key)

    def take(self, key: tuple[int, int]) -> tuple[Record, float]:
        """Wait for the read of `key` (request it first), keep it in the host-RAM cache; returns the
        record and the seconds waited. A failed read raises its PackError (file, record, offset)."""
        read = self._inflight[key]
        t0 = time.perf_counter()
        try:
            buf = read.result()
        finally:
            del self._inflight[key]
        waited = time.perf_counter() - t0
        rec = Record(buf, self.pack, key)
        self._put(key, rec, self.pack.read_bytes(key))
        return rec, waited

    def harvest(self) -> None:
        """Move every finished read into the host-RAM cache (no waiting)."""
        for key in [k for k, r in self._inflight.items() if r.done.is_set()]:
            self.take(key)

    def first_use(self, key: tuple[int, int]) -> bool:
        """Mark a record as used by a pick; True when a guess read it and this is its first use."""
        if key in self.guessed:
            self.guessed.discard(key)
            self.guess_used += 1
            return True
        return False

    def stats(self) -> dict:
        """What the tier holds now (beside the per-layer counters)."""
        c = self.cache
        return {"file": str(self.pack.path), "records": len(self.pack.entries), "o_direct": self.pack.direct,
                "o_direct_reason": self.pack.direct_reason, "verify": self.pack.verify, "read_threads": self.threads,
                "read_chunk_bytes": self.chunk_bytes,
                "cache_capacity_bytes": c.capacity, "cache_resident_bytes": c.resident, "cache_peak_bytes": c.peak,
                "cache_records": len(c), "cache_inserts": c.inserts, "cache_evictions": c.evictions,
                "guess_reads": self.guess_reads, "guess_used": self.guess_used,
                "guess_unused_now": len(self.guessed), "guess_dropped": self.guess_dropped,
                "guess_wasted": self.guess_reads - self.guess_used - len(self.guessed)}

    def close(self) -> None:
        self._pool.close()
        for read in self._inflight.values():
            read.cancel("the tier closed")
        self._inflight.clear()
        self.pack.close()

    def __del__(self):  # noqa: D105 - a tier dropped unclosed lets its reader threads end
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.close(join=False)
