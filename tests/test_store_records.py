"""Typed store documents (moebench/store/records.py): on real run and compare directories written by
`api.run` and `api.compare` (the engine on the zoo model, GSM8K and CMMLU items), every document reads
into its class and writes back the same JSON; bad input names the file, the key and the type."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from moebench import api
from moebench.store import RunStore
from moebench.store.records import (COMPARE_SCHEMA_VERSION, CompareDoc, ItemRecord, Manifest, RecordError,
                                    RunCounts)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compared(tmp_path_factory, zoo, data_dir) -> Path:
    pytest.importorskip("torch")
    tmp = tmp_path_factory.mktemp("records")
    suite = tmp / "tiny.toml"
    suite.write_text('name = "tiny"\n[[tasks]]\ntask = "gsm8k"\nlimit = 3\nshots = 1\nmax_tokens = 8\n'
                     '[[tasks]]\ntask = "cmmlu"\nper_subject_limit = 1\nlimit = 3\nshots = 0\n'
                     '[probes]\nnvml = false\n', encoding="utf-8")
    runner = tmp / "engine.toml"
    runner.write_text((ROOT / "runners" / "engine-bf16.toml").read_text(encoding="utf-8").replace(
        'model = "models/zoo/tiny-moe"', f'model = "{zoo / "tiny-moe"}"'), encoding="utf-8")
    runs = []
    for label in ("base", "cand"):
        run_dir, code = api.run(api.RunOptions(suite=str(suite), runner=str(runner), out=str(tmp / label),
                                               label=label, quiet=True))
        assert code == 0, (run_dir / "manifest.json").read_text()
        runs.append(run_dir)
    out, _ = api.compare(str(runs[0]), str(runs[1]), out=str(tmp / "cmp"), write_report=False)
    return out


def _json(path: Path):
    return json.loads(path.read_text(encoding="utf-8"))


def test_real_documents_read_typed_and_write_back_the_same_json(compared):
    cmp_raw = _json(compared / "compare.json")
    doc = CompareDoc.from_dict(cmp_raw, "compare.json")
    assert doc.to_dict() == cmp_raw
    assert doc.schema_version == COMPARE_SCHEMA_VERSION
    assert (doc.baseline.label, doc.candidate.label) == ("base", "cand")
    assert set(doc.tasks) == {"gsm8k", "cmmlu"} and doc.tasks["gsm8k"]["n_paired"] == 3
    for side in (doc.baseline, doc.candidate):
        run = Path(side.run)
        raw = _json(run / "manifest.json")
        m = Manifest.from_dict(raw, str(run / "manifest.json"))
        assert m.to_dict() == raw
        assert (m.status, m.label, m.suite_name, m.runner_name) == ("complete", side.label, "tiny", "engine")
        assert set(m.summary) == {"gsm8k", "cmmlu"} and m.counts.asked == 6 and m.ended_at
        lines = [json.loads(ln) for ln in (run / "items.jsonl").read_text(encoding="utf-8").splitlines()]
        recs = [ItemRecord.from_dict(ln, f"{run}/items.jsonl") for ln in lines]
        assert [r.to_dict() for r in recs] == lines
        assert [r.key for r in recs] == [(ln["task"], ln["item_id"]) for ln in lines]
        assert {r.status for r in recs} == {"ok"} and all(isinstance(r.correct, bool) for r in recs)
        assert all("prompt_hash" in r.extra for r in recs)


@pytest.mark.parametrize("change,message", [
    ({"status": "done"}, r"manifest\.json: key 'status' is 'done', expected one of 'running'"),
    ({"label": 7}, r"manifest\.json: key 'label' is an integer, expected a string or null"),
    ({"suite": ["quality"]}, r"manifest\.json: key 'suite' is a list, expected an object or null"),
    ({"schema_version": "1"}, r"manifest\.json: key 'schema_version' is a string, expected an integer"),
    ({"schema_version": 99}, r"manifest\.json: schema_version 99 is newer than this moebench reads"),
])
def test_bad_manifest_names_file_key_and_type(compared, change, message):
    raw = _json(compared.parent / "base" / "manifest.json")
    with pytest.raises(RecordError, match=message):
        Manifest.from_dict({**raw, **change}, "results/base/manifest.json")
    with pytest.raises(RecordError, match=r"manifest\.json: missing key 'status' \(expected a string\)"):
        Manifest.from_dict({k: v for k, v in raw.items() if k != "status"}, "results/base/manifest.json")


def test_bad_item_records_and_compare_documents_name_file_key_and_type(compared):
    line = json.loads((compared.parent / "base" / "items.jsonl").read_text(encoding="utf-8").splitlines()[0])
    with pytest.raises(RecordError, match=r"items\.jsonl line 1: key 'correct' is a string, expected true or false"):
        ItemRecord.from_dict({**line, "correct": "yes"}, "items.jsonl line 1")
    with pytest.raises(RecordError, match=r"items\.jsonl: missing key 'item_id'"):
        ItemRecord.from_dict({k: v for k, v in line.items() if k != "item_id"})
    with pytest.raises(RecordError, match=r"items\.jsonl: expected a JSON object, got a list"):
        ItemRecord.from_dict([line])
    cmp_raw = _json(compared / "compare.json")
    with pytest.raises(RecordError, match=r"compare\.json: key 'tasks' is a list, expected an object or null"):
        CompareDoc.from_dict({**cmp_raw, "tasks": []})
    with pytest.raises(RecordError, match=r"compare\.json: baseline: key 'label' is an integer"):
        CompareDoc.from_dict({**cmp_raw, "baseline": {"run": "x", "label": 3}})


def test_gate_and_report_refuse_a_malformed_compare_naming_the_key(compared, tmp_path, capsys):
    from moebench.report.render import ReportError, render
    bad = tmp_path / "cmp"
    bad.mkdir()
    cmp_raw = _json(compared / "compare.json")
    (bad / "compare.json").write_text(json.dumps({**cmp_raw, "candidate": "cand"}), encoding="utf-8")
    rules = tmp_path / "rules.toml"
    rules.write_text("[gsm8k]\nmax_losses = 3\n", encoding="utf-8")
    assert api.gate(str(bad), str(rules)) == 2
    assert "compare.json: key 'candidate' is a string, expected an object or null" in capsys.readouterr().err
    with pytest.raises(ReportError, match=r"compare\.json: key 'candidate' is a string"):
        render(bad)
    assert api.gate(str(compared), str(rules)) == 0


def test_run_store_writes_what_the_manifest_class_reads(tmp_path):
    store = RunStore.create_or_resume(tmp_path / "r", {"run_id": "abc", "label": "x", "suite": {"name": "s"},
                                                       "runner": {"name": "http", "kind": "http"}})
    store.append({"task": "gsm8k", "item_id": "gsm8k/test/0", "status": "error", "correct": None,
                  "answer": None, "reference": "4", "output": None, "error": "RunnerError: boom"})
    store.finish("failed", summary={}, counts=RunCounts(asked=1, errors=1))
    store.close()
    m = Manifest.from_dict(_json(tmp_path / "r" / "manifest.json"))
    assert (m.status, m.run_id, m.runner_name, m.counts) == ("failed", "abc", "http", RunCounts(asked=1, errors=1))
    rec = ItemRecord.from_dict(json.loads((tmp_path / "r" / "items.jsonl").read_text().splitlines()[0]))
    assert rec.status == "error" and rec.correct is None and rec.extra == {"error": "RunnerError: boom"}


def test_single_run_report_reads_items_typed_and_names_a_bad_record(compared, tmp_path):
    import shutil

    from moebench.report.render import ReportError, render
    run = tmp_path / "base"
    shutil.copytree(compared.parent / "base", run)
    html = render(run).read_text(encoding="utf-8")
    assert "gsm8k/test/0" in html and "moebench run: base" in html
    items = run / "items.jsonl"
    lines = items.read_text(encoding="utf-8").splitlines()
    bad = {**json.loads(lines[1]), "status": "skipped"}
    items.write_text("\n".join([lines[0], json.dumps(bad), *lines[2:]]) + "\n", encoding="utf-8")
    with pytest.raises(ReportError, match=rf"items\.jsonl \(item '{bad['item_id']}'\): key 'status' is 'skipped', "
                                          r"expected one of 'ok', 'error'"):
        render(run)


def test_the_writer_takes_item_records_and_writes_the_lines_the_run_loop_always_wrote(tmp_path):
    """What a task hands the run loop (an ItemRecord, the JSON fields kld and speed return, or a
    failure) is written with the contract's keys first, then status, then the task's own, wall_s last;
    an ItemRecord and its JSON object give the same bytes."""
    import asyncio
    from moebench.store.session import ask_record

    async def typed():
        return ItemRecord(task="gsm8k", item_id="?", status="ok", correct=True, answer="18", reference="18",
                          output="so #### 18", extra={"extraction": "####", "prompt_hash": "ab12"})

    async def fields():
        return {"kld_mean": 0.25, "output": None, "role": "candidate"}

    async def failing():
        raise ConnectionError("refused")

    async def ask():
        return [await ask_record("gsm8k", "gsm8k/test/0", typed, str),
                await ask_record("kld", "kld/0", fields, str),
                await ask_record("gsm8k", "gsm8k/test/1", failing, lambda e: f"{type(e).__name__}: {e}")]

    recs = asyncio.run(ask())
    lines = {}
    for name, as_given in (("typed", recs), ("json", [r.to_dict() for r in recs])):
        store = RunStore.create_or_resume(tmp_path / name, {"label": name, "suite": {"name": "s"}})
        written = [store.append(r) for r in as_given]
        store.close()
        assert written == [r.to_dict() for r in recs]
        lines[name] = (tmp_path / name / "items.jsonl").read_bytes()
    assert lines["typed"] == lines["json"]
    got = [json.loads(ln) for ln in lines["typed"].decode("utf-8").splitlines()]
    head = ["task", "item_id", "correct", "answer", "reference", "output", "status"]
    assert [list(g) for g in got] == [head + ["extraction", "prompt_hash", "wall_s"],
                                      head + ["kld_mean", "role", "wall_s"], head + ["error", "error_type", "wall_s"]]
    assert got[0]["item_id"] == "gsm8k/test/0" and got[0]["correct"] is True and got[0]["answer"] == "18"
    assert (got[1]["status"], got[1]["correct"], got[1]["kld_mean"]) == ("ok", None, 0.25)
    assert (got[2]["status"], got[2]["correct"], got[2]["error"], got[2]["error_type"]) == (
        "error", None, "ConnectionError: refused", "ConnectionError")
    assert all(isinstance(g["wall_s"], float) for g in got)
    assert [ItemRecord.from_dict(g) for g in got] == recs
