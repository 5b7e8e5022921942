"""NVML sampler: GPU memory, power, energy counter, utilisation and clocks of one or several GPUs,
read by one background thread.

Usage (the run wires it):
    probe = NvmlProbe(interval_ms=100, gpu_indices=[0, 1])      # or "all", or gpu_index=0
    if probe.available:
        probe.start(run_dir, idle_s=0)   # sampling starts; no work yet
        probe.mark("load"); ...          # load the model, warm it up
        probe.measure_idle(5.0)          # the "baseline_idle" window: loaded, warm, nothing running
        probe.mark("prefill", at=t); probe.count_tokens(prefill=n, decode=m)
        info = probe.stop()              # writes nvml_samples.parquet (or .csv) and nvml_phases.json

Every tick reads every card at the same instant `t`; the samples file holds one row per (tick, card)
with the card's NVML index in column `gpu`. The summary gives each card's memory and energy under
"gpus" and, as its headline "memory"/"energy", the one card's figures or, with several cards, the
figures of their per-tick sum ("sum": memory used by the whole rig at once, energy of all cards).
Where NVML is absent (no driver, no GPU: this CPU machine) `available` is False with `reason`, and
every method is a harmless no-op, so the run goes on.

Counters (they differ; the samples keep each under its own column):
  mem_used_bytes / mem_free_bytes / mem_reserved_bytes  nvmlDeviceGetMemoryInfo v2 (used excludes reserved)
  power_instant_w / power_avg_w                          field values NVML_FI_DEV_POWER_INSTANT / _AVERAGE
  power_usage_w                                          nvmlDeviceGetPowerUsage (a ~1 s average on H100/H200)
  energy_mj                                              nvmlDeviceGetTotalEnergyConsumption (mJ since driver load)
"""
from __future__ import annotations

import io
import json
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypedDict

from moebench.json_fields import is_of
from moebench.json_types import JsonObject
from moebench.probes.energy import Sample, TariffTable, Tariffs, summarize_cards
from moebench.probes.records import CardsSummary, PhaseTokens
from moebench.store import write_bytes_atomic, write_json_atomic

FI_POWER_INSTANT = 186    # NVML_FI_DEV_POWER_INSTANT
FI_POWER_AVERAGE = 185    # NVML_FI_DEV_POWER_AVERAGE
BASELINE_IDLE = "baseline_idle"

SAMPLE_COLUMNS = ("t", "gpu", "mem_total_bytes", "mem_used_bytes", "mem_free_bytes", "mem_reserved_bytes",
                  "power_instant_w", "power_avg_w", "power_usage_w", "energy_mj",
                  "sm_util_pct", "mem_util_pct", "sm_clock_mhz", "mem_clock_mhz")


def _field_value(v: Any) -> float | None:
    """A c_nvmlFieldValue_t as a number (None where the field did not answer)."""
    if getattr(v, "nvmlReturn", 1) != 0:
        return None
    kind = v.valueType
    val = v.value
    return float({0: val.dVal, 1: val.uiVal, 2: val.ulVal, 3: val.ullVal, 4: val.sllVal,
                  5: val.siVal, 6: getattr(val, "usVal", 0)}.get(kind, val.ullVal))


def resolve_gpu_indices(spec: Any, count: int, where: str = "gpu_indices") -> list[int]:
    """[indices] from `"all"`, an int or a list of ints, checked against the `count` cards NVML sees."""
    if spec == "all":
        return list(range(count))
    items = [spec] if is_of(spec, (int,)) else spec
    if not isinstance(items, (list, tuple)) or not items or any(
            not isinstance(i, int) or isinstance(i, bool) for i in items):
        raise ValueError(f"{where}: expected \"all\", a GPU index or a non-empty list of GPU indices, got {spec!r}")
    bad = [i for i in items if not 0 <= i < count]
    if bad:
        raise ValueError(f"{where}: GPU index {bad[0]} does not exist (NVML sees {count} GPU(s): 0..{count - 1})")
    if len(set(items)) != len(items):
        raise ValueError(f"{where}: GPU indices repeat: {list(items)!r}")
    return list(items)


class GpuName(TypedDict):
    index: int
    name: str


