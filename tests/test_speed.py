"""Speed task against a local OpenAI-compatible test server with known timing, through the HTTP runner.

The server streams the first token `first_ms` after a request arrives, then one token every
`every_ms`; it tokenizes with a real byte-level BPE (llama-server's /tokenize shape). The measured
TTFT and decode rate must land within 5% of those.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import multiprocessing
import re
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from conftest import haystack_bpe
from tokenizers import Tokenizer
from moebench.config import COMMON_TASK_SCHEMA, ProfileError, validate
from moebench.datasets import data_dir
from moebench.tasks.base import TaskContext, prompt_hash
from moebench.tasks.needle import HAYSTACK_FILE
from moebench.speed.ab import run_ab
from moebench.speed.compare import speed_compare, summarize_speed
from moebench.speed.records import Timing
from moebench.speed.task import SpeedTask

http_runner = pytest.importorskip("moebench.runners.http", reason="the HTTP runner is not in the tree yet")
DATA = data_dir()
HAYSTACK = DATA / HAYSTACK_FILE
pytestmark = pytest.mark.skipif(not HAYSTACK.is_file(), reason=f"{HAYSTACK} not in the data mirror")


TOK = haystack_bpe(300000)


def _differs(prompt: str) -> bool:
    """Prompts on which the "variant" server answers differently (about half of them)."""
    return hashlib.sha256(prompt.encode()).hexdigest()[0] in "01234567"


class PacedHandler(BaseHTTPRequestHandler):
    """OpenAI-style /v1/completions (SSE when stream=true), llama-server-style /tokenize, GET /_log."""

    first_s = every_s = 0.0
    variant = False
    tok: Tokenizer
    log: list[dict] = []

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._json(self.log)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        arrived = time.perf_counter()
        if self.path == "/tokenize":
            return self._json({"tokens": self.tok.encode(body["content"]).ids})
        if self.path != "/v1/completions":
            return self._json({"error": "not found"}, 404)
        prompt = body["prompt"]
        pieces = answer(prompt, int(body["max_tokens"]), bool(body.get("ignore_eos")), self.variant)
        if body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i, piece in enumerate(pieces):
                due = arrived + self.first_s + i * self.every_s      # absolute times: no drift
                time.sleep(max(0.0, due - time.perf_counter()))
                chunk = {"choices": [{"index": 0, "text": piece, "finish_reason": None}]}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
            usage = {"prompt_tokens": len(self.tok.encode(prompt).ids), "completion_tokens": len(pieces)}
            last = {"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": usage}
            self.wfile.write(f"data: {json.dumps(last)}\n\ndata: [DONE]\n\n".encode())
            self.wfile.flush()
        else:
            time.sleep(self.first_s)
            self._json({"choices": [{"index": 0, "text": "".join(pieces), "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": len(self.tok.encode(prompt).ids),
                                  "completion_tokens": len(pieces)}})
        # times relative to the server's own clock; only differences are compared
        self.log.append({"body": body, "arrived": arrived, "ended": time.perf_counter()})

    def _json(self, data, status=200):
        raw = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)


def answer(prompt: str, max_tokens: int, ignore_eos: bool, variant: bool) -> list[str]:
    m = re.search(r"secret access code is ([A-Z0-9]{10})\.", prompt)
    if m and not ignore_eos:                           # a needle question: read the code back
        return [" " + m.group(1)][:max_tokens]
    salt = "B" if variant and _differs(prompt) else "A"
    return [f" w{int(hashlib.sha256(f'{salt}{prompt}{i}'.encode()).hexdigest()[:3], 16)}"
            for i in range(max_tokens)]


def _serve(tokenizer_json: str, first_ms: float, every_ms: float, variant: bool, port_queue) -> None:
    """Server process body: its own interpreter, so the client's work never delays its clock."""
    PacedHandler.tok = Tokenizer.from_str(tokenizer_json)
    PacedHandler.first_s, PacedHandler.every_s, PacedHandler.variant = first_ms / 1000, every_ms / 1000, variant
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), PacedHandler)
    httpd.daemon_threads = True
    port_queue.put(httpd.server_address[1])
    httpd.serve_forever()


