"""The NVML probe over several GPUs, against a fake NVML of three cards (pynvml's API, modelled
devices with known power and memory); the real NVML runs on the GPU machine (benchmarks/gpu_rig_h200.py)."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from moebench.probes.energy import cards_summary
from moebench.probes.nvml import NvmlProbe, read_samples, resolve_gpu_indices


class FakeNvml:
    """pynvml's calls the probe makes, for `n` cards. Card i draws watts[i] (W) until `set_watts`,
    its energy counter integrates that exactly, and its used memory is mem_used[i] bytes."""

    class NVMLError(Exception):
        pass

    nvmlMemory_v2 = 2
    NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2

    def __init__(self, watts, mem_used, total=141 * 2**30):
        self.watts, self.mem_used, self.total = list(watts), list(mem_used), total
        self.joules = [0.0] * len(watts)
        self.t = [time.perf_counter()] * len(watts)
        self.lock = threading.Lock()
        self.inits = 0

    def _advance(self, i):
        now = time.perf_counter()
        self.joules[i] += self.watts[i] * (now - self.t[i])
        self.t[i] = now

    def set_watts(self, i, w):
        with self.lock:
            self._advance(i)
            self.watts[i] = w

    # -- pynvml API --
    def nvmlInit(self):
        self.inits += 1

    def nvmlShutdown(self):
        self.inits -= 1

    def nvmlDeviceGetCount(self):
        return len(self.watts)

    def nvmlDeviceGetHandleByIndex(self, i):
        if not 0 <= i < len(self.watts):
            raise self.NVMLError("invalid argument")
        return i

    def nvmlDeviceGetName(self, h):
        return f"Fake GPU {h}".encode()

    def nvmlSystemGetDriverVersion(self):
        return "999.1"

    def nvmlDeviceGetMemoryInfo(self, h, version=None):
        used = self.mem_used[h]
        return SimpleNamespace(total=self.total, used=used, free=self.total - used - 600 * 2**20,
                               reserved=600 * 2**20)

    def nvmlDeviceGetFieldValues(self, h, fields):
        raise self.NVMLError("not supported")          # like an older driver: power from GetPowerUsage

    def nvmlDeviceGetPowerUsage(self, h):
        return int(self.watts[h] * 1000)

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        with self.lock:
            self._advance(h)
            return int(self.joules[h] * 1000)

    def nvmlDeviceGetUtilizationRates(self, h):
        return SimpleNamespace(gpu=50, memory=20)

    def nvmlDeviceGetClockInfo(self, h, clock):
        return 1980 if clock == self.NVML_CLOCK_SM else 3201


GIB = 2**30


def test_three_cards_one_thread_per_card_figures_and_their_sum(tmp_path):
    nv = FakeNvml(watts=[100.0, 200.0, 300.0], mem_used=[10 * GIB, 20 * GIB, 30 * GIB])
    probe = NvmlProbe(interval_ms=10, gpu_indices="all", nvml=nv, idle_s=0)
    assert probe.available, probe.reason
    assert [g["name"] for g in probe.device["gpus"]] == ["Fake GPU 0", "Fake GPU 1", "Fake GPU 2"]
    before = threading.active_count()
    probe.start(tmp_path, idle_s=0)
    assert threading.active_count() == before + 1          # one sampler thread for all cards
    probe.mark("load")
    time.sleep(0.1)
    probe.measure_idle(0.4)
    probe.mark("decode")
    nv.set_watts(1, 500.0)                                 # card 1 works; 0 and 2 stay idle
    nv.mem_used[1] = 50 * GIB
    time.sleep(0.5)
    probe.count_tokens(decode=100)
    info = probe.stop()
    assert nv.inits == 0                                   # NVML shut down again
    assert info["gpu_indices"] == [0, 1, 2]
    s = info["summary"]
    assert s["cards"] == 3 and s["headline"] == "sum of GPUs 0, 1, 2"
    cards = {g["index"]: g for g in s["gpus"]}
    # per card: memory peaks and min free, idle power, decode power
    assert cards[0]["memory"]["peak_used_bytes"] == 10 * GIB and cards[1]["memory"]["peak_used_bytes"] == 50 * GIB
    assert cards[1]["memory"]["min_free_bytes"] == 141 * GIB - 50 * GIB - 600 * 2**20
    assert cards[2]["memory"]["reserved_bytes"] == 600 * 2**20
    for i, idle_w, work_w in ((0, 100, 100), (1, 200, 500), (2, 300, 300)):
        e = cards[i]["energy"]
        assert e["idle_power_w"] == pytest.approx(idle_w, rel=0.05)
        assert e["phases"]["decode"]["mean_power_w"] == pytest.approx(work_w, rel=0.05)
        whole = e["whole_run"]
        assert abs(whole["rel_diff_integral_vs_counter"]) < 0.05       # counter vs integrated power
    # the sum: energy by phase is the cards' added up, idle and decode power too
    e = s["energy"]
    for phase in ("load", "baseline_idle", "decode"):
        assert e["phases"][phase]["counter_j"] == pytest.approx(
            sum(cards[i]["energy"]["phases"][phase]["counter_j"] for i in range(3)), rel=1e-9)
    assert e["whole_run"]["counter_j"] == pytest.approx(sum(cards[i]["energy"]["whole_run"]["counter_j"]
                                                            for i in range(3)), rel=1e-9)
    assert e["idle_power_w"] == pytest.approx(600, rel=0.05)
    assert e["phases"]["decode"]["mean_power_w"] == pytest.approx(900, rel=0.05)
    assert e["phases"]["decode"]["net_j"] == pytest.approx(300 * e["phases"]["decode"]["duration_s"], rel=0.1)
    assert e["per_token"]["decode"]["tokens"] == 100
    assert s["memory"]["peak_used_bytes"] == 90 * GIB          # all cards at once
    # the samples file: one row per card and tick, the card in column `gpu`
    df, phases = read_samples(tmp_path)
    counts = df.groupby("t")["gpu"].nunique()
    assert (counts == 3).all() and sorted(df["gpu"].unique()) == [0, 1, 2]
    assert [p["phase"] for p in phases][:3] == ["load", "baseline_idle", "idle"]
    assert cards_summary(df, phases, tokens={"decode": 100})["energy"]["phases"]["decode"]["counter_j"] == \
        pytest.approx(e["phases"]["decode"]["counter_j"])


def test_a_subset_of_cards_and_one_card_keep_their_shape(tmp_path):
    nv = FakeNvml(watts=[100.0, 200.0, 300.0], mem_used=[1 * GIB, 2 * GIB, 3 * GIB])
    probe = NvmlProbe(interval_ms=10, gpu_indices=[0, 2], nvml=nv)
    probe.start(tmp_path, idle_s=0)
    time.sleep(0.2)
    s = probe.stop()["summary"]
    assert [g["index"] for g in s["gpus"]] == [0, 2] and s["memory"]["peak_used_bytes"] == 4 * GIB
    one = NvmlProbe(interval_ms=10, gpu_index=1, nvml=FakeNvml([100.0, 250.0], [GIB, 7 * GIB]))
    one.start(None, idle_s=0.2)
    s1 = one.stop()["summary"]
    assert s1["cards"] == 1 and s1["gpus"][0]["index"] == 1 and s1["memory"]["peak_used_bytes"] == 7 * GIB
    assert s1["energy"]["idle_power_w"] == pytest.approx(250, rel=0.05)


def test_bad_gpu_indices_are_named():
    probe = NvmlProbe(gpu_indices=[0, 5], nvml=FakeNvml([1.0, 1.0, 1.0], [0, 0, 0]))
    assert not probe.available and "gpu_indices: GPU index 5 does not exist (NVML sees 3 GPU(s)" in probe.reason
    with pytest.raises(ValueError, match="repeat"):
        resolve_gpu_indices([1, 1], 3)
    with pytest.raises(ValueError, match='expected "all"'):
        resolve_gpu_indices("some", 3)
    assert resolve_gpu_indices("all", 2) == [0, 1] and resolve_gpu_indices(1, 2) == [1]


def test_suite_key_gpu_indices_is_checked(tmp_path):
    from moebench.config import ProfileError, load_suite
    from moebench.tasks import task_schemas
    for value, ok in (('"all"', True), ("[0, 2]", True), ('"first"', False), ("[]", False), ("[1, 1]", False)):
        p = tmp_path / "s.toml"
        p.write_text(f'name = "s"\n[[tasks]]\ntask = "speed"\n[probes]\ngpu_indices = {value}\nidle_s = 2.5\n')
        if ok:
            assert load_suite(p, task_schemas()).probes["gpu_indices"] in ("all", [0, 2])
        else:
            with pytest.raises(ProfileError, match="gpu_indices"):
                load_suite(p, task_schemas())