class NvmlIdentity(TypedDict):
    """The sampled cards as the manifest's probes.nvml names them (JSON: spread into stop()'s report)."""

    gpu_name: str               # the first card's
    driver: str
    gpus: list[GpuName]


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class NvmlReader:
    """Several GPUs through pynvml (or a module with its API: `nvml`); `read()` returns one sample
    per card (missing counters as None), each with the card's index under "gpu"."""

    def __init__(self, gpu_indices: Any = 0, nvml: Any = None):
        if nvml is None:
            import pynvml as nvml        # nvidia-ml-py
        self.nv = nvml
        nvml.nvmlInit()
        try:
            self.indices = resolve_gpu_indices(gpu_indices, int(nvml.nvmlDeviceGetCount()))
            self.handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in self.indices]
            self.names = [_text(nvml.nvmlDeviceGetName(h)) for h in self.handles]
            self.driver = _text(nvml.nvmlSystemGetDriverVersion())
        except Exception:
            nvml.nvmlShutdown()
            raise
        # per card: older drivers lack the field values or the v2 memory call
        self.has_fields = [True] * len(self.handles)
        self.has_memory_v2 = [True] * len(self.handles)

    def read(self) -> list[Sample]:
        return [self._read_card(c) for c in range(len(self.handles))]

    def _read_card(self, c: int) -> Sample:
        nv, h = self.nv, self.handles[c]
        s: Sample = {"gpu": self.indices[c]}
        try:
            if self.has_memory_v2[c]:
                m = nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2)
                s["mem_reserved_bytes"] = int(m.reserved)
            else:
                m = nv.nvmlDeviceGetMemoryInfo(h)
            s.update(mem_total_bytes=int(m.total), mem_used_bytes=int(m.used), mem_free_bytes=int(m.free))
        except nv.NVMLError:
            if self.has_memory_v2[c]:        # older drivers: v1 (used then includes reserved)
                self.has_memory_v2[c] = False
        if self.has_fields[c]:
            try:
                vals = nv.nvmlDeviceGetFieldValues(h, [FI_POWER_INSTANT, FI_POWER_AVERAGE])
                inst, avg = (_field_value(v) for v in vals)
                s["power_instant_w"] = inst / 1000.0 if inst is not None else None
                s["power_avg_w"] = avg / 1000.0 if avg is not None else None
                if inst is None and avg is None:
                    self.has_fields[c] = False
            except nv.NVMLError:
                self.has_fields[c] = False
        for key, fn in (("power_usage_w", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),
                        ("energy_mj", lambda: float(nv.nvmlDeviceGetTotalEnergyConsumption(h)))):
            try:
                s[key] = fn()
            except nv.NVMLError:
                s[key] = None
        try:
            u = nv.nvmlDeviceGetUtilizationRates(h)
            s["sm_util_pct"], s["mem_util_pct"] = float(u.gpu), float(u.memory)
        except nv.NVMLError:
            pass
        for key, clock in (("sm_clock_mhz", nv.NVML_CLOCK_SM), ("mem_clock_mhz", nv.NVML_CLOCK_MEM)):
            try:
                s[key] = float(nv.nvmlDeviceGetClockInfo(h, clock))
            except nv.NVMLError:
                pass
        return s

    def identity(self) -> NvmlIdentity:
        return {"gpu_name": self.names[0], "driver": self.driver,
                "gpus": [{"index": i, "name": n} for i, n in zip(self.indices, self.names)]}

    def close(self) -> None:
        try:
            self.nv.nvmlShutdown()
        except Exception:
            pass


@dataclass(frozen=True)
class PhaseMark:
    """The work entered `phase` at `t` seconds after the probe started (nvml_phases.json's rows)."""

    phase: str
    t: float

    def to_json(self) -> dict[str, str | float]:
        return {"phase": self.phase, "t": self.t}


