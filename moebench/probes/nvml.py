"""NVML sampler: GPU memory, power, energy counter, utilisation and clocks in a background thread.

Usage (the run wires it):
    probe = NvmlProbe(interval_ms=100, gpu_index=0)
    if probe.available:
        probe.start(run_dir)          # takes a short "baseline_idle" window first (idle power)
        probe.mark("load"); ...; probe.mark("prefill", at=t); probe.count_tokens(prefill=n, decode=m)
        info = probe.stop()           # writes nvml_samples.parquet (or .csv) and nvml_phases.json
Where NVML is absent (no driver, no GPU: this CPU machine) `available` is False with `reason`, and
every method is a harmless no-op, so the run goes on.

Counters (they differ; the samples keep each under its own column):
  mem_used_bytes / mem_free_bytes / mem_reserved_bytes  nvmlDeviceGetMemoryInfo v2 (used excludes reserved)
  power_instant_w / power_avg_w                          field values NVML_FI_DEV_POWER_INSTANT / _AVERAGE
  power_usage_w                                          nvmlDeviceGetPowerUsage (a ~1 s average on H100/H200)
  energy_mj                                              nvmlDeviceGetTotalEnergyConsumption (mJ since driver load)
"""
from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any, Callable

FI_POWER_INSTANT = 186    # NVML_FI_DEV_POWER_INSTANT
FI_POWER_AVERAGE = 185    # NVML_FI_DEV_POWER_AVERAGE
BASELINE_IDLE = "baseline_idle"

