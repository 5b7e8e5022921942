"""Secrets stay out of profiles and runs: literal secrets in files are refused at any depth, naming the
file and the key path; secrets from the environment (and secret-shaped text) never reach a run's files."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import moebench_cli
from moebench.config import ProfileError, load_runner
from moebench.runners import runner_schemas
from moebench.secrets import literal_secrets, redact

REFUSED = [
    ('kind = "http"\nbase_url = "http://127.0.0.1:1/v1"\napi_key = "plain"\n', "api_key"),
    ('kind = "http"\nbase_url = "http://127.0.0.1:1/v1"\nextra_body = { api_key = "sk-abc" }\n', "extra_body.api_key"),
    ('kind = "http"\nbase_url = "http://127.0.0.1:1/v1"\n[extra_body.meta.auth]\ntoken = "t0k"\n',
     "extra_body.meta.auth.token"),
    ('kind = "http"\nbase_url = "http://127.0.0.1:1/v1"\nextra_body = { list = [1, { password = "pw" }] }\n',
     "extra_body.list[1].password"),
    ('kind = "http"\nbase_url = "http://127.0.0.1:1/v1"\n[extra_body.headers]\nAuthorization = "Bearer abc"\n',
     "extra_body.headers.Authorization"),
    ('kind = "llama-server"\nmodel = "m.gguf"\nenv = { HF_TOKEN = "hf_abc" }\n', "env.HF_TOKEN"),
    ('kind = "llama-server"\nmodel = "m.gguf"\nargs = ["-c", "512", "--api-key", "s3cret"]\n', "args[3]"),
    ('kind = "llama-server"\nmodel = "m.gguf"\nargs = ["--api-key=s3cret"]\n', "args[0]"),
    ('kind = "http"\nbase_url = "http://127.0.0.1:1/v1"\nextra_body = { clientSecret = "c1i3nt" }\n',
     "extra_body.clientSecret"),
]


@pytest.mark.parametrize("text,path", REFUSED)
def test_literal_secret_at_any_depth_is_refused_naming_file_and_key_path(tmp_path, text, path):
    p = tmp_path / "r.toml"
    p.write_text(text)
    with pytest.raises(ProfileError) as e:
        load_runner(p, runner_schemas())
    msg = str(e.value)
    assert msg.startswith(f"{p}: key {path!r}") and "secrets never live in files" in msg
    secret = text.split('"')[-2]
    assert secret not in msg                                   # the refusal does not print the secret


def test_names_that_only_look_secret_are_accepted():
    profile = {"api_key_env": "X", "tokenize": "llama-server", "token_prompts": True, "max_tokens": 4,
               "tokenizer": "models/zoo/tiny-moe", "args": ["--api-key-file", "/run/key", "-c", "512"],
               "extra_body": {"top_k": 1, "author": "me", "keywords": ["a"]}}
    assert literal_secrets(profile) == []
    assert redact(profile) == profile


def test_redaction_walks_every_depth_by_name_and_by_shape():
    profile = {"extra_body": {"user": "sk-shapeSECRET0123456", "meta": [{"note": "hf_SHAPEhfSECRET123"},
                                                                      "Authorization: Bearer abcdef123456"]},
               "env": {"GITHUB_TOKEN": "whatever"}, "args": ["--hf-token", "x1", "--token=y2", "-c", "64"]}
    r = redact(profile)
    assert r == {"extra_body": {"user": "***", "meta": [{"note": "***"}, "Authorization: ***"]},
                 "env": {"GITHUB_TOKEN": "***"}, "args": ["--hf-token", "***", "--token=***", "-c", "64"]}


ENV_KEY = "sk-live-ENVSECRET-0123456789abcdef"
SHAPED = ["sk-shape-SECRET-abcdef0123", "Bearer shapebearer123456", "hf_SHAPEhfSECRET123456"]


class _EchoingServer:
    """Answers every GSM8K item with '#### 1', except that the third request gets a 400 whose body
    echoes the Authorization header (as some servers do in an 'invalid key' message)."""

    def __init__(self):
        self.seen: list[dict] = []
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.seen.append({"auth": self.headers.get("Authorization"), "body": body})
                if len(outer.seen) == 3:
                    out, code = json.dumps({"error": f"invalid key: {self.headers.get('Authorization')}"}), 400
                else:
                    out, code = json.dumps({"choices": [{"text": "#### 1", "finish_reason": "stop"}]}), 200
                data = out.encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.port = self.server.server_address[1]


def test_planted_secrets_reach_no_file_of_the_run(tmp_path: Path, data_dir):
    srv = _EchoingServer()
    try:
        suite = tmp_path / "s.toml"
        suite.write_text('name = "s"\n[[tasks]]\ntask = "gsm8k"\nlimit = 4\nshots = 0\n[probes]\nnvml = false\n')
        runner = tmp_path / "r.toml"
        runner.write_text(
            f'kind = "http"\nbase_url = "http://127.0.0.1:{srv.port}/v1"\napi_key_env = "MOEBENCH_TEST_KEY"\n'
            f'retries = 0\n[extra_body]\nuser = "{SHAPED[0]}"\n[extra_body.metadata]\n'
            f'tags = ["{SHAPED[1]}", {{ note = "{SHAPED[2]}" }}]\n')
        out = tmp_path / "run"
        res = moebench_cli("run", str(suite), "--runner", str(runner), "--out", str(out),
                           env={"MOEBENCH_TEST_KEY": ENV_KEY})
        assert res.returncode == 0, res.stderr
        # The secrets were used: the key went out as a header, the extra body as sent.
        assert all(s["auth"] == f"Bearer {ENV_KEY}" for s in srv.seen) and len(srv.seen) == 4
        assert srv.seen[0]["body"]["metadata"]["tags"][1]["note"] == SHAPED[2]
        # ...and reached no file of the run, though the server echoed the key into an error.
        files = [p for p in out.rglob("*") if p.is_file()]
        assert {p.name for p in files} >= {"manifest.json", "items.jsonl"}
        for p in files:
            data = p.read_bytes()
            for secret in [ENV_KEY, *SHAPED, "ENVSECRET", "shapebearer", "SHAPEhfSECRET"]:
                assert secret.encode() not in data, f"{secret!r} leaked into {p}"
        for stream in (res.stdout, res.stderr):
            assert ENV_KEY not in stream
        errors = [json.loads(x) for x in (out / "items.jsonl").read_text().splitlines() if '"error"' in x]
        assert len(errors) == 1 and "invalid key: Bearer ***" in errors[0]["error"]
        m = json.loads((out / "manifest.json").read_text())
        assert m["runner"]["extra_body"]["user"] == "***" and m["runner"]["api_key_env"] == "MOEBENCH_TEST_KEY"
    finally:
        srv.server.shutdown()