class NvmlProbe:
    """Background sampler with phase marks. Times are seconds since `start()` (perf_counter based).

    gpu_indices: "all", an index or a list of indices (NVML's numbering); None: `gpu_index`.
    reader: a callable returning one sample dict (one card) or a list of them (several), in place of
    NVML (tests). nvml: a module with pynvml's API in place of pynvml (tests: a fake of N cards)."""

    def __init__(self, interval_ms: int = 100, gpu_index: int = 0, idle_s: float = 1.0,
                 tariffs: Tariffs | TariffTable | None = None,
                 reader: Callable[[], Any] | None = None, gpu_indices: Any = None, nvml: Any = None):
        self.interval_s = max(0.001, interval_ms / 1000.0)
        self.gpu_index = gpu_index
        self.idle_s = idle_s
        self.tariffs = Tariffs.of(tariffs)
        self.available = False
        self.reason: str | None = None
        self.device: NvmlIdentity | None = None     # None where a `reader` stands in for NVML
        self._reader_obj: NvmlReader | None = None
        self._read = reader
        if reader is None:
            spec = gpu_index if gpu_indices is None else gpu_indices
            try:
                self._reader_obj = NvmlReader(spec, nvml=nvml)
                self._read = self._reader_obj.read
                self.device = self._reader_obj.identity()
            except ValueError as e:      # a bad gpu_indices: the user's mistake, said as such
                self.reason = f"NVML probe: {e}"
                return
            except Exception as e:       # ImportError, NVMLError_LibraryNotFound, no such GPU, ...
                self.reason = f"NVML unavailable: {type(e).__name__}: {e}"
                return
        self.available = True
        self.samples: list[Sample] = []
        self.phases: list[PhaseMark] = []
        self.tokens: PhaseTokens = {"prefill": 0, "decode": 0}
        self.read_errors = 0
        self.run_dir: Path | None = None
        self._t0: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- life cycle -------------------------------------------------------------------------------
    def start(self, run_dir: str | Path | None = None, idle_s: float | None = None) -> None:
        """Start sampling; with idle_s > 0, first blocks that long in a "baseline_idle" window."""
        if not self.available or self._thread is not None:
            return
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, name="nvml-probe", daemon=True)
        self._thread.start()
        idle = self.idle_s if idle_s is None else idle_s
        if idle > 0:
            self.measure_idle(idle)

    def measure_idle(self, seconds: float, phase: str = BASELINE_IDLE, then: str = "idle") -> None:
        """Block `seconds` in the `phase` window (nothing must run meanwhile), then mark `then`.
        The run calls it once the model is loaded and warm, so the idle draw is the loaded card's."""
        if not self.available or self._t0 is None or seconds <= 0:
            return
        self.mark(phase)
        time.sleep(seconds)
        self.mark(then)

    def _samples_of(self, got: Any, now: float) -> list[Sample]:
        rows = got if isinstance(got, list) else [got]
        out = []
        for r in rows:
            r = dict(r)
            r.setdefault("gpu", self.gpu_index)
            r["t"] = now
            out.append(r)
        return out

    def _loop(self) -> None:
        assert self._t0 is not None and self._read is not None
        next_t = time.perf_counter()
        while not self._stop.is_set():
            now = time.perf_counter()
            try:
                got = self._read()
            except Exception:
                self.read_errors += 1
                got = []
            rows = self._samples_of(got, now - self._t0)
            with self._lock:
                self.samples.extend(rows)
            next_t += self.interval_s
            delay = next_t - time.perf_counter()
            if delay < 0:                 # fell behind (slow reads): do not burst to catch up
                next_t = time.perf_counter()
                delay = 0
            self._stop.wait(delay)

    def mark(self, phase: str, at: float | None = None) -> None:
        """The work enters `phase` now, or at perf_counter time `at` (marks may arrive late)."""
        if not self.available or self._t0 is None:
            return
        t = (time.perf_counter() if at is None else at) - self._t0
        with self._lock:
            self.phases.append(PhaseMark(str(phase), t))

    def count_tokens(self, prefill: int = 0, decode: int = 0) -> None:
        """Tokens processed inside marked prefill/decode phases (for J/token)."""
        if self.available:
            with self._lock:
                self.tokens["prefill"] += int(prefill)
                self.tokens["decode"] += int(decode)

    def stop(self, tokens: PhaseTokens | None = None,
             tariffs: Tariffs | TariffTable | None = None) -> JsonObject:
        """stop_report(...) as the manifest's probes.nvml: {available, files, n_samples, summary, ...}."""
        return self.stop_report(tokens=tokens, tariffs=tariffs).to_json()

    def stop_report(self, tokens: PhaseTokens | None = None,
                    tariffs: Tariffs | TariffTable | None = None) -> NvmlReport | NoSamples:
        """Stop, write the samples and marks, and report them (NoSamples where NVML is absent or the
        probe never started)."""
        if not self.available:
            return NoSamples(available=False, reason=self.reason)
        if self._thread is None:
            return NoSamples(available=True, reason="never started")
        end = time.perf_counter() - (self._t0 or 0.0)
        self._stop.set()
        self._thread.join(timeout=10)
        # One last sample at or after `end`: the loop's last one can be an interval (more when the
        # thread lags) before it, which cut the last phase's energy short (a 0.2 s phase at 400 W
        # read 359 W on a busy machine).
        try:
            final = self._read() if self._read is not None else None
        except Exception:
            self.read_errors += 1
            final = None
        with self._lock:
            if final is not None:
                self.samples.extend(self._samples_of(final, time.perf_counter() - (self._t0 or 0.0)))
            self.phases.append(PhaseMark("end", end))
            samples = list(self.samples)
            phases = [m.to_json() for m in sorted(self.phases, key=lambda m: m.t)]
        if self._reader_obj is not None:
            self._reader_obj.close()
        cards = sorted({int(s["gpu"]) for s in samples if s.get("gpu") is not None})
        files = write_samples(self.run_dir, samples, phases) if self.run_dir is not None else None
        return NvmlReport(
            interval_ms=self.interval_s * 1000.0, device=self.device, gpu_indices=cards, n_samples=len(samples),
            read_errors=self.read_errors, tokens=dict(tokens or self.tokens), files=files,
            summary=summarize_cards(samples, phases, tokens=tokens or self.tokens,
                                    tariffs=Tariffs.of(tariffs) or self.tariffs))


