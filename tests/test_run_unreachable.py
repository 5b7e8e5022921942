"""A server that is down is a failed run, not a finished one: the run stops after its first few items
fail to connect (api.UNREACHABLE_STOP_AFTER), prints the cause, and `--resume` finishes it once the
server is up. A run that ends with errored items prints its most common error causes. Each case drives
the real CLI in a subprocess against a port with nothing listening or the planted HTTP server."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO, moebench_cli, read_items
from openai_fake import serve

from moebench.api import UNREACHABLE_STOP_AFTER


def _free_port() -> int:
    """A port on 127.0.0.1 with nothing listening (bound, read, closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _profiles(tmp: Path, port: int, n: int, concurrency: int = 1, retries: int | None = None) -> tuple[Path, Path]:
    suite = tmp / "g.toml"
    suite.write_text(f'name = "g"\n[[tasks]]\ntask = "gsm8k"\nlimit = {n}\nshots = 0\n[probes]\nnvml = false\n')
    runner = tmp / "r.toml"
    runner.write_text(f'kind = "http"\nbase_url = "http://127.0.0.1:{port}/v1"\nmodel = "m"\n'
                      f'concurrency = {concurrency}\n' + (f"retries = {retries}\n" if retries is not None else ""))
    return suite, runner


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def test_dead_server_stops_the_run_early_as_failed_naming_the_cause_then_resume_finishes(tmp_path, data_dir):
    n = 40
    port = _free_port()
    suite, runner = _profiles(tmp_path, port, n)        # the HTTP runner's default retries and backoff
    out = tmp_path / "run"
    t0 = time.time()
    dead = moebench_cli("run", str(suite), "--runner", str(runner), "--out", str(out), timeout=120)
    took = time.time() - t0
    assert dead.returncode == 1, dead.stderr
    # The default retries (3, backoff 0.5 s doubling, jitter up to 1.5x) bound each item's waiting by
    # 5.25 s: the stop comes after the first few items, not after all 40 (about 140 s).
    assert took < 45, f"the early stop took {took:.0f} s"
    errors = [ln for ln in dead.stderr.splitlines() if ln.startswith("error")]
    assert len(errors) == 1, dead.stderr
    assert "ConnectError" in errors[0] and f"http://127.0.0.1:{port}/v1" in errors[0], errors
    assert f"first {UNREACHABLE_STOP_AFTER} items" in errors[0] and "--resume" in errors[0], errors
    assert "status: failed" in dead.stdout and "status: complete" not in dead.stdout
    m = _manifest(out)
    assert m["status"] == "failed" and m["ended_at"]
    failed = [e for e in m["events"] if e["event"] == "failed"]
    assert len(failed) == 1 and "ConnectError" in failed[0]["message"]
    recs = read_items(out)
    assert len(recs) == UNREACHABLE_STOP_AFTER == m["counts"]["asked"] == m["counts"]["errors"]
    assert all(r["status"] == "error" and r["correct"] is None and "ConnectError" in r["error"] for r in recs)

    srv = serve({"default": "#### 1"}, port=port)         # the server is back
    try:
        done = moebench_cli("run", str(suite), "--runner", str(runner), "--out", str(out), "--resume")
        assert done.returncode == 0, done.stderr
        m2 = _manifest(out)
        assert m2["status"] == "complete" and m2["resumes"] == 1
        last = {r["item_id"]: r for r in read_items(out)}
        assert sorted(last) == sorted(f"gsm8k/test/{i}" for i in range(n))
        assert all(r["status"] == "ok" for r in last.values())
        assert m2["summary"]["gsm8k"]["n_errors"] == 0
    finally:
        srv.shutdown()
        srv.server_close()


def test_dead_server_with_concurrent_clients_stops_after_the_first_to_finish(tmp_path, data_dir):
    n, clients = 60, 8
    suite, runner = _profiles(tmp_path, _free_port(), n, concurrency=clients, retries=1)
    out = tmp_path / "run"
    dead = moebench_cli("run", str(suite), "--runner", str(runner), "--out", str(out), timeout=120)
    assert dead.returncode == 1, dead.stderr
    assert "ConnectError" in dead.stderr and f"first {UNREACHABLE_STOP_AFTER} items" in dead.stderr
    m = _manifest(out)
    assert m["status"] == "failed"
    recs = read_items(out)
    # The items in flight when the stop came are cancelled unrecorded (asked again on resume); those
    # that finished are error records, never wrong answers.
    assert UNREACHABLE_STOP_AFTER <= len(recs) < n and len(recs) == m["counts"]["asked"]
    assert all(r["status"] == "error" and r["correct"] is None for r in recs)


def test_server_lost_mid_run_is_no_early_stop_and_the_common_error_causes_are_printed(tmp_path, data_dir):
    """The early stop is for a server that never answered: once items succeeded, a server that goes
    away makes error records to the end (retried on resume), and the run names the causes."""
    n = 12
    srv = serve({"default": "#### 1", "delay_s": 0.3})
    port = srv.server_address[1]
    suite, runner = _profiles(tmp_path, port, n, retries=0)
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "moebench.cli", "run", str(suite), "--runner", str(runner),
                             "--out", str(out)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not ((out / "items.jsonl").exists() and len(read_items(out)) >= 2):
            time.sleep(0.02)
        srv.shutdown()
        srv.server_close()
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    m = _manifest(out)
    assert m["status"] == "complete"
    recs = read_items(out)
    ok = [r for r in recs if r["status"] == "ok"]
    errs = [r for r in recs if r["status"] == "error"]
    assert len(recs) == n and len(ok) >= 2 and len(errs) >= UNREACHABLE_STOP_AFTER, [r["status"] for r in recs]
    conn = [r for r in errs if "ConnectError" in r["error"]]
    assert conn, [r["error"] for r in errs]
    lines = stdout.splitlines()
    assert "most common errors:" in lines, stdout
    causes = lines[lines.index("most common errors:") + 1:]
    top = conn[0]["error"]
    assert any(ln.strip() == f"{len(conn)} x {top}" for ln in causes), stdout


def test_every_item_errored_prints_the_causes_with_counts(tmp_path, data_dir):
    srv = serve({"default": "#### 1", "fail_first": 10})          # HTTP 500 to the first 10 requests
    try:
        suite, runner = _profiles(tmp_path, srv.server_address[1], 5, retries=0)
        out = tmp_path / "run"
        res = moebench_cli("run", str(suite), "--runner", str(runner), "--out", str(out))
        assert res.returncode == 1, res.stderr
        recs = read_items(out)
        assert len(recs) == 5 and all(r["status"] == "error" for r in recs)
        lines = res.stdout.splitlines()
        assert "most common errors:" in lines, res.stdout
        causes = [ln.strip() for ln in lines[lines.index("most common errors:") + 1:] if ln.startswith("  ")]
        assert len(causes) == 1 and causes[0].startswith("5 x ") and "500" in causes[0], res.stdout
        m = _manifest(out)
        assert m["error_causes"] == [{"error": recs[0]["error"], "count": 5}]
        assert causes[0] == f"5 x {recs[0]['error']}"
        again = moebench_cli("run", str(suite), "--runner", str(runner), "--out", str(tmp_path / "run2"), "--json")
        assert again.returncode == 1, again.stderr
        assert json.loads(again.stdout)["error_causes"] == [{"error": recs[0]["error"], "count": 5}]
        # Nothing was measured: the run is failed, not complete, and --resume asks every item again.
        assert "status: failed" in lines and m["status"] == "failed"
        assert any(e["event"] == "failed" and "every item asked (5) errored" in e["message"] for e in m["events"])
        done = moebench_cli("run", str(suite), "--runner", str(runner), "--out", str(out), "--resume")
        assert done.returncode == 0, done.stderr
        m2 = _manifest(out)
        assert m2["status"] == "complete" and m2["error_causes"] == [] and m2["summary"]["gsm8k"]["n_errors"] == 0
        assert "most common errors:" not in done.stdout
    finally:
        srv.shutdown()
        srv.server_close()
