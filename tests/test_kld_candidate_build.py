"""KLD of a llama.cpp candidate measures the candidate's own build with its own flags.

A "patched build" here is a folder of wrapper scripts around the real llama.cpp tools that log their
argv and exec the real binary: the tests see which binary ran, with which flags, and that no
llama-server started for a KLD-only suite (baseline side too).
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from moebench import api
from moebench.config import ProfileError
from moebench.tools import llama_args

CONTEXT = 256


def _tool(name: str) -> Path:
    from moebench.tools import llamacpp
    try:
        return llamacpp.tool(name)
    except llamacpp.ToolError as e:
        pytest.skip(f"llama.cpp tools not built: {e}")


def _patched_build(folder: Path, log: Path, tools=("llama-server", "llama-perplexity")) -> Path:
    folder.mkdir(parents=True)
    for name in tools:
        real = _tool(name)
        script = folder / name
        script.write_text(f'#!/bin/sh\nprintf "%s\\n" "{name} $*" >> "{log}"\nexec "{real}" "$@"\n')
        script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return folder


def _suite(tmp: Path) -> Path:
    p = tmp / "kld.toml"
    p.write_text(f'name = "kld-build"\n[[tasks]]\ntask = "kld"\ncontext = {CONTEXT}\nchunks = 2\n'
                 '[probes]\nnvml = false\n')
    return p


def _profile(tmp: Path, name: str, model: Path, args: list[str], binary: Path | None) -> Path:
    p = tmp / f"{name}.toml"
    lines = ['kind = "llama-server"', f'model = "{model}"', f"args = {json.dumps(args)}"]
    if binary is not None:
        lines.append(f'binary = "{binary}"')
    p.write_text("\n".join(lines) + "\n")
    return p


def _logged(log: Path) -> list[list[str]]:
    return [line.split() for line in log.read_text().splitlines()] if log.is_file() else []


def test_kld_runs_the_candidates_own_llama_perplexity_with_its_flags(zoo, tmp_path):
    log = tmp_path / "argv.log"
    build = _patched_build(tmp_path / "patched" / "bin", log)
    suite = _suite(tmp_path)
    base_prof = _profile(tmp_path, "base", zoo / "tiny-moe-bf16.gguf", ["-t", "2"], build / "llama-server")
    flags = ["-t", "2", "-fa", "off", "-ctk", "f16", "-ctv", "f16", "-b", "256", "-ub", "128", "-ngl", "0",
             "--metrics", "--cache-reuse", "64", "--temp", "0.7", "-c", "4096"]
    cand_prof = _profile(tmp_path, "cand", zoo / "tiny-moe-q8_0.gguf", flags, build / "llama-server")
    base, code = api.run(api.RunOptions(suite=str(suite), runner=str(base_prof), out=str(tmp_path / "base"),
                                        as_baseline=True, quiet=True))
    assert code == 0
    cand, code = api.run(api.RunOptions(suite=str(suite), runner=str(cand_prof), out=str(tmp_path / "cand"),
                                        baseline=str(base), quiet=True))
    assert code == 0
    runs = _logged(log)
    # No llama-server process was started on either side: the server binary saw only --version.
    assert not [a for a in runs if a[0] == "llama-server" and "--version" not in a], runs
    ppl = [a for a in runs if a[0] == "llama-perplexity" and ("--kl-divergence-base" in a)]
    assert len(ppl) == 2, runs                     # the baseline's and the candidate's measurement
    cand_argv = next(a for a in ppl if "--kl-divergence" in a)
    joined = " ".join(cand_argv)
    for want in ("-fa off", "-ctk f16", "-ctv f16", "-b 256", "-ub 128", "-ngl 0", "-t 2",
                 f"-m {zoo / 'tiny-moe-q8_0.gguf'}"):
        assert want in joined, (want, joined)
    for gone in ("--metrics", "--cache-reuse", "--temp", "4096"):
        assert gone not in joined, (gone, joined)
    assert joined.count("-b ") == 1                # the profile's batch replaced the default one

    manifest = json.loads((cand / "manifest.json").read_text())
    tool = manifest["summary"]["kld"]["llama_perplexity"]
    assert tool["binary"] == str(build / "llama-perplexity")
    assert tool["version"].startswith("version:") and "beside the profile's binary" in tool["source"]
    assert tool["args"] == ["-t", "2", "-fa", "off", "-ctk", "f16", "-ctv", "f16", "-b", "256", "-ub", "128",
                            "-ngl", "0"]
    assert tool["dropped_args"] == ["--metrics", "--cache-reuse", "64", "--temp", "0.7", "-c", "4096"]
    assert [c[0] for c in tool["commands"]] == [str(build / "llama-perplexity")]
    assert tool["commands"][0][1:] == cand_argv[1:]     # the command recorded is the one that ran
    assert manifest["build"]["server_started"] is False
    base_manifest = json.loads((base / "manifest.json").read_text())
    assert base_manifest["summary"]["kld"]["llama_perplexity"]["binary"] == str(build / "llama-perplexity")

    out, cmp = api.compare(str(base), str(cand), out=str(tmp_path / "cmp"))
    assert cmp["kld"]["method"] == "llama-perplexity" and cmp["kld"]["mean"] > 0
    assert cmp["kld"]["llama_perplexity"]["binary"] == str(build / "llama-perplexity")
    html = (out / "report.html").read_text()
    assert str(build / "llama-perplexity") in html and "-ctk f16" in html and tool["version"] in html


def test_unknown_flags_are_refused_before_any_work(zoo, tmp_path):
    log = tmp_path / "argv.log"
    build = _patched_build(tmp_path / "bin", log)
    prof = _profile(tmp_path, "cand", zoo / "tiny-moe-q8_0.gguf",
                    ["-t", "2", "--expert-cache-policy", "lru", "-ngl", "0", "--made-up"], build / "llama-server")
    with pytest.raises(ProfileError) as e:
        api.run(api.RunOptions(suite=str(_suite(tmp_path)), runner=str(prof), out=str(tmp_path / "r"), quiet=True))
    msg = str(e.value)
    assert "--expert-cache-policy, --made-up" in msg and "cand.toml" in msg and "'args'" in msg
    assert not (tmp_path / "r" / "items.jsonl").exists()
    assert all(a[1:] == ["--help"] for a in _logged(log)), _logged(log)   # only its --help was read


def test_a_named_build_without_llama_perplexity_is_refused(zoo, tmp_path):
    build = _patched_build(tmp_path / "bin", tmp_path / "argv.log", tools=("llama-server",))
    prof = _profile(tmp_path, "cand", zoo / "tiny-moe-q8_0.gguf", [], build / "llama-server")
    with pytest.raises(ProfileError, match="no llama-perplexity"):
        api.run(api.RunOptions(suite=str(_suite(tmp_path)), runner=str(prof), out=str(tmp_path / "r"), quiet=True))


def test_no_binary_named_uses_the_built_tools(zoo, tmp_path):
    from moebench.runners.llama_server import LlamaServerRunner
    runner = LlamaServerRunner({"model": str(zoo / "tiny-moe-q8_0.gguf"), "args": ["-t", "2"]})
    plan = runner.perplexity_plan()
    assert plan.binary == str(_tool("llama-perplexity")) and "built llama.cpp tools" in plan.source
    assert plan.args == ["-t", "2"]


def test_help_parsing_on_the_real_binary():
    flags = llama_args.help_flags(_tool("llama-perplexity"))
    for name, takes in (("-ngl", True), ("--n-gpu-layers", True), ("-ts", True), ("-ot", True),
                        ("--n-cpu-moe", True), ("-ctk", True), ("-fa", True), ("-kvu", False),
                        ("--kl-divergence", False), ("-nkvo", False), ("--no-host", False)):
        assert name in flags, name
        assert flags.takes_value[name] is takes, name
    out = llama_args.sort_args(["-ngl", "99", "--n-cpu-moe=20", "-ot", r"\.ffn_.*_exps\.=CPU", "--jinja",
                                "--port", "8080", "--spec-draft-n-max", "8", "-md", "d.gguf", "--bogus"], flags)
    assert out.passed == ["-ngl", "99", "--n-cpu-moe=20", "-ot", r"\.ffn_.*_exps\.=CPU"]
    assert out.dropped == ["--jinja", "--port", "8080", "--spec-draft-n-max", "8", "-md", "d.gguf"]
    assert out.refused == ["--bogus"]
    assert os.path.basename(str(_tool("llama-perplexity"))) == "llama-perplexity"