@dataclass(frozen=True)
class NoSamples:
    """A probe with nothing to report: NVML absent (available False), or never started (no samples)."""

    available: bool
    reason: str | None

    def to_json(self) -> JsonObject:
        if not self.available:
            return {"available": False, "reason": self.reason}
        return {"available": True, "n_samples": 0, "reason": self.reason}


@dataclass(frozen=True)
class NvmlReport:
    """What a probe that sampled reports at stop() (the manifest's probes.nvml)."""

    interval_ms: float
    device: NvmlIdentity | None
    gpu_indices: list[int]
    n_samples: int
    read_errors: int
    tokens: PhaseTokens                     # prefill and decode tokens, for J/token
    files: dict[str, str] | None            # samples_file, phases_file (in the run directory)
    summary: CardsSummary

    def to_json(self) -> JsonObject:
        out: JsonObject = {"available": True, "interval_ms": self.interval_ms, **(self.device or {}),
                               "gpu_indices": self.gpu_indices, "n_samples": self.n_samples,
                               "read_errors": self.read_errors, "tokens": self.tokens}
        out.update(self.files or {})
        out["summary"] = self.summary.to_json()
        return out


def write_samples(run_dir: Path, samples: list[Sample], phases: list[dict[str, str | float]]) -> dict[str, str]:
    """nvml_samples.parquet (csv where pyarrow is missing) and nvml_phases.json into run_dir."""
    import pandas as pd
    run_dir.mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame(samples)
    for c in SAMPLE_COLUMNS:
        if c not in df.columns:
            df[c] = math.nan
    df = df[list(SAMPLE_COLUMNS) + [c for c in df.columns if c not in SAMPLE_COLUMNS]]
    # Written whole and renamed into place: never through a link planted in the run.
    try:
        buf = io.BytesIO()
        df.to_parquet(buf, index=False)
        path = run_dir / "nvml_samples.parquet"
    except ImportError:
        buf = io.BytesIO(df.to_csv(index=False).encode("utf-8"))
        path = run_dir / "nvml_samples.csv"
    write_bytes_atomic(path, buf.getvalue())
    phases_path = run_dir / "nvml_phases.json"
    write_json_atomic(phases_path, phases)
    return {"samples_file": path.name, "phases_file": phases_path.name}


def read_samples(run_dir: str | Path) -> tuple[Any, list[dict[str, str | float]]]:
    """(samples DataFrame, phases) of a run directory, for re-summarising later (column `gpu`: the
    card of each row; one row per card and tick)."""
    import pandas as pd
    d = Path(run_dir)
    pq, csv = d / "nvml_samples.parquet", d / "nvml_samples.csv"
    df = pd.read_parquet(pq) if pq.is_file() else pd.read_csv(csv)
    phases = json.loads((d / "nvml_phases.json").read_text())
    return df, phases
