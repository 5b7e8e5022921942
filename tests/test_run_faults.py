"""A run keeps its data under faults: two writers, a dead writer's lock, a full disk, SIGTERM, a failed
resume. Each case drives the real CLI in a subprocess against the planted HTTP server."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import REPO, moebench_cli, read_items
from openai_fake import serve


def _profiles(tmp: Path, port: int, n: int) -> tuple[Path, Path]:
    suite = tmp / "g.toml"
    suite.write_text(f'name = "g"\n[[tasks]]\ntask = "gsm8k"\nlimit = {n}\nshots = 0\n[probes]\nnvml = false\n')
    runner = tmp / "r.toml"
    runner.write_text(f'kind = "http"\nbase_url = "http://127.0.0.1:{port}/v1"\nmodel = "m"\nconcurrency = 1\n'
                      'retries = 0\n')
    return suite, runner


def _start(suite: Path, runner: Path, out: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "moebench.cli", "run", str(suite), "--runner", str(runner),
                             "--out", str(out), *extra], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_items(out: Path, n: int, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (out / "items.jsonl").exists() and len(read_items(out)) >= n:
            return
        time.sleep(0.02)
    raise AssertionError(f"{out}: fewer than {n} items after {timeout} s")


def _leftovers(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.iterdir() if ".tmp" in p.name)


def test_second_writer_exits_2_naming_the_holder(tmp_path, data_dir):
    n = 16
    srv = serve({"default": "#### 1", "delay_s": 0.6})
    try:
        suite, runner = _profiles(tmp_path, srv.server_address[1], n)
        out = tmp_path / "run"
        first = _start(suite, runner, out)
        _wait_items(out, 1)
        t0 = time.time()
        second = moebench_cli("run", str(suite), "--runner", str(runner), "--out", str(out))
        assert second.returncode == 2, second.stderr
        assert time.time() - t0 < 30
        err = second.stderr.strip()
        assert err.startswith("error: ") and "Traceback" not in err and len(err.splitlines()) == 1
        assert f"PID {first.pid}" in err and "started 20" in err and "another moebench process" in err
        assert first.wait(timeout=120) == 0, first.stderr.read()
        ids = [r["item_id"] for r in read_items(out)]
        assert len(ids) == n and len(set(ids)) == n, "every item exactly once: no second writer"
        m = json.loads((out / "manifest.json").read_text())
        assert m["status"] == "complete" and m["counts"]["asked"] == n
    finally:
        srv.shutdown()


def test_stale_lock_of_a_dead_writer_is_taken_over(tmp_path, data_dir):
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from moebench.store import RunLock
        RunLock({str(out)!r}).acquire()
        print("held", flush=True)
        time.sleep(600)
        """)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    srv = serve({"default": "#### 1"})
    try:
        suite, runner = _profiles(tmp_path, srv.server_address[1], 3)
        refused = moebench_cli("run", str(suite), "--runner", str(runner), "--out", str(out))
        assert refused.returncode == 2 and f"PID {holder.pid}" in refused.stderr
        holder.send_signal(signal.SIGKILL)          # dies holding the lock: the file stays, the lock goes
        holder.wait()
        ok = moebench_cli("run", str(suite), "--runner", str(runner), "--out", str(out))
        assert ok.returncode == 0, ok.stderr
        m = json.loads((out / "manifest.json").read_text())
        assert m["status"] == "complete"
        taken = [e for e in m["events"] if e["event"] == "stale_lock_taken_over"]
        assert len(taken) == 1 and taken[0]["previous_pid"] == holder.pid
        lock = json.loads((out / ".lock").read_text())
        assert lock["pid"] != holder.pid and "released_at" in lock
    finally:
        srv.shutdown()
        if holder.poll() is None:
            holder.kill()


# A full filesystem without touching the host: a small tmpfs mounted in a private mount namespace.
# FULL_TARGET makes $FULL/items.jsonl (a copy of $SEED when given) and fills the tmpfs to the last byte.
FULL_TARGET = """
set -e
mount -t tmpfs -o size=128k tmpfs "$FULL"
if [ -n "$SEED" ]; then cp "$SEED" "$FULL/items.jsonl"; else : > "$FULL/items.jsonl"; fi
head -c 1048576 /dev/zero > "$FULL/filler" 2>/dev/null || true
set +e
"""


