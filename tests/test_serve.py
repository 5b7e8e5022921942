"""moebench serve: the OpenAI-compatible server over a runner, tested over real HTTP on 127.0.0.1.

`MarkovRunner` (also used by test_lmeval.py) is a small, deterministic Runner: a real byte-level BPE
tokenizer trained with `tokenizers` on GSM8K/CMMLU text from the data mirror, and a next-token
distribution that depends on the last token only (fixed pseudo-random logits per token id), so greedy
outputs, top-k log-probs and teacher-forced scores are exact and reproducible.
"""
from __future__ import annotations

import asyncio
import json
import threading
import time
from functools import lru_cache

import httpx
import numpy as np
import pytest

from moebench.runners.base import Capability, GenerateRequest, GenerateResult, Runner, RunnerError
from moebench.serve import BackgroundServer, ServeOptions

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@lru_cache(maxsize=1)
def toy_tokenizer():
    from moebench.datasets import data_dir
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = data_dir()
    lines = (root / "gsm8k" / "train.jsonl").read_text(encoding="utf-8").splitlines()[:1500]
    texts = [json.loads(x)["question"] + "\n" + json.loads(x)["answer"] for x in lines]
    texts += [p.read_text(encoding="utf-8") for p in sorted((root / "cmmlu" / "dev").glob("*.csv"))[:20]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1200, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


class MarkovRunner(Runner):
    """Deterministic toy LM behind the Runner contract. `caps` picks which capabilities it offers."""

    kind = "markov"
    ALL = frozenset({Capability.GENERATE, Capability.TOP_LOGPROBS, Capability.TOKENIZE,
                     Capability.TOKEN_PROMPTS, Capability.FULL_LOGITS})

    def __init__(self, caps: frozenset[str] | None = None, concurrency: int = 2, delay_s: float = 0.0,
                 fail_on: str | None = None):
        super().__init__({"name": "markov", "concurrency": concurrency})
        self.capabilities = self.ALL if caps is None else frozenset(caps)
        self.tok = toy_tokenizer()
        self.vocab = self.tok.get_vocab_size()
        self.eos_token_id = self.tok.token_to_id("<|endoftext|>")
        self.delay_s = delay_s
        self.fail_on = fail_on          # a prompt containing this text raises RunnerError
        self.started = self.closed = 0
        self.in_flight = self.max_in_flight = 0
        self._table: dict[int, np.ndarray] = {}

    def _logprobs_after(self, token_id: int) -> np.ndarray:
        if token_id not in self._table:
            logits = np.random.default_rng(1000 + token_id).normal(size=self.vocab) * 3.0
            logits[self.eos_token_id] -= 4.0          # rarely end
            z = logits - logits.max()
            self._table[token_id] = z - np.log(np.exp(z).sum())
        return self._table[token_id]

    async def start(self, run_dir=None):
        self.started += 1

    async def close(self):
        self.closed += 1

    async def tokenize(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    async def detokenize(self, token_ids: list[int]) -> str:
        return self.tok.decode(token_ids, skip_special_tokens=False)

    async def logits(self, token_ids: list[int]) -> np.ndarray:
        return np.stack([self._logprobs_after(t) for t in token_ids])

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            ids = request.prompt if isinstance(request.prompt, list) else await self.tokenize(request.prompt)
            text_prompt = request.prompt if isinstance(request.prompt, str) else await self.detokenize(ids)
            if self.fail_on and self.fail_on in text_prompt:
                raise RunnerError(f"planted failure for a prompt containing {self.fail_on!r}")
            if not ids:
                raise RunnerError("empty prompt")
            rng = np.random.default_rng(request.seed if request.seed is not None else 0)
            out, tops, last, finish = [], [], ids[-1], "length"
            for _ in range(request.max_tokens):
                lp = self._logprobs_after(last)
                if request.temperature > 0:
                    p = np.exp(lp / request.temperature)
                    nxt = int(rng.choice(self.vocab, p=p / p.sum()))
                else:
                    nxt = int(np.argmax(lp))
                if request.top_logprobs:
                    best = np.argsort(-lp, kind="stable")[: request.top_logprobs]
                    tops.append({self.tok.decode([int(t)], skip_special_tokens=False): float(lp[t]) for t in best})
                if nxt == self.eos_token_id and not request.ignore_eos:
                    finish = "stop"
                    break
                out.append(nxt)
                last = nxt
                text = self.tok.decode(out)
                cut = [text.find(s) for s in request.stop if s and s in text]
                if cut:
                    finish = "stop"
                    text = text[: min(cut)]
                    return GenerateResult(text=text, token_ids=out, prompt_tokens=len(ids),
                                          output_tokens=len(out), finish_reason=finish,
                                          top_logprobs=tops or None)
            return GenerateResult(text=self.tok.decode(out), token_ids=out, prompt_tokens=len(ids),
                                  output_tokens=len(out), finish_reason=finish, top_logprobs=tops or None)
        finally:
            self.in_flight -= 1


# -- fixtures -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    runner = MarkovRunner()
    with BackgroundServer(runner, ServeOptions(port=0, max_body_bytes=64 * 1024)) as s:
        yield s, runner
    assert runner.closed == 1


def post(url: str, body, **kw) -> httpx.Response:
    return httpx.post(url, json=body, timeout=30, **kw)


# -- tests ----------------------------------------------------------------------------------------

def test_health_models_and_binding(server):
    s, runner = server
    assert s.url.startswith("http://127.0.0.1:")
    assert httpx.get(s.url.replace("/v1", "/health")).json() == {"status": "ok"}
    models = httpx.get(s.url + "/models").json()
    assert models["data"][0]["id"] == "markov"
    assert "full_logits" in models["data"][0]["capabilities"]


def test_completion_greedy_matches_runner_and_is_deterministic(server):
    s, runner = server
    prompt = "Question: Natalia sold clips to 48 of her friends.\nAnswer:"
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
    a, b = post(s.url + "/completions", body).json(), post(s.url + "/completions", body).json()
    direct = asyncio.run(runner.generate(GenerateRequest(prompt=prompt, max_tokens=12)))
    assert a["choices"][0]["text"] == b["choices"][0]["text"] == direct.text
    assert a["usage"]["completion_tokens"] == len(direct.token_ids)
    assert a["usage"]["prompt_tokens"] == len(runner.tok.encode(prompt, add_special_tokens=False).ids)


def test_token_id_prompt_and_batch(server):
    s, runner = server
    ids = runner.tok.encode("Janet has 3 apples", add_special_tokens=False).ids
    by_ids = post(s.url + "/completions", {"prompt": [ids, ids[:3]], "max_tokens": 5, "temperature": 0}).json()
    by_text = post(s.url + "/completions", {"prompt": ["Janet has 3 apples", "x"], "max_tokens": 5,
                                            "temperature": 0}).json()
    assert [c["index"] for c in by_ids["choices"]] == [0, 1]
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"] != ""
    assert by_ids["choices"][1]["text"] != by_ids["choices"][0]["text"]
    mixed = post(s.url + "/completions", {"prompt": [ids, "Janet"], "max_tokens": 5})
    assert mixed.status_code == 400 and "'prompt' must be" in mixed.json()["error"]["message"]


def test_logprobs_legacy_format_exact(server):
    s, runner = server
    prompt = "Tom has 5 pens"
    r = post(s.url + "/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 3}).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 4
    assert lp["text_offset"][0] == len(prompt)
    assert "".join(lp["tokens"]) == r["choices"][0]["text"]
    # Greedy: every chosen token is the best alternative, with exactly the model's log-prob.
    last = runner.tok.encode(prompt, add_special_tokens=False).ids[-1]
    expected = float(np.max(runner._logprobs_after(last)))
    assert lp["token_logprobs"][0] == pytest.approx(expected, abs=1e-9)
    for tok, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        # (pieces of partial UTF-8 byte tokens all read "\ufffd", so keys may collide: <= 3)
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(v, abs=1e-9)


def test_echo_prompt_logprobs_teacher_forced(server):
    s, runner = server
    prompt = "Weng earns $12 an hour"
    ids = runner.tok.encode(prompt, add_special_tokens=False).ids
    r = post(s.url + "/completions", {"prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1,
                                      "echo": True}).json()
    ch = r["choices"][0]
    lp = ch["logprobs"]
    assert ch["text"].startswith(prompt)
    assert len(lp["tokens"]) == len(ids) + 1 and lp["token_logprobs"][0] is None
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(float(runner._logprobs_after(ids[i - 1])[ids[i]]), abs=1e-9)
    assert lp["text_offset"][0] == 0


def test_echo_logprobs_refused_without_prompt_scoring():
    runner = MarkovRunner(caps=MarkovRunner.ALL - {Capability.FULL_LOGITS})
    with BackgroundServer(runner) as s:
        r = post(s.url + "/completions", {"prompt": "hi there", "max_tokens": 1, "logprobs": 1, "echo": True})
        assert r.status_code == 400
        assert "prompt_logprobs or full_logits" in r.json()["error"]["message"]
        # Without echo, logprobs come from the generation's top alternatives.
        r = post(s.url + "/completions", {"prompt": "hi there", "max_tokens": 3, "temperature": 0, "logprobs": 2})
        assert r.status_code == 200
        lp = r.json()["choices"][0]["logprobs"]
        assert all(v is not None and len(t) == 2 for v, t in zip(lp["token_logprobs"], lp["top_logprobs"]))


def test_stop_and_seeded_sampling(server):
    s, runner = server
    body = {"prompt": "The farmer", "max_tokens": 30, "temperature": 0}
    full = post(s.url + "/completions", body).json()["choices"][0]["text"]
    assert len(full) > 4
    stop = full[2:4]
    cut = post(s.url + "/completions", {**body, "stop": [stop]}).json()["choices"][0]
    assert cut["text"] == full[: full.index(stop)] and cut["finish_reason"] == "stop"
    hot = {"prompt": "The farmer", "max_tokens": 20, "temperature": 1.5, "seed": 7}
    x, y = post(s.url + "/completions", hot).json(), post(s.url + "/completions", hot).json()
    z = post(s.url + "/completions", {**hot, "seed": 8}).json()
    assert x["choices"][0]["text"] == y["choices"][0]["text"]
    assert z["choices"][0]["text"] != x["choices"][0]["text"]


def test_streaming_completion_sse(server):
    s, runner = server
    body = {"prompt": "Betty is saving money", "max_tokens": 10, "temperature": 0}
    whole = post(s.url + "/completions", body).json()["choices"][0]
    chunks, done = [], False
    with httpx.stream("POST", s.url + "/completions", json={**body, "stream": True}, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunks.append(json.loads(line[6:]))
    assert done and len(chunks) >= 3
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"]


def test_chat_completion_with_logprobs_and_stream(server):
    s, runner = server
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    r = post(s.url + "/chat/completions", {"messages": msgs, "max_tokens": 6, "temperature": 0,
                                           "logprobs": True, "top_logprobs": 2}).json()
    msg = r["choices"][0]["message"]
    assert msg["role"] == "assistant"
    prompt = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
              "<|im_start|>assistant\n")
    assert msg["content"] == asyncio.run(runner.generate(GenerateRequest(prompt=prompt, max_tokens=6,
                                                                         stop=["<|im_end|>"]))).text
    content = r["choices"][0]["logprobs"]["content"]
    assert content and all(len(c["top_logprobs"]) == 2 for c in content)
    assert "".join(c["token"] for c in content) == msg["content"]
    deltas = []
    with httpx.stream("POST", s.url + "/chat/completions",
                      json={"messages": msgs, "max_tokens": 6, "temperature": 0, "stream": True}, timeout=30) as st:
        for line in st.iter_lines():
            if line.startswith("data: {"):
                deltas.append(json.loads(line[6:])["choices"][0]["delta"].get("content", ""))
    assert "".join(deltas) == msg["content"]


@pytest.mark.parametrize("body, status, words", [
    ({"max_tokens": 3}, 400, "missing 'prompt'"),
    ({"prompt": "x", "max_tokens": -1}, 400, "'max_tokens' must be between"),
    ({"prompt": "x", "max_tokens": "3"}, 400, "'max_tokens' must be an integer"),
    ({"prompt": "x", "temperature": True}, 400, "'temperature' must be"),
    ({"prompt": [1, -2]}, 400, "'prompt' must be"),
    ({"prompt": "x", "stop": [1]}, 400, "'stop' must be"),
    ({"prompt": "x", "n": 2}, 400, "only n = 1"),
    ({"prompt": "x", "logprobs": 1000}, 400, "'logprobs' must be between"),
])
def test_bad_requests_get_4xx_json(server, body, status, words):
    s, _ = server
    r = post(s.url + "/completions", body)
    assert r.status_code == status
    assert words in r.json()["error"]["message"]


def test_bad_json_unknown_path_and_body_limit(server):
    s, _ = server
    r = httpx.post(s.url + "/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(s.url + "/completions", content=b"[1, 2]")
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    r = httpx.get(s.url + "/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
    r = post(s.url + "/chat/completions", {"messages": [{"role": "robot", "content": "x"}]})
    assert r.status_code == 400 and "messages[0]" in r.json()["error"]["message"]
    r = post(s.url + "/completions", {"prompt": "x" * (70 * 1024)})
    assert r.status_code == 413 and "exceeds the limit" in r.json()["error"]["message"]


def test_token_prompt_refused_without_capability():
    runner = MarkovRunner(caps={Capability.GENERATE, Capability.TOKENIZE})
    with BackgroundServer(runner) as s:
        r = post(s.url + "/completions", {"prompt": [5, 6, 7], "max_tokens": 2})
        assert r.status_code == 400 and "token_prompts" in r.json()["error"]["message"]
        r = post(s.url + "/completions", {"prompt": "ok", "max_tokens": 2, "logprobs": 1})
        assert r.status_code == 400 and "top_logprobs" in r.json()["error"]["message"]


def test_backend_failure_is_502_json():
    runner = MarkovRunner(fail_on="BOOM")
    with BackgroundServer(runner) as s:
        r = post(s.url + "/completions", {"prompt": "BOOM now", "max_tokens": 2})
        assert r.status_code == 502 and "planted failure" in r.json()["error"]["message"]
        assert post(s.url + "/completions", {"prompt": "fine", "max_tokens": 2}).status_code == 200


def test_concurrency_bounded_and_queue_overflow_429():
    runner = MarkovRunner(concurrency=8, delay_s=0.3)
    with BackgroundServer(runner, ServeOptions(port=0, max_concurrency=2, max_queue=2)) as s:
        results: list[int] = []

        def ask():
            results.append(post(s.url + "/completions", {"prompt": "hello", "max_tokens": 1}).status_code)

        threads = [threading.Thread(target=ask) for _ in range(7)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert runner.max_in_flight == 2                      # never more than max_concurrency at once
    assert results.count(200) == 4 and results.count(429) == 3    # 2 running + 2 queued; the rest refused


def _metrics(url: str) -> dict[str, float]:
    from moebench.runners.metrics import parse_prometheus
    r = httpx.get(url[: -len("/v1")] + "/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain")
    return parse_prometheus(r.text)


def test_metrics_page_counts_running_waiting_admitted_and_rejected():
    """GET /metrics while 2 requests run, 2 wait and 3 were refused, then once all are done."""
    runner = MarkovRunner(concurrency=8, delay_s=0.6)
    with BackgroundServer(runner, ServeOptions(port=0, max_concurrency=2, max_queue=2)) as s:
        assert _metrics(s.url) == {"moebench:num_requests_running": 0, "moebench:num_requests_waiting": 0,
                                   "moebench:requests_admitted_total": 0, "moebench:requests_rejected_total": 0}
        results: list[int] = []

        def ask():
            results.append(post(s.url + "/completions", {"prompt": "hello", "max_tokens": 1}).status_code)

        threads = [threading.Thread(target=ask) for _ in range(7)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 0.4        # the 3 refused answer at once; the first 2 hold 0.6 s
        while results.count(429) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        during = _metrics(s.url)
        for t in threads:
            t.join()
        after = _metrics(s.url)
    assert results.count(429) == 3
    assert during["moebench:num_requests_running"] == 2 and during["moebench:num_requests_waiting"] == 2
    assert during["moebench:requests_rejected_total"] == 3 and during["moebench:requests_admitted_total"] == 2
    assert after == {"moebench:num_requests_running": 0, "moebench:num_requests_waiting": 0,
                     "moebench:requests_admitted_total": 4, "moebench:requests_rejected_total": 3}


def test_tokenizer_endpoints_vllm_style(server):
    s, runner = server
    base = s.url[: -len("/v1")]
    info = httpx.get(base + "/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>"
    toks = post(base + "/tokenize", {"prompt": "Question: 12 apples", "add_special_tokens": False}).json()["tokens"]
    assert toks == runner.tok.encode("Question: 12 apples", add_special_tokens=False).ids
    assert post(base + "/detokenize", {"tokens": toks}).json()["prompt"] == "Question: 12 apples"


# -- live streaming (GenerateRequest.on_text) -------------------------------------------------------

class PacedRunner(Runner):
    """Streams fixed pieces through on_text with a pause after each, applying stop strings to the
    final text the way the real runners do: when its last piece is out, the first pieces must have
    reached the client long before."""

    kind = "paced"
    capabilities = frozenset({Capability.GENERATE})
    PIECES = ["Hello", " wor", "ld, ", "the", " end ST", "OP and more"]

    def __init__(self, pause_s: float):
        super().__init__({"name": "paced"})
        self.pause_s = pause_s
        self.finished_at = None

    async def start(self, run_dir=None):
        pass

    async def close(self):
        pass

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        from moebench.scoring.answers import first_stop
        for piece in self.PIECES:
            if request.on_text is not None:
                request.on_text(piece)
            await asyncio.sleep(self.pause_s)
        text = "".join(self.PIECES)
        cut = first_stop(text, request.stop)
        self.finished_at = time.monotonic()
        return GenerateResult(text=text if cut is None else text[:cut], finish_reason="stop" if cut else "length")


def _sse_pieces(url: str, body: dict, field) -> tuple[list[str], list[float], list[dict]]:
    pieces, times, events = [], [], []
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            events.append(ev)
            piece = field(ev["choices"][0]) if ev.get("choices") else None
            if piece:
                pieces.append(piece)
                times.append(time.monotonic())
    return pieces, times, events


def test_stream_sends_text_while_generating_and_holds_back_a_stop_prefix():
    runner = PacedRunner(pause_s=0.25)
    with BackgroundServer(runner) as s:
        pieces, times, events = _sse_pieces(s.url + "/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stop": ["STOP"]},
            lambda c: c["delta"].get("content"))
        # the first piece arrived while the runner still had 5 pauses (1.25 s) to go
        assert times[0] < runner.finished_at - 0.8, (times[0], runner.finished_at)
        assert "".join(pieces) == "Hello world, the end "
        assert not any("ST" in p for p in pieces)        # "ST" could have begun "STOP": never sent
        assert events[-1]["choices"][0]["finish_reason"] == "stop"
        pieces, times, _ = _sse_pieces(s.url + "/completions", {"prompt": "hi", "max_tokens": 20},
                                       lambda c: c["text"])
        assert "".join(pieces) == "".join(PacedRunner.PIECES) and len(pieces) >= 5
        assert times[0] < runner.finished_at - 0.8


def test_stream_error_after_headers_is_an_sse_error_event():
    runner = MarkovRunner(fail_on="explode")
    with BackgroundServer(runner) as s:
        _, _, events = _sse_pieces(s.url + "/chat/completions",
                                   {"messages": [{"role": "user", "content": "explode"}], "max_tokens": 4},
                                   lambda c: c["delta"].get("content"))
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"      # the stream had started
    assert events[-1]["error"]["type"] == "server_error"
    assert events[-1]["error"]["message"].startswith("the backend failed:")


def test_stream_over_the_real_engine_runner_matches_the_whole_answer(zoo):
    """The zoo model behind `serve`: a streamed chat answer arrives in several pieces that join to the
    non-streamed answer, with a stop string taken from that answer."""
    from moebench.runners.engine import EngineRunner
    runner = EngineRunner({"model": str(zoo / "tiny-moe"), "dtype": "float32", "max_seq_len": 512}, "test")
    with BackgroundServer(runner) as s:
        # A question the zoo model answers at length (to "Who was Prince Andrew?" it says "Answer: A").
        body = {"messages": [{"role": "user", "content": "Who was Pierre Bezukhov, and what did he do in Moscow?"}],
                "max_tokens": 24, "temperature": 0}
        whole = post(s.url + "/chat/completions", body).json()["choices"][0]["message"]["content"]
        pieces, _, events = _sse_pieces(s.url + "/chat/completions", body, lambda c: c["delta"].get("content"))
        assert len(pieces) > 3 and "".join(pieces) == whole
        stop = whole.split()[3]
        cut = post(s.url + "/chat/completions", {**body, "stop": [stop]}).json()["choices"][0]
        pieces, _, events = _sse_pieces(s.url + "/chat/completions", {**body, "stop": [stop]},
                                        lambda c: c["delta"].get("content"))
        assert "".join(pieces) == cut["message"]["content"] and stop not in "".join(pieces)
        assert events[-1]["choices"][0]["finish_reason"] == cut["finish_reason"] == "stop"


def test_stream_options_include_usage_over_the_real_engine_runner(zoo):
    """`stream_options.include_usage` (what the official openai client and serving benchmarks use to
    count tokens): every chunk carries "usage": null and a last chunk with empty choices carries the
    same usage the non-streamed answer gives; without it no chunk has a usage key; without `stream`
    it is a 400 naming the parameter."""
    from moebench.runners.engine import EngineRunner
    runner = EngineRunner({"model": str(zoo / "tiny-moe"), "dtype": "float32", "max_seq_len": 512}, "test")
    with BackgroundServer(runner) as s:
        cases = [("/chat/completions", {"messages": [{"role": "user", "content": "What is 2+2?"}]},
                  lambda c: c["delta"].get("content")),
                 ("/completions", {"prompt": "Natalia sold clips to"}, lambda c: c.get("text")),
                 ("/completions", {"prompt": ["Natalia sold clips to", "Betty is saving money"]},
                  lambda c: c.get("text"))]
        for path, extra, field in cases:
            body = {**extra, "max_tokens": 12, "temperature": 0}
            whole = post(s.url + path, body).json()
            pieces, _, events = _sse_pieces(s.url + path, {**body, "stream_options": {"include_usage": True}}, field)
            assert pieces, path
            assert all("usage" in e and e["usage"] is None for e in events[:-1]), path
            last = events[-1]
            assert last["choices"] == [] and last["usage"] == whole["usage"], (path, last, whole["usage"])
            assert last["usage"]["completion_tokens"] > 0
            _, _, plain = _sse_pieces(s.url + path, body, field)
            assert plain and not any("usage" in e for e in plain), path
        r = post(s.url + "/completions", {"prompt": "x", "max_tokens": 2, "stream_options": {"include_usage": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
        r = post(s.url + "/completions", {"prompt": "x", "max_tokens": 2, "stream": True,
                                          "stream_options": {"include_usage": "yes"}})
        assert r.status_code == 400 and "include_usage" in r.json()["error"]["message"]
