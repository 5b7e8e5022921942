from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


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
