"""benchmarks/llama_cuda_prebuilt.py's pack and install, and peers_h200.py build's use of them.

The CUDA build itself needs pip's CUDA compiler and about 40 minutes of two cores, so these tests pack the real
CPU build's llama-server (the tool cache's, skipped with the reason where absent) under the pack's
layout: what install checks (the layout, the stamp, that llama-server runs, the device's libraries)
does not depend on the backend.
"""
from __future__ import annotations

import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest

from conftest import load_benchmark
from moebench.tools import llamacpp

prebuilt = load_benchmark("llama_cuda_prebuilt")


@pytest.fixture()
def cpu_server() -> Path:
    p = llamacpp.bin_dir(cuda=False) / "llama-server"
    if not os.access(p, os.X_OK):
        pytest.skip(f"no CPU build of llama.cpp at {p.parent} (bash setup.sh setup builds it)")
    return p


def fake_pack(cache: Path, server: Path, carry: Path, cuda_carry: Path) -> None:
    """A prebuilt folder holding every target (llama-server the real one, the others scripts), a
    stand-in libggml-cuda and a stamp, packed into carry and cuda_carry by the script's own `pack`."""
    bins = cache / "llamacpp" / f"{llamacpp.BUILD_COMMIT}-cuda-prebuilt" / "build" / "bin"
    bins.mkdir(parents=True)
    for t in llamacpp.TARGETS:
        if t == "llama-server":
            shutil.copy2(server, bins / t)
        else:
            (bins / t).write_text("#!/bin/sh\nexit 0\n")
            (bins / t).chmod(0o755)
    (bins / "libggml-fake.so").write_bytes(b"\0" * 64)
    (bins / "libggml-cuda.so.0.26.0").write_bytes(b"\1" * 64)
    (bins / "libggml-cuda.so").symlink_to("libggml-cuda.so.0.26.0")
    stamp = {"build_number": llamacpp.BUILD_NUMBER, "build_commit": llamacpp.BUILD_COMMIT, "variant": "cuda",
             "flags": ["-DBUILD_SHARED_LIBS=ON"], "built_at": "here"}
    (bins / llamacpp.STAMP).write_text(json.dumps(stamp))
    prebuilt.pack(carry, cuda_carry)


def stand_in_libs(tmp_path: Path) -> Path:
    """A folder holding stand-ins of the device's CUDA libraries (install only links them)."""
    libs = tmp_path / "cuda-lib"
    libs.mkdir()
    for name in prebuilt.DEVICE_LIBS:
        (libs / name).write_bytes(b"\0")
    return libs


def test_pack_then_install_puts_the_build_where_the_cuda_build_goes(cpu_server, tmp_path, monkeypatch):
    cache, carry, cuda_carry = tmp_path / "cache", tmp_path / "carry", tmp_path / "carry-cuda"
    monkeypatch.setenv("MOEBENCH_CACHE", str(cache))
    fake_pack(cache, cpu_server, carry, cuda_carry)
    with tarfile.open(carry / prebuilt.PACK_NAME) as tar:
        names = set(tar.getnames())
    assert {f"bin/{t}" for t in llamacpp.TARGETS} | {"bin/libggml-fake.so", f"bin/{llamacpp.STAMP}",
                                                     "src/llama.cpp/convert_hf_to_gguf.py"} <= names
    assert any(n.startswith("src/llama.cpp/gguf-py/gguf/") for n in names)
    assert not any("__pycache__" in n or "libggml-cuda" in n for n in names)
    with tarfile.open(cuda_carry / prebuilt.CUDA_LIB_PACK) as tar:
        assert set(tar.getnames()) == {"bin/libggml-cuda.so", "bin/libggml-cuda.so.0.26.0"}
    # the first call's unpack: the binaries and the source files, no libggml-cuda yet
    prebuilt.unpack([carry])
    bins = llamacpp.bin_dir(cuda=True)
    assert (bins / "llama-server").is_file() and not (bins / "libggml-cuda.so.0.26.0").exists()
    assert (llamacpp.variant_dir(cuda=True) / "src" / "llama.cpp" / "convert_hf_to_gguf.py").is_file()
    assert prebuilt.install([carry]) is False        # the second pack has not come
    libs = stand_in_libs(tmp_path)
    monkeypatch.setattr(prebuilt, "DEVICE_LIB_DIRS", (str(tmp_path / "absent"), str(libs)))
    assert prebuilt.install([carry, cuda_carry]) is True
    assert (bins / "libggml-cuda.so.0.26.0").read_bytes() == b"\1" * 64
    assert os.access(bins / "llama-server", os.X_OK)
    assert llamacpp.read_stamp(bins).flags == ["-DBUILD_SHARED_LIBS=ON"]
    for name in prebuilt.DEVICE_LIBS:
        assert (bins / name).resolve() == libs / name
    src = llamacpp.variant_dir(cuda=True) / "src" / "llama.cpp"
    assert (src / "convert_hf_to_gguf.py").is_file() and (src / "gguf-py").is_dir()
    # tools look in the CUDA build first: prepare's llama-quantize comes from the pack
    assert llamacpp.tool("llama-quantize") == bins / "llama-quantize"


