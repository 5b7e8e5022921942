"""The run store never writes through a symbolic link and never adopts records of unknown origin: a
link planted for any file of a run directory (items.jsonl, manifest.json, .lock, a side file) is
refused with exit 2 naming it, and its target stays byte for byte; a folder with items.jsonl but no
manifest.json is no run to resume. Runs drive the real CLI against the planted HTTP server."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import moebench_cli, read_items
from openai_fake import serve


@pytest.fixture()
def server():
    srv = serve({"default": "#### 1"})
    yield srv
    srv.shutdown()
    srv.server_close()


def _profiles(tmp: Path, port: int, n: int = 3) -> tuple[Path, Path]:
    suite = tmp / "g.toml"
    suite.write_text(f'name = "g"\n[[tasks]]\ntask = "gsm8k"\nlimit = {n}\nshots = 0\n[probes]\nnvml = false\n')
    runner = tmp / "r.toml"
    runner.write_text(f'kind = "http"\nbase_url = "http://127.0.0.1:{port}/v1"\nmodel = "m"\nretries = 0\n')
    return suite, runner


def _run(suite: Path, runner: Path, out: Path, *extra: str):
    return moebench_cli("run", str(suite), "--runner", str(runner), "--out", str(out), *extra)


def _interrupted_run(suite: Path, runner: Path, out: Path, limit: str = "2") -> None:
    """A run of the first items, marked as stopped part-way (so `--resume` continues it)."""
    assert _run(suite, runner, out, "--limit", limit).returncode == 0
    m = json.loads((out / "manifest.json").read_text())
    m["status"] = "interrupted"
    (out / "manifest.json").write_text(json.dumps(m))


def _refused(res, path: Path) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr)
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error")]
    assert len(errors) == 1 and "Traceback" not in res.stderr, res.stderr
    assert errors[0].startswith(f"error: {path}: ") and "symbolic link" in errors[0], errors


def test_resume_refuses_an_items_link_and_leaves_its_target_whole(tmp_path, data_dir, server):
    suite, runner = _profiles(tmp_path, server.server_address[1])
    out = tmp_path / "run"
    _interrupted_run(suite, runner, out)
    victim = tmp_path / "victim.jsonl"
    # A torn tail: what the resume's cut would truncate had it followed the link.
    victim.write_bytes((out / "items.jsonl").read_bytes() + b'{"task": "gsm8k", "item_')
    (out / "items.jsonl").unlink()
    (out / "items.jsonl").symlink_to(victim)
    before, manifest = victim.read_bytes(), (out / "manifest.json").read_bytes()
    _refused(_run(suite, runner, out, "--resume"), out / "items.jsonl")
    assert victim.read_bytes() == before
    assert (out / "manifest.json").read_bytes() == manifest and (out / "items.jsonl").is_symlink()


def test_resume_refuses_an_items_link_into_another_run(tmp_path, data_dir, server):
    suite, runner = _profiles(tmp_path, server.server_address[1])
    mine, other = tmp_path / "mine", tmp_path / "other"
    _interrupted_run(suite, runner, mine)
    assert _run(suite, runner, other, "--limit", "1").returncode == 0
    theirs = (other / "items.jsonl").read_bytes()
    (mine / "items.jsonl").unlink()
    (mine / "items.jsonl").symlink_to(other / "items.jsonl")
    _refused(_run(suite, runner, mine, "--resume"), mine / "items.jsonl")
    assert (other / "items.jsonl").read_bytes() == theirs and len(read_items(other)) == 1


def test_fresh_run_refuses_a_lock_link_and_leaves_its_target_whole(tmp_path, data_dir, server):
    suite, runner = _profiles(tmp_path, server.server_address[1])
    out = tmp_path / "run"
    out.mkdir()
    victim = tmp_path / "precious.txt"
    victim.write_text("precious\n")
    (out / ".lock").symlink_to(victim)
    _refused(_run(suite, runner, out), out / ".lock")
    assert victim.read_text() == "precious\n"
    assert sorted(p.name for p in out.iterdir()) == [".lock"]


def test_resume_refuses_a_manifest_link(tmp_path, data_dir, server):
    suite, runner = _profiles(tmp_path, server.server_address[1])
    out = tmp_path / "run"
    _interrupted_run(suite, runner, out)
    victim = tmp_path / "elsewhere.json"
    (out / "manifest.json").rename(victim)
    (out / "manifest.json").symlink_to(victim)
    before = victim.read_bytes()
    _refused(_run(suite, runner, out, "--resume"), out / "manifest.json")
    assert victim.read_bytes() == before


def test_resume_refuses_a_link_for_a_side_file(tmp_path, data_dir, server):
    """Side files (nvml_samples.parquet, nvml_phases.json, speed_token_times.jsonl, kld/...) are
    written by the probes and tasks: a link planted for any of them refuses the run before it starts."""
    suite, runner = _profiles(tmp_path, server.server_address[1])
    out = tmp_path / "run"
    _interrupted_run(suite, runner, out)
    victim = tmp_path / "victim.json"
    victim.write_text("[]\n")
    (out / "kld").mkdir()
    (out / "kld" / "meta.json").symlink_to(victim)
    items = (out / "items.jsonl").read_bytes()
    _refused(_run(suite, runner, out, "--resume"), out / "kld" / "meta.json")
    assert victim.read_text() == "[]\n" and (out / "items.jsonl").read_bytes() == items


def test_fresh_run_refuses_items_without_a_manifest(tmp_path, data_dir, server):
    suite, runner = _profiles(tmp_path, server.server_address[1])
    out = tmp_path / "run"
    out.mkdir()
    planted = json.dumps({"task": "gsm8k", "item_id": "gsm8k/test/0", "status": "ok", "correct": True,
                          "answer": "18", "reference": "18", "output": "#### 18"}) + "\n"
    (out / "items.jsonl").write_text(planted)
    res = _run(suite, runner, out)
    assert res.returncode == 2, res.stderr
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {out / 'items.jsonl'}: "), res.stderr
    assert "no manifest.json" in errors[0]
    assert (out / "items.jsonl").read_text() == planted and not (out / "manifest.json").exists()


def test_manifest_temp_file_link_is_not_followed(tmp_path):
    """manifest.json (and every JSON the store writes) is replaced through a temporary file beside it:
    a link planted under that name is removed, never written through."""
    from moebench.store import write_json_atomic
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / f".manifest.json.tmp{os.getpid()}").symlink_to(victim)
    write_json_atomic(run / "manifest.json", {"status": "running"})
    assert victim.read_text() == "precious\n"
    assert json.loads((run / "manifest.json").read_text()) == {"status": "running"}
    assert not (run / "manifest.json").is_symlink()
    assert sorted(p.name for p in run.iterdir()) == ["manifest.json"]


def test_nvml_side_files_replace_a_link_instead_of_writing_through_it(tmp_path):
    pytest.importorskip("pandas")
    from moebench.probes.nvml import write_samples
    run = tmp_path / "run"
    run.mkdir()
    victims = {}
    for name in ("nvml_samples.parquet", "nvml_samples.csv", "nvml_phases.json"):
        victims[name] = tmp_path / f"victim-{name}"
        victims[name].write_text("precious\n")
        (run / name).symlink_to(victims[name])
    files = write_samples(run, [{"t": 0.0, "gpu": 0, "power_w": 100.0}], [{"phase": "idle", "start": 0.0}])
    assert all(v.read_text() == "precious\n" for v in victims.values())
    for name in files.values():
        assert (run / name).is_file() and not (run / name).is_symlink()
    assert json.loads((run / "nvml_phases.json").read_text()) == [{"phase": "idle", "start": 0.0}]


def test_kld_base_file_refuses_a_link_and_leaves_its_target_whole(tmp_path):
    """base.kld is written chunk by chunk into the run: never through a link planted there."""
    import numpy as np
    from moebench.store import StoreError
    from moebench.kld.perplexity_tool import BaseFileWriter
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious")
    (tmp_path / "base.kld").symlink_to(victim)
    with pytest.raises(StoreError, match=r"base\.kld: is a symbolic link"):
        BaseFileWriter(tmp_path / "base.kld", 4, 8, np.zeros((1, 4), dtype=np.int32))
    assert victim.read_bytes() == b"precious"
