"""benchmarks/llama_server_overhead.py against the real llama-bench and llama-server (CPU build)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from test_llama_server_runner import _server_binary, _write_tiny_moe

REPO = Path(__file__).resolve().parent.parent


def load_script():
    spec = importlib.util.spec_from_file_location("llama_server_overhead",
                                                  REPO / "benchmarks" / "llama_server_overhead.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_mode_is_measured_beside_llama_bench(tmp_path: Path) -> None:
    """One length, two server flag sets: llama-bench's rate, and for each set and each request mode the
    server's own rate; the streamed modes also the client's; the table has one row per set and length."""
    bin_dir = _server_binary().parent
    if not (bin_dir / "llama-bench").is_file():
        pytest.skip("this llama.cpp build has no llama-bench")
    mod = load_script()
    model = _write_tiny_moe(tmp_path / "tiny.gguf")
    res = mod.measure(bin_dir, model, ["-t", "1"], [[], ["-bs"]], [16], 1, 50000)
    assert res["llama_bench"][16] > 0
    assert list(res["server"]) == ["-t 1", "-t 1 -bs"]
    for by_len in res["server"].values():
        modes = by_len[16]
        assert set(modes) == set(mod.MODES)
        assert all(m["server"] > 0 for m in modes.values())
        assert all(("client" in modes[m]) == (m in mod.STREAMED) for m in mod.MODES)
        assert all(modes[m]["client"] > 0 for m in mod.STREAMED)
    rows = [line for line in mod.table(res).splitlines() if line.startswith("| -t 1")]
    assert len(rows) == 2 and all(row.split(" | ")[1] == "16" for row in rows)
    assert all(len(row.split(" | ")) == 3 + len(mod.MODES) + len(mod.STREAMED) for row in rows)
    # The argmax modes name the chain moebench's runner sends to a server that samples on the CPU or not.
    assert mod.mode_body("harness_argmax", True) == {**mod.HARNESS, "samplers": ["temperature"]}
    assert mod.mode_body("argmax", False) == {"samplers": ["top_k"], "top_k": 1}


def test_a_server_that_cannot_start_is_reported_with_its_output(tmp_path: Path) -> None:
    mod = load_script()
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(RuntimeError, match="llama-server exited"):
        mod.Server(_server_binary().parent, bad, [], 256)


def test_show_prints_the_committed_tables() -> None:
    """--show reads a saved file of several models (str keys from JSON) and prints each one's table,
    the ratios to llama-bench computed from the figures saved; a result saved before the argmax modes
    shows the three modes it holds."""
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "llama_server_overhead.py"), "--show",
                          str(REPO / "benchmarks" / "results" / "llama_server_overhead.json")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "| -ngl 99 -fa on -bs | 128 | 227.9 | 217.9 (0.956) | 216.2 (0.949) | 216.2 | 217.5 (0.954) | 217.6 |" \
        in run.stdout                                                  # H200 bf16: three modes
    assert "| -ngl 99 -fa on -bs | 128 | 222.3 | 205.1 (0.923) |" in run.stdout    # H100 bf16: five
    headers = [line for line in run.stdout.splitlines() if line.startswith("| server flags")]
    assert [h.count("argmax") for h in headers] == [0, 0, 3, 3, 3]
    assert run.stdout.count("| -ngl 99 -fa on") == 20
