"""Group commit in the run store: records arriving together share one write and one fsync, each is
acknowledged only after the fsync that covers it, and a SIGKILL at any moment (a group commit among
them) leaves no torn or duplicated line and loses no acknowledged record."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import REPO
from moebench.store import RunStore, iter_records


def _store(path: Path) -> RunStore:
    return RunStore.create_or_resume(path, {"run_id": "t", "suite": {"name": "s"}})


def test_records_arriving_together_share_an_fsync_and_are_acknowledged_after_it(tmp_path, monkeypatch):
    store = _store(tmp_path / "run")
    fd = store._items_file.fileno()
    synced = {"calls": 0, "bytes": 0}
    real_fsync = os.fsync

    def slow_fsync(f):
        time.sleep(0.02)                # a slow disk: records pile up behind the fsync in progress
        real_fsync(f)
        if f == fd:
            synced["calls"] += 1
            synced["bytes"] = os.fstat(fd).st_size

    monkeypatch.setattr(os, "fsync", slow_fsync)

    async def go():
        async def one(i):
            await asyncio.sleep(0.001 * (i % 7))
            rec = await store.append_async({"task": "t", "item_id": str(i), "status": "ok", "pad": "x" * 100})
            # acknowledged: the file's size at the last fsync covers this record's line
            text = (tmp_path / "run" / "items.jsonl").read_bytes()[: synced["bytes"]]
            assert f'"item_id": "{i}"'.encode() in text
            return rec

        return await asyncio.gather(*(one(i) for i in range(200)))

    try:
        recs = asyncio.run(go())
        assert [r["item_id"] for r in recs] == [str(i) for i in range(200)]
        assert store.append({"task": "t", "item_id": "sync", "status": "ok"})["item_id"] == "sync"
    finally:
        store.close()
    assert synced["calls"] < 60, synced           # batched: far fewer fsyncs than records
    ids = [r["item_id"] for r in iter_records(tmp_path / "run" / "items.jsonl")]
    assert sorted(ids) == sorted([str(i) for i in range(200)] + ["sync"])


def test_append_many_shares_fsyncs_and_returns_durable(tmp_path, monkeypatch):
    store = _store(tmp_path / "run")
    fd = store._items_file.fileno()
    calls = []
    real_fsync = os.fsync

    def counting(f):
        real_fsync(f)
        if f == fd:
            calls.append(os.fstat(fd).st_size)

    monkeypatch.setattr(os, "fsync", counting)
    try:
        out = store.append_many([{"task": "t", "item_id": str(i), "status": "ok", "x": float("nan") if i == 3 else i}
                                 for i in range(500)])
        assert calls and calls[-1] == os.fstat(fd).st_size       # everything returned is fsynced
    finally:
        store.close()
    assert len(calls) < 50, len(calls)
    assert out[3]["status"] == "error" and out[3]["non_finite"]   # written as it is returned
    assert [r["item_id"] for r in iter_records(tmp_path / "run" / "items.jsonl")] == [str(i) for i in range(500)]


def test_a_failed_write_fails_its_batch_and_every_later_append(tmp_path, monkeypatch):
    store = _store(tmp_path / "run")
    store.append({"task": "t", "item_id": "0", "status": "ok"})
    real_fsync = os.fsync

    def full(f):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    try:
        with pytest.raises(OSError) as e:
            store.append({"task": "t", "item_id": "1", "status": "ok"})
        assert e.value.errno == 28 and e.value.filename == str(tmp_path / "run" / "items.jsonl")
        monkeypatch.setattr(os, "fsync", real_fsync)
        with pytest.raises(OSError):            # nothing more is written after a failed write
            store.append({"task": "t", "item_id": "2", "status": "ok"})
    finally:
        store.close()
    ids = [r["item_id"] for r in iter_records(tmp_path / "run" / "items.jsonl")]
    assert "2" not in ids and ids[0] == "0"


WRITER = textwrap.dedent("""
    import asyncio, os, sys
    from moebench.store import RunStore
    store = RunStore.create_or_resume(sys.argv[1], {"run_id": "k", "suite": {"name": "s"}})
    start = int(sys.argv[2])
    out = os.fdopen(1, "w", buffering=1)

    async def one(i):
        # big records: a batch's write takes long enough for the kill to land inside it
        rec = await store.append_async({"task": "t", "item_id": str(i), "status": "ok", "pad": "y" * 60000})
        out.write(rec["item_id"] + "\\n")       # acknowledged: durable

    async def worker(w):
        for i in range(start + w, start + 100000, 64):
            await one(i)

    async def main():
        await asyncio.gather(*(worker(w) for w in range(64)))

    print("READY", flush=True)
    asyncio.run(main())
