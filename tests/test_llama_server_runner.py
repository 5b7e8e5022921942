"""The llama-server runner against a real llama-server on 127.0.0.1 serving a tiny MoE GGUF.

The GGUF comes from models/zoo when the zoo is built, else from `moebench.zoo.build.build_zoo`, else a
tiny Mixtral-style MoE (llama architecture, GPT-2 vocabulary from the llama.cpp sdist) is written here
with the sdist's gguf-py: random weights, but a real file the real server loads.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from moebench.config import ProfileError, load_runner
from moebench.runners import runner_schemas
from moebench.runners.base import Capability, GenerateRequest, RunnerError
from moebench.runners.llama_server import LlamaServerRunner
from moebench.runners.wire import LlamaCompletionBody
from moebench.tools import llamacpp

REPO = Path(__file__).resolve().parent.parent


def _server_binary() -> Path:
    try:
        return llamacpp.tool("llama-server")
    except llamacpp.ToolError as e:
        pytest.skip(f"llama-server not available: {e}")


def _write_tiny_moe(path: Path) -> Path:
    """A 2-layer, 64-wide, 4-expert top-2 MoE in GGUF (llama arch), deterministic from seed 0."""
    import numpy as np

    reader_cls = llamacpp.gguf_reader_class()
    if reader_cls is None:
        pytest.skip("gguf-py not importable from the llama.cpp sdist")
    import gguf

    vocab = reader_cls(str(llamacpp.source_dir() / "models" / "ggml-vocab-gpt-2.gguf"))
    n_vocab, n_embd, n_layer, n_head, n_head_kv, n_ff, n_expert = 50257, 64, 2, 4, 2, 64, 4
    head_dim = n_embd // n_head
    rng = np.random.default_rng(0)

    def mat(*shape: int, scale: float = 0.08) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("moebench-test-tiny-moe")
    w.add_context_length(2048)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(2)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for key, field in vocab.fields.items():
        if key.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[1] if len(field.types) > 1 else None
            w.add_key_value(key, field.contents(), vtype, sub)
    w.add_tensor("token_embd.weight", mat(n_vocab, n_embd, scale=1.0))
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    for i in range(n_layer):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(b + "attn_q.weight", mat(n_embd, n_embd))
        w.add_tensor(b + "attn_k.weight", mat(n_head_kv * head_dim, n_embd))
        w.add_tensor(b + "attn_v.weight", mat(n_head_kv * head_dim, n_embd))
        w.add_tensor(b + "attn_output.weight", mat(n_embd, n_embd))
        w.add_tensor(b + "ffn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(b + "ffn_gate_inp.weight", mat(n_expert, n_embd, scale=0.5))
        w.add_tensor(b + "ffn_gate_exps.weight", mat(n_expert, n_ff, n_embd))
        w.add_tensor(b + "ffn_up_exps.weight", mat(n_expert, n_ff, n_embd))
        w.add_tensor(b + "ffn_down_exps.weight", mat(n_expert, n_embd, n_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _cached_tiny_moe() -> Path:
    """The fallback GGUF is deterministic, so it is written once into the tool cache (about 10 s)."""
    path = llamacpp.cache_root() / "test-models" / "tiny-moe-test-f32-v1.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        _write_tiny_moe(tmp)
        os.replace(tmp, path)
    return path


@pytest.fixture(scope="session")
def gguf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _server_binary()
    zoo = REPO / "models" / "zoo"
    for name in ("tiny-moe-q8_0.gguf", "tiny-moe-bf16.gguf", "tiny-moe-q4_0.gguf"):
        if (zoo / name).is_file():
            return zoo / name
    out = llamacpp.cache_root() / "test-zoo"      # build_zoo reuses its outputs when inputs match
    try:
        from moebench.zoo.build import ZooBuildError, build_zoo  # type: ignore[import-not-found]
    except ImportError:
        return _cached_tiny_moe()
    try:
        build_zoo(out)
    except ZooBuildError as e:              # e.g. the trained weights are not committed yet
        print(f"zoo not buildable here ({e}); using a tiny random-weight MoE GGUF")
        return _cached_tiny_moe()
    found = sorted(out.glob("*q8_0*.gguf")) or sorted(out.glob("*.gguf"))
    assert found, f"build_zoo({out}) wrote no GGUF"
    return found[0]


def _profile(model: Path, **extra) -> dict:
    # One thread: the CPU is shared, and spinning ggml threads on a busy machine are 200x slower.
    return {"model": str(model), "concurrency": 2, "ctx_size": 4096, "startup_timeout_s": 60.0,
            "request_timeout_s": 60.0, "args": ["--threads", "1"], **extra}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def server(gguf_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """One started runner shared by the read-only tests (start-up costs about a second)."""
    loop = asyncio.new_event_loop()
    runner = LlamaServerRunner(_profile(gguf_model))
    run_dir = tmp_path_factory.mktemp("run")
    loop.run_until_complete(runner.start(str(run_dir)))
    yield runner, loop, run_dir
    loop.run_until_complete(runner.close())
    loop.close()


PROMPT = "The old prince Bolkonsky walked into the room and said"


def test_start_health_and_greedy_generation_is_deterministic(server):
    runner, loop, run_dir = server
    assert (run_dir / "llama-server.log").stat().st_size > 0
    assert runner.proc is not None and runner.proc.poll() is None
    req = GenerateRequest(prompt=PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True)
    a = loop.run_until_complete(runner.generate(req))
    b = loop.run_until_complete(runner.generate(req))
    assert a.output_tokens == 12 and len(a.token_ids) == 12
    assert a.token_ids == b.token_ids and a.text == b.text
    assert a.finish_reason == "length"
    assert a.prompt_tokens and a.prompt_tokens > 5
    assert a.timings["predicted_n"] == 12 and a.timings["prompt_per_second"] > 0
    assert a.endpoint == runner.base_url


def test_top_logprobs_per_generated_position(server):
    runner, loop, _ = server
    res = loop.run_until_complete(runner.generate(
        GenerateRequest(prompt=PROMPT, max_tokens=4, top_logprobs=5, ignore_eos=True)))
    assert res.top_logprobs is not None and len(res.top_logprobs) == 4
    for pos, token_id in zip(res.top_logprobs, res.token_ids):
        assert 1 <= len(pos) <= 5
        values = list(pos.values())
        assert all(v <= 0.0 for v in values)
        assert values == sorted(values, reverse=True)       # the server lists the likeliest first
    # Greedy: the generated token is the top alternative at its position.
    first_text = loop.run_until_complete(runner.detokenize([res.token_ids[0]]))
    assert max(res.top_logprobs[0], key=res.top_logprobs[0].get) == first_text


def test_token_id_prompt_matches_text_prompt(server):
    runner, loop, _ = server
    ids = loop.run_until_complete(runner.tokenize(PROMPT))
    by_text = loop.run_until_complete(runner.generate(
        GenerateRequest(prompt=PROMPT, max_tokens=6, ignore_eos=True, cache_prompt=False)))
    by_ids = loop.run_until_complete(runner.generate(
        GenerateRequest(prompt=ids, max_tokens=6, ignore_eos=True, cache_prompt=False)))
    assert by_ids.prompt_tokens == len(ids)
    if by_text.prompt_tokens == len(ids):            # the vocab adds no BOS: both prompts are equal
        assert by_ids.token_ids == by_text.token_ids
    else:                                            # a BOS was added to the text prompt only
        assert by_text.prompt_tokens == len(ids) + 1


def test_tokenize_round_trip(server):
    runner, loop, _ = server
    text = "Prince Andrew looked at Pierre, 1812; naïve — \"quotes\"."
    ids = loop.run_until_complete(runner.tokenize(text))
    assert len(ids) > 5 and all(isinstance(t, int) for t in ids)
    assert loop.run_until_complete(runner.detokenize(ids)) == text


def test_stream_records_token_arrival_times(server):
    runner, loop, _ = server
    pieces: list[str] = []
    res = loop.run_until_complete(runner.generate(
        GenerateRequest(prompt=PROMPT + " again", max_tokens=8, ignore_eos=True, stream=True, top_logprobs=2,
                        on_text=pieces.append)))
    assert len(pieces) >= 4 and "".join(pieces) == res.text       # on_text: the text as it streamed
    assert len(res.token_ids) == 8 and len(res.token_times) == 8
    assert res.token_times == sorted(res.token_times) and res.token_times[0] > 0
    assert res.output_tokens == 8 and res.timings["predicted_n"] == 8
    assert len(res.top_logprobs) == 8
    plain = loop.run_until_complete(runner.generate(
        GenerateRequest(prompt=PROMPT + " again", max_tokens=8, ignore_eos=True)))
    assert plain.token_ids == res.token_ids and plain.text == res.text


def test_capabilities_and_identity(server, gguf_model: Path):
    runner, _, _ = server
    assert {Capability.GENERATE, Capability.STREAM, Capability.TOP_LOGPROBS, Capability.TOKENIZE,
            Capability.TOKEN_PROMPTS} <= runner.capabilities
    ident = runner.identity()
    import hashlib
    assert ident["model"]["sha256"] == hashlib.sha256(gguf_model.read_bytes()).hexdigest()
    assert ident["model"]["size_bytes"] == gguf_model.stat().st_size
    assert ident["model"]["gguf"]["architecture"] and ident["model"]["gguf"]["parameter_count"] > 0
    assert ident["build"]["build_number"] == llamacpp.BUILD_NUMBER
    assert ident["build"]["build_commit"] == llamacpp.BUILD_COMMIT


def test_greedy_requests_ask_for_the_argmax_alone_and_get_the_default_chain_s_tokens(gguf_model: Path,
                                                                                      tmp_path: Path):
    """The server says whether it samples in the graph (/props); a greedy request then names the argmax
    alone (the server echoes the chain it ran), and the tokens are those of the server's default chain."""
    req = GenerateRequest(prompt=PROMPT, max_tokens=24, temperature=0.0, ignore_eos=True)
    cases = {"cpu": ({}, ["top_k"], False), "graph": ({"args": ["--threads", "1", "-bs"]}, ["temperature"], True),
             "default chain": ({"greedy_argmax": False}, None, False)}
    tokens = {}
    for name, (extra, samplers, in_graph) in cases.items():
        runner = LlamaServerRunner(_profile(gguf_model, **extra))
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(runner.start(str(tmp_path / name.replace(" ", "-"))))
            assert runner.backend_sampling is in_graph, name
            chain = runner.identity()["build"]["greedy_samplers"]
            if samplers is None:
                assert chain is None and runner.greedy_in_graph() is None
            else:
                assert chain == {"samplers": samplers, "top_k": None if in_graph else 1, "backend_sampling": in_graph}
            tokens[name] = loop.run_until_complete(runner.generate(req)).token_ids
            body = LlamaCompletionBody.of(req, runner.greedy_in_graph())
            ran = loop.run_until_complete(runner._post_json("/completion", body))["generation_settings"]
            default_chain = ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
                             "temperature"]
            assert ran["samplers"] == (samplers or default_chain), name
        finally:
            loop.run_until_complete(runner.close())
            loop.close()
    assert len(tokens["cpu"]) == 24
    assert tokens["cpu"] == tokens["graph"] == tokens["default chain"]


