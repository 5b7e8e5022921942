"""Speed task sampling settings and speculative-decoding figures, against a small server that streams
llama-server-style draft counters it chose in advance (acceptance known exactly), then through compare
and the report. The real draft model on llama-server is tested in test_llama_server_runner.py."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from moebench import api
from moebench.runners.base import CapabilityError

# temperature -> (drafted, accepted) per request, as a llama-server with a draft model reports them
COUNTERS = {0.0: (20, 19), 1.0: (20, 5)}


class _DraftServer:
    """`per_reply`: llama-server style, counters in each stream's final `timings`; else vLLM style,
    cumulative counters on GET /metrics (8 drafted, 6 accepted per request)."""

    def __init__(self, per_reply: bool = True):
        self.bodies: list[dict] = []
        self.drafted = self.accepted = 0
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                text = ("# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.\n"
                        "# TYPE vllm:spec_decode_num_draft_tokens_total counter\n"
                        f'vllm:spec_decode_num_draft_tokens_total{{model_name="m"}} {float(outer.drafted)}\n'
                        f'vllm:spec_decode_num_accepted_tokens_total{{model_name="m"}} {float(outer.accepted)}\n'
                        'vllm:num_requests_running{model_name="m"} 0.0\n').encode()
                if per_reply:
                    text, code = b"not found", 404
                else:
                    code = 200
                self.send_response(code)
                self.send_header("Content-Length", str(len(text)))
                self.end_headers()
                self.wfile.write(text)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize":
                    data = json.dumps({"tokens": list(range(len(body["content"].split())))}).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                outer.bodies.append(body)
                drafted, accepted = COUNTERS[float(body["temperature"])]
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                n = body["max_tokens"]
                for i in range(n):
                    self.wfile.write(b"data: " + json.dumps({"choices": [{"index": 0, "text": f" t{i}"}]}).encode()
                                     + b"\n\n")
                last = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                        "usage": {"prompt_tokens": 40, "completion_tokens": n}}
                if per_reply:
                    last["timings"] = {"predicted_n": n, "draft_n": drafted, "draft_n_accepted": accepted}
                else:
                    outer.drafted += 8
                    outer.accepted += 6
                self.wfile.write(b"data: " + json.dumps(last).encode() + b"\n\ndata: [DONE]\n\n")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"


def _run(tmp: Path, url: str, name: str, sampling: str) -> Path:
    suite = tmp / f"{name}.toml"
    suite.write_text(f'name = "{name}"\n[[tasks]]\ntask = "speed"\nprompt_lengths = [32, 64]\noutput_tokens = 24\n'
                     f'repeats = 2\nwarmup = 0\n{sampling}[probes]\nnvml = false\n')
    runner = tmp / "draft.toml"
    runner.write_text(f'kind = "http"\nbase_url = "{url}"\ntokenize = "llama-server"\nretries = 0\n')
    run_dir, code = api.run(api.RunOptions(suite=str(suite), runner=str(runner), out=str(tmp / name), quiet=True))
    assert code == 0
    return run_dir


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "items.jsonl").read_text().splitlines()]


def test_sampling_keys_reach_the_server_and_every_record(tmp_path, data_dir):
    srv = _DraftServer()
    try:
        greedy = _run(tmp_path, srv.url, "greedy", "")
        sampled = _run(tmp_path, srv.url, "sampled", "temperature = 1.0\ntop_p = 0.9\ntop_k = 40\nseed = 7\n")
    finally:
        srv.server.shutdown()
    greedy_bodies = [b for b in srv.bodies if b["temperature"] == 0.0]
    sampled_bodies = [b for b in srv.bodies if b["temperature"] == 1.0]
    assert len(greedy_bodies) == len(sampled_bodies) == 4
    assert all("top_p" not in b and "top_k" not in b and b["seed"] == 1234 for b in greedy_bodies)
    assert all(b["top_p"] == 0.9 and b["top_k"] == 40 and b["seed"] == 7 for b in sampled_bodies)
    for run, want in ((greedy, {"temperature": 0.0, "top_p": None, "top_k": None, "seed": 1234}),
                      (sampled, {"temperature": 1.0, "top_p": 0.9, "top_k": 40, "seed": 7})):
        assert all(r["sampling"] == want for r in _records(run))
        assert json.loads((run / "manifest.json").read_text())["summary"]["speed"]["sampling"] == want


def test_draft_counters_become_acceptance_rates_compared_and_reported(tmp_path, data_dir):
    srv = _DraftServer()
    try:
        greedy = _run(tmp_path, srv.url, "greedy", "")
        sampled = _run(tmp_path, srv.url, "sampled", "temperature = 1.0\ntop_p = 0.9\n")
    finally:
        srv.server.shutdown()
    for run, (drafted, accepted) in ((greedy, COUNTERS[0.0]), (sampled, COUNTERS[1.0])):
        for r in _records(run):
            assert r["status"] == "ok" and r["draft_n"] == drafted and r["draft_n_accepted"] == accepted
            assert r["acceptance_rate"] == pytest.approx(accepted / drafted)
            assert r["tokens_per_step"] == pytest.approx(24 / (24 - accepted))
        by_len = json.loads((run / "manifest.json").read_text())["summary"]["speed"]["by_prompt_length"]
        for length in ("32", "64"):
            d = by_len[length]["1"]["draft"]
            assert d["n"] == 2 and d["draft_n"] == 2 * drafted and d["draft_n_accepted"] == 2 * accepted
            assert d["acceptance_rate"] == pytest.approx(accepted / drafted)
    out, cmp = api.compare(str(greedy), str(sampled), str(tmp_path / "cmp"))
    rows = cmp["speed"]["rows"]
    assert [r["prompt_length"] for r in rows] == [32, 64]
    assert all(r["acceptance_baseline"] == pytest.approx(0.95) and r["acceptance_candidate"] == pytest.approx(0.25)
               for r in rows)
    assert cmp["speed"]["sampling"]["candidate"] == {"temperature": 1.0, "top_p": 0.9, "top_k": None, "seed": 1234}
    html = (out / "report.html").read_text(encoding="utf-8")
    assert "Speculative decoding" in html
    assert html.count('<td class="num">0.95</td><td class="num">0.25</td>') == 2          # per prompt length
    assert "Sampling: baseline greedy (seed 1234); candidate temperature 1, top_p 0.9, seed 1234." in html
    # A gate rule on the acceptance rate: the sampled candidate's 0.25 fails 0.5, passes 0.2.
    for limit, code in ((0.5, 1), (0.2, 0)):
        rules = tmp_path / f"rules{limit}.toml"
        rules.write_text(f"[speed]\nmin_acceptance_rate = {limit}\n")
        assert api.gate(str(out), str(rules)) == code
        if code:
            assert "draft acceptance rate" in (out / "summary.md").read_text()


def test_top_p_on_a_runner_without_sampling_is_refused_before_any_work(tmp_path, data_dir):
    from moebench.runners.base import Capability, Runner

    class GreedyOnly(Runner):
        kind = "greedy-only"
        capabilities = frozenset({Capability.GENERATE, Capability.STREAM})

    from moebench.config import COMMON_TASK_SCHEMA, validate
    from moebench.runners.base import check_capabilities
    from moebench.tasks.base import TaskContext
    from moebench.speed.task import SpeedTask
    opts = validate({"task": "speed", "temperature": 0.7, "top_p": 0.9}, {**COMMON_TASK_SCHEMA, **SpeedTask.options}, "t")
    task = SpeedTask(opts, TaskContext(data_dir=data_dir))
    with pytest.raises(CapabilityError, match="needs sampling"):
        check_capabilities(GreedyOnly({}), {"speed": task.needs(GreedyOnly({}))})
    greedy = SpeedTask(validate({"task": "speed"}, {**COMMON_TASK_SCHEMA, **SpeedTask.options}, "t"),
                       TaskContext(data_dir=data_dir))
    check_capabilities(GreedyOnly({}), {"speed": greedy.needs(GreedyOnly({}))})     # greedy needs no sampling


def test_server_side_draft_counters_are_read_per_group_from_metrics(tmp_path, data_dir):
    srv = _DraftServer(per_reply=False)
    try:
        run = _run(tmp_path, srv.url, "vllm", "")
    finally:
        srv.server.shutdown()
    recs = _records(run)
    assert len(recs) == 4 and all("draft_n" not in r for r in recs)
    for r in recs:       # 2 requests per group, 8 drafted and 6 accepted each
        assert r["group_spec_decode"] == {"draft_n": 16, "draft_n_accepted": 12, "acceptance_rate": 0.75,
                                          "source": "/metrics vllm"}
    by_len = json.loads((run / "manifest.json").read_text())["summary"]["speed"]["by_prompt_length"]
    assert all(by_len[L]["1"]["draft"]["acceptance_rate"] == 0.75 for L in ("32", "64"))
    assert srv.drafted == 32                    # no request outside the groups was counted (warmup = 0)
