"""A stand-in llama-server binary for protocol tests of the llama-server runner: it takes the real
command line (`--port N`, the rest ignored), answers GET /health, and answers every POST /completion
with the raw text in $FAKE_COMPLETION (a non-streamed request) or the SSE events in $FAKE_STREAM (a JSON
list of raw `data:` payloads, for a streamed one); with $FAKE_DRIP set, it sends a status line and then
one byte every 0.2 s for 12 s (a server alive but never done). Raw text, so a test can plant NaN, Infinity, or
anything else a real server might send by mistake. The real llama-server tests are test_llama_e2e.py
and test_llama_server_runner.py."""
from __future__ import annotations

import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._send(200 if self.path == "/health" else 404, b'{"status":"ok"}')

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))) or b"{}")
        if self.path != "/completion":
            self._send(404, b'{"error":{"message":"not found"}}')
        elif os.environ.get("FAKE_DRIP"):
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            for _ in range(60):
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(0.2)
        elif body.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for payload in json.loads(os.environ["FAKE_STREAM"]):
                self.wfile.write(b"data: " + payload.encode() + b"\n\n")
                self.wfile.flush()
        else:
            self._send(200, os.environ["FAKE_COMPLETION"].encode())


if __name__ == "__main__":
    if "--help" in sys.argv:
        print("usage: llama_server_fake.py --port N [ignored llama-server options]")
        sys.exit(0)
    port = int(sys.argv[sys.argv.index("--port") + 1])
    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