async def _until_slots_busy(runner: LlamaServerRunner, n: int, timeout_s: float = 20.0) -> None:
    import httpx
    async with httpx.AsyncClient(base_url=runner.base_url) as client:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            slots = (await client.get("/slots")).json()
            if sum(bool(s.get("is_processing")) for s in slots) >= n:
                return
            await asyncio.sleep(0.02)
    raise AssertionError(f"{n} slots never busy at once")


def test_server_killed_mid_run_is_restarted_and_requests_reasked(gguf_model: Path, tmp_path: Path):
    async def scenario():
        runner = LlamaServerRunner(_profile(gguf_model, max_restarts=2))
        await runner.start(str(tmp_path))
        try:
            first_pid = runner.proc.pid
            n = 600                                  # most of a second of decoding per request
            reqs = [GenerateRequest(prompt=f"{PROMPT} {i}", max_tokens=n, ignore_eos=True) for i in range(3)]
            tasks = [asyncio.create_task(runner.generate(r)) for r in reqs]
            await _until_slots_busy(runner, 2)       # both slots decoding, the third request queued
            assert not any(t.done() for t in tasks), "requests finished before the kill; make them longer"
            os.kill(first_pid, signal.SIGKILL)
            results = await asyncio.gather(*tasks)
            assert all(r.output_tokens == n and len(r.token_ids) == n for r in results)
            assert runner.proc.pid != first_pid and runner.proc.poll() is None
            restarts = [e for e in runner.events if e["event"] == "restart"]
            assert len(restarts) == 1, runner.events          # one restart, however many requests failed
            assert restarts[0]["exit_code"] == -signal.SIGKILL and restarts[0]["reason"]
            assert not _pid_alive(first_pid)
            again = await runner.generate(reqs[0])   # greedy: the re-asked answer is the answer
            assert again.token_ids == results[0].token_ids
            # the log is appended across restarts: two start banners
            assert (tmp_path / "llama-server.log").read_text(errors="replace").count("=== moebench") == 2
            return runner
        finally:
            await runner.close()
    asyncio.run(scenario())


