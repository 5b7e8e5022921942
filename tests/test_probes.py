"""NVML probe and energy summary: synthetic sample tables with known answers, NVML absent, a live thread."""
from __future__ import annotations

import json
import time

import pandas as pd
import pytest

from moebench.probes.energy import (counter_energy_j, energy_summary, integrated_energy_j, phase_windows,
                                    tokens_from_records)
from moebench.probes.energy_compare import memory_energy_compare
from moebench.probes.nvml import NvmlProbe, read_samples


def _table(segments, hz=10.0, start_mj=5_000_000.0):
    """Samples for consecutive (seconds, watts) segments; the counter integrates the power exactly."""
    rows, t, e = [], 0.0, start_mj
    dt = 1.0 / hz
    for seconds, watts in segments:
        for _ in range(int(round(seconds * hz))):
            rows.append({"t": round(t, 9), "power_instant_w": watts, "energy_mj": e,
                         "mem_used_bytes": 10e9 + t * 1e8, "mem_free_bytes": 130e9 - t * 1e8,
                         "mem_reserved_bytes": 615 * 2**20, "mem_total_bytes": 141e9})
            t += dt
            e += watts * dt * 1000.0
    rows.append({"t": round(t, 9), "power_instant_w": segments[-1][1], "energy_mj": e})
    return rows


def test_constant_300w_for_10s_is_3000j_by_counter_and_integral():
    s = energy_summary(_table([(10, 300.0)]), [{"phase": "prefill", "t": 0.0}])
    ph = s["energy"]["phases"]["prefill"]
    assert ph["counter_j"] == pytest.approx(3000.0, rel=1e-9)
    assert ph["integral_j"] == pytest.approx(3000.0, rel=1e-9)
    assert ph["mean_power_w"] == pytest.approx(300.0)
    assert abs(ph["rel_diff_integral_vs_counter"]) < 1e-9
    assert s["energy"]["idle_power_w"] is None and ph["net_j"] is None    # no idle window: no net figure


def test_idle_subtracted_per_phase_j_per_token_kwh_and_cost():
    rows = _table([(2, 80.0), (4, 500.0), (6, 300.0)])
    phases = [{"phase": "baseline_idle", "t": 0.0}, {"phase": "prefill", "t": 2.0}, {"phase": "decode", "t": 6.0},
              {"phase": "end", "t": 12.0}]
    s = energy_summary(pd.DataFrame(rows), phases, tokens={"prefill": 4000, "decode": 600},
                       tariffs={"day": 0.30, "night": 0.12, "currency": "EUR"})
    e = s["energy"]
    assert e["idle_power_w"] == pytest.approx(80.0)
    # the power steps between samples, so the trapezoid smears 1/10 s of each step: compare the counter
    assert e["phases"]["prefill"]["counter_j"] == pytest.approx(2000.0)
    assert e["phases"]["prefill"]["net_j"] == pytest.approx(2000.0 - 80 * 4)
    assert e["phases"]["decode"]["net_j"] == pytest.approx(1800.0 - 80 * 6)
    assert e["per_token"]["prefill"]["net_j_per_token"] == pytest.approx(1680 / 4000)
    assert e["per_token"]["decode"]["gross_j_per_token"] == pytest.approx(3.0)
    assert e["per_token"]["decode"]["net_j_per_token"] == pytest.approx(2.2)
    assert e["kwh_per_million_tokens"]["decode"]["gross"] == pytest.approx(3.0 * 1e6 / 3.6e6)
    all_net = (1680 + 1320) / 4600 * 1e6 / 3.6e6
    assert e["kwh_per_million_tokens"]["all"]["net"] == pytest.approx(all_net)
    assert e["cost_per_million_tokens"]["day"]["all"]["net"] == pytest.approx(all_net * 0.30)
    assert e["cost_per_million_tokens"]["night"]["decode"]["gross"] == pytest.approx(3.0 / 3.6 * 0.12)
    assert e["cost_per_million_tokens"]["currency"] == "EUR"
    assert e["whole_run"]["counter_j"] == pytest.approx(160 + 2000 + 1800)
    assert abs(e["whole_run"]["rel_diff_integral_vs_counter"]) < 0.01