class PacedServer:
    """A PacedHandler server in a child process on 127.0.0.1 (first token after first_ms, then every every_ms)."""

    def __init__(self, first_ms: float, every_ms: float, variant: bool = False):
        ctx = multiprocessing.get_context("spawn")
        q = ctx.Queue()
        self.proc = ctx.Process(target=_serve, args=(TOK.to_str(), first_ms, every_ms, variant, q), daemon=True)
        self.proc.start()
        port = q.get(timeout=60)
        self.url = f"http://127.0.0.1:{port}/v1"

    @property
    def requests(self) -> list[dict]:
        return httpx.get(self.url[:-3] + "/_log", timeout=10).json()

    def close(self):
        self.proc.terminate()
        self.proc.join(timeout=10)


@pytest.fixture
def paced():
    servers = []

    def make(first_ms, every_ms, variant=False):
        servers.append(PacedServer(first_ms, every_ms, variant))
        return servers[-1]

    yield make
    for s in servers:
        s.close()


def _runner_profile(tmp_path: Path, name: str, url: str, concurrency: int = 1) -> Path:
    p = tmp_path / f"{name}.toml"
    p.write_text(f'kind = "http"\nbase_url = "{url}"\ntokenize = "llama-server"\nconcurrency = {concurrency}\n'
                 f'retries = 0\n')
    return p


def _speed_task(ctx: TaskContext, **opts) -> SpeedTask:
    return SpeedTask(validate({"task": "speed", **opts}, {**COMMON_TASK_SCHEMA, **SpeedTask.options}, "test"), ctx)


