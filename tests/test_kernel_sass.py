"""benchmarks/kernel_sass.py compiles the fused MoE kernels for sm_90 without a GPU (Triton's own
ptxas / nvdisasm / cuobjdump) from the arguments fused_moe would launch them with."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Looked up, not imported: importing triton here, before moebench's kernels switch the CPU interpreter
# on (TRITON_INTERPRET=1 before the first import), would leave every later interpreter test broken.
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
ROOT = Path(__file__).resolve().parent.parent


def test_kernel_sass_reports_the_shipped_launches(tmp_path):
    out = tmp_path / "sass.json"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_sass.py"), "--kernels", "gate_up,down",
                          "--formats", "int8,ternary", "--json", str(out)], capture_output=True, text=True, env=env,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())
    from moebench.engine.decode_config import DEFAULT
    assert [(r["kernel"], r["format"]) for r in rows] == [("gate_up", "int8"), ("down", "int8"),
                                                          ("gate_up", "ternary"), ("down", "ternary")]
    for r in rows:
        want = DEFAULT.launch_for(r["kernel"], r["format"])
        assert r["launch"][:1] == [want.BN] and r["launch"][2:] == [want.num_warps, want.num_stages], r
        assert 0 < r["registers"] <= 255 and r["stack_bytes"] == 0, r
        # every kernel loads weights and stores its rows: real SASS, not an empty report
        assert r["columns"]["LDG"] > 0 and r["ops"].get("STG", 0) > 0 and r["instructions"] > 100, r
    # the printed table names every row
    assert run.stdout.count("\n") == 1 + len(rows)


def test_kernel_sass_router_takes_its_maxima_as_integer_warp_reductions(tmp_path):
    """The fused router's softmax max and top-k rounds reduce int32 keys (norm_router.sortable_bits):
    on sm_90 each is one REDUX, no float max shuffle tree (FMNMX) is left."""
    out = tmp_path / "router.json"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_sass.py"), "--kernels", "router",
                          "--json", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = json.loads(out.read_text())
    assert row["kernel"] == "router" and row["stack_bytes"] == 0
    # 8 rounds of (max, index min) and the softmax's max: 17 integer warp reductions
    assert row["columns"]["redux"] >= 17 and row["ops"].get("FMNMX", 0) == 0, row["ops"]
    assert row["columns"]["LDG"] > 0 and row["ops"].get("STG", 0) > 0


def test_kernel_sass_compiles_the_attention_with_its_early_kv_block(tmp_path):
    """decode attention compiled for sm_90 as the GPU runs it (PDL on), plain, with early_weights
    "attention_kv" and with rope_in_attention: the early variant issues the first block's K and V
    loads as plain global loads ahead of the pipelined loop (more LDG, no spills); at the default
    short splits every variant counts its splits in with a global atomic (the last one merges); the
    rope variant loads the raw q / k / v and the RoPE tables' rows too (more LDG, no spills)."""
    out = tmp_path / "attention.json"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_sass.py"), "--kernels", "attention",
                          "--json", str(out)], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    plain, early, rope = json.loads(out.read_text())
    assert (plain["format"], early["format"], rope["format"]) == ("dense", "early_kv", "rope")
    for r in (plain, early, rope):
        assert r["kernel"] == "attention" and 0 < r["registers"] <= 255 and r["stack_bytes"] == 0, r
        assert r["ops"].get("STG", 0) > 0 and r["instructions"] > 100, r
        assert r["ops"].get("ATOMG", 0) > 0, r["ops"]
    assert early["columns"]["LDG"] > plain["columns"]["LDG"], (plain["columns"], early["columns"])
    assert rope["columns"]["LDG"] > plain["columns"]["LDG"], (plain["columns"], rope["columns"])


def test_kernel_sass_refuses_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_sass.py")], capture_output=True,
                         text=True, env=env, timeout=120)
    assert run.returncode != 0 and "TRITON_INTERPRET=0" in run.stderr


def test_kernel_sass_l2_prefetch_programs_issue_l2_prefetches(tmp_path):
    """DecodeConfig.l2_prefetch compiled for sm_90: the router and the q/k norm + RoPE launch each
    carry L2 prefetches (CCTL, from prefetch.global.L2::evict_last) with them and none without, and
    neither spills."""
    counts = {}
    for flag in ((), ("--l2-prefetch",)):
        out = tmp_path / f"pf{len(flag)}.json"
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_sass.py"), "--kernels", "router,rope",
                              *flag, "--json", str(out)], capture_output=True, text=True, env=env, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        rows = json.loads(out.read_text())
        assert [r["kernel"] for r in rows] == ["router", "rope"]
        for r in rows:
            assert r["stack_bytes"] == 0 and r["columns"]["LDG"] > 0 and r["ops"].get("STG", 0) > 0, r
        counts[bool(flag)] = [r["columns"]["cctl"] for r in rows]
    assert counts[False] == [0, 0] and min(counts[True]) > 0, counts


def test_kernel_sass_experts_evict_first_marks_the_dense_weight_loads(tmp_path):
    """DecodeConfig.experts_evict_first (on by default) compiled for sm_90: bf16 gate_up's and down's
    weight loads carry L2's evict-first hint (LDG ... .EF), none do with --no-evict-first, and the
    packed int4 rows (word loads, which the option leaves alone) are the same code either way."""
    rows = {}
    for flag in (("--no-evict-first",), ()):
        out = tmp_path / f"ef{len(flag)}.json"
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_sass.py"), "--kernels", "gate_up,down",
                              "--formats", "dense,int4", *flag, "--json", str(out)], capture_output=True, text=True,
                             env=env, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        rows[not flag] = {(r["kernel"], r["format"]): r for r in json.loads(out.read_text())}
    for key, off in rows[False].items():
        on = rows[True][key]
        assert off["ldg_evict_first"] == 0 and off["stack_bytes"] == on["stack_bytes"] == 0, key
        if key[1] == "dense":
            assert on["ldg_evict_first"] >= 8 and on["columns"]["LDG"] == off["columns"]["LDG"], (key, on)
        else:
            assert on["ldg_evict_first"] == 0 and on["ops"] == off["ops"], key


def test_kernel_sass_packed_evict_first_marks_the_packed_word_loads(tmp_path):
    """DecodeConfig.packed_evict_first (off by default) compiled for sm_90: int8's and int4's word
    loads in gate_up and down carry the evict-first hint with --packed-evict-first and none without;
    the bf16 rows (experts_evict_first's) are the same code either way."""
    rows = {}
    for flag in ((), ("--packed-evict-first",)):
        out = tmp_path / f"pef{len(flag)}.json"
        env = {**os.environ, "TRITON_INTERPRET": "0"}
        run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_sass.py"), "--kernels", "gate_up,down",
                              "--formats", "dense,int8,int4", *flag, "--json", str(out)], capture_output=True,
                             text=True, env=env, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        rows[bool(flag)] = {(r["kernel"], r["format"]): r for r in json.loads(out.read_text())}
    assert len(rows[True]) == 6, sorted(rows[True])
    for key, off in rows[False].items():
        on = rows[True][key]
        assert off["stack_bytes"] == on["stack_bytes"] == 0, key
        if key[1] == "dense":
            assert on["ops"] == off["ops"] and on["ldg_evict_first"] == off["ldg_evict_first"] > 0, key
        else:
            assert off["ldg_evict_first"] == 0 and on["ldg_evict_first"] > 0, (key, on)
            assert on["columns"]["LDG"] == off["columns"]["LDG"], (key, on["columns"], off["columns"])