def test_a_pack_that_does_not_run_or_lacks_a_library_is_removed(cpu_server, tmp_path, monkeypatch, capsys):
    cache, carry, cuda_carry = tmp_path / "cache", tmp_path / "carry", tmp_path / "carry-cuda"
    monkeypatch.setenv("MOEBENCH_CACHE", str(cache))
    fake_pack(cache, cpu_server, carry, cuda_carry)
    monkeypatch.setattr(prebuilt, "device_lib_dirs", lambda: [tmp_path / "absent"])
    assert prebuilt.install([carry, cuda_carry]) is False
    assert "no libcudart.so.13" in capsys.readouterr().out
    assert not llamacpp.bin_dir(cuda=True).exists()
    # every library found, but llama-server cannot start (a truncated binary)
    libs = stand_in_libs(tmp_path)
    monkeypatch.setattr(prebuilt, "device_lib_dirs", lambda: [libs])
    broken = tmp_path / "broken"
    broken.write_bytes(cpu_server.read_bytes()[:4096])
    broken.chmod(0o755)
    shutil.rmtree(cache)
    fake_pack(cache, broken, carry, cuda_carry)
    assert prebuilt.install([carry, cuda_carry]) is False
    assert "does not run here" in capsys.readouterr().out
    assert not llamacpp.bin_dir(cuda=True).exists()


def test_peers_build_without_a_runnable_pack_or_source_fails_with_the_reason(cpu_server, tmp_path, monkeypatch):
    """peers_h200.py build: the pack does not run (no CUDA libraries) and there is no source to compile:
    the status file wait-build reads says so, and the stage exits 1."""
    peers = load_benchmark("peers_h200")
    cache, carry, cuda_carry = tmp_path / "cache", tmp_path / "carry", tmp_path / "carry-cuda"
    monkeypatch.setenv("MOEBENCH_CACHE", str(cache))
    fake_pack(cache, cpu_server, carry, cuda_carry)
    monkeypatch.setattr(peers.prebuilt(), "device_lib_dirs", lambda: [tmp_path / "absent"])
    with pytest.raises(SystemExit) as stop:
        peers.build([carry, cuda_carry], 2)
    assert stop.value.code == 1
    status = json.loads(peers.build_status_file().read_text())
    assert status["ok"] is False and "no llama-src.tar.gz" in status["error"]
    assert not llamacpp.bin_dir(cuda=True).exists()
    # with the libraries found the same pack installs, and the status says it was the prebuilt one
    libs = stand_in_libs(tmp_path)
    monkeypatch.setattr(peers.prebuilt(), "device_lib_dirs", lambda: [libs])
    peers.build([carry, cuda_carry], 2)
    assert json.loads(peers.build_status_file().read_text())["prebuilt"] is True
    assert peers.wait_build(5) == 0