def test_timing_matches_the_server_pace_and_prompts_are_unique(paced, tmp_path):
    # D = 1200 ms: the request's own fixed costs (connect, the server's tokenizing, parsing) stay well
    # inside 5% of it even on a loaded CPU; at 300 ms a group median once read 0.3196 under load, at
    # 600 ms 0.6301 (two clients, a clean-clone CI run).
    server = paced(first_ms=1200, every_ms=30)
    runner = http_runner.HttpRunner({"base_url": server.url, "tokenize": "llama-server", "concurrency": 1})
    task = _speed_task(TaskContext(data_dir=DATA, run_dir=tmp_path), prompt_lengths=[256, 1024],
                       output_tokens=11, repeats=2, clients=[1, 2], warmup=0)
    # The CPU here is shared (load average above 10 seen): each measurement within 15%, each
    # group's median within 5% of the server's pace.

    async def go():
        await runner.start()
        try:
            await task.prepare(runner)
            recs = []
            for it in task.items():
                recs.append({"task": "speed", "item_id": it.item_id, "status": "ok",
                             **await task.evaluate(it, runner)})
            return recs
        finally:
            await runner.close()

    records = asyncio.run(go())
    assert [r["item_id"] for r in records][:6] == ["speed/256/1/0/0", "speed/256/1/1/0", "speed/256/2/0/0",
                                                    "speed/256/2/0/1", "speed/256/2/1/0", "speed/256/2/1/1"]
    assert len(records) == 12
    for r in records:
        assert r["ttft_s"] == pytest.approx(1.200, rel=0.15), r["item_id"]
        assert r["decode_tok_s"] == pytest.approx(1000 / 30, rel=0.15), r["item_id"]
        assert abs(r["prompt_tokens"] - r["prompt_length"]) <= max(1, r["prompt_length"] // 100)
        assert r["prefill_tok_s"] == pytest.approx(r["prompt_tokens"] / r["ttft_s"])
        assert r["output_tokens"] == 11 and r["correct"] is None and not r["stopped_early"]
    summary = summarize_speed(records)
    for length in ("256", "1024"):
        for clients in ("1", "2"):
            g = summary[length][clients]
            assert g["ttft_s"]["median"] == pytest.approx(1.200, rel=0.05), (length, clients, g["ttft_s"])
            assert g["decode_tok_s"]["median"] == pytest.approx(1000 / 30, rel=0.05), (length, clients)
    log = server.requests
    bodies = [q["body"] for q in log]
    assert len(bodies) == 12 and len({b["prompt"] for b in bodies}) == 12          # unique prompts
    assert all(b["cache_prompt"] is False and b["ignore_eos"] is True and b["stream"] for b in bodies)
    # closed loop with 2 clients: both in flight together; a client's next request only after its
    # previous one ended
    by_hash = {prompt_hash(q["body"]["prompt"]): q for q in log}
    seen = {r["item_id"]: by_hash[r["prompt_hash"]] for r in records}
    c0r0, c1r0, c0r1 = seen["speed/1024/2/0/0"], seen["speed/1024/2/0/1"], seen["speed/1024/2/1/0"]
    assert abs(c0r0["arrived"] - c1r0["arrived"]) < 0.1
    assert c0r1["arrived"] >= c0r0["ended"] - 0.005
    timings = (tmp_path / "speed_token_times.jsonl").read_text().splitlines()
    assert len(timings) == 12 and len(json.loads(timings[0])["token_times"]) == 11

    s = summary["1024"]["2"]
    assert s["ttft_s"]["n"] == 4
    assert s["ttft_s"]["min"] <= s["ttft_s"]["p25"] <= s["ttft_s"]["median"] <= s["ttft_s"]["p75"] <= s["ttft_s"]["max"]
    assert s["aggregate_decode_tok_s"] == pytest.approx(2 * 1000 / 30, rel=0.05)
    slower = [{**r, "ttft_s": r["ttft_s"] * 2, "decode_tok_s": r["decode_tok_s"] / 2,
               "prefill_tok_s": r["prefill_tok_s"] / 2} for r in records]
    cmp = speed_compare(records, slower)
    assert len(cmp["rows"]) == 4
    assert all(row["ttft_ratio"] == pytest.approx(2.0) and row["decode_ratio"] == pytest.approx(0.5)
               for row in cmp["rows"])
    assert cmp["geomean"]["prefill"] == pytest.approx(0.5)


def test_timing_fields_formulae_and_missing_stream():
    f = Timing.of([0.5, 0.6, 0.7, 0.9], prompt_tokens=1000, output_tokens=4)
    assert f.ttft_s == 0.5 and f.prefill_tok_s == 2000 and f.decode_tok_s == pytest.approx(3 / 0.4)
    from moebench.runners.base import RunnerError
    with pytest.raises(RunnerError, match="no token_times"):
        Timing.of(None, 10, 1)


def test_bad_clients_option_names_the_key():
    with pytest.raises(ProfileError, match="'clients'"):
        _speed_task(TaskContext(data_dir=DATA), clients=[1, 0])


def test_suite_end_to_end_through_the_run_api(paced, tmp_path):
    """`moebench run` (api.run) with a needle + speed suite over HTTP: records, side files, summary."""
    api = pytest.importorskip("moebench.api")
    server = paced(first_ms=40, every_ms=10)
    suite = tmp_path / "ns.toml"
    suite.write_text('name = "ns"\n'
                     '[[tasks]]\ntask = "needle"\nlengths = [1024, 2048]\ndepths = [0.0, 0.5, 1.0]\nmax_tokens = 8\n'
                     '[[tasks]]\ntask = "speed"\nprompt_lengths = [300]\noutput_tokens = 6\nrepeats = 2\n'
                     'clients = 1\nwarmup = 0\n[probes]\nnvml = true\n')
    runner = _runner_profile(tmp_path, "paced", server.url, concurrency=2)
    run_dir, code = api.run(api.RunOptions(suite=str(suite), runner=str(runner), out=str(tmp_path / "run"),
                                           quiet=True))
    assert code == 0
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    records = [json.loads(x) for x in (run_dir / "items.jsonl").read_text().splitlines()]
    needle = [r for r in records if r["task"] == "needle"]
    speed = [r for r in records if r["task"] == "speed"]
    assert len(needle) == 6 and all(r["status"] == "ok" and r["correct"] for r in needle)
    assert all(abs(r["prompt_tokens"] - r["length"]) <= 0.005 * r["length"] for r in needle)
    assert {r["item_id"] for r in speed} == {"speed/300/1/0/0", "speed/300/1/1/0"}
    assert all(0.04 <= r["ttft_s"] < 0.5 and r["decode_tok_s"] > 0 for r in speed)   # the server's pace bounds it
    assert manifest["summary"]["needle"]["by_length"]["2048"]["found"] == 3
    assert manifest["summary"]["speed"]["by_prompt_length"]["300"]["1"]["ttft_s"]["n"] == 2
    assert HAYSTACK_FILE in manifest["data_files"]
    assert manifest["probes"]["nvml"]["available"] in (True, False)


def test_warm_up_sends_each_prompt_token_count_of_the_group_before_its_clock(paced, tmp_path):
    """A group's prompts are fitted to within 1% of the asked length, so they differ by a token or
    more, and a backend pays for a new shape's first request (the engine on an H100: a first
    129-token request waited 0.96 s for its first token after a 128-token warm-up, later ones
    0.06-0.07 s). The warm-up sends one untimed request of each count the timed prompts have, each
    with an opening of its own, before the first timed request."""
    server = paced(first_ms=5, every_ms=2)
    runner = http_runner.HttpRunner({"base_url": server.url, "tokenize": "llama-server", "concurrency": 1})
    task = _speed_task(TaskContext(data_dir=DATA, run_dir=tmp_path), prompt_lengths=[300], output_tokens=2,
                       repeats=8, clients=1, warmup=1)

    async def go():
        await runner.start()
        try:
            await task.prepare(runner)
            return [await task.evaluate(it, runner) for it in task.items()]
        finally:
            await runner.close()

    records = asyncio.run(go())
    timed = [r["prompt_tokens"] for r in records]
    assert len(set(timed)) > 1, timed                 # the case the warm-up is for
    sent = [q["body"]["prompt"] for q in server.requests]
    counts = [len(TOK.encode(p).ids) for p in sent]
    n_warm = len(set(timed))
    assert len(sent) == n_warm + len(records)
    assert sorted(counts[:n_warm]) == sorted(set(timed))           # each count once, first
    assert counts[n_warm:] == timed
    assert not set(sent[:n_warm]) & set(sent[n_warm:])             # no timed prompt was warmed


def test_ab_mode_fresh_processes_and_output_identity(paced, tmp_path):
    a = paced(first_ms=30, every_ms=5)
    b = paced(first_ms=30, every_ms=5, variant=True)
    pa, pb = _runner_profile(tmp_path, "a", a.url), _runner_profile(tmp_path, "b", b.url)
    opts = {"prompt_lengths": [200, 400], "output_tokens": 4, "repeats": 3, "clients": 1, "warmup": 0}
    result = run_ab(str(pa), str(pb), opts, str(tmp_path / "ab"), order="ABBA")
    assert [p["which"] for p in result["passes"]] == ["A", "B", "B", "A"]
    assert len({p["pid"] for p in result["passes"]}) == 4                    # a fresh process per pass
    assert all(p["n_ok"] == 6 and p["n_errors"] == 0 for p in result["passes"])
    out = result["outputs"]
    b_prompts = {q["body"]["prompt"] for q in b.requests}
    assert len(b_prompts) == 6                                               # same 6 prompts in both B passes
    assert {q["body"]["prompt"] for q in a.requests} == b_prompts            # and the same as A's
    assert out["n_compared"] == 6 and out["compared_on"] == "text"
    assert out["n_differ"] == sum(_differs(p) for p in b_prompts) > 0
    assert out["a_self_n_differ"] == 0 and out["b_self_n_differ"] == 0
    assert result["speed_b_vs_a"]["rows"][0]["ttft_ratio"] == pytest.approx(1.0, rel=0.5)
    assert (tmp_path / "ab" / "ab.json").is_file() and (tmp_path / "ab" / "pass3_A.json").is_file()
    with pytest.raises(ValueError, match="order"):
        run_ab(str(pa), str(pb), opts, str(tmp_path / "ab2"), order="AAC")


def test_ab_rounds_won_paired_ratios_and_gate(paced, tmp_path):
    """B decodes at twice A's pace: it wins every round; the rounds keep the A,B,B,A order; output
    identity is checked over every A pass against every B pass; the gate counts rounds won."""
    from moebench.api import report
    from moebench.gate import run_gate
    # paces far above the few ms a loaded CPU adds to a streamed token
    a = paced(first_ms=20, every_ms=60)
    b = paced(first_ms=20, every_ms=30, variant=True)
    pa, pb = _runner_profile(tmp_path, "a", a.url), _runner_profile(tmp_path, "b", b.url)
    opts = {"prompt_lengths": [200], "output_tokens": 6, "repeats": 3, "clients": 1, "warmup": 0}
    out = tmp_path / "ab"
    result = run_ab(str(pa), str(pb), opts, str(out), order="ABBAABBA")
    ab = result["speed_ab"]
    assert [(r["round"], r["a_pass"], r["b_pass"]) for r in ab["rounds"]] == [(1, 0, 1), (2, 3, 2), (3, 4, 5),
                                                                              (4, 7, 6)]
    assert all(r["winner"] == "B" and r["n_pairs"] == 3 for r in ab["rounds"])
    assert ab["rounds_won"] == {"A": 0, "B": 4, "tie": 0}
    dec = ab["paired"]["decode_tok_s"]
    assert dec["n_pairs"] == 12 and dec["median_ratio"] == pytest.approx(2.0, rel=0.25)
    assert 1.0 < dec["ratio_ci95"][0] <= dec["median_ratio"] <= dec["ratio_ci95"][1]
    ident = ab["identity"]
    assert len(ident["pairs"]) == 16 and {(p["a_pass"], p["b_pass"]) for p in ident["pairs"]} == \
        {(i, j) for i in (0, 3, 4, 7) for j in (1, 2, 5, 6)}
    prompts = {q["body"]["prompt"] for q in b.requests}
    assert ident["n_differ_any"] == sum(_differs(p) for p in prompts) > 0
    assert all(p["n_differ"] == ident["n_differ_any"] for p in ident["pairs"])
    # the A/B directory is a compare directory: report and gate read it
    html = report(str(out)).read_text(encoding="utf-8")
    assert "A/B speed rounds (ABBAABBA)" in html and "Rounds won: B 4" in html
    rules = tmp_path / "ab.toml"
    rules.write_text("[speed_ab]\nmin_rounds_won = 4\nmin_rounds = 4\nmin_decode_ratio = 1.2\nmin_samples = 5\n")
    assert run_gate(out, rules) == 0
    rules.write_text("[speed_ab]\nmin_rounds_won = 5\n")
    assert run_gate(out, rules) == 1
    rules.write_text("[speed_ab]\nmax_differing_outputs = 0\n")
    assert run_gate(out, rules) == 1


def test_speed_options_type_names_exactly_the_schema_keys():
    """SpeedOptions (what SpeedTask.__init__ reads) and SpeedTask.options (what a suite may set) name
    the same keys, so a key added to one and not the other is caught here."""
    from moebench.speed.task import SpeedOptions, SpeedTask
    from moebench.tasks.base import TaskOptions

    def keys(td) -> set[str]:
        return set(td.__required_keys__ | td.__optional_keys__)

    assert keys(SpeedOptions) - keys(TaskOptions) == set(SpeedTask.options)
