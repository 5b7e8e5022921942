"""Data that is not the data: a run checks every data file it reads against the data folder's
SHA256SUMS before any request. A file that differs is refused (exit 2, naming it) unless
--allow-modified-data, which the manifest and the report then record; a file with nothing to check
it against runs `unverified`, said in one line. Real CLI against the planted HTTP server on 127.0.0.1,
with a copy of the mirror's GSM8K files in a temp folder as the data folder."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from conftest import moebench_cli
from openai_fake import serve
from request_count import RequestCount

GSM8K = ("gsm8k/test.jsonl", "gsm8k/train.jsonl")


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _copy_mirror(data_dir: Path, dest: Path, sums: bool = True) -> Path:
    """The mirror's GSM8K files (and, with `sums`, its SHA256SUMS) copied into `dest`."""
    for rel in GSM8K:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(data_dir / rel, dest / rel)
    if sums:
        shutil.copyfile(data_dir / "SHA256SUMS", dest / "SHA256SUMS")
    return dest


def _change_first_answer(path: Path) -> None:
    """One GSM8K answer changed: the first test item's final answer 18 becomes 19."""
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    row = json.loads(lines[0])
    assert row["answer"].endswith("#### 18")
    row["answer"] = row["answer"][: -len("18")] + "19"
    lines[0] = json.dumps(row) + "\n"
    path.write_text("".join(lines), encoding="utf-8")


class _Server:
    """The planted server, counting every request."""

    def __enter__(self):
        self.server = serve({"default": "#### 18"})
        self.count = RequestCount(self.server)
        return self

    @property
    def requests(self) -> int:
        return self.count.n

    def __exit__(self, *exc):
        self.server.shutdown()


def _run(tmp: Path, port: int, data: Path, out: Path, *extra: str):
    suite = tmp / "g.toml"
    suite.write_text('name = "g"\n[[tasks]]\ntask = "gsm8k"\nlimit = 2\nshots = 1\nmax_tokens = 16\n'
                     '[probes]\nnvml = false\n')
    runner = tmp / "r.toml"
    runner.write_text(f'kind = "http"\nbase_url = "http://127.0.0.1:{port}/v1"\nmodel = "m"\nretries = 0\n')
    return moebench_cli("run", str(suite), "--runner", str(runner), "--out", str(out), *extra,
                        env={"MOEBENCH_DATA_DIR": str(data)}, timeout=120)


def test_modified_data_file_is_refused_before_any_request(tmp_path, data_dir):
    data = _copy_mirror(data_dir, tmp_path / "mirror")
    _change_first_answer(data / "gsm8k" / "test.jsonl")
    with _Server() as srv:
        proc = _run(tmp_path, srv.server.server_address[1], data, tmp_path / "run")
        assert proc.returncode == 2, proc.stderr
        assert srv.requests == 0                                    # refused before any request
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: data file {data / 'gsm8k' / 'test.jsonl'} differs from {data / 'SHA256SUMS'}")
    assert _sha(data_dir / "gsm8k/test.jsonl") in line and _sha(data / "gsm8k/test.jsonl") in line
    assert "--allow-modified-data" in line and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()                          # nothing written


def test_an_edited_sha256sums_does_not_vouch_for_an_edited_file(tmp_path, data_dir):
    """Someone changed an answer and wrote the new hash into the copy's SHA256SUMS: the project's own
    list of the mirror's files still knows the real hash."""
    data = _copy_mirror(data_dir, tmp_path / "mirror")
    test_file = data / "gsm8k" / "test.jsonl"
    _change_first_answer(test_file)
    sums = data / "SHA256SUMS"
    sums.write_text(sums.read_text().replace(_sha(data_dir / "gsm8k/test.jsonl"), _sha(test_file)))
    with _Server() as srv:
        proc = _run(tmp_path, srv.server.server_address[1], data, tmp_path / "run")
        assert proc.returncode == 2, proc.stderr
        assert srv.requests == 0
    assert f"data file {test_file} differs from moebench/mirror/SHA256SUMS" in proc.stderr