def test_dropped_connection_of_a_live_server_is_sent_again_at_once(gguf_model: Path, tmp_path: Path):
    """A live server that drops a request's connection before answering (a pooled keep-alive
    connection it had closed) is asked again at once, not restarted: the result says so (`resends`,
    `sent_at` after the call began, token times from the resend), the runner counts it and records
    one "reconnect" event per drop up to RECONNECT_EVENTS, and the speed task's phases start at the
    resend (the energy of the wait is not the request's)."""
    import contextlib
    import aiohttp
    from moebench.runners import llama_server
    from moebench.runners.responses import transport_error

    async def main():
        runner = LlamaServerRunner(_profile(gguf_model))
        await runner.start(str(tmp_path))
        real_open = runner._open
        drops = {"left": 0}

        @contextlib.asynccontextmanager
        async def flaky_open(method, path, body=None, timeout_s=None):
            if path == "/completion" and drops["left"] > 0:
                drops["left"] -= 1
                raise transport_error(aiohttp.ServerDisconnectedError(), method, runner.base_url + path, 10.0, 60.0)
            async with real_open(method, path, body, timeout_s) as r:
                yield r

        runner._open = flaky_open
        try:
            req = GenerateRequest(prompt=PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True, stream=True)
            clean = await runner.generate(req)
            assert clean.resends == 0 and "resends" not in clean.to_record_fields()
            outcomes = []
            for _ in range(llama_server.RECONNECT_EVENTS + 1):
                drops["left"] = 1
                t = time.perf_counter()
                res = await runner.generate(req)
                outcomes.append((res, t, time.perf_counter() - t))
            pid = runner.proc.pid
        finally:
            await runner.close()
        return clean, outcomes, runner, pid

    clean, outcomes, runner, pid = asyncio.run(main())
    for res, t, took in outcomes:
        assert res.token_ids == clean.token_ids and res.resends == 1
        assert res.to_record_fields()["resends"] == 1
        assert res.sent_at is not None and res.sent_at > t
        assert took < 0.5, took                      # asked again at once, not after a wait
        assert res.token_times[0] > 0 and res.sent_at + res.token_times[-1] <= t + took
    assert runner.restarts == 0 and runner.reconnects == llama_server.RECONNECT_EVENTS + 1
    events = [e for e in runner.events]
    assert [e["event"] for e in events] == ["reconnect"] * llama_server.RECONNECT_EVENTS, events
    assert events[-1]["reconnects"] == llama_server.RECONNECT_EVENTS and "disconnect" in events[0]["reason"].lower()
    assert not _pid_alive(pid)


