"""run -> compare -> report -> gate through the real CLI, against an HTTP server on 127.0.0.1
that answers planted GSM8K replies, so the exact wins and losses are known in advance."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, moebench_cli, read_items
from moebench.datasets import read_jsonl
from moebench.scoring.answers import gsm8k_reference
from openai_fake import serve

N = 10
BASE_RIGHT = {0, 1, 2, 3, 4, 5}
CAND_RIGHT = {2, 3, 4, 5, 6, 7, 8}
EXPECTED_LOSSES = sorted(BASE_RIGHT - CAND_RIGHT)     # right in baseline, wrong in candidate
EXPECTED_WINS = sorted(CAND_RIGHT - BASE_RIGHT)


def _plan(data_dir: Path) -> dict:
    rows = read_jsonl(data_dir / "gsm8k" / "test.jsonl")[:N]
    answers: dict[str, list] = {"baseline": [], "candidate": []}
    for i, row in enumerate(rows):
        ref = gsm8k_reference(row["answer"])
        key = row["question"][:60]
        for model, right in (("baseline", BASE_RIGHT), ("candidate", CAND_RIGHT)):
            # wrong answers are planted as a different number; one carries <script> to test escaping
            text = f"Let me think.\n#### {ref}" if i in right else f"<script>alert({i})</script> #### {int(float(ref)) + 1}"
            answers[model].append([key, text])
    return {"answers": answers, "default": "#### -1"}


def _profiles(tmp: Path, port: int) -> tuple[Path, Path, Path]:
    suite = tmp / "gsm8k10.toml"
    suite.write_text(f'name = "gsm8k10"\n[[tasks]]\ntask = "gsm8k"\nlimit = {N}\nshots = 2\nmax_tokens = 64\n'
                     '[probes]\nnvml = true\n')
    runners = []
    for model in ("baseline", "candidate"):
        p = tmp / f"{model}.toml"
        p.write_text(f'kind = "http"\nbase_url = "http://127.0.0.1:{port}/v1"\nmodel = "{model}"\nconcurrency = 3\n')
        runners.append(p)
    return suite, runners[0], runners[1]


def test_run_compare_report_gate(tmp_path, data_dir):
    server = serve(_plan(data_dir))
    try:
        suite, base_p, cand_p = _profiles(tmp_path, server.server_address[1])
        runs = {}
        for name, prof in (("base", base_p), ("cand", cand_p)):
            proc = moebench_cli("run", str(suite), "--runner", str(prof), "--out", str(tmp_path / name),
                                "--label", name, check=True)
            runs[name] = Path(proc.stdout.strip().splitlines()[-1])
            assert runs[name] == tmp_path / name
            m = json.loads((runs[name] / "manifest.json").read_text())
            assert m["status"] == "complete"
            assert m["label"] == name and m["runner"]["kind"] == "http"
            assert "gsm8k/test.jsonl" in m["data_files"] and len(m["data_files"]["gsm8k/test.jsonl"]) == 64
            assert m["probes"]["nvml"]["available"] is False          # no GPU here: reported, run goes on
            assert m["moebench"]["git_revision"]
            items = read_items(runs[name])
            assert sorted(r["item_id"] for r in items) == sorted(f"gsm8k/test/{i}" for i in range(N))
            assert all(r["status"] == "ok" for r in items)

        cmp_dir = tmp_path / "cmp"
        proc = moebench_cli("compare", str(runs["base"]), str(runs["cand"]), "--out", str(cmp_dir), check=True)
        assert "gsm8k" in proc.stdout and proc.stdout.strip().splitlines()[-1] == str(cmp_dir)
        cmp = json.loads((cmp_dir / "compare.json").read_text())
        g = cmp["tasks"]["gsm8k"]
        assert g["n_paired"] == N
        assert g["baseline_correct"] == len(BASE_RIGHT) and g["candidate_correct"] == len(CAND_RIGHT)
        assert g["losses"] == [f"gsm8k/test/{i}" for i in EXPECTED_LOSSES]
        assert g["wins"] == [f"gsm8k/test/{i}" for i in EXPECTED_WINS]
        assert g["excluded"] == []
        assert g["mcnemar_p"] == pytest.approx(1.0)      # 3 wins vs 2 losses
        assert g["delta_ci95"][0] <= 0.1 <= g["delta_ci95"][1]

        html = (cmp_dir / "report.html").read_text()
        assert "<script>alert(0)</script>" not in html and "&lt;script&gt;alert(0)" in html
        proc = moebench_cli("report", str(cmp_dir), "--out", str(tmp_path / "r.html"), check=True)
        assert (tmp_path / "r.html").stat().st_size > 1000

        strict = tmp_path / "strict.toml"
        strict.write_text("[gsm8k]\nmax_losses = 1\n")
        lenient = tmp_path / "lenient.toml"
        lenient.write_text("[gsm8k]\nmax_losses = 2\nmax_accuracy_drop = 0.0\n")
        assert moebench_cli("gate", str(cmp_dir), "--rules", str(strict)).returncode == 1
        assert "FAIL" in (cmp_dir / "summary.md").read_text()
        assert moebench_cli("gate", str(cmp_dir), "--rules", str(lenient)).returncode == 0
        assert moebench_cli("gate", str(cmp_dir), "--rules", str(tmp_path / "missing.toml")).returncode == 2
        assert (cmp_dir / "junit.xml").is_file()
    finally:
        server.shutdown()


def test_bad_server_gives_error_records_not_wrong_answers(tmp_path, data_dir):
    rows = read_jsonl(data_dir / "gsm8k" / "test.jsonl")[:4]
    plan = {"garbage_for": [rows[1]["question"][:50]], "bad_request_for": [rows[2]["question"][:50]],
            "default": "#### 0"}
    server = serve(plan)
    try:
        suite, base_p, _ = _profiles(tmp_path, server.server_address[1])
        suite.write_text('name = "g4"\n[[tasks]]\ntask = "gsm8k"\nlimit = 4\nshots = 0\n')
        proc = moebench_cli("run", str(suite), "--runner", str(base_p), "--out", str(tmp_path / "r"))
        assert proc.returncode == 0, proc.stderr
        recs = {r["item_id"]: r for r in read_items(tmp_path / "r")}
        assert recs["gsm8k/test/1"]["status"] == "error" and "not JSON" in recs["gsm8k/test/1"]["error"]
        assert recs["gsm8k/test/2"]["status"] == "error" and "HTTP 400" in recs["gsm8k/test/2"]["error"]
        assert recs["gsm8k/test/1"]["correct"] is None
        assert recs["gsm8k/test/0"]["status"] == "ok"
        summary = json.loads((tmp_path / "r" / "manifest.json").read_text())["summary"]["gsm8k"]
        assert summary["n_errors"] == 2 and summary["n_scored"] == 2
    finally:
        server.shutdown()


def test_sigkill_then_resume_asks_each_item_once(tmp_path, data_dir):
    """Kill `moebench run` with SIGKILL halfway; `--resume` finishes it. Every item ends up exactly
    once in items.jsonl and no item that had finished was asked again."""
    n = 12
    log = tmp_path / "asked.jsonl"
    plan = {"default": "#### 1", "delay_s": 0.25, "log": str(log)}
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan))
    srv = subprocess.Popen([sys.executable, str(REPO / "tests" / "openai_fake.py"), "--plan", str(plan_path)],
                           stdout=subprocess.PIPE, text=True)
    try:
        port = int(srv.stdout.readline().split()[1])
        suite, base_p, _ = _profiles(tmp_path, port)
        suite.write_text(f'name = "g"\n[[tasks]]\ntask = "gsm8k"\nlimit = {n}\nshots = 0\n')
        base_p.write_text(f'kind = "http"\nbase_url = "http://127.0.0.1:{port}/v1"\nmodel = "b"\nconcurrency = 1\n')
        out = tmp_path / "run"
        proc = subprocess.Popen([sys.executable, "-m", "moebench.cli", "run", str(suite), "--runner", str(base_p),
                                 "--out", str(out)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.time() + 60
        while time.time() < deadline:
            if (out / "items.jsonl").exists() and len(read_items(out)) >= n // 2:
                break
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        done_before = {r["item_id"] for r in read_items(out)}
        assert n // 2 <= len(done_before) < n
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["status"] in ("running", "interrupted")
        asked_before = len(log.read_text().splitlines())

        res = moebench_cli("run", str(suite), "--runner", str(base_p), "--out", str(out), "--resume", check=True)
        assert res.stdout.strip().splitlines()[-1] == str(out)
        items = read_items(out)
        ids = [r["item_id"] for r in items]
        assert sorted(ids) == sorted(f"gsm8k/test/{i}" for i in range(n)), "every item exactly once"
        asked_after = [json.loads(line) for line in log.read_text().splitlines()][asked_before:]
        questions = {r["item_id"]: r["question"] for r in items}
        for a in asked_after:
            for item_id in done_before:
                assert questions[item_id][-150:] not in a["prompt_tail"], f"{item_id} was asked again"
        assert len(asked_after) == n - len(done_before)
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["status"] == "complete" and manifest["resumes"] == 1
    finally:
        srv.kill()
        srv.wait()


def test_torn_last_line_is_ignored_and_cut_on_resume(tmp_path):
    from moebench.store import RunStore, iter_records
    store = RunStore.create_or_resume(tmp_path / "r", {"label": "x"})
    store.append({"task": "t", "item_id": "a", "status": "ok"})
    store.close()
    with open(tmp_path / "r" / "items.jsonl", "ab") as f:
        f.write(b'{"task": "t", "item_id": "b", "sta')      # a crash mid-write
    assert [r["item_id"] for r in iter_records(tmp_path / "r" / "items.jsonl")] == ["a"]
    store = RunStore.create_or_resume(tmp_path / "r", {"label": "x"})
    store.append({"task": "t", "item_id": "b", "status": "ok"})
    store.close()
    lines = (tmp_path / "r" / "items.jsonl").read_text().splitlines()
    assert [json.loads(x)["item_id"] for x in lines] == ["a", "b"]


def test_corrupt_middle_line_is_an_error_naming_the_line(tmp_path):
    from moebench.store import StoreError, iter_records
    p = tmp_path / "items.jsonl"
    p.write_text('{"task":"t","item_id":"a","status":"ok"}\nnot json\n{"task":"t","item_id":"b","status":"ok"}\n')
    with pytest.raises(StoreError, match="line 2"):
        list(iter_records(p))


def test_capability_mismatch_is_reported_before_any_work(tmp_path):
    """KLD needs prompt log-probs, which a plain OpenAI-compatible server lacks: exit 2 before any item."""
    suite = tmp_path / "k.toml"
    suite.write_text('name = "k"\n[[tasks]]\ntask = "kld"\nchunks = 1\n')
    runner = tmp_path / "h.toml"
    runner.write_text('kind = "http"\nbase_url = "http://127.0.0.1:9/v1"\n')
    proc = moebench_cli("run", str(suite), "--runner", str(runner), "--out", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stderr
    assert "prompt_logprobs" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "r" / "items.jsonl").exists()


def test_bad_suite_key_exits_2_naming_file_and_key(tmp_path):
    suite = tmp_path / "s.toml"
    suite.write_text('name = "s"\n[[tasks]]\ntask = "gsm8k"\nshots = "five"\n')
    proc = moebench_cli("run", str(suite), "--runner", "runners/http.toml", "--out", str(tmp_path / "r"))
    assert proc.returncode == 2
    assert str(suite) in proc.stderr and "'shots'" in proc.stderr and "Traceback" not in proc.stderr
