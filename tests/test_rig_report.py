"""compare.json's per-card memory/energy, torch memory and `engine` section, the report's rig sections,
and gate rules that name a card or the sum: from runs whose probe summary the real code computed
(cards_summary over modelled samples of three cards) and engine telemetry as the runner writes it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from moebench.compare.build import build_compare
from moebench.gate import run_gate
from moebench.probes.energy import cards_summary
from moebench.probes.nvml import write_samples
from moebench.report.render import render

GIB = 2**30


def _samples(watts: list[float], work_watts: list[float], used_gib: list[float]):
    """10 Hz samples of len(watts) cards: 2 s load, 2 s baseline idle, 4 s decode at work_watts."""
    rows, mj = [], [0.0] * len(watts)
    for k in range(81):
        t = k * 0.1
        for c, (idle, work) in enumerate(zip(watts, work_watts)):
            w = work if t >= 4.0 else idle
            rows.append({"t": t, "gpu": c, "power_usage_w": w, "energy_mj": mj[c],
                         "mem_used_bytes": used_gib[c] * GIB, "mem_free_bytes": (141 - used_gib[c]) * GIB,
                         "mem_reserved_bytes": 600 * 2**20, "mem_total_bytes": 141 * GIB})
            mj[c] += w * 100.0
    phases = [{"phase": "load", "t": 0.0}, {"phase": "baseline_idle", "t": 2.0}, {"phase": "idle", "t": 4.0},
              {"phase": "decode", "t": 4.0}, {"phase": "end", "t": 8.0}]
    return rows, phases


def _run(path: Path, label: str, watts, work, used, tiers: dict | None, decode_tok_s: float) -> Path:
    path.mkdir(parents=True)
    rows, phases = _samples(watts, work, used)
    write_samples(path, rows, phases)
    summary = cards_summary(rows, phases, tokens={"decode": 400})
    engine = {"choices": {"dtype": {"value": "bfloat16", "why": "auto on CUDA"},
                          "cuda_graphs": {"value": True, "why": "auto on CUDA"}},
              "decode_steps": 400,
              "torch_memory": {"available": True, "source": "torch.cuda", "phases": {
                  "load": {"peak_allocated_bytes": 2 * GIB, "peak_reserved_bytes": 3 * GIB},
                  "decode": {"peak_allocated_bytes": 5 * GIB, "peak_reserved_bytes": 6 * GIB}},
                  "peak_allocated_bytes": 5 * GIB, "peak_reserved_bytes": 6 * GIB}}
    if tiers:
        engine["tiers"] = tiers
    manifest = {"schema_version": 1, "run_id": label, "label": label, "status": "complete",
                "suite": {"name": "speed"}, "runner": {"kind": "engine", "name": label},
                "probes": {"nvml": {"available": True, "gpu_indices": list(range(len(watts))), "summary": summary}},
                "engine": engine}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with (path / "items.jsonl").open("w") as f:
        for rep in range(3):
            f.write(json.dumps({"task": "speed", "item_id": f"speed/128/1/{rep}/0", "status": "ok", "correct": None,
                                "answer": None, "reference": None, "output": "", "prompt_length": 128,
                                "clients": 1, "prompt_tokens": 128, "output_tokens": 64, "ttft_s": 0.01,
                                "prefill_tok_s": 12800.0, "decode_tok_s": decode_tok_s + rep}) + "\n")
    return path


def _layer(gpu, hits, misses, prefetch=0, direct=0):
    host = hits + misses + prefetch + direct
    return {"routed": gpu + host, "picks_gpu": gpu, "picks_host": host, "host_hits": hits, "host_misses": misses,
            "host_direct": direct, "prefetch_hits": prefetch, "route_tail_skips": 0, "stage_copies": prefetch,
            "bytes_h2d": misses * 1000, "bytes_host_read": direct * 1000, "copy_wait_s": 0.01 * misses}


def test_compare_report_and_gate_per_card(tmp_path):
    base = _run(tmp_path / "bf16", "bf16", [70.0, 60.0, 60.0], [400.0, 60.0, 60.0], [20, 1, 1], None, 1800.0)
    layers = [_layer(600, 150, 50), _layer(500, 100, 50, prefetch=150, direct=0)]
    total = {k: sum(l[k] for l in layers) for k in layers[0]}
    cand = _run(tmp_path / "tiered", "tiered", [70.0, 60.0, 60.0], [300.0, 90.0, 60.0], [12, 4, 1],
                {"layers": layers, "total": total}, 1500.0)
    cmp = build_compare(base, cand)
    mem, en = cmp["memory"], cmp["energy"]
    assert set(mem["gpus"]) == {"gpu0", "gpu1", "gpu2", "sum"}
    assert mem["gpus"]["gpu1"]["candidate"]["peak_used_bytes"] == 4 * GIB
    assert mem["gpus"]["sum"]["candidate"]["peak_used_bytes"] == 17 * GIB
    assert mem["torch"]["candidate"]["phases"]["decode"]["peak_allocated_bytes"] == 5 * GIB
    whole = {k: en["gpus"][k]["candidate"]["whole_run_counter_j"] for k in en["gpus"]}
    assert whole["sum"] == pytest.approx(whole["gpu0"] + whole["gpu1"] + whole["gpu2"])
    assert whole["gpu1"] == pytest.approx(60 * 4 + 90 * 4)
    assert en["gpus"]["sum"]["candidate"]["idle_power_w"] == pytest.approx(190.0)
    assert en["phases"]["decode"]["candidate"]["mean_power_w"] == pytest.approx(450.0)
    eng = cmp["engine"]
    assert eng["baseline"]["choices"] == {"dtype": "bfloat16", "cuda_graphs": True}
    assert "tiers" not in eng["baseline"]
    t = eng["candidate"]["tiers"]
    assert t["total"]["host_hit_rate"] == pytest.approx((250 + 150) / 500)
    assert t["layers"][1]["host_hit_rate"] == pytest.approx(250 / 300)
    assert eng["hit_rate_vs_speed"] == [{"run": "candidate", "host_hit_rate": pytest.approx(0.8),
                                         "gpu_pick_share": pytest.approx(1100 / 1600), "decode_tok_s_median": 1501.0}]

    cdir = tmp_path / "cmp"
    cdir.mkdir()
    (cdir / "compare.json").write_text(json.dumps(cmp))
    html = render(cdir).read_text()
    gpus = html[html.index('id="gpus"'):html.index('id="torch-memory"')]
    for card in ("GPU 0", "GPU 1", "GPU 2", "sum"):
        assert f"<td>{card}</td>" in gpus
    assert "17.00 GiB" in gpus and "4.00 GiB" in gpus
    torch_part = html[html.index('id="torch-memory"'):html.index('id="energy-phases"')]
    assert "5.00 GiB" in torch_part and "<td>decode</td>" in torch_part
    engine_part = html[html.index('id="engine"'):]
    assert "expert picks per layer, host: cache hits" in engine_part and "host hit rate against decode speed" in engine_part
    assert "cuda_graphs = True" in engine_part

    rules = tmp_path / "rules.toml"
    rules.write_text("[memory]\nmax_peak_used_gib = 20\n[memory.gpu1]\nmax_peak_used_gib = 3\n"
                     "[energy]\nmax_idle_power_w = 200\n[energy.gpu0]\nmax_whole_run_kj = 10\n"
                     "[energy.sum]\nmax_whole_run_kj = 1\n")
    assert run_gate(str(cdir), str(rules)) == 1
    summary = (cdir / "summary.md").read_text()
    rows = {ln.split("|")[1].strip(): ln.split("|")[4].strip() for ln in summary.splitlines()
            if ln.startswith("| ") and ln.count("|") == 5}
    assert rows["memory.gpu1.max_peak_used_gib"] == "**FAIL**" and rows["memory.max_peak_used_gib"] == "PASS"
    assert rows["energy.max_idle_power_w"] == "PASS" and rows["energy.gpu0.max_whole_run_kj"] == "PASS"
    assert rows["energy.sum.max_whole_run_kj"] == "**FAIL**"
    bad = tmp_path / "bad.toml"
    bad.write_text("[memory.card7]\nmax_peak_used_gib = 3\n")
    assert run_gate(str(cdir), str(bad)) == 2


def test_a_single_runs_report_shows_its_cards_torch_memory_phases_and_tiers(tmp_path):
    layers = [_layer(600, 150, 50), _layer(500, 100, 50, prefetch=150)]
    total = {k: sum(l[k] for l in layers) for k in layers[0]}
    run = _run(tmp_path / "tiered", "tiered", [70.0, 60.0], [300.0, 90.0], [12, 4], {"layers": layers, "total": total},
               1500.0)
    html = render(run).read_text()
    gpus = html[html.index('id="gpus"'):html.index('id="torch-memory"')]
    assert "<td>GPU 0</td>" in gpus and "<td>GPU 1</td>" in gpus and "<td>sum</td>" in gpus
    assert "baseline" not in gpus and "16.00 GiB" in gpus                 # 12 + 4 GiB at once
    phases = html[html.index('id="energy-phases"'):html.index('id="engine"')]
    assert "<td>baseline_idle</td>" in phases and "candidate net J" in phases and "baseline s" not in phases
    assert "expert picks per layer, host: prefetch hits" in html[html.index('id="engine"'):]