@pytest.mark.parametrize("client_keepalive", [None, 30.0])
def test_a_connection_the_server_closed_when_idle(gguf_model: Path, tmp_path: Path, monkeypatch, client_keepalive):
    """llama-server closes a keep-alive connection idle for 5 s. The runner's pool lets its own go
    sooner (KEEPALIVE_S), so a request after a 5.5 s pause that kept the event loop busy (the close
    unseen) opens a fresh connection; a client that kept it longer (30 s, aiohttp's way) sends the
    request into the closed connection, and the runner asks again at once and says so."""
    from moebench.runners import llama_server
    if client_keepalive is not None:
        monkeypatch.setattr(llama_server, "KEEPALIVE_S", client_keepalive)

    async def main():
        runner = LlamaServerRunner(_profile(gguf_model))
        await runner.start(str(tmp_path))
        try:
            await runner.generate(GenerateRequest(prompt=PROMPT, max_tokens=4, ignore_eos=True))   # pooled
            time.sleep(5.5)          # blocking: the loop never sees the server's close
            t = time.perf_counter()
            res = await runner.generate(GenerateRequest(prompt=PROMPT, max_tokens=4, ignore_eos=True, stream=True))
            return res, time.perf_counter() - t, runner
        finally:
            await runner.close()

    res, took, runner = asyncio.run(main())
    assert res.output_tokens == 4 and took < 0.5, took
    if client_keepalive is None:
        assert res.resends == 0 and runner.reconnects == 0 and runner.events == []
    else:
        assert res.resends == 1 and runner.reconnects == 1 and runner.restarts == 0
        assert [e["event"] for e in runner.events] == ["reconnect"] and "/completion" in runner.events[0]["reason"]