SAMPLE_COLUMNS = ("t", "mem_total_bytes", "mem_used_bytes", "mem_free_bytes", "mem_reserved_bytes",
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


class NvmlReader:
    """One GPU through pynvml; `read()` returns one sample (missing counters as None)."""

    def __init__(self, gpu_index: int = 0):
        import pynvml                    # nvidia-ml-py
        self.nv = pynvml
        pynvml.nvmlInit()
        try:
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(gpu_index)
            name = pynvml.nvmlDeviceGetName(self.handle)
            self.name = name.decode() if isinstance(name, bytes) else str(name)
            drv = pynvml.nvmlSystemGetDriverVersion()
            self.driver = drv.decode() if isinstance(drv, bytes) else str(drv)
        except Exception:
            pynvml.nvmlShutdown()
            raise
        self.has_fields = True
        self.has_memory_v2 = True

    def read(self) -> dict[str, Any]:
        nv, h = self.nv, self.handle
        s: dict[str, Any] = {}
        try:
            if self.has_memory_v2:
                m = nv.nvmlDeviceGetMemoryInfo(h, version=nv.nvmlMemory_v2)
                s["mem_reserved_bytes"] = int(m.reserved)
            else:
                m = nv.nvmlDeviceGetMemoryInfo(h)
            s.update(mem_total_bytes=int(m.total), mem_used_bytes=int(m.used), mem_free_bytes=int(m.free))
        except nv.NVMLError:
            if self.has_memory_v2:           # older drivers: v1 (used then includes reserved)
                self.has_memory_v2 = False
        if self.has_fields:
            try:
                vals = nv.nvmlDeviceGetFieldValues(h, [FI_POWER_INSTANT, FI_POWER_AVERAGE])
                inst, avg = (_field_value(v) for v in vals)
                s["power_instant_w"] = inst / 1000.0 if inst is not None else None
                s["power_avg_w"] = avg / 1000.0 if avg is not None else None
                if inst is None and avg is None:
                    self.has_fields = False
            except nv.NVMLError:
                self.has_fields = False
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

    def identity(self) -> dict[str, Any]:
        return {"gpu_name": self.name, "driver": self.driver}

    def close(self) -> None:
        try:
            self.nv.nvmlShutdown()
        except Exception:
            pass


class NvmlProbe:
    """Background sampler with phase marks. Times are seconds since `start()` (perf_counter based)."""

    def __init__(self, interval_ms: int = 100, gpu_index: int = 0, idle_s: float = 1.0,
                 tariffs: dict[str, Any] | None = None,
                 reader: Callable[[], dict[str, Any]] | None = None):
        self.interval_s = max(0.001, interval_ms / 1000.0)
        self.gpu_index = gpu_index
        self.idle_s = idle_s
        self.tariffs = tariffs
        self.available = False
        self.reason: str | None = None
        self.device: dict[str, Any] = {}
        self._reader_obj: NvmlReader | None = None
        self._read = reader
        if reader is None:
            try:
                self._reader_obj = NvmlReader(gpu_index)
                self._read = self._reader_obj.read
                self.device = self._reader_obj.identity()
            except Exception as e:       # ImportError, NVMLError_LibraryNotFound, no such GPU, ...
                self.reason = f"NVML unavailable: {type(e).__name__}: {e}"
                return
        self.available = True
        self.samples: list[dict[str, Any]] = []
        self.phases: list[dict[str, Any]] = []
        self.tokens = {"prefill": 0, "decode": 0}
        self.read_errors = 0
        self.run_dir: Path | None = None
        self._t0: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- life cycle -------------------------------------------------------------------------------
    def start(self, run_dir: str | Path | None = None, idle_s: float | None = None) -> None:
        """Start sampling; blocks for `idle_s` to measure the idle draw before any work."""
        if not self.available or self._thread is not None:
            return
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self._t0 = time.perf_counter()
        self.mark(BASELINE_IDLE)
        self._thread = threading.Thread(target=self._loop, name="nvml-probe", daemon=True)
        self._thread.start()
        idle = self.idle_s if idle_s is None else idle_s
        if idle > 0:
            time.sleep(idle)
        self.mark("idle")

    def _loop(self) -> None:
        assert self._t0 is not None and self._read is not None
        next_t = time.perf_counter()
        while not self._stop.is_set():
            now = time.perf_counter()
            try:
                s = self._read()
            except Exception:
                self.read_errors += 1
                s = {}
            s["t"] = now - self._t0
            with self._lock:
                self.samples.append(s)
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
            self.phases.append({"phase": str(phase), "t": t})

    def count_tokens(self, prefill: int = 0, decode: int = 0) -> None:
        """Tokens processed inside marked prefill/decode phases (for J/token)."""
        if self.available:
            with self._lock:
                self.tokens["prefill"] += int(prefill)
                self.tokens["decode"] += int(decode)

    def stop(self, tokens: dict[str, int] | None = None,
             tariffs: dict[str, Any] | None = None) -> dict[str, Any]:
        """Stop, write the samples and marks, return {available, files, n_samples, summary, ...}."""
        if not self.available:
            return {"available": False, "reason": self.reason}
        if self._thread is None:
            return {"available": True, "n_samples": 0, "reason": "never started"}
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
                final["t"] = time.perf_counter() - (self._t0 or 0.0)
                self.samples.append(final)
            self.phases.append({"phase": "end", "t": end})
            samples = list(self.samples)
            phases = sorted(self.phases, key=lambda p: p["t"])
        if self._reader_obj is not None:
            self._reader_obj.close()
        out: dict[str, Any] = {"available": True, "interval_ms": self.interval_s * 1000.0, **self.device,
                               "n_samples": len(samples), "read_errors": self.read_errors,
                               "tokens": dict(tokens or self.tokens)}
        if self.run_dir is not None:
            out.update(write_samples(self.run_dir, samples, phases))
        from moebench.probes.energy import energy_summary
        out["summary"] = energy_summary(samples, phases, tokens=tokens or self.tokens,
                                        tariffs=tariffs or self.tariffs)
        return out


def write_samples(run_dir: Path, samples: list[dict[str, Any]], phases: list[dict[str, Any]]) -> dict[str, str]:
    """nvml_samples.parquet (csv where pyarrow is missing) and nvml_phases.json into run_dir."""
    import pandas as pd
    run_dir.mkdir(parents=True, exist_ok=True)
    df = pd.DataFrame(samples)
    for c in SAMPLE_COLUMNS:
        if c not in df.columns:
            df[c] = math.nan
    df = df[list(SAMPLE_COLUMNS) + [c for c in df.columns if c not in SAMPLE_COLUMNS]]
    try:
        path = run_dir / "nvml_samples.parquet"
        df.to_parquet(path, index=False)
    except ImportError:
        path = run_dir / "nvml_samples.csv"
        df.to_csv(path, index=False)
    phases_path = run_dir / "nvml_phases.json"
    phases_path.write_text(json.dumps(phases, indent=1))
    return {"samples_file": path.name, "phases_file": phases_path.name}


def read_samples(run_dir: str | Path) -> tuple[Any, list[dict[str, Any]]]:
    """(samples DataFrame, phases) of a run directory, for re-summarising later."""
    import pandas as pd
    d = Path(run_dir)
    pq, csv = d / "nvml_samples.parquet", d / "nvml_samples.csv"
    df = pd.read_parquet(pq) if pq.is_file() else pd.read_csv(csv)
    phases = json.loads((d / "nvml_phases.json").read_text())
    return df, phases
