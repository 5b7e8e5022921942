"""benchmarks/peers_h200.py's `table` stage over results files: the committed table of record, and two
calls' results merged (a measure split over two device calls), with the harness-vs-llama-bench and
engine-vs-llama.cpp ratios computed from the figures given; and its `wait-build` stage."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "peers_h200.py"
SHAPE = {"hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
         "head_dim": 128, "num_experts": 32, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
         "vocab_size": 151936}


def table(*files: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "table", *map(str, files)], capture_output=True, text=True,
                          timeout=60)


def side(rate: float, **extra: float) -> dict:
    return {"by_length": {"128": {"decode_tok_s": rate, **extra}}, "decode_j_per_token": 1.0}


def call(**parts) -> dict:
    return {"shape": SHAPE, "lengths": [128], "output_tokens": 128, "llama_flags": ["-ngl", "99"],
            "backend_sampling_flags": ["-bs"], "copy_Bps": 4.25e12, "llama": {}, "engine": {}, "engine_a8": {},
            **parts}


def row(out: str, start: str) -> list[str]:
    [line] = [ln for ln in out.splitlines() if ln.startswith(start)]
    return [c.strip() for c in line.strip("|").split("|")]


def test_table_of_record_prints() -> None:
    res = table(ROOT / "benchmarks" / "results" / "peers_h200.json")
    assert res.returncode == 0, res.stderr
    assert "| bf16 / bf16 | 128 | 442.3 | – | 217.1 | 2.04x |" in res.stdout
    assert "| int4 / Q4_0 | 4096 | 461.6 | 493.2 | 247.4 | 1.87x | 1.99x |" in res.stdout
    assert "| Q8_0 | 128 | 280.5 | 246.9 | 260.6 | 0.880 | 0.929 |" in res.stdout


def test_h100_table_prints() -> None:
    """The H100 run (two measure calls on one machine saved as one, docs/peers-h200.md) prints the rows
    the docs cite."""
    res = table(ROOT / "benchmarks" / "results" / "peers_h100.json")
    assert res.returncode == 0, res.stderr
    assert "| int8 / Q8_0 | 128 | 426.4 | 443.0 | 258.0 | 1.65x | 1.72x |" in res.stdout
    assert "| Q4_0 | 128 | 291.7 | 263.8 | 275.4 | 0.904 | 0.944 | 0.943 |" in res.stdout
    # the a8 plans against llama-bench, and which engine column is llama.cpp's precision
    assert row(res.stdout, "| int4 / Q4_0 | 4096 |")[-1] == "1.73x"
    assert "llama.cpp's Q8_0 / Q4_0 decode multiplies 8-bit activations (q8_1" in res.stdout


def test_two_calls_merge_and_ratios(tmp_path: Path) -> None:
    first = call(llama={"bf16": {"llama_bench": {"128": 200.0}, "harness": side(180.0),
                                 "harness_bs": side(190.0, server_decode_tok_s=191.0)}},
                 engine={"bf16": side(300.0)})
    second = call(llama={"Q8_0": {"llama_bench": {"128": 250.0}, "harness": side(225.0)}},
                  engine={"int8": side(500.0)}, engine_a8={"int8": side(550.0)})
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(first))
    b.write_text(json.dumps(second))
    res = table(a, b)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    # harness / llama-bench, with and without backend sampling, and the server's own rate
    assert row(out, "| bf16 | 128 |")[5:8] == ["0.900", "0.950", "0.955"]
    assert row(out, "| Q8_0 | 128 |")[4:7] == ["–", "0.900", "–"]
    # the engine over llama.cpp's backend-sampling run where there is one, else its default run
    assert row(out, "| bf16 / bf16 | 128 |")[5:8] == ["1.58x", "–", "1.50x"]
    assert row(out, "| int8 / Q8_0 | 128 |")[5:8] == ["2.22x", "2.44x", "2.00x"]
    assert row(out, "| int8 / Q8_0 | 128 |")[-1] == "2.20x"        # engine a8 / llama-bench: 550 / 250
    assert row(out, "| bf16 / bf16 | 128 |")[-1] == "–"
    assert "Q8_0: no backend-sampling run" in out


def test_calls_of_different_shapes_are_refused(tmp_path: Path) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(call()))
    b.write_text(json.dumps(call(shape={**SHAPE, "num_experts": 16})))
    res = table(a, b)
    assert res.returncode != 0
    assert "different shape" in res.stderr


def test_wait_build_reads_what_build_leaves(tmp_path: Path, monkeypatch) -> None:
    """wait-build exits 0 once the background build says it succeeded, 1 when it says it failed, and 1
    after its timeout when the build has left nothing."""
    from moebench.tools import llamacpp
    monkeypatch.setenv("MOEBENCH_CACHE", str(tmp_path))        # the child inherits it

    def wait(timeout: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(SCRIPT), "wait-build", "--timeout", timeout],
                              capture_output=True, text=True, timeout=60)

    res = wait("0.5")
    assert res.returncode == 1 and "no " in res.stdout and "peers-build.json" in res.stdout
    status = llamacpp.variant_dir(cuda=True) / "peers-build.json"
    assert status.is_relative_to(tmp_path)
    status.parent.mkdir(parents=True)
    status.write_text(json.dumps({"ok": False, "error": "cmake exited 2"}))
    res = wait("5")
    assert res.returncode == 1 and "cmake exited 2" in res.stdout
    status.write_text(json.dumps({"ok": True, "seconds": 352}))
    assert wait("5").returncode == 0


def test_measure_refuses_an_unknown_skip_name(tmp_path: Path) -> None:
    """A misspelt --skip side would measure it anyway and spend a device call: refused at once, with
    the name and the sides that exist."""
    res = subprocess.run([sys.executable, str(SCRIPT), "measure", "--work", str(tmp_path), "--out", str(tmp_path),
                          "--skip", "llama-Q4_0,engine-int4a8"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "unknown side(s) engine-int4a8" in res.stderr and "engine-int4-a8" in res.stderr
    assert list(tmp_path.iterdir()) == []


def test_rephase_takes_each_request_s_decode_from_its_answering_send(tmp_path: Path) -> None:
    """`rephase`: a run whose requests waited 1 s before their answering send (at idle power) inside
    the window marked from the call gets the decode J/token of the requests' own decode (400 W over
    0.5 s for 100 tokens: 2 J), not of the marked windows (which held the wait)."""
    from moebench.probes.nvml import write_samples
    run = tmp_path / "runs" / "llama-bf16-bs"
    run.mkdir(parents=True)
    ticks = [i / 100 for i in range(0, 1001)]          # 10 s at 100 Hz, the counter in mJ
    busy = [(2.0, 3.0), (5.0, 6.0)]                    # each request's send to its last token (prefill 0.5 s)

    def watts(t: float) -> float:
        return 400.0 if any(a <= t < b for a, b in busy) else 100.0
    energy, samples = 0.0, []
    for i, t in enumerate(ticks):
        if i:
            energy += watts(ticks[i - 1]) * (t - ticks[i - 1]) * 1000
        samples.append({"t": t, "gpu": 0, "energy_mj": energy, "power_instant_w": watts(t)})
    phases = [{"phase": "idle", "t": 0.0}]
    for a, b in busy:       # as recorded: prefill from the call (1 s before the send), decode from call + ttft
        phases += [{"phase": "prefill", "t": a - 1.0}, {"phase": "decode", "t": a - 0.5}, {"phase": "idle", "t": b}]
    write_samples(run, samples, phases)
    items = [{"task": "speed", "status": "ok", "ttft_s": 0.5, "e2e_s": 1.0, "timings": {"wall_s": 1.0}}] * 2
    (run / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))
    (run / "manifest.json").write_text(json.dumps({"probes": {"nvml": {"tokens": {"prefill": 256, "decode": 200}}}}))
    res = call(llama={"bf16": {"harness_bs": side(200.0)}})
    res["llama"]["bf16"]["harness_bs"]["decode_j_per_token"] = 4.5
    path = tmp_path / "peers.json"
    path.write_text(json.dumps(res))
    done = subprocess.run([sys.executable, str(SCRIPT), "rephase", "--runs", str(tmp_path / "runs"), str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads(path.read_text())["llama"]["bf16"]["harness_bs"]
    assert got["decode_j_per_token_recorded"] == 4.5
    assert abs(got["decode_j_per_token"] - 2.0) < 0.02, got


def test_engine_only_prepare_writes_no_gguf(tmp_path: Path) -> None:
    """`prepare --engine-only` (a device call that re-measures the engine's sides alone), at the small
    shape: the checkpoint and both engine packs, and no GGUF (no llama.cpp converter or llama-quantize
    is run)."""
    work, link = tmp_path / "work", tmp_path / "link"
    res = subprocess.run([sys.executable, str(SCRIPT), "prepare", "--small", "--engine-only", "--work", str(work),
                          "--link", str(link), "--carry", str(tmp_path / "no-carry")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    assert link.resolve() == work.resolve()
    names = sorted(p.name for p in work.iterdir())
    assert names == ["engine-int4", "engine-int8", "hf", "shape.json"], names
    assert json.loads((work / "shape.json").read_text())["num_hidden_layers"] == 4
    assert (work / "hf" / "config.json").is_file()
    assert any((work / "engine-int4").iterdir()) and any((work / "engine-int8").iterdir())
    assert "convert_hf_to_gguf" not in res.stdout + res.stderr and "llama-quantize" not in res.stdout + res.stderr