def test_speed_phases_are_the_answering_request_s(gguf_model: Path, tmp_path: Path):
    """The speed task marks each request's prefill from when the answering request was sent (a
    resend after a dropped connection starts later than the call) and ends its decode at the last
    token: the probe's windows hold the request's work, not the client's wait."""
    import contextlib
    import aiohttp
    from moebench.config import COMMON_TASK_SCHEMA, validate
    from moebench.datasets import data_dir
    from moebench.runners.responses import transport_error
    from moebench.speed.task import SpeedTask
    from moebench.tasks.base import TaskContext

    class Marks:
        def __init__(self):
            self.marks, self.tokens = [], {"prefill": 0, "decode": 0}

        def mark(self, phase, at=None):
            self.marks.append((phase, time.perf_counter() if at is None else at))

        def count_tokens(self, prefill=0, decode=0):
            self.tokens["prefill"] += prefill
            self.tokens["decode"] += decode

    probe = Marks()
    task = SpeedTask(validate({"task": "speed", "prompt_lengths": [64], "output_tokens": 8, "repeats": 3,
                               "clients": 1, "warmup": 0}, {**COMMON_TASK_SCHEMA, **SpeedTask.options}, "test"),
                     TaskContext(data_dir=data_dir(), run_dir=tmp_path, probe=probe))
    sent: list[float] = []

    async def main():
        runner = LlamaServerRunner(_profile(gguf_model))
        await runner.start(str(tmp_path))
        real_open = runner._open

        @contextlib.asynccontextmanager
        async def flaky_open(method, path, body=None, timeout_s=None):
            if path == "/completion" and len(sent) % 2 == 0:     # every request's first send drops
                sent.append(time.perf_counter())
                await asyncio.sleep(0.3)                        # ... after a while
                raise transport_error(aiohttp.ServerDisconnectedError(), method, runner.base_url + path, 10.0, 60.0)
            if path == "/completion":
                sent.append(time.perf_counter())
            async with real_open(method, path, body, timeout_s) as r:
                yield r

        runner._open = flaky_open
        try:
            await task.prepare(runner)
            return [await task.evaluate(it, runner) for it in task.items()]
        finally:
            await runner.close()

    records = asyncio.run(main())
    assert len(records) == 3 and all(r["resends"] == 1 for r in records)
    starts = [i for i, m in enumerate(probe.marks) if m[0] == "prefill"]
    assert len(starts) == 3, probe.marks
    for i, r in enumerate(records):
        (_, pre), (d, dec), (e, idle) = probe.marks[starts[i]: starts[i] + 3]
        assert (d, e) == ("decode", "idle"), probe.marks
        dropped, resent = sent[2 * i], sent[2 * i + 1]
        assert resent - dropped >= 0.3 and dropped < pre <= resent, (dropped, pre, resent)   # the wait is not prefill
        assert dec - pre == pytest.approx(r["ttft_s"], abs=1e-6)
        assert idle - pre == pytest.approx(r["e2e_s"], abs=1e-6)
    assert probe.tokens["decode"] == 24