def test_allow_modified_data_runs_and_the_manifest_and_report_say_so(tmp_path, data_dir):
    data = _copy_mirror(data_dir, tmp_path / "mirror")
    _change_first_answer(data / "gsm8k" / "test.jsonl")
    out = tmp_path / "run"
    with _Server() as srv:
        proc = _run(tmp_path, srv.server.server_address[1], data, out, "--allow-modified-data")
        assert proc.returncode == 0, proc.stderr
        assert srv.requests > 0
    warnings = [l for l in proc.stderr.splitlines() if "modified data" in l]
    assert warnings == ["warning: running on modified data (--allow-modified-data): gsm8k/test.jsonl differs "
                        "from SHA256SUMS; the manifest and the report say so"]
    m = json.loads((out / "manifest.json").read_text())
    v = m["data_verification"]
    assert v["allow_modified"] is True and v["sums_file"] == str(data / "SHA256SUMS")
    test_entry = v["files"]["gsm8k/test.jsonl"]
    assert test_entry["status"] == "modified"
    assert test_entry["sha256"] == _sha(data / "gsm8k/test.jsonl") == m["data_files"]["gsm8k/test.jsonl"]
    assert test_entry["expected"] == _sha(data_dir / "gsm8k/test.jsonl")
    assert v["files"]["gsm8k/train.jsonl"]["status"] == "verified"
    report = moebench_cli("report", str(out), check=True)
    html = Path(report.stdout.strip().splitlines()[-1]).read_text(encoding="utf-8")
    assert "MODIFIED (run with --allow-modified-data): gsm8k/test.jsonl differs from SHA256SUMS" in html


def test_folder_without_sha256sums_runs_unverified_and_says_so_in_one_line(tmp_path, data_dir):
    data = _copy_mirror(data_dir, tmp_path / "own", sums=False)
    _change_first_answer(data / "gsm8k" / "test.jsonl")       # the user's own data: nothing to check it by
    out = tmp_path / "run"
    with _Server() as srv:
        proc = _run(tmp_path, srv.server.server_address[1], data, out)
        assert proc.returncode == 0, proc.stderr
    notes = [l for l in proc.stderr.splitlines() if "not verified" in l]
    assert notes == [f"note: data not verified ({data} has no SHA256SUMS): gsm8k/test.jsonl; "
                     "the manifest records them as unverified"]
    v = json.loads((out / "manifest.json").read_text())["data_verification"]
    assert v["sums_file"] is None and v["allow_modified"] is False
    assert v["files"]["gsm8k/test.jsonl"]["status"] == "unverified"
    assert v["files"]["gsm8k/test.jsonl"]["reason"] == f"no SHA256SUMS in {data}"
    # the untouched train file is byte for byte the project's mirror file: verified by its own list
    assert v["files"]["gsm8k/train.jsonl"] == {"sha256": _sha(data_dir / "gsm8k/train.jsonl"),
                                                "status": "verified", "against": "moebench/mirror/SHA256SUMS"}


def test_file_missing_from_sha256sums_is_unverified(tmp_path, data_dir):
    data = _copy_mirror(data_dir, tmp_path / "mirror")
    _change_first_answer(data / "gsm8k" / "test.jsonl")
    sums = data / "SHA256SUMS"
    sums.write_text("".join(l for l in sums.read_text().splitlines(keepends=True) if "gsm8k/test.jsonl" not in l))
    out = tmp_path / "run"
    with _Server() as srv:
        proc = _run(tmp_path, srv.server.server_address[1], data, out)
        assert proc.returncode == 0, proc.stderr
    assert f"note: data not verified (not listed in {sums}): gsm8k/test.jsonl;" in proc.stderr
    v = json.loads((out / "manifest.json").read_text())["data_verification"]
    assert v["files"]["gsm8k/test.jsonl"]["status"] == "unverified"
    assert v["files"]["gsm8k/train.jsonl"]["status"] == "verified"


def test_the_mirror_itself_is_verified_without_a_word(tmp_path, data_dir):
    out = tmp_path / "run"
    with _Server() as srv:
        proc = _run(tmp_path, srv.server.server_address[1], data_dir, out)
        assert proc.returncode == 0, proc.stderr
    assert "not verified" not in proc.stderr and "modified" not in proc.stderr
    v = json.loads((out / "manifest.json").read_text())["data_verification"]
    assert {rel: e["status"] for rel, e in v["files"].items()} == {rel: "verified" for rel in GSM8K}
    assert v["sums_file"] == str(data_dir / "SHA256SUMS")
    report = moebench_cli("report", str(out), check=True)
    html = Path(report.stdout.strip().splitlines()[-1]).read_text(encoding="utf-8")
    assert "2 file(s) verified against SHA256SUMS" in html


def test_a_malformed_sha256sums_is_a_clear_error(tmp_path, data_dir):
    data = _copy_mirror(data_dir, tmp_path / "mirror")
    (data / "SHA256SUMS").write_text("not a checksum line\n")
    with _Server() as srv:
        proc = _run(tmp_path, srv.server.server_address[1], data, tmp_path / "run")
        assert proc.returncode == 2, proc.stderr
        assert srv.requests == 0
    assert f"{data / 'SHA256SUMS'}: line 1 is not '<sha256>  <relative path>'" in proc.stderr
