"""Every JSON file moebench writes is standard JSON (no NaN, Infinity): a record holding a non-finite
number becomes an error record naming the field (never a crash, nothing lost), and a document's
non-finite numbers are written as null and named in its `non_finite` list."""
from __future__ import annotations

import json
import math
from pathlib import Path

from conftest import moebench_cli, read_items
from openai_fake import serve


def _strict(text: str):
    """json.loads that refuses NaN, Infinity and -Infinity, as standard JSON parsers do."""
    def refuse(name: str):
        raise AssertionError(f"non-standard JSON constant {name}")
    return json.loads(text, parse_constant=refuse)


def test_server_reply_with_a_non_finite_field_becomes_an_error_record_naming_it(tmp_path, data_dir):
    # The server's own timings (llama-server sends them) carry a NaN for the first question only.
    srv = serve({"default": "#### 1", "extra": {"Janet": {"timings": {"prompt_ms": math.nan, "predicted_n": 3}}}})
    try:
        suite = tmp_path / "g.toml"
        suite.write_text('name = "g"\n[[tasks]]\ntask = "gsm8k"\nlimit = 3\nshots = 0\n[probes]\nnvml = false\n')
        runner = tmp_path / "r.toml"
        runner.write_text(f'kind = "http"\nbase_url = "http://127.0.0.1:{srv.server_address[1]}/v1"\nmodel = "m"\n'
                          'retries = 0\n')
        out = tmp_path / "run"
        res = moebench_cli("run", str(suite), "--runner", str(runner), "--out", str(out))
        assert res.returncode == 0, res.stderr
        assert "Traceback" not in res.stderr
        lines = (out / "items.jsonl").read_text().splitlines()
        recs = [_strict(ln) for ln in lines]
        assert len(recs) == 3
        bad = [r for r in recs if r["item_id"] == "gsm8k/test/0"]
        assert len(bad) == 1
        bad = bad[0]
        assert bad["status"] == "error" and bad["correct"] is None
        # The HTTP runner refuses the impossible value at parse time, naming the field and the URL (the
        # store's own conversion of a non-finite record is the next test's).
        assert bad["error_type"] == "RunnerError", bad
        assert "field 'timings.prompt_ms' is nan" in bad["error"] and "/v1/completions" in bad["error"], bad
        assert all(r["status"] == "ok" for r in recs if r is not bad)
        m = _strict((out / "manifest.json").read_text())
        assert m["status"] == "complete" and m["summary"]["gsm8k"]["n_errors"] == 1
        assert "field 'timings.prompt_ms' is nan" in res.stdout
    finally:
        srv.shutdown()
        srv.server_close()


def test_store_append_turns_a_non_finite_record_into_an_error_record(tmp_path):
    """Whatever produced it (a task, lm-eval, an import), a record is written as standard JSON."""
    from moebench.store import RunStore
    store = RunStore.create_or_resume(tmp_path / "run", {"run_id": "r", "label": "x"})
    try:
        ok = store.append({"task": "t", "item_id": "t/0", "status": "ok", "correct": True, "n": 1.5})
        bad = store.append({"task": "t", "item_id": "t/1", "status": "ok", "correct": True, "answer": "4",
                            "usage": {"completion_tokens": math.inf, "prompt_tokens": 7},
                            "top": [{"A": -0.1, "B": -math.inf}]})
        failed = store.append({"task": "t", "item_id": "t/2", "status": "error", "error": "RunnerError: boom",
                               "wall_s": math.nan})
    finally:
        store.close()
    written = [_strict(ln) for ln in (tmp_path / "run" / "items.jsonl").read_text().splitlines()]
    assert written == [ok, bad, failed]
    assert ok["status"] == "ok" and "non_finite" not in ok
    assert bad["status"] == "error" and bad["correct"] is None and bad["error_type"] == "NonFiniteValue"
    assert bad["error"] == "non-finite values at usage.completion_tokens, top[0].B"
    assert bad["non_finite"] == {"usage.completion_tokens": "Infinity", "top[0].B": "-Infinity"}
    assert bad["usage"] == {"completion_tokens": None, "prompt_tokens": 7} and bad["answer"] == "4"
    assert failed["error"] == "RunnerError: boom; non-finite value at wall_s" and failed["wall_s"] is None


def test_documents_write_non_finite_numbers_as_null_and_name_them(tmp_path):
    from moebench.store import write_json_atomic
    path = tmp_path / "doc.json"
    write_json_atomic(path, {"kld": {"mean": math.inf, "quantiles": [0.1, math.nan]}, "n": 3,
                             "delta": -math.inf})
    doc = _strict(path.read_text())
    assert doc == {"kld": {"mean": None, "quantiles": [0.1, None]}, "n": 3, "delta": None,
                   "non_finite": ["kld.mean", "kld.quantiles[1]", "delta"]}


# json.dumps calls that only quote strings (no number can reach them): the rest of the package writes
# JSON through moebench.jsonout.
STRING_ONLY = {   # (file, text of the line): why
    ("moebench/lmeval/local_tasks.py", "return json.dumps(text, ensure_ascii=False)"): "a YAML scalar quoted",
    ("moebench/lmeval/local_tasks.py", "fill = json.dumps(str(root))[1:-1]"): "a path escaped for YAML",
    ("moebench/secrets.py", "escaped = json.dumps(s)[1:-1]"): "a secret as it appears inside a JSON string",
    ("moebench/runners/wire.py", "json.dumps(c, ensure_ascii=False) for c in self.choices"): "grammar choices",
    ("moebench/serve.py", 'f"got {json.dumps(v)[:80]}", param=key)'): "a request value quoted in an error",
    # The sandbox child runs isolated (python -I -S) and cannot import moebench: its launch
    # configuration and status lines are strings and integers on a private pipe, never a file.
    ("moebench/scoring/sandbox.py", 'os.write(status_fd, (json.dumps({"stage": stage, **kw})'): "the sandbox's pipe",
}


def test_serve_sends_standard_json_even_for_a_non_finite_number():
    """moebench serve's replies and SSE events go through wire_json: a -inf log-prob is null on the wire."""
    from moebench.serve import wire_json
    text = wire_json({"logprobs": {"token_logprobs": [-0.5, -math.inf], "top": [{"a": math.nan}]}, "n": 1})
    assert _strict(text) == {"logprobs": {"token_logprobs": [-0.5, None], "top": [{"a": None}]}, "n": 1}
    assert wire_json({"ok": [1.5, "x"]}) == '{"ok": [1.5, "x"]}'


def test_no_json_writer_in_the_package_allows_nan():
    """Every JSON writer goes through moebench.jsonout (allow_nan=False); json.dump/json.dumps appear
    only in jsonout.py and where they quote strings (STRING_ONLY)."""
    root = Path(__file__).resolve().parents[1]
    offenders = []
    for py in sorted((root / "moebench").rglob("*.py")):
        rel = str(py.relative_to(root))
        if py.name == "jsonout.py":
            continue
        for n, line in enumerate(py.read_text(encoding="utf-8").splitlines(), start=1):
            allowed = any(rel == f and text in line for f, text in STRING_ONLY)
            # aiohttp's json_response uses json.dumps unless given serve's wire_json
            raw_response = "web.json_response(" in line and "dumps=wire_json" not in line
            # the engine imports nothing else of moebench: it calls json.dumps with allow_nan=False itself
            strict = "allow_nan=False" in line
            if ("json.dump(" in line or "json.dumps(" in line or raw_response) and not (allowed or strict):
                offenders.append(f"{rel}:{n}: {line.strip()}")
    assert offenders == []