def test_restart_bound_gives_runner_error(gguf_model: Path, tmp_path: Path):
    async def scenario():
        runner = LlamaServerRunner(_profile(gguf_model, max_restarts=0))
        await runner.start(str(tmp_path))
        try:
            os.kill(runner.proc.pid, signal.SIGKILL)
            with pytest.raises(RunnerError, match="max_restarts=0"):
                await runner.generate(GenerateRequest(prompt=PROMPT, max_tokens=2))
            assert runner.events and runner.events[-1]["event"] == "gave_up"
        finally:
            await runner.close()
    asyncio.run(scenario())


def test_server_that_cannot_come_back_fails_requests_with_the_reason(gguf_model: Path, tmp_path: Path):
    model = tmp_path / "model.gguf"
    import shutil
    shutil.copy(gguf_model, model)

    async def scenario():
        runner = LlamaServerRunner(_profile(model, startup_timeout_s=30.0))
        await runner.start(str(tmp_path))
        try:
            os.kill(runner.proc.pid, signal.SIGKILL)
            model.write_bytes(b"GGUF" + b"\xff" * 64)     # the restart will find a broken file
            with pytest.raises(RunnerError, match="could not be restarted"):
                await runner.generate(GenerateRequest(prompt=PROMPT, max_tokens=2))
            assert [e["event"] for e in runner.events] == ["restart_failed"]
            with pytest.raises(RunnerError, match="could not be restarted"):   # and stays failed
                await runner.tokenize("x")
        finally:
            await runner.close()
    asyncio.run(scenario())


def test_fixed_port_is_reused_after_a_restart(gguf_model: Path, tmp_path: Path):
    from moebench.runners.llama_server import _free_port
    port = _free_port("127.0.0.1")

    async def scenario():
        runner = LlamaServerRunner(_profile(gguf_model, port=port))
        await runner.start(str(tmp_path))
        try:
            assert runner.base_url == f"http://127.0.0.1:{port}"
            before = await runner.generate(GenerateRequest(prompt=PROMPT, max_tokens=5, ignore_eos=True))
            os.kill(runner.proc.pid, signal.SIGKILL)
            after = await runner.generate(GenerateRequest(prompt=PROMPT, max_tokens=5, ignore_eos=True))
            assert runner.port == port and after.endpoint == f"http://127.0.0.1:{port}"
            assert after.token_ids == before.token_ids
            assert [e["event"] for e in runner.events] == ["restart"]
            # it died between requests: a new connection is refused, a kept-alive one reads EOF
            assert runner.events[0]["reason"].split(":")[0] in ("ConnectError", "ReadError", "RemoteProtocolError")
        finally:
            await runner.close()
    asyncio.run(scenario())