def _in_private_mount(script: str, env: dict, tmp: Path) -> subprocess.CompletedProcess:
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here: {probe.stderr.decode().strip()}")
    full = tmp / "full"
    full.mkdir(exist_ok=True)
    env = {**os.environ, "FULL": str(full), "PY": sys.executable, "SEED": "", **env}
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", FULL_TARGET + script],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if r.returncode == 32 or "mount:" in r.stderr:
        pytest.skip(f"tmpfs cannot be mounted here: {r.stderr.strip()}")
    return r


def _run_script(*extra: str) -> str:
    # The full file is bind-mounted over $OUT/items.jsonl (the store refuses a symbolic link there).
    return (': > "$OUT/items.jsonl"\nmount --bind "$FULL/items.jsonl" "$OUT/items.jsonl"\n'
            f'"$PY" -m moebench.cli run "$SUITE" --runner "$RUNNER" --out "$OUT" {" ".join(extra)} '
            '> "$SEEN/stdout" 2> "$SEEN/stderr"\necho $? > "$SEEN/rc"\numount "$OUT/items.jsonl"\n'
            'cp "$FULL/items.jsonl" "$OUT/items.jsonl"\n')


def test_full_disk_under_items_is_one_error_line_and_a_failed_manifest(tmp_path, data_dir):
    """items.jsonl lives on a full filesystem, the manifest on a working one: one `error:` line naming
    the file and the errno, exit 1, the manifest `failed` with an end time, no temporary files."""
    srv = serve({"default": "#### 1"})
    try:
        suite, runner = _profiles(tmp_path, srv.server_address[1], 4)
        out, seen = tmp_path / "run", tmp_path / "seen"
        out.mkdir()
        seen.mkdir()
        _in_private_mount(_run_script(), {"OUT": str(out), "SEEN": str(seen), "SUITE": str(suite),
                                          "RUNNER": str(runner)}, tmp_path)
        stderr = (seen / "stderr").read_text()
        assert (seen / "rc").read_text().strip() == "1", stderr
        errors = [line for line in stderr.splitlines() if line.startswith("error")]
        assert errors == [f"error: {out / 'items.jsonl'}: No space left on device (errno 28 ENOSPC)"], stderr
        assert "Traceback" not in stderr
        m = json.loads((out / "manifest.json").read_text())
        assert m["status"] == "failed" and m["ended_at"]
        assert any("No space left" in e.get("message", "") for e in m["events"] if e["event"] == "failed")
        assert _leftovers(out) == []
    finally:
        srv.shutdown()


