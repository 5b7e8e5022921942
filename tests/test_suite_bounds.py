"""Profile values are bounded when they load: a value that would grow a prompt, a queue or a wait past
what any machine survives (or NaN / infinity) is refused with exit 2 naming the file and the key,
before a runner starts or a request is sent. The bounds are documented in docs/profiles.md."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import REPO, moebench_cli
from moebench.config import (COMMON_RUNNER_SCHEMA, COMMON_TASK_SCHEMA, PROBES_SCHEMA, ProfileError, bounds_text,
                             load_runner, load_suite)
from moebench.runners import runner_schemas
from moebench.tasks import task_schemas
from openai_fake import serve
from request_count import RequestCount


def _suite(tmp: Path, body: str, probes: str = "nvml = false") -> Path:
    p = tmp / "s.toml"
    p.write_text(f'name = "s"\n[[tasks]]\n{body}\n[probes]\n{probes}\n')
    return p


def _runner(tmp: Path, port: int = 9, extra: str = "") -> Path:
    p = tmp / "r.toml"
    p.write_text(f'kind = "http"\nbase_url = "http://127.0.0.1:{port}/v1"\nmodel = "m"\n{extra}\n')
    return p


# (task entry, key named in the error, words the error must hold)
SUITE_CASES = [
    ('task = "gsm8k"\nshots = 100000', "shots", "between 0 and 64"),
    ('task = "cmmlu"\nshots = 6', "shots", "between 0 and 5"),
    ('task = "speed"\nclients = 100000', "clients", "between 1 and 1,024"),
    ('task = "speed"\nclients = [1, 100000]', "clients", "item 1 must be between 1 and 1,024"),
    ('task = "speed"\nwarmup = 1000000000', "warmup", "between 0 and 1,000"),
    ('task = "speed"\nwarmup = -3', "warmup", "between 0 and 1,000"),
    ('task = "speed"\nprompt_lengths = [128, 1000000000]', "prompt_lengths", "item 1 must be between 1 and 1,048,576"),
    ('task = "speed"\ntemperature = nan', "temperature", "must be a finite number"),
    ('task = "speed"\nseed = -1', "seed", "between 0 and 4,294,967,295"),
    ('task = "humaneval"\ntimeout_s = 1e300', "timeout_s", "more than 0 and at most 3,600"),
    ('task = "humaneval"\ntimeout_s = inf', "timeout_s", "must be a finite number"),
    ('task = "needle"\nlengths = [2000000]', "lengths", "item 0 must be between 1 and 1,048,576"),
    ('task = "needle"\ndepths = [0.5, nan]', "depths", "item 1 must be a finite number"),
    ('task = "kld"\ncontext = 4194304', "context", "between 4 and 1,048,576"),
    ('task = "kld"\ncorpus = "../../etc/passwd"', "corpus", "must be a path inside the data mirror"),
    ('task = "gsm8k"\nlimit = 100000000', "limit", "between 1 and 10,000,000"),
    ('task = "cmmlu"\nsubjects = ["agronomy", "../../../etc/passwd"]', "subjects",
     "'../../../etc/passwd', not a CMMLU subject"),
    ('task = "cmmlu"\nsubjects = ["/etc/passwd"]', "subjects", "'/etc/passwd', not a CMMLU subject"),
    ('task = "cmmlu"\nsubjects = ["astronomyy"]', "subjects", "'astronomyy', not a CMMLU subject"),
]


@pytest.mark.parametrize("body,key,words", SUITE_CASES, ids=[c[0].split("\n")[1] for c in SUITE_CASES])
def test_out_of_bounds_suite_value_is_refused_at_load_naming_file_and_key(tmp_path, body, key, words):
    p = _suite(tmp_path, body)
    with pytest.raises(ProfileError) as e:
        load_suite(p, task_schemas())
    msg = str(e.value)
    assert str(p) in msg and f"key {key!r}" in msg and words in msg, msg


@pytest.mark.parametrize("probes,key,words", [
    ("idle_s = nan", "idle_s", "must be a finite number"),
    ("idle_s = 1e9", "idle_s", "between 0 and 3,600"),
    ("interval_ms = 100000000", "interval_ms", "between 1 and 60,000"),
])
def test_out_of_bounds_probe_value_is_refused(tmp_path, probes, key, words):
    p = _suite(tmp_path, 'task = "gsm8k"', probes)
    with pytest.raises(ProfileError) as e:
        load_suite(p, task_schemas())
    msg = str(e.value)
    assert f"{p} [probes]" in msg and f"key {key!r}" in msg and words in msg, msg


@pytest.mark.parametrize("extra,key,words", [
    ("timeout_s = 1e300", "timeout_s", "more than 0 and at most 86,400"),
    ("timeout_s = inf", "timeout_s", "must be a finite number"),
    ("timeout_s = nan", "timeout_s", "must be a finite number"),
    ("retries = -1", "retries", "between 0 and 100"),
    ("backoff_s = -0.5", "backoff_s", "between 0 and 86,400"),
    ("concurrency = 100000", "concurrency", "between 1 and 1,024"),
    ("max_response_bytes = 100000000000", "max_response_bytes", "between 1 and 4,294,967,296"),
])
def test_out_of_bounds_runner_value_is_refused_at_load(tmp_path, extra, key, words):
    p = _runner(tmp_path, extra=extra)
    with pytest.raises(ProfileError) as e:
        load_runner(p, runner_schemas())
    msg = str(e.value)
    assert str(p) in msg and f"key {key!r}" in msg and words in msg, msg


def test_llama_server_port_outside_65535_is_refused(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    p = tmp_path / "l.toml"
    p.write_text(f'kind = "llama-server"\nmodel = "{model}"\nport = 70000\n')
    with pytest.raises(ProfileError, match=r"key 'port' must be between 0 and 65,535, got 70000"):
        load_runner(p, runner_schemas())


def test_values_at_the_bounds_load(tmp_path):
    """The documented limits themselves are allowed: a bound is not off by one."""
    p = _suite(tmp_path, 'task = "speed"\nclients = [1, 1024]\nwarmup = 0\nprompt_lengths = [1, 1048576]\n'
                         'seed = 4294967295\n[[tasks]]\ntask = "gsm8k"\nshots = 64\n'
                         '[[tasks]]\ntask = "cmmlu"\nshots = 5\nsubjects = ["agronomy"]')
    s = load_suite(p, task_schemas())
    assert s.tasks[0]["clients"] == [1, 1024] and s.tasks[1]["shots"] == 64 and s.tasks[2]["subjects"] == ["agronomy"]
    r = load_runner(_runner(tmp_path, extra="timeout_s = 86400\nretries = 0\nconcurrency = 1024"), runner_schemas())
    assert r.settings.timeout_s == 86400 and r.settings.concurrency == 1024


@pytest.mark.parametrize("body,key", [
    ('task = "gsm8k"\nshots = 100000', "shots"),
    ('task = "speed"\nclients = 100000', "clients"),
    ('task = "speed"\nprompt_lengths = [1000000000]', "prompt_lengths"),
    ('task = "cmmlu"\nsubjects = ["../../../etc"]', "subjects"),
], ids=["shots", "clients", "prompt_lengths", "subjects"])
def test_cli_refuses_unbounded_suite_before_any_request(tmp_path, body, key):
    server = serve({"default": "#### 1"})
    asked = RequestCount(server)
    try:
        suite = _suite(tmp_path, body)
        runner = _runner(tmp_path, server.server_address[1])
        out = tmp_path / "run"
        proc = moebench_cli("run", str(suite), "--runner", str(runner), "--out", str(out), timeout=120)
        assert proc.returncode == 2, proc.stderr
        line = proc.stderr.strip().splitlines()[-1]
        assert line.startswith("error: ") and str(suite) in line and f"key {key!r}" in line, proc.stderr
        assert "Traceback" not in proc.stderr
        assert asked.n == 0                                  # nothing was asked
        assert not out.exists()                              # and nothing was left behind
    finally:
        server.shutdown()


def test_cli_refuses_infinite_runner_timeout(tmp_path):
    suite = _suite(tmp_path, 'task = "gsm8k"\nlimit = 1\nshots = 0')
    runner = _runner(tmp_path, extra="timeout_s = 1e300")
    proc = moebench_cli("run", str(suite), "--runner", str(runner), "--out", str(tmp_path / "run"), timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert str(runner) in proc.stderr and "key 'timeout_s'" in proc.stderr and "at most 86,400" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_out_naming_a_regular_file_exits_2_in_plain_words(tmp_path):
    suite = _suite(tmp_path, 'task = "gsm8k"\nlimit = 1\nshots = 0')
    runner = _runner(tmp_path)
    target = tmp_path / "notes.txt"
    target.write_text("keep me\n")
    proc = moebench_cli("run", str(suite), "--runner", str(runner), "--out", str(target), timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"--out {target} is a file, not a directory" in proc.stderr
    assert "errno" not in proc.stderr and "Traceback" not in proc.stderr
    assert target.read_text() == "keep me\n"                # the file is untouched
    below = target / "run"                                  # a file on the way there: the same answer
    proc = moebench_cli("run", str(suite), "--runner", str(runner), "--out", str(below), timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert f"--out {below}: {target} is a file, not a directory" in proc.stderr
    assert target.read_text() == "keep me\n"


def _schemas() -> list[tuple[str, dict]]:
    return ([("[probes]", PROBES_SCHEMA), ("every task", COMMON_TASK_SCHEMA), ("every runner", COMMON_RUNNER_SCHEMA)]
            + [(f"task {k}", v) for k, v in task_schemas().items()]
            + [(f"runner {k}", v) for k, v in runner_schemas().items()])


def _numeric(field) -> bool:
    types = field.types if isinstance(field.types, tuple) else (field.types,)
    items = field.item_type if isinstance(field.item_type, tuple) else (field.item_type,)
    return bool({int, float} & set(types + items))


def test_every_numeric_key_has_a_bound_documented_in_profiles_md():
    """Each numeric key of every suite and runner schema carries a low and a high bound, and
    docs/profiles.md lists it with exactly those bounds (a row `| key | ... | bounds |`)."""
    doc = (REPO / "docs" / "profiles.md").read_text(encoding="utf-8")
    checked = 0
    for where, schema in _schemas():
        for key, field in schema.items():
            if not _numeric(field):
                continue
            assert field.low is not None and field.high is not None, f"{where} key {key!r} has no bound"
            section = doc.split(f"<!-- {where} -->", 1)
            assert len(section) == 2, f"docs/profiles.md has no section marked <!-- {where} -->"
            rows = section[1].split("<!--", 1)[0]
            assert re.search(rf"^\| `{re.escape(key)}` \|.*\| {re.escape(bounds_text(field))} \|$", rows, re.M), \
                f"docs/profiles.md ({where}) lacks `{key}` with bounds {bounds_text(field)!r}"
            checked += 1
    assert checked >= 50


@pytest.mark.parametrize("limit", ["0", "-3", "100000000"])
def test_cli_limit_outside_its_bound_exits_2_before_any_request(tmp_path, limit):
    """`--limit 0` once ran every item and `--limit -3` all but the last three."""
    server = serve({"default": "#### 1"})
    asked = RequestCount(server)
    try:
        suite = _suite(tmp_path, 'task = "gsm8k"\nlimit = 5\nshots = 0')
        runner = _runner(tmp_path, server.server_address[1])
        out = tmp_path / "run"
        proc = moebench_cli("run", str(suite), "--runner", str(runner), "--out", str(out), "--limit", limit,
                            timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert f"argument --limit: must be a whole number between 1 and 10,000,000, got {limit!r}" in proc.stderr
        assert asked.n == 0 and not out.exists()
    finally:
        server.shutdown()


def test_api_limit_outside_its_bound_is_usage_error(tmp_path):
    from moebench import api
    server = serve({"default": "#### 1"})
    asked = RequestCount(server)
    try:
        suite = _suite(tmp_path, 'task = "gsm8k"\nlimit = 5\nshots = 0')
        runner = _runner(tmp_path, server.server_address[1], extra="retries = 0")
        for limit in (0, -3):
            with pytest.raises(api.UsageError, match=rf"limit must be between 1 and 10,000,000, got {limit}"):
                api.run(api.RunOptions(suite=str(suite), runner=str(runner), out=str(tmp_path / "run"),
                                       limit=limit, quiet=True))
            assert asked.n == 0 and not (tmp_path / "run").exists()
    finally:
        server.shutdown()