def test_port_taken_between_pick_and_bind_is_retried(gguf_model: Path, tmp_path: Path, monkeypatch):
    import socket
    from moebench.runners import llama_server

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    picks = iter([busy.getsockname()[1]])
    real_pick = llama_server._free_port
    monkeypatch.setattr(llama_server, "_free_port", lambda host: next(picks, None) or real_pick(host))

    async def scenario():
        runner = LlamaServerRunner(_profile(gguf_model))
        await runner.start(str(tmp_path))
        try:
            assert runner.port != busy.getsockname()[1]
            assert await runner.tokenize("hello")
        finally:
            await runner.close()
    try:
        asyncio.run(scenario())
    finally:
        busy.close()
    log = (tmp_path / "llama-server.log").read_text(errors="replace")
    assert log.count("=== moebench") == 2 and "couldn't bind HTTP server socket" in log


def test_startup_timeout_stops_the_server(gguf_model: Path, tmp_path: Path):
    runner = LlamaServerRunner(_profile(gguf_model, startup_timeout_s=0.05))
    with pytest.raises(RunnerError, match=r"/health not 200 after 0\.05 s"):
        asyncio.run(runner.start(str(tmp_path)))
    assert runner.proc is not None and not _pid_alive(runner.proc.pid)


def test_close_leaves_no_process(gguf_model: Path, tmp_path: Path):
    async def scenario():
        runner = LlamaServerRunner(_profile(gguf_model))
        await runner.start(str(tmp_path))
        pid = runner.proc.pid
        assert _pid_alive(pid)
        await runner.close()
        assert not _pid_alive(pid)
        await runner.close()                      # twice is fine
    asyncio.run(scenario())


# The child restores Python's Ctrl-C handler: a shell starts background jobs (`cmd &`, nohup) with
# SIGINT ignored, the child would inherit that, and SIGINT could not end it (the test's premise).
CHILD = textwrap.dedent("""
    import asyncio, signal, sys, time
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from moebench.runners.llama_server import LlamaServerRunner
    async def main():
        r = LlamaServerRunner({"model": sys.argv[1], "ctx_size": 512, "startup_timeout_s": 60.0,
                               "args": ["--threads", "1"]})
        await r.start(sys.argv[2])
        print(r.proc.pid, flush=True)
        await asyncio.sleep(120)              # "working" until a signal arrives
    asyncio.run(main())
""")


# SIGKILL cannot be caught: the server dies through PR_SET_PDEATHSIG (setpriv), not the exit hooks.
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_signal_to_parent_leaves_no_orphan(gguf_model: Path, tmp_path: Path, sig: int):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(gguf_model), str(tmp_path)],
                             stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        line = child.stdout.readline()
        assert line.strip().isdigit(), f"child printed {line!r}"
        server_pid = int(line)
        assert _pid_alive(server_pid)
        child.send_signal(sig)
        child.wait(20)
        deadline = time.monotonic() + 10
        while _pid_alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _pid_alive(server_pid), f"llama-server {server_pid} survived {sig!r} to its parent"
    finally:
        if child.poll() is None:
            child.kill()


def test_missing_model_file_names_the_key(tmp_path: Path):
    profile = tmp_path / "bad.toml"
    profile.write_text('kind = "llama-server"\nmodel = "models/zoo/does-not-exist.gguf"\n')
    with pytest.raises(ProfileError, match=r"bad\.toml: key 'model' must name an existing GGUF file"):
        load_runner(profile, runner_schemas())
    with pytest.raises(ProfileError, match=r"key 'model': GGUF file not found: .*does-not-exist\.gguf"):
        LlamaServerRunner({"model": str(tmp_path / "does-not-exist.gguf")}, str(profile))


def test_not_a_gguf_and_owned_flags_are_rejected(tmp_path: Path):
    bogus = tmp_path / "x.gguf"
    bogus.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ProfileError, match="is not a GGUF file"):
        LlamaServerRunner({"model": str(bogus)}, "runners/x.toml")
    bogus.write_bytes(b"GGUF" + b"\0" * 16)
    with pytest.raises(ProfileError, match=r"key 'args' must not set --port"):
        LlamaServerRunner({"model": str(bogus), "args": ["--port", "9000"]}, "runners/x.toml")