def test_sigterm_records_counts_and_a_failed_resume_keeps_the_status(tmp_path, data_dir):
    srv = serve({"default": "#### 1", "delay_s": 0.1})
    try:
        suite, runner = _profiles(tmp_path, srv.server_address[1], 30)
        out, seen = tmp_path / "run", tmp_path / "seen"
        seen.mkdir()
        proc = _start(suite, runner, out)
        _wait_items(out, 3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130
        m = json.loads((out / "manifest.json").read_text())
        n_done = len(read_items(out))
        assert m["status"] == "interrupted" and m["ended_at"]
        assert m["counts"]["asked"] == n_done >= 3
        assert m["summary"]["gsm8k"]["n"] == n_done

        # The resume fails (its items file sits on a full filesystem): the run stays "interrupted",
        # with a new end time and the failure among its events; no record is lost.
        kept = (out / "items.jsonl").read_bytes()
        (tmp_path / "seed.jsonl").write_bytes(kept)
        (out / "items.jsonl").unlink()
        _in_private_mount(_run_script("--resume"), {"OUT": str(out), "SEEN": str(seen), "SUITE": str(suite),
                                                   "RUNNER": str(runner), "SEED": str(tmp_path / "seed.jsonl")},
                          tmp_path)
        stderr = (seen / "stderr").read_text()
        assert (seen / "rc").read_text().strip() == "1" and "errno 28 ENOSPC" in stderr, stderr
        assert "Traceback" not in stderr
        m2 = json.loads((out / "manifest.json").read_text())
        assert m2["status"] == "interrupted" and m2["ended_at"] > m["ended_at"]
        assert m2["events"][-1]["event"] == "failed" and "No space left" in m2["events"][-1]["message"]
        # Records that fitted into the last page stay; a partly written one is a torn tail, cut on resume.
        assert (out / "items.jsonl").read_bytes().startswith(kept)
        done = moebench_cli("run", str(suite), "--runner", str(runner), "--out", str(out), "--resume")
        assert done.returncode == 0, done.stderr
        assert sorted(r["item_id"] for r in read_items(out)) == sorted(f"gsm8k/test/{i}" for i in range(30))
        assert json.loads((out / "manifest.json").read_text())["status"] == "complete"
    finally:
        srv.shutdown()


FULL_DISK = """
set -e
mount -t tmpfs -o size=256k tmpfs "$DISK"
head -c 180000 /dev/zero > "$DISK/filler"
set +e
"$PY" -m moebench.cli run "$SUITE" --runner "$RUNNER" --out "$DISK/run" > "$OUTDIR/stdout" 2> "$OUTDIR/stderr"
echo $? > "$OUTDIR/rc"
ls -a "$DISK/run" > "$OUTDIR/listing"
cp "$DISK/run/manifest.json" "$OUTDIR/manifest.json"
rm "$DISK/filler"
"$PY" -m moebench.cli run "$SUITE" --runner "$RUNNER" --out "$DISK/run" --resume > "$OUTDIR/stdout2" 2> "$OUTDIR/stderr2"
echo $? > "$OUTDIR/rc2"
cp "$DISK/run/manifest.json" "$OUTDIR/manifest2.json"
cp "$DISK/run/items.jsonl" "$OUTDIR/items2.jsonl"
"""


def test_full_disk_mid_run_then_resume_after_freeing_space(tmp_path, data_dir):
    """A real full filesystem (a 256 KiB tmpfs in a private mount namespace): the run stops with one
    `error:` line, its manifest stays readable, no temporary file is left; freed, `--resume` completes."""
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here: {probe.stderr.decode().strip()}")
    srv = serve({"default": "x" * 3000 + " #### 1"})
    try:
        suite, runner = _profiles(tmp_path, srv.server_address[1], 40)
        disk, outdir = tmp_path / "disk", tmp_path / "seen"
        disk.mkdir()
        outdir.mkdir()
        env = {**os.environ, "DISK": str(disk), "OUTDIR": str(outdir), "SUITE": str(suite),
               "RUNNER": str(runner), "PY": sys.executable}
        r = subprocess.run(["unshare", "--mount", "--propagation", "private", "bash", "-c", FULL_DISK],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        if "mount" in r.stderr and not (outdir / "rc").exists():
            pytest.skip(f"tmpfs cannot be mounted here: {r.stderr.strip()}")
        stderr = (outdir / "stderr").read_text()
        assert (outdir / "rc").read_text().strip() == "1", stderr
        lines = [line for line in stderr.splitlines() if line.startswith("error")]
        assert len(lines) == 1 and "errno 28 ENOSPC" in lines[0] and "Traceback" not in stderr, stderr
        assert str(disk / "run") in lines[0]
        json.loads((outdir / "manifest.json").read_text())        # whole: readable JSON
        assert [n for n in (outdir / "listing").read_text().split() if ".tmp" in n] == []
        assert (outdir / "rc2").read_text().strip() == "0", (outdir / "stderr2").read_text()
        m = json.loads((outdir / "manifest2.json").read_text())
        assert m["status"] == "complete" and m["resumes"] == 1
        ids = [json.loads(x)["item_id"] for x in (outdir / "items2.jsonl").read_text().splitlines() if x.strip()]
        assert sorted(set(ids)) == sorted(f"gsm8k/test/{i}" for i in range(40))
    finally:
        srv.shutdown()


def test_resume_that_cannot_open_its_items_keeps_the_status_and_notes_the_failure(tmp_path, data_dir):
    srv = serve({"default": "#### 1"})
    try:
        suite, runner = _profiles(tmp_path, srv.server_address[1], 3)
        out = tmp_path / "run"
        assert moebench_cli("run", str(suite), "--runner", str(runner), "--out", str(out)).returncode == 0
        m = json.loads((out / "manifest.json").read_text())
        m["status"] = "interrupted"                       # as if it had been stopped
        (out / "manifest.json").write_text(json.dumps(m))
        (out / "items.jsonl").rename(out / "items.saved")
        (out / "items.jsonl").mkdir()                     # cannot be opened for appending
        res = moebench_cli("run", str(suite), "--runner", str(runner), "--out", str(out), "--resume")
        assert res.returncode == 1 and "Traceback" not in res.stderr
        assert [x for x in res.stderr.splitlines() if x.startswith("error")] == [
            f"error: {out / 'items.jsonl'}: Is a directory (errno 21 EISDIR)"]
        m2 = json.loads((out / "manifest.json").read_text())
        assert m2["status"] == "interrupted" and m2["ended_at"] > m["ended_at"]
        assert m2["events"][-1]["event"] == "failed" and "EISDIR" not in m2["events"][-1]["message"]
        assert "Is a directory" in m2["events"][-1]["message"]
        assert _leftovers(out) == []
    finally:
        srv.shutdown()