def test_counter_reset_is_rejected_and_shows_as_a_disagreement():
    rows = _table([(10, 300.0)])
    for r in rows[50:]:
        r["energy_mj"] -= 5_000_000.0 + 30_000.0        # driver reload: the counter restarts near 0
    s = energy_summary(rows, [{"phase": "decode", "t": 0.0}])
    ph = s["energy"]["phases"]["decode"]
    assert s["energy"]["negative_deltas_rejected"] == 1
    assert ph["counter_j"] == pytest.approx(3000.0 - 30.0)    # the one interval across the reset is lost
    assert ph["integral_j"] == pytest.approx(3000.0)
    assert ph["rel_diff_integral_vs_counter"] == pytest.approx(30 / 2970)


def test_windows_clip_between_samples_and_repeat_phases_add_up():
    ts, mj = [0.0, 1.0, 2.0], [0.0, 100_000.0, 300_000.0]         # 100 W then 200 W
    assert counter_energy_j(ts, mj, 0.5, 1.5) == (pytest.approx(50 + 100), 0)
    assert integrated_energy_j([0.0, 2.0], [100.0, 300.0], 0.0, 1.0) == pytest.approx(150.0)
    w = phase_windows([{"phase": "prefill", "t": 0}, {"phase": "decode", "t": 1},
                       {"phase": "prefill", "t": 3}, {"phase": "end", "t": 4}], t_end=9.0)
    assert w == [("prefill", 0.0, 1.0), ("decode", 1.0, 3.0), ("prefill", 3.0, 4.0)]
    s = energy_summary(_table([(4, 250.0)]), [{"phase": "prefill", "t": 0}, {"phase": "decode", "t": 1},
                                              {"phase": "prefill", "t": 3}])
    assert s["energy"]["phases"]["prefill"]["windows"] == 2
    assert s["energy"]["phases"]["prefill"]["counter_j"] == pytest.approx(500.0)


def test_memory_figures_and_bad_samples():
    s = energy_summary(_table([(10, 300.0)]), [])
    m = s["memory"]
    assert m["n_samples"] == 101 and m["interval_s_median"] == pytest.approx(0.1)
    assert m["peak_used_bytes"] == pytest.approx(10e9 + 9.9 * 1e8) and m["min_free_bytes"] == pytest.approx(130e9 - 9.9 * 1e8)
    assert m["reserved_bytes"] == 615 * 2**20
    with pytest.raises(ValueError, match="sample 0 has no numeric 't'"):
        energy_summary([{"power_instant_w": 1.0}], [])


def test_probe_without_nvml_reports_unavailable_and_never_crashes(tmp_path):
    probe = NvmlProbe(interval_ms=50)
    try:
        import pynvml
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("NVML is present on this machine")
    except Exception:
        pass
    assert probe.available is False and "NVML" in probe.reason
    probe.start(tmp_path)
    probe.mark("prefill")
    probe.count_tokens(prefill=10, decode=2)
    assert probe.stop() == {"available": False, "reason": probe.reason}
    assert not list(tmp_path.iterdir())


def test_probe_thread_samples_marks_and_files(tmp_path):
    """The sampler thread, late marks and the files, with a reader that models a 200 W / 400 W device."""
    t0 = time.perf_counter()
    state = {"w": 200.0, "joules": 0.0, "t": t0}

    def reader():
        now = time.perf_counter()
        state["joules"] += state["w"] * (now - state["t"])
        state["t"] = now
        return {"power_instant_w": state["w"], "energy_mj": state["joules"] * 1000.0,
                "mem_used_bytes": 1e9, "mem_free_bytes": 2e9}

    probe = NvmlProbe(interval_ms=20, idle_s=0.3, reader=reader, tariffs={"day": 0.3, "night": 0.1})
    assert probe.available
    probe.start(tmp_path)
    t_prefill = time.perf_counter()
    state["w"] = 400.0
    time.sleep(0.4)
    probe.mark("decode")
    time.sleep(0.2)
    probe.mark("prefill", at=t_prefill)                     # a mark that arrives late (speed task)
    probe.count_tokens(prefill=1000, decode=50)
    info = probe.stop()
    assert info["available"] and info["samples_file"] == "nvml_samples.parquet"
    assert 0.9 * 0.9 / 0.02 < info["n_samples"] < 1.2 * 0.9 / 0.02 + 5
    df, phases = read_samples(tmp_path)
    assert len(df) == info["n_samples"] and df["t"].is_monotonic_increasing
    assert [p["phase"] for p in phases] == ["baseline_idle", "idle", "prefill", "decode", "end"]
    e = info["summary"]["energy"]
    assert e["idle_power_w"] == pytest.approx(200.0, rel=0.1)
    assert e["phases"]["decode"]["mean_power_w"] == pytest.approx(400.0, rel=0.1)
    assert abs(e["phases"]["decode"]["rel_diff_integral_vs_counter"]) < 0.05
    assert e["per_token"]["prefill"]["tokens"] == 1000 and e["per_token"]["decode"]["tokens"] == 50
    assert "day" in e["cost_per_million_tokens"]
    json.dumps(info)                                          # goes into the manifest as is


