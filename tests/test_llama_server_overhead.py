"""benchmarks/llama_server_overhead.py against the real llama-bench and llama-server (CPU build)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, load_benchmark
from test_llama_server_runner import _server_binary, _write_tiny_moe


def load_script():
    return load_benchmark("llama_server_overhead")


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
    assert [h.count("argmax") for h in headers[:5]] == [0, 0, 3, 3, 3]
    # The DEBUG_TIMINGS twin's tables (H100, three GGUFs): the plain server's rate against llama-bench's
    # and the phases around llama_decode, each from the figures saved.
    assert [h.count("llama_decode + sync") for h in headers] == [0] * 5 + [1] * 3
    assert "| -ngl 99 -fa on -bs | 3.574 (0.960) | 3.570 | 0.001 | 3.791 | 3.584 | 0.011 | 0.009 |" \
        in run.stdout                                                                                # Q4_0
    assert "| -ngl 99 -fa on | not run | 5.997 | 0.001 | 4.587 | 4.546 | 1.476 | 1.473 |" in run.stdout   # bf16
    assert run.stdout.count("| -ngl 99 -fa on") == 20 + 6


# Lines of a DEBUG_TIMINGS twin's log (llama.cpp b11434 CUDA, an H100, Q4_0 with -bs): its first print
# comes before any decode; the last one holds the averages over every decode since the start, each
# request's first ("prompt eval") among them.
TWIN_LOG = """\
0.01.669.110 I srv  update_slots: n_pre_decode      = 0
0.01.669.115 I srv  update_slots: avg t_pre_decode  = -nan ms
0.01.669.115 I srv  update_slots: avg t_decode      = -nan ms
0.01.669.116 I srv  update_slots: avg t_post_decode = -nan ms
0.01.669.116 I srv  update_slots: avg t_sampl       = -nan ms
0.02.295.488 I slot print_timing: id  0 | task 0 | prompt eval time =      41.38 ms /    16 tokens (    2.59 ms per token,   386.62 tokens per second)
0.07.508.732 I srv  update_slots: n_pre_decode      = 128
0.07.508.735 I srv  update_slots: avg t_pre_decode  = 0.000656 ms
0.07.508.736 I srv  update_slots: avg t_decode      = 3.894789 ms
0.07.508.737 I srv  update_slots: avg t_post_decode = 0.011000 ms
0.07.508.738 I srv  update_slots: avg t_sampl       = 0.009336 ms
0.07.550.827 I slot print_timing: id  0 | task 129 | prompt eval time =      29.43 ms /     1 tokens (   29.43 ms per token,    33.97 tokens per second)
0.08.042.467 I slot print_timing: id  0 | task 132 | prompt eval time =      29.31 ms /     1 tokens (   29.31 ms per token,    34.12 tokens per second)
0.08.527.011 I slot print_timing: id  0 | task 261 | prompt eval time =      20.82 ms /     1 tokens (   20.82 ms per token,    48.03 tokens per second)
0.09.002.745 I slot print_timing: id  0 | task 390 | prompt eval time =      21.03 ms /     1 tokens (   21.03 ms per token,    47.56 tokens per second)
0.09.478.707 I slot print_timing: id  0 | task 519 | prompt eval time =      21.30 ms /     1 tokens (   21.30 ms per token,    46.94 tokens per second)
0.09.954.921 I slot print_timing: id  0 | task 648 | prompt eval time =      21.30 ms /     1 tokens (   21.30 ms per token,    46.95 tokens per second)
0.15.156.876 I srv  update_slots: n_pre_decode      = 770
0.15.156.877 I srv  update_slots: avg t_pre_decode  = 0.000826 ms
0.15.156.878 I srv  update_slots: avg t_decode      = 3.791106 ms
0.15.156.878 I srv  update_slots: avg t_post_decode = 0.011031 ms
0.15.156.879 I srv  update_slots: avg t_sampl       = 0.009257 ms
0.15.186.518 I slot print_timing: id  0 | task 777 | prompt eval time =      21.75 ms /     1 tokens (   21.75 ms per token,    45.98 tokens per second)
"""


def test_the_twins_last_averages_are_read_and_a_plain_server_is_named() -> None:
    mod = load_script()
    avg = mod.twin_averages(TWIN_LOG)
    assert {k: avg[k] for k in ("t_pre_decode", "t_decode", "t_post_decode", "t_sampl", "n_decodes")} == \
        {"t_pre_decode": 0.000826, "t_decode": 3.791106, "t_post_decode": 0.011031, "t_sampl": 0.009257,
         "n_decodes": 770}
    # the seven requests before the last print (warm-up, a 2-token one, five timed), not the one after it
    assert avg["first_decodes_ms"] == [41.38, 29.43, 29.31, 20.82, 21.03, 21.30, 21.30]
    assert avg["t_decode_steady"] == pytest.approx((770 * 3.791106 - 184.57) / 763)
    assert 3.58 < avg["t_decode_steady"] < 3.59
    plain_log = "\n".join(line for line in TWIN_LOG.splitlines() if "avg" not in line and "n_pre" not in line)
    with pytest.raises(RuntimeError, match="built with DEBUG_TIMINGS"):
        mod.twin_averages(plain_log)