""")


def test_sigkill_during_group_commits_leaves_no_torn_or_duplicated_line(tmp_path):
    run = tmp_path / "run"
    acked: set[str] = set()
    start = 0
    for kill_after in (0.15, 0.4, 0.05, 0.7, 0.25, 0.33, 0.1, 0.55):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(run), str(start)], cwd=REPO,
                                stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert proc.stdout.readline().strip() == "READY"
        time.sleep(kill_after)
        proc.send_signal(signal.SIGKILL)
        rest = proc.stdout.read()
        proc.wait()
        # every line the writer printed whole is an acknowledged record
        acked |= {x for x in rest.split("\n")[:-1] if x}
        data = (run / "items.jsonl").read_bytes()
        lines = data.split(b"\n")
        for raw in lines[:-1]:                  # every line but a torn tail is one whole record
            json.loads(raw)
        ids = [r["item_id"] for r in iter_records(run / "items.jsonl")]
        assert len(ids) == len(set(ids)), "a record was written twice"
        missing = acked - set(ids)
        assert not missing, f"acknowledged records lost: {sorted(missing)[:5]}"
        start += 100000                         # the next writer resumes (cutting any torn tail)
    assert len(acked) > 0
    assert sum(1 for _ in iter_records(run / "items.jsonl")) > len(acked) / 2


def test_records_of_one_loop_pass_reach_the_writer_together(tmp_path, monkeypatch):
    store = _store(tmp_path / "run")
    fd = store._items_file.fileno()
    synced: list[int] = []
    real_fsync = os.fsync

    def counting(f):
        real_fsync(f)
        if f == fd:
            synced.append(os.fstat(fd).st_size)

    monkeypatch.setattr(os, "fsync", counting)

    async def go():
        # 50 appends with no await between them: one pass of the loop, so one batch and one fsync
        futures = [store.append_async({"task": "t", "item_id": str(i), "status": "ok"}) for i in range(50)]
        assert synced == []                 # nothing handed over before the pass ends
        return await asyncio.gather(*futures)

    try:
        recs = asyncio.run(go())
    finally:
        store.close()
    assert [r["item_id"] for r in recs] == [str(i) for i in range(50)]
    assert synced == [os.path.getsize(tmp_path / "run" / "items.jsonl")]
    assert [r["item_id"] for r in iter_records(tmp_path / "run" / "items.jsonl")] == [str(i) for i in range(50)]


def test_a_blocking_append_or_close_on_the_loop_writes_what_the_loop_holds_first(tmp_path):
    store = _store(tmp_path / "run")

    async def go():
        held = store.append_async({"task": "t", "item_id": "a", "status": "ok"})
        store.append({"task": "t", "item_id": "b", "status": "ok"})         # durable on return, after "a"
        last = store.append_async({"task": "t", "item_id": "c", "status": "ok"})
        store.close()                                                      # "c" is written before the end
        return await held, await last

    a, c = asyncio.run(go())
    assert (a["item_id"], c["item_id"]) == ("a", "c")
    assert [r["item_id"] for r in iter_records(tmp_path / "run" / "items.jsonl")] == ["a", "b", "c"]


def test_append_async_after_a_failed_write_raises_at_once(tmp_path, monkeypatch):
    store = _store(tmp_path / "run")

    def full(f):
        raise OSError(28, "No space left on device")

    async def go():
        first = store.append_async({"task": "t", "item_id": "1", "status": "ok"})
        with pytest.raises(OSError) as e:
            await first                     # its batch failed: its future carries the error
        assert e.value.errno == 28
        with pytest.raises(OSError):        # and every later append fails where it is made
            store.append_async({"task": "t", "item_id": "2", "status": "ok"})

    monkeypatch.setattr(os, "fsync", full)
    try:
        asyncio.run(go())
    finally:
        store.close()
    assert "2" not in [r["item_id"] for r in iter_records(tmp_path / "run" / "items.jsonl")]