def test_last_phase_energy_is_whole_when_the_sampler_lags(tmp_path):
    """A reader slower than the interval (a busy machine): the phase that runs until stop() still gets
    all of its energy, because stop() takes one last sample (before, the loop's last sample could be
    up to a read before the end: a 0.2 s phase at 400 W measured 359 W)."""
    state = {"joules": 0.0, "t": time.perf_counter()}

    def reader():
        time.sleep(0.08)                                  # 4x the interval: the loop lags
        now = time.perf_counter()
        state["joules"] += 400.0 * (now - state["t"])
        state["t"] = now
        return {"power_instant_w": 400.0, "energy_mj": state["joules"] * 1000.0}

    probe = NvmlProbe(interval_ms=20, idle_s=0.0, reader=reader)
    probe.start(tmp_path)
    probe.mark("decode")
    time.sleep(0.25)
    info = probe.stop()
    decode = info["summary"]["energy"]["phases"]["decode"]
    assert decode["mean_power_w"] == pytest.approx(400.0, rel=0.03), decode


def test_memory_energy_compare_from_manifests():
    def manifest(watts_decode, peak):
        rows = _table([(2, 80.0), (2, 400.0), (4, watts_decode)])
        for r in rows:
            if "mem_used_bytes" in r:
                r["mem_used_bytes"] = peak
        s = energy_summary(rows, [{"phase": "baseline_idle", "t": 0}, {"phase": "prefill", "t": 2},
                                  {"phase": "decode", "t": 4}], tokens={"prefill": 2000, "decode": 400})
        return {"probes": {"nvml": {"available": True, "summary": s}}}

    cmp = memory_energy_compare(manifest(280.0, 40e9), manifest(180.0, 20e9))
    assert cmp["memory"]["peak_used_ratio"] == pytest.approx(0.5)
    assert cmp["memory"]["peak_used_bytes_delta"] == -20e9
    dec = cmp["energy"]["per_token"]["decode"]
    assert dec["baseline_net_j_per_token"] == pytest.approx(200 * 4 / 400)
    assert dec["net_ratio"] == pytest.approx(100 / 200)
    off = memory_energy_compare({"probes": {"nvml": {"available": False, "reason": "NVML unavailable: x"}}},
                                manifest(1.0, 1.0))
    assert off["energy"]["available"] is False and off["energy"]["reason"]["baseline"] == "NVML unavailable: x"


def test_tokens_from_records():
    recs = [{"task": "speed", "status": "ok", "prompt_tokens": 100, "output_tokens": 8},
            {"task": "speed", "status": "error", "prompt_tokens": 100, "output_tokens": 8},
            {"task": "gsm8k", "status": "ok", "prompt_tokens": 999, "output_tokens": 9}]
    assert tokens_from_records(recs) == {"prefill": 100, "decode": 8}


@pytest.mark.gpu
def test_real_nvml_when_present(tmp_path):
    probe = NvmlProbe(interval_ms=50, idle_s=0.5)
    if not probe.available:
        pytest.skip(probe.reason)
    probe.start(tmp_path)
    time.sleep(1.0)
    info = probe.stop()
    assert info["n_samples"] >= 20 and info["summary"]["memory"]["peak_used_bytes"] > 0
    assert info["summary"]["energy"]["idle_power_w"] > 10