def test_server_that_cannot_load_fails_with_log_tail(tmp_path: Path):
    _server_binary()
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\x03\0\0\0" + b"\xff" * 64)     # valid magic, garbage header
    runner = LlamaServerRunner({"model": str(broken), "startup_timeout_s": 30.0})
    with pytest.raises(RunnerError, match=r"did not start: the process exited with code"):
        asyncio.run(runner.start(str(tmp_path)))
    assert "broken.gguf" in (tmp_path / "llama-server.log").read_text(errors="replace")
    asyncio.run(runner.close())


def test_gguf_header_reader_agrees_with_gguf_py(tmp_path: Path):
    """moebench's one GGUF header reader against the sdist's GGUFReader on a small real GGUF, with the
    arrays skipped (the runner's identity) and read."""
    import numpy as np
    from moebench.gguf_header import GgufFormatError, read_gguf

    reader_cls = llamacpp.gguf_reader_class()
    if reader_cls is None:
        pytest.skip("gguf-py not importable from the llama.cpp sdist")
    import gguf

    path = tmp_path / "small.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_name("header-check")
    w.add_expert_count(8)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_array("tokenizer.ggml.tokens", ["a", "bb", "ccc", "\u00e9t\u00e9"])
    w.add_array("tokenizer.ggml.token_type", [1, 1, 3, 1])
    w.add_bool("general.flag", True)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.add_tensor("blk.0.ffn_up_exps.weight", np.zeros((8, 16, 32), np.float16))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()

    header = read_gguf(path, arrays="lengths")
    meta = header.metadata
    ref = reader_cls(str(path))
    assert meta["general.architecture"] == "qwen3moe" and meta["general.name"] == "header-check"
    assert meta["qwen3moe.expert_count"] == 8 and meta["general.flag"] is True
    assert abs(meta["qwen3moe.attention.layer_norm_rms_epsilon"] - 1e-6) < 1e-12
    assert meta["tokenizer.ggml.tokens"] == "<array of 4>"
    assert meta["tokenizer.ggml.token_type"] == "<array of 4>"
    assert [(t.name, t.n_elements) for t in header.tensors] == [(t.name, int(t.n_elements)) for t in ref.tensors] == [
        ("token_embd.weight", 128), ("blk.0.ffn_up_exps.weight", 4096)]
    assert [t.type_name for t in header.tensors] == ["F32", "F16"]
    for key in ("general.architecture", "general.name", "qwen3moe.expert_count"):
        assert ref.fields[key].contents() == meta[key]
    full = read_gguf(path).metadata                   # arrays read as values
    assert full["tokenizer.ggml.tokens"] == ref.fields["tokenizer.ggml.tokens"].contents() == ["a", "bb", "ccc", "\u00e9t\u00e9"]
    assert full["tokenizer.ggml.token_type"] == [1, 1, 3, 1]
    assert {k: v for k, v in full.items() if not k.startswith("tokenizer.")} == {
        k: v for k, v in meta.items() if not k.startswith("tokenizer.")}
    # A truncated header is an error that names the file, never a partial read.
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:60])
    with pytest.raises(GgufFormatError, match="cut.gguf"):
        read_gguf(cut)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GgufFormatError, match="empty.gguf"):
        read_gguf(tmp_path / "empty.gguf", arrays="lengths")


def test_shipped_profiles_load(tmp_path: Path):
    schemas = runner_schemas()
    for name in ("llama-bf16", "llama-q8_0", "llama-q4_0", "llama-server"):
        path = REPO / "runners" / f"{name}.toml"
        text = path.read_text()
        assert 'kind = "llama-server"' in text
        # Point the model at an existing file so validation of everything else can run here.
        fake = tmp_path / "m.gguf"
        fake.write_bytes(b"GGUF" + b"\0" * 16)
        lines = [f'model = "{fake}"' if ln.startswith("model =") else ln for ln in text.splitlines()]
        (tmp_path / f"{name}.toml").write_text("\n".join(lines) + "\n")
        prof = load_runner(tmp_path / f"{name}.toml", schemas)
        assert prof.kind == "llama-server" and prof.settings.concurrency >= 1
