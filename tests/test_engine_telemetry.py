"""What the engine records about itself in a run: tier counters per layer (CPU per-expert path;
the fused path's device counters on CUDA, and in Triton's CPU interpreter where triton is
installed), torch memory per phase, the decode path chosen; and a whole `moebench run` of the tiered zoo model with a fake three-card NVML, which
checks that idle is measured after load and that every task's work is booked under a work phase."""
from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from conftest import fused_kernels_or_skip

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton's first import (see kernels/runtime.py)

from moebench.engine import Engine  # noqa: E402
from moebench.engine.placement import find_tiered  # noqa: E402
from moebench.engine.tiering import calibrate, pack, plan_hot_cold  # noqa: E402

E, TOP_K, H, I, LAYERS = 8, 2, 64, 96, 2


@pytest.fixture(scope="module")
def tiered(tmp_path_factory, data_dir):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=H, intermediate_size=128, moe_intermediate_size=I, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=E, num_experts_per_tok=TOP_K,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], initializer_range=0.1,
        max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("telemetry")
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(root / "ckpt")
    text = (data_dir / "wikitext2" / "wiki.test.raw").read_bytes()[:8000].replace(b"\r\n", b"\n")
    batches = [list(text[i:i + 96]) for i in range(0, 4 * 96, 96)]
    stats = calibrate(Engine.load(root / "ckpt", device="cpu", dtype="float32"), batches, samples_per_expert=8)
    plan = plan_hot_cold(stats, 0.25, hot="int8", cold="ternary", cold_home="host", cache_slots=1)
    return pack(root / "ckpt", plan, root / "tiered"), batches


def test_tiered_generate_counts_every_pick_once(tiered):
    art, batches = tiered
    eng = Engine.load(art, device="cpu", dtype="float32")
    prompt, new = batches[0][:40], 12
    eng.generate([prompt], new, ignore_eos=True)
    tel = eng.telemetry()
    assert tel["decode_steps"] == new - 1          # the CPU decodes step by step: no step ahead
    assert tel["torch_memory"] == {"available": False, "reason": "torch keeps no allocator statistics on cpu"}
    layers = tel["tiers"]["layers"]
    assert len(layers) == LAYERS
    for m, layer in zip(find_tiered(eng.model), layers):
        assert layer["routed"] == (len(prompt) + new - 1) * TOP_K
        assert layer["picks_gpu"] + layer["picks_host"] == layer["routed"]
        assert layer["picks_host"] > 0 and layer["host_misses"] > 0 and layer["host_hits"] > 0
        # the invariant: hits + misses = host-tier picks (no route-tail-skip, no fused path)
        assert layer["host_hits"] + layer["host_misses"] == layer["picks_host"]
        assert layer["picks_gpu"] == layer["tokens_gpu"]
        assert layer["prefetch_hits"] == layer["host_direct"] == layer["route_tail_skips"] == 0
        biggest = max(s.nbytes for s, h in zip(m._stores, m.homes) if h == "host")
        assert 0 < layer["bytes_h2d"] <= layer["cache_misses"] * biggest
        assert layer["copy_wait_s"] > 0
    total = tel["tiers"]["total"]
    assert total["host_hits"] + total["host_misses"] == total["picks_host"]
    eng.reset_telemetry()
    after = eng.telemetry()
    assert after["decode_steps"] == 0 and after["tiers"]["total"]["routed"] == 0


def test_route_tail_skips_are_host_picks_too(tiered):
    art, batches = tiered
    eng = Engine.load(art, device="cpu", dtype="float32")
    for m in find_tiered(eng.model):
        m.skip_tail_from = 1
    eng.logits(batches[1])
    for layer in eng.telemetry()["tiers"]["layers"]:
        assert layer["route_tail_skips"] > 0
        assert layer["host_hits"] + layer["host_misses"] + layer["route_tail_skips"] == layer["picks_host"]


def runtime_available() -> bool:
    from moebench.engine.kernels import runtime
    return runtime.available()


def test_runner_states_its_decode_choices(tmp_path, tiered):
    import asyncio
    from moebench.runners.engine import EngineRunner, decode_choices
    cpu = decode_choices({"dtype": "auto"}, "cpu")
    assert cpu["dtype"] == {"value": "float32", "why": "auto on the CPU"}
    assert cpu["cuda_graphs"]["value"] is False and cpu["experts_impl"]["value"] == "auto"
    assert decode_choices({"dtype": "float16", "cuda_graphs": False}, "cuda")["cuda_graphs"] == \
        {"value": False, "why": "profile"}
    cuda = decode_choices({"dtype": "auto"}, "cuda")
    assert cuda["dtype"]["value"] == "bfloat16" and cuda["cuda_graphs"]["value"] is True
    runner = EngineRunner({"model": str(tiered[0]), "dtype": "auto", "device": "cpu"})
    build = runner.identity()["build"]
    assert build["choices"]["dtype"]["value"] == "float32"
    # prefetch auto on the CPU: off, and the manifest says why (the CUDA branch: test_engine_runner.py)
    assert runner.offloaded == ["host"]
    assert build["choices"]["prefetch_host"] == {"value": False, "why": "auto on the CPU: off (prefetch stages "
                                                 "experts in GPU memory)"}
    assert build["choices"]["prefetch_early"]["value"] is False
    assert build["decode"]["prefetch_host"] is False and build["decode"]["prefetch_early"] is False
    # an explicit prefetch_host is kept; the started engine stages experts
    asked = EngineRunner({"model": str(tiered[0]), "device": "cpu", "dtype": "float32", "experts_impl": "triton",
                          "prefetch_host": True})
    if runtime_available():
        asyncio.run(asked.start())
        assert asked.choices["prefetch_host"] == {"value": True, "why": "profile", "runs": True}
        assert asked.engine.decode.prefetch_host and not asked.engine.decode.prefetch_early
    assert asked.identity()["build"]["decode"]["prefetch_host"] is True
    assert asked.choices["prefetch_early"] == {"value": False, "why": "auto on the CPU: off"}


