"""The CLI says what it is doing (issue 44): help that lists every exit code, errors that list what
exists and suggest the nearest name, profile paths that resolve from any folder, capability errors
that name the profile keys adding the capability, checks before any work, start-up lines."""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import REPO, moebench_cli
from moebench.config import ProfileError, load_runner, load_suite
from moebench.runners import runner_schemas
from moebench.tasks import task_schemas


def test_gate_help_lists_every_exit_code():
    text = " ".join(moebench_cli("gate", "--help", check=True).stdout.split())
    for code, words in (("0", "pass"), ("1", "a rule failed"), ("2", "bad input"), ("3", "inconclusive")):
        assert f"{code} {words}" in text, (code, text[:400])
    top = " ".join(moebench_cli("--help", check=True).stdout.split())
    assert "3 inconclusive" in text and "moebench" in top


def test_profile_not_found_lists_the_available_ones_and_the_nearest(tmp_path):
    proc = moebench_cli("run", "smoke", "--runner", "engine-bf61", cwd=tmp_path, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    err = proc.stderr
    assert "profile 'engine-bf61' not found (did you mean 'engine-bf16'?)" in err, err
    shipped = sorted(p.stem for p in (REPO / "runners").glob("*.toml"))
    assert f"available runners: {', '.join(shipped)}" in err, err
    proc = moebench_cli("run", "smok", "--runner", "http", cwd=tmp_path, env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and "did you mean 'smoke'?" in proc.stderr and "available suites:" in proc.stderr


def test_unknown_keys_and_values_suggest_the_nearest_known_one(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text('name = "x"\n[[tasks]]\ntask = "gsm8k"\nshotz = 3\n')
    with pytest.raises(ProfileError, match=r"unknown key 'shotz' \(did you mean 'shots'\?\)"):
        load_suite(p, task_schemas())
    p.write_text('name = "x"\n[[tasks]]\ntask = "humaneva"\n')
    with pytest.raises(ProfileError, match=r"got 'humaneva' \(did you mean 'humaneval'\?\)"):
        load_suite(p, task_schemas())
    r = tmp_path / "r.toml"
    r.write_text('kind = "http"\nbase_url = "http://127.0.0.1:1/v1"\nprompt_logprob = "vllm"\n')
    with pytest.raises(ProfileError, match=r"unknown key 'prompt_logprob' \(did you mean 'prompt_logprobs'\?\)"):
        load_runner(r, runner_schemas())
    r.write_text('kind = "enigne"\n')
    with pytest.raises(ProfileError, match=r"got 'enigne' \(did you mean 'engine'\?\)"):
        load_runner(r, runner_schemas())
    r.write_text('kind = "http"\nbase_url = "http://127.0.0.1:1/v1"\napi = "chatt"\n')
    with pytest.raises(ProfileError, match=r"got 'chatt' \(did you mean 'chat'\?\)"):
        load_runner(r, runner_schemas())
    # nothing close: no suggestion, the allowed keys as before
    p.write_text('name = "x"\n[[tasks]]\ntask = "gsm8k"\nzzzzzz = 3\n')
    with pytest.raises(ProfileError) as e:
        load_suite(p, task_schemas())
    assert "did you mean" not in str(e.value) and "allowed keys:" in str(e.value)


def test_gate_rule_typo_suggests_the_rule(tmp_path):
    from moebench.gate import load_rules
    g = tmp_path / "g.toml"
    g.write_text("[gsm8k]\nmax_loses = 2\n")
    with pytest.raises(ProfileError, match=r"unknown key 'max_loses' \(did you mean 'max_losses'\?\)"):
        load_rules(g)


def _serve(args: list[str], cwd: Path):
    import os
    import re
    import subprocess
    import sys
    import time
    proc = subprocess.Popen([sys.executable, "-m", "moebench.cli", "serve", *args, "--port", "0"], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    lines, url = [], None
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        lines.append(line)
        m = re.search(r"serving \S+ \(\w[\w-]*\) on (\S+)", line)
        if m:
            url = m.group(1).rstrip("/")
            break
    return proc, url, lines


def test_shipped_engine_profile_serves_from_another_folder(tmp_path, zoo):
    """`moebench serve --runner engine-bf16` from a folder outside the checkout: the shipped profile's
    model path resolves against the checkout, not the caller's working directory; the model load is said
    before it starts."""
    import re

    import httpx
    proc, url, lines = _serve(["--runner", "engine-bf16"], tmp_path)
    try:
        assert url, "".join(lines)
        assert any(re.match(r"\[\s*[\d.]+s\] loading the model \S*tiny-moe into the engine", ln) for ln in lines), lines
        r = httpx.post(url + "/completions", json={"prompt": "Natalia sold clips to", "max_tokens": 4,
                                                   "temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_relative_paths_resolve_against_the_profile_folder_and_name_every_try(tmp_path, zoo):
    elsewhere = tmp_path / "else" / "where"       # "../models" from here is no folder
    elsewhere.mkdir(parents=True)
    (tmp_path / "profiles").mkdir()
    (tmp_path / "models").symlink_to(zoo)
    prof = tmp_path / "profiles" / "mine.toml"
    prof.write_text('kind = "engine"\nmodel = "../models/tiny-moe"\n')
    import os
    old = os.getcwd()
    os.chdir(elsewhere)
    try:
        r = load_runner(prof, runner_schemas())
        assert Path(r.settings.model) == tmp_path / "profiles" / ".." / "models" / "tiny-moe"
        assert (Path(r.settings.model) / "config.json").is_file()
        # shipped llama-server profile: the GGUF resolves against the checkout
        r = load_runner(REPO / "runners" / "llama-q4_0.toml", runner_schemas())
        assert Path(r.settings.model).resolve() == (REPO / "models" / "zoo" / "tiny-moe-q4_0.gguf").resolve()
        prof.write_text('kind = "engine"\nmodel = "models/zoo/nope"\n')
        with pytest.raises(ProfileError) as e:
            load_runner(prof, runner_schemas())
        msg = str(e.value)
        assert "key 'model' must name an existing checkpoint directory (not found: tried" in msg
        for base in (tmp_path / "profiles", elsewhere):
            assert str(base / "models" / "zoo" / "nope") in msg, msg
        assert "zoo build" not in msg      # its advice would build a second zoo in the wrong place
    finally:
        os.chdir(old)
    # from the checkout the text stays as written (the manifest keeps what the profile says)
    r = load_runner(REPO / "runners" / "engine-bf16.toml", runner_schemas())
    assert r.settings.model == "models/zoo/tiny-moe"


def test_http_profile_names_the_keys_that_add_a_missing_capability(tmp_path):
    """The shipped `http` profile cannot run the smoke suite's KLD: the error says which profile keys
    would add prompt_logprobs and tokenize, before anything starts."""
    proc = moebench_cli("run", "smoke", "--runner", "http", "--limit", "1", "--out", str(tmp_path / "run"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    err = proc.stderr
    assert "task 'kld' needs prompt_logprobs, tokenize" in err
    assert "Profile keys that would add them to" in err and "http.toml" in err
    assert 'prompt_logprobs = "vllm" | "echo" | "sglang"' in err and 'tokenize = "vllm"' in err
    assert 'tokenizer = "PATH"' in err
    assert not (tmp_path / "run").exists()


def test_serve_profile_runs_the_smoke_suite_and_vocabularies_are_checked_before_any_work(tmp_path, zoo):
    """runners/serve.toml against `moebench serve --runner engine-bf16` runs the whole smoke suite (KLD
    included, recorded as a baseline with its vocabulary size). An engine candidate measures KLD against
    it; against a served baseline that recorded no vocabulary size it is refused before any work, with
    no Python None in the message."""
    import json
    proc, url, lines = _serve(["--runner", "engine-bf16"], tmp_path)
    try:
        assert url, "".join(lines)
        text = (REPO / "runners" / "serve.toml").read_text().replace("http://127.0.0.1:8000/v1", url)
        profile = tmp_path / "served.toml"
        profile.write_text(text.replace('tokenizer = "models/zoo/tiny-moe"', f'tokenizer = "{zoo / "tiny-moe"}"'))
        base = tmp_path / "base"
        run = moebench_cli("run", "smoke", "--runner", str(profile), "--limit", "1", "--out", str(base))
        assert run.returncode == 0, run.stderr
        manifest = json.loads((base / "manifest.json").read_text())
        assert manifest["status"] == "complete" and set(manifest["summary"]) == {"gsm8k", "cmmlu", "humaneval", "kld"}
        meta = json.loads(next(base.rglob("meta.json")).read_text())
        assert meta["n_vocab"] == 50257 and meta["runner_kind"] == "http"
        kld_suite = tmp_path / "kld.toml"
        kld_suite.write_text('name = "kld1"\n[[tasks]]\ntask = "kld"\ncontext = 512\nchunks = 1\n'
                             '[probes]\nnvml = false\n')
        # a served baseline whose profile names no tokenizer records no vocabulary size
        bare = tmp_path / "bare.toml"
        bare.write_text("\n".join(ln for ln in text.splitlines() if not ln.startswith("tokenizer")))
        base_bare = tmp_path / "base-bare"
        run = moebench_cli("run", str(kld_suite), "--runner", str(bare), "--as-baseline", "--out", str(base_bare))
        assert run.returncode == 0, run.stderr
        # an engine candidate: measured against the first, refused before any work against the second
        cand = tmp_path / "cand"
        run = moebench_cli("run", str(kld_suite), "--runner", "engine-bf16", "--baseline", str(base_bare),
                           "--out", str(cand))
        assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
        assert f"baseline {base_bare} recorded no vocabulary size" in run.stderr
        assert "50,257 tokens" in run.stderr and "None" not in run.stderr
        assert not cand.exists()
        run = moebench_cli("run", str(kld_suite), "--runner", "engine-bf16", "--baseline", str(base),
                           "--out", str(cand))
        assert run.returncode == 0, run.stderr
        kld = json.loads((cand / "manifest.json").read_text())["summary"]["kld"]["kld"]
        assert kld["n_tokens"] > 0 and kld["mean"] < 1e-3, kld    # the same model on both sides
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_start_up_says_what_it_is_doing_with_elapsed_time(tmp_path, data_dir):
    """The engine's ~15 s start-up: a line once the runner, items and data are checked, one before the model
    loads, one when it is ready, one before the first item; each with seconds since the run began, in order."""
    import re
    suite = tmp_path / "one.toml"
    suite.write_text('name = "one"\n[[tasks]]\ntask = "gsm8k"\nlimit = 1\nmax_tokens = 8\n[probes]\nnvml = false\n')
    proc = moebench_cli("run", str(suite), "--runner", "engine-bf16", "--out", str(tmp_path / "run"), cwd=tmp_path,
                        env={"PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    timed = [(float(m.group(1)), m.group(2)) for m in (re.match(r"\[\s*([\d.]+)s\] (.*)", ln) for ln in lines) if m]
    texts = [t for _, t in timed]
    assert len(timed) == 4, lines
    assert texts[0].startswith("suite one, runner engine-bf16 (engine), run directory")
    assert texts[1].startswith("loading the model ") and "tiny-moe into the engine" in texts[1]
    assert texts[2] == "engine runner ready; warming up"
    assert texts[3] == "starting 1 task(s), 1 item(s): gsm8k"
    assert [t for t, _ in timed] == sorted(t for t, _ in timed) and timed[-1][0] > 0
    first_progress = next(i for i, ln in enumerate(lines) if ln.startswith("gsm8k: "))
    assert first_progress > lines.index(f"[{timed[-1][0]:6.1f}s] {texts[3]}")


@pytest.mark.skipif(not (REPO / "models" / "zoo" / "tiny-moe-bf16.gguf").is_file(), reason="no zoo GGUF")
def test_llama_server_start_up_names_the_server_and_its_log(tmp_path, data_dir):
    suite = tmp_path / "one.toml"
    suite.write_text('name = "one"\n[[tasks]]\ntask = "gsm8k"\nlimit = 1\nmax_tokens = 8\n[probes]\nnvml = false\n')
    run_dir = tmp_path / "run"
    proc = moebench_cli("run", str(suite), "--runner", "llama-bf16", "--out", str(run_dir))
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stderr.splitlines() if "starting llama-server" in ln)
    assert f"its log: {run_dir / 'llama-server.log'}" in line and "tiny-moe-bf16.gguf" in line
    assert (run_dir / "llama-server.log").is_file()
    assert "llama-server runner ready" in proc.stderr


def test_rerun_onto_an_unfinished_out_says_so_on_its_first_line(tmp_path, data_dir):
    """A run that failed (its server was down) left an unfinished run directory; a second `run --out`
    onto it continues it, and says so first, with the label change."""
    import socket
    with socket.socket() as s:          # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    profile = tmp_path / "down.toml"
    profile.write_text(f'kind = "http"\nbase_url = "http://127.0.0.1:{port}/v1"\nretries = 0\n')
    suite = tmp_path / "one.toml"
    suite.write_text('name = "one"\n[[tasks]]\ntask = "gsm8k"\nlimit = 4\nmax_tokens = 8\n[probes]\nnvml = false\n')
    out = tmp_path / "run"
    first = moebench_cli("run", str(suite), "--runner", str(profile), "--out", str(out), "--label", "a")
    assert first.returncode == 1 and (out / "manifest.json").is_file(), first.stderr
    assert "continuing" not in first.stderr
    again = moebench_cli("run", str(suite), "--runner", str(profile), "--out", str(out), "--label", "b")
    head = again.stderr.splitlines()[0]
    assert head.startswith(f"continuing the unfinished run in {out} (status failed, ")
    assert "its label 'a' becomes 'b'" in head, head
    import json
    assert json.loads((out / "manifest.json").read_text())["label"] == "b"      # what the line said


def test_items_progress_is_plain_lines_off_a_terminal_and_startup_lines_can_be_quiet():
    """In a CI log (no terminal) item progress is whole lines at each quarter, never carriage returns;
    the start-up log says nothing when quiet (the API's quiet runs)."""
    import io
    from moebench.progress import Progress, StartupLog
    out = io.StringIO()
    p = Progress("gsm8k", 8, stream=out, every_s=1e9)
    for _ in range(8):
        p.advance()
    p.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert [ln.split(" in ")[0] for ln in lines] == ["gsm8k: 1/8 (12%)", "gsm8k: 2/8 (25%)", "gsm8k: 4/8 (50%)",
                                                     "gsm8k: 6/8 (75%)", "gsm8k: 8/8 (100%)"], lines
    quiet, loud = io.StringIO(), io.StringIO()
    StartupLog(quiet=True, stream=quiet)("loading")
    StartupLog(stream=loud)("loading")
    assert quiet.getvalue() == "" and loud.getvalue().endswith("s] loading\n")
