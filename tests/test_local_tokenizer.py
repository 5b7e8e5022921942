"""The http runner's local tokenizer: a Hugging Face folder, a tokenizer.json, or a GGUF vocabulary,
all tokenizing the zoo model's text alike; bad paths are profile errors naming the key."""
from __future__ import annotations

import asyncio

import pytest

from moebench.config import ProfileError
from moebench.runners.base import Capability
from moebench.runners.http import HttpRunner
from moebench.runners.local_tokenizer import load_tokenizer

TEXT = "Prince Andrew looked at the sky; 17 + 25 = 42. «Ça va?» 東京"


def test_folder_json_and_gguf_agree(zoo):
    folder = load_tokenizer(str(zoo / "tiny-moe"), "p.toml")
    file = load_tokenizer(str(zoo / "tiny-moe" / "tokenizer.json"), "p.toml")
    gguf = load_tokenizer(str(zoo / "tiny-moe-bf16.gguf"), "p.toml")
    ids = folder.encode(TEXT)
    assert len(ids) > 10 and file.encode(TEXT) == ids and gguf.encode(TEXT) == ids
    assert folder.vocab_size == gguf.vocab_size == 50257
    assert folder.decode(ids) == TEXT == gguf.decode(ids)
    assert folder.id_of_piece(" sky") == ids[ids.index(folder.encode(" sky")[0])]


def test_http_runner_counts_tokens_with_it(zoo):
    runner = HttpRunner({"base_url": "http://127.0.0.1:9/v1", "tokenizer": str(zoo / "tiny-moe")}, "p.toml")
    assert Capability.TOKENIZE in runner.capabilities and runner.vocab_size() == 50257
    assert asyncio.run(runner.tokenize(TEXT)) == load_tokenizer(str(zoo / "tiny-moe"), "x").encode(TEXT)


@pytest.mark.parametrize("make, words", [
    (lambda d: d / "missing", "not found"),
    (lambda d: d, "folder without tokenizer.json"),
    (lambda d: (d / "bad.json").write_text("{]") and d / "bad.json", "cannot be read as a tokenizer.json"),
])
def test_bad_tokenizer_paths_are_profile_errors(tmp_path, make, words):
    with pytest.raises(ProfileError, match=f"p.toml: key 'tokenizer'.*{words}"):
        HttpRunner({"base_url": "http://127.0.0.1:9/v1", "tokenizer": str(make(tmp_path))}, "p.toml")
