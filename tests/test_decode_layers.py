"""--layers and --experts of the decode benchmarks (decode_ab.py, and decode_h200.py through
moebench.bench.decode_bench): the model is built with that many decoder layers (experts a layer) of
the same shape, and the output says so, so a run cut to fit a smaller GPU, or at the peers' expert
count, cannot pass for the full shape."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Looked up, not imported: importing triton here, before moebench's kernels switch the CPU interpreter
# on, would leave the interpreter tests collected after this file broken (the scripts run in children).
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
ROOT = Path(__file__).resolve().parent.parent


def run(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


def test_decode_ab_builds_the_layers_asked_for(tmp_path):
    out = tmp_path / "ab.json"
    r = run(["benchmarks/decode_ab.py", "--small", "--layers", "2", "--experts", "8", "--variants", "int8",
             "--tokens", "4", "--reps", "1", "--out", str(out)])
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["layers"] == 2 and doc["experts"] == 8          # the small shape has 4 and 16
    assert (doc["prompt_len"], doc["tokens"]) == (64, 4)
    assert doc["errors"] == {}
    assert doc["variants"]["int8"]["tok_s"] > 0 and len(doc["variants"]["int8"]["tokens"]) == 4


def test_decode_h200_records_the_cut_shape(tmp_path):
    r = run(["benchmarks/decode_h200.py", "--small", "--layers", "3", "--experts", "8",
             "--only", "parity_fused_vs_reference", "--out", str(tmp_path)])
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads((tmp_path / "decode_h200.json").read_text())
    assert doc["shape"]["num_hidden_layers"] == 3 and doc["shape"]["num_experts"] == 8
    assert doc["errors"] == {} and "parity_fused_vs_reference" in doc["variants"]


def test_fewer_experts_than_top_k_is_refused():
    check = "from moebench.bench.reference_model import bench_shape as s; print(s(True, 0, {})['num_experts'])"
    ok = run(["-c", check.format(4)])                  # the small shape's top-k
    assert ok.returncode == 0 and ok.stdout.strip() == "4", ok.stderr[-2000:]
    bad = run(["-c", check.format(3)])
    assert bad.returncode != 0 and "bench_shape: 3 experts a layer, fewer than top-k 4" in bad.stderr
