"""A small OpenAI-compatible server for protocol tests (planted answers, delays, faults).

It never replaces the real integration tests against llama-server and the engine; it exists to plant
exact answers (so wins and losses are known) and to misbehave on purpose.

Run as a script: `python tests/openai_fake.py --plan plan.json [--port 0]`; prints "PORT <n>" once
listening. The plan (JSON):
  {"answers": {"<model>": [["<substring of the last question>", "<reply text>"], ...]},
   "default": "reply when nothing matches",
   "delay_s": 0.0,                      # before every reply
   "first_token_ms": 0, "token_ms": 0,  # streaming schedule
   "fail_first": 0,                     # answer HTTP 500 to the first N requests
   "garbage_for": ["<substring>"],      # answer non-JSON when the prompt contains it
   "bad_request_for": ["<substring>"],  # answer HTTP 400
   "log": "path.jsonl",                 # append every prompt asked
   "extra": {"<substring>": {...}},     # merged into the (non-streamed) response JSON, e.g. "timings"
   "top_logprobs": {"<substring>": {"A": -0.1, "B": -2.0}}}
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Handler(BaseHTTPRequestHandler):
    plan: dict[str, Any] = {}
    counter = 0
    lock = threading.Lock()

    def log_message(self, *args: Any) -> None:   # quiet
        pass

    def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path in ("/health", "/v1/models"):
            self._send(200, b'{"status":"ok","data":[{"id":"fake"}]}')
        else:
            self._send(404, b'{"error":"not found"}')

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(length) or b"{}")
        plan = self.plan
        cls = type(self)                # each served plan counts its own requests (fail_first)
        with cls.lock:
            cls.counter += 1
            n = cls.counter
        if self.path == "/tokenize":
            # whitespace "tokenizer" for protocol tests
            toks = [hash(w) % 50000 for w in body.get("content", "").split()]
            self._send(200, json.dumps({"tokens": toks}).encode())
            return
        chat = self.path.endswith("/chat/completions")
        prompt = body["messages"][-1]["content"] if chat else body.get("prompt", "")
        prompt_s = prompt if isinstance(prompt, str) else json.dumps(prompt)
        last_q = prompt_s.rsplit("Question:", 1)[-1]
        if plan.get("log"):
            with self.lock, open(plan["log"], "a") as f:
                f.write(json.dumps({"n": n, "model": body.get("model"), "prompt_tail": last_q[-200:]}) + "\n")
        if n <= plan.get("fail_first", 0):
            self._send(500, b'{"error":"planted failure"}')
            return
        if any(s in last_q for s in plan.get("bad_request_for", [])):
            self._send(400, b'{"error":"planted bad request"}')
            return
        if any(s in last_q for s in plan.get("garbage_for", [])):
            self._send(200, b"<html>this is not json</html>", "text/html")
            return
        time.sleep(plan.get("delay_s", 0.0))
        reply = plan.get("default", "I do not know.")
        for sub, text in plan.get("answers", {}).get(body.get("model", ""), []):
            if sub in last_q:
                reply = text
                break
        top = None
        for sub, lps in (plan.get("top_logprobs") or {}).items():
            if sub in last_q:
                top = lps
        if body.get("stream"):
            self._stream(reply, chat)
            return
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
        if chat:
            choice["message"] = {"role": "assistant", "content": reply}
        else:
            choice["text"] = reply
        if top is not None and (body.get("logprobs") or body.get("top_logprobs")):
            if chat:
                choice["logprobs"] = {"content": [{"token": max(top, key=top.get), "logprob": max(top.values()),
                                                   "top_logprobs": [{"token": t, "logprob": v} for t, v in top.items()]}]}
            else:
                choice["logprobs"] = {"tokens": [max(top, key=top.get)], "token_logprobs": [max(top.values())],
                                      "top_logprobs": [top]}
        out = {"id": f"cmpl-{n}", "object": "text_completion", "model": body.get("model"), "choices": [choice],
               "usage": {"prompt_tokens": len(prompt_s.split()), "completion_tokens": len(reply.split())}}
        for sub, extra in (plan.get("extra") or {}).items():
            if sub in last_q:
                out.update(extra)
        self._send(200, json.dumps(out).encode())

    def _stream(self, reply: str, chat: bool) -> None:
        """SSE: first token after first_token_ms, then one every token_ms (one word a token)."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        words = reply.split(" ")
        time.sleep(self.plan.get("first_token_ms", 0) / 1000)
        for i, w in enumerate(words):
            if i:
                time.sleep(self.plan.get("token_ms", 0) / 1000)
            piece = w if i == 0 else " " + w
            c = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            self.wfile.write(b"data: " + json.dumps({"choices": [c]}).encode() + b"\n\n")
            self.wfile.flush()
        usage = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": len(words)}}
        self.wfile.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        self.wfile.flush()


def serve(plan: dict[str, Any], port: int = 0) -> ThreadingHTTPServer:
    """Start in a background thread; returns the server (`server.server_address[1]` is the port)."""
    handler = type("PlannedHandler", (Handler,), {"plan": plan, "counter": 0, "lock": threading.Lock()})
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", required=True)
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args()
    with open(a.plan) as f:
        srv = serve(json.load(f), a.port)
    print(f"PORT {srv.server_address[1]}", flush=True)
    threading.Event().wait()
