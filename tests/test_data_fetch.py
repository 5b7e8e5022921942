"""`moebench data fetch` against a local stand-in for the public sources (never the network).

The stand-in serves the real mirror's files (../shared/datasets) at the URLs the sources use:
GitHub raw (`/<owner>/<repo>/<commit>/<path in repo>`, mapped back through the project's own
sources.json) and a Hugging Face hub dataset repository holding the mirror's layout.
"""
from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import pytest

from conftest import moebench_cli
from moebench.data_fetch import FetchError, fetch_mirror, github_locations, github_source, hub_source, mirror_files


class StandIn:
    """GitHub raw and hub URLs served from a local mirror folder; counts requests; can corrupt one file."""

    def __init__(self, root: Path):
        self.root, self.requests, self.corrupt = root, [], set()
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                rel = stand_in.resolve(unquote(self.path))
                stand_in.requests.append(self.path)
                if rel is None or not (stand_in.root / rel).is_file():
                    self.send_error(404)
                    return
                body = (stand_in.root / rel).read_bytes()
                if rel in stand_in.corrupt:
                    body = body[:-1] + bytes([body[-1] ^ 1])
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def resolve(self, path: str) -> str | None:
        hub = "/datasets/test-org/moebench-data/resolve/main/"
        if path.startswith(hub):
            return path[len(hub):]
        for loc in github_locations():
            head = f"/{loc['repo']}/{loc['commit']}/{loc['path']}"
            if path.startswith(head):
                return loc["prefix"] + path[len(head):]
        return None

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stand_in(data_dir):
    s = StandIn(data_dir)
    yield s
    s.close()


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_project_carries_the_mirrors_checksums(data_dir):
    ours = {f.path: f.sha256 for f in mirror_files()}
    theirs = dict(reversed(line.split("  ", 1)) for line in (data_dir / "SHA256SUMS").read_text().splitlines() if line)
    assert ours == theirs and len(ours) == 188
    urls = {github_source("http://x").url_for(p) for p in ours}
    assert len(urls) == len(ours)          # every file has a source, no two share a URL


def test_fetch_from_github_stand_in_writes_the_mirror_layout(stand_in, data_dir, tmp_path):
    out = tmp_path / "mirror"
    proc = moebench_cli("data", "fetch", "--to", str(out), "--base-url", stand_in.url + "/", check=True, timeout=300)
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    files = mirror_files()
    assert len(stand_in.requests) == len(files)
    for f in files:
        got = out / f.path
        assert got.is_file(), f.path
        assert _sha(got) == f.sha256 == _sha(data_dir / f.path), f.path
    assert (out / "SHA256SUMS").read_bytes() == (data_dir / "SHA256SUMS").read_bytes()
    assert not list(out.rglob("*.part"))
    # The fetched mirror is usable: a suite's data reads from it.
    assert sum(1 for line in (out / "gsm8k" / "test.jsonl").read_text().splitlines() if line) == 1319
    # A second fetch finds every file present and matching: no request.
    stand_in.requests.clear()
    moebench_cli("data", "fetch", "--to", str(out), "--base-url", stand_in.url, check=True, timeout=300)
    assert stand_in.requests == []


def test_a_file_with_the_wrong_hash_is_refused_and_named(stand_in, tmp_path):
    stand_in.corrupt.add("gsm8k/test.jsonl")
    out = tmp_path / "mirror"
    with pytest.raises(FetchError) as err:
        fetch_mirror(out, github_source(stand_in.url), only=["gsm8k/"], log=lambda m: None)
    msg = str(err.value)
    want = next(f.sha256 for f in mirror_files() if f.path == "gsm8k/test.jsonl")
    assert "gsm8k/test.jsonl" in msg and want in msg and "1 of 2 files failed" in msg
    assert not (out / "gsm8k" / "test.jsonl").exists() and not list(out.rglob("*.part"))
    assert (out / "gsm8k" / "train.jsonl").is_file()        # the good file stays; a re-fetch resumes
    proc = moebench_cli("data", "fetch", "--to", str(out), "--base-url", stand_in.url, "--only", "gsm8k/")
    assert proc.returncode == 1 and "gsm8k/test.jsonl" in proc.stderr


def test_missing_file_and_unknown_repo_are_clear_errors(stand_in, tmp_path):
    with pytest.raises(FetchError, match=r"HTTP 404"):
        fetch_mirror(tmp_path / "m", hub_source("test-org/other", endpoint=stand_in.url), only=["humaneval/"],
                     log=lambda m: None)
    with pytest.raises(FetchError, match="--hub-repo"):
        hub_source(None)
    with pytest.raises(FetchError, match="no mirror file starts with"):
        fetch_mirror(tmp_path / "m", github_source(stand_in.url), only=["nothing/"], log=lambda m: None)


def test_fetch_from_hub_stand_in(stand_in, data_dir, tmp_path):
    out = tmp_path / "hub"
    moebench_cli("data", "fetch", "--to", str(out), "--source", "hub", "--hub-repo", "test-org/moebench-data",
                 "--hub-endpoint", stand_in.url, "--only", "humaneval/", "--only", "wikitext2/", check=True)
    got = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert got == ["README.md", "humaneval/HumanEval.jsonl.gz", "wikitext2/wiki.test.raw"]
    for rel in got[1:]:
        assert (out / rel).read_bytes() == (data_dir / rel).read_bytes()
    assert all(r.startswith("/datasets/test-org/moebench-data/resolve/main/") for r in stand_in.requests)