@pytest.fixture()
def fake_nvml(monkeypatch):
    from test_probes_gpus import FakeNvml
    nv = FakeNvml(watts=[90.0, 60.0, 60.0], mem_used=[5 * 2**30, 2**30, 2**30])
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    return nv


def test_tiered_run_records_telemetry_idle_after_load_and_work_phases(tmp_path, zoo_tiered, data_dir, fake_nvml):
    from moebench.api import RunOptions, run
    zoo = zoo_tiered
    suite = tmp_path / "rig.toml"
    suite.write_text('''name = "rig"
[[tasks]]
task = "gsm8k"
limit = 2
shots = 1
max_tokens = 8
[[tasks]]
task = "cmmlu"
limit = 2
shots = 1
[[tasks]]
task = "speed"
prompt_lengths = [64]
output_tokens = 6
repeats = 2
clients = [1]
warmup = 1
[probes]
interval_ms = 20
gpu_indices = "all"
idle_s = 0.5
idle_end_s = 0.2
''')
    run_dir, code = run(RunOptions(suite=str(suite), runner="engine-tiered", out=str(tmp_path / "run"), quiet=True))
    assert code == 0
    m = json.loads((run_dir / "manifest.json").read_text())
    assert m["build"]["choices"]["cuda_graphs"]["value"] is False
    eng = m["engine"]
    assert eng["choices"]["dtype"]["value"] == "float32" and eng["warmup_s"] > 0
    total = eng["tiers"]["total"]
    assert total["picks_host"] > 0 and len(eng["tiers"]["layers"]) >= 1
    assert total["host_hits"] + total["host_misses"] == total["picks_host"]
    for layer in eng["tiers"]["layers"]:
        assert layer["host_hits"] + layer["host_misses"] == layer["picks_host"]
    nv = m["probes"]["nvml"]
    assert nv["available"] and nv["gpu_indices"] == [0, 1, 2] and nv["summary"]["cards"] == 3
    phases = [p["phase"] for p in json.loads((run_dir / "nvml_phases.json").read_text())]
    # idle is measured once the model is loaded and warm, before the first task
    assert phases[:4] == ["load", "warmup", "baseline_idle", "idle"]
    assert phases[-3:] == ["baseline_idle_end", "idle", "end"]
    assert "generate" in phases and "score" in phases and "prefill" in phases and "decode" in phases
    energy = nv["summary"]["energy"]
    assert energy["idle_phase"] == "baseline_idle"
    assert energy["idle_power_w"] == pytest.approx(210.0, rel=0.05)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("prefetch", [False, True])
def test_fused_path_counts_picks_on_the_device(tiered, prefetch, device):
    """The fused path's counters live inside its kernels: on CUDA under graph replays, and on the CPU
    in Triton's interpreter (where triton is installed), which runs the same kernel code."""
    fused_kernels_or_skip(device)
    art, batches = tiered
    eng = Engine.load(art, device=device, dtype="bfloat16" if device == "cuda" else "float32", experts_impl="triton",
                      cuda_graphs=device == "cuda", prefetch_host=prefetch)
    prompt, new = batches[0][:40], 24
    out = eng.generate([prompt], new, ignore_eos=True)[0]
    if device == "cuda":
        assert eng._graphs, "decode steps ran as CUDA graphs"
    tel = eng.telemetry()
    steps = tel["decode_steps"]
    assert steps >= new - 1
    trace = eng.trace(prompt + out.token_ids[:steps], router_logits=False)
    for layer, ids in zip(tel["tiers"]["layers"], trace.topk_ids):
        # every pick counted once, graph replays included, warm-up and capture runs excluded
        assert layer["routed"] == (len(prompt) + steps) * TOP_K
        assert layer["picks_gpu"] + layer["picks_host"] == layer["routed"]
        assert (layer["host_hits"] + layer["host_misses"] + layer["prefetch_hits"] + layer["host_direct"]
                == layer["picks_host"])
        assert layer["host_direct"] + layer["prefetch_hits"] > 0          # decode's host picks, fused
        assert layer["routed"] == ids.numel()
    layers = tel["tiers"]["layers"]
    if prefetch:     # layer l stages layer l+1's guesses: every MoE layer but the first gets copies
        assert layers[0]["stage_copies"] == layers[0]["prefetch_hits"] == 0
        for layer in layers[1:]:
            assert layer["stage_copies"] > 0 and layer["bytes_h2d"] > 0 and layer["prefetch_hits"] > 0
    else:
        assert all(layer["prefetch_hits"] == layer["stage_copies"] == 0 for layer in layers)
    if device != "cuda":
        return
    memory = eng.telemetry()["torch_memory"]          # after the trace: its "score" phase too
    assert memory["available"] and memory["phases"]["decode"]["peak_allocated_bytes"] > 0
    assert set(memory["phases"]) == {"load", "prefill", "decode", "score"}
