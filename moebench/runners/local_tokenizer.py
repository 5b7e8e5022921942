"""A tokenizer read from local files, for servers whose own /tokenize is missing or unusable.

`tokenizer = PATH` in an http runner profile names one of:
- a Hugging Face tokenizer folder (tokenizer.json, plus tokenizer_config.json for BOS handling);
- a `tokenizer.json` file;
- a GGUF file: its byte-level BPE vocabulary (tokenizer.ggml.tokens/merges, llama.cpp's "gpt2" model).

Besides text <-> ids it maps the token strings some servers return (legacy `echo` log-probs are keyed
by decoded token text) back to ids, refusing strings that several ids decode to.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moebench.config import ProfileError


class LocalTokenizer:
    def __init__(self, tok: Any, source: str, add_bos: bool = False, bos_token_id: int | None = None):
        self._tok = tok
        self.source = source
        self.add_bos = add_bos
        self.bos_token_id = bos_token_id
        self._by_piece: dict[str, int | None] | None = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def piece(self, token_id: int) -> str:
        return self._tok.decode([int(token_id)], skip_special_tokens=False)

    def id_of_piece(self, piece: str) -> int:
        """The id whose decoded text is `piece`; KeyError when none or several ids decode to it."""
        if self._by_piece is None:
            pieces = self._tok.decode_batch([[i] for i in range(self.vocab_size)], skip_special_tokens=False)
            by: dict[str, int | None] = {}
            for i, p in enumerate(pieces):
                by[p] = None if p in by else i          # None: ambiguous (e.g. partial UTF-8 bytes)
            self._by_piece = by
        tid = self._by_piece.get(piece, -1)
        if tid is None:
            raise KeyError(f"{piece!r} is the decoded text of several token ids in {self.source}")
        if tid < 0:
            raise KeyError(f"{piece!r} is not the decoded text of any token in {self.source}")
        return tid


def load_tokenizer(spec: str, where: str) -> LocalTokenizer:
    """Read the tokenizer `spec` names; a ProfileError naming `where` and key 'tokenizer' if unusable."""
    from tokenizers import Tokenizer

    path = Path(spec).expanduser()
    key = f"{where}: key 'tokenizer'"
    if path.is_dir():
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ProfileError(f"{key}: {path} is a folder without tokenizer.json (expected a Hugging Face "
                               "tokenizer folder, a tokenizer.json or a GGUF file)")
        tok = _read_json_tokenizer(Tokenizer, file, key)
        add_bos, bos = False, None
        config = path / "tokenizer_config.json"
        if config.is_file():
            try:
                tc = json.loads(config.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise ProfileError(f"{key}: {config} is not valid JSON ({e})") from None
            add_bos = bool(tc.get("add_bos_token", False))
            entry = tc.get("bos_token")
            entry = entry.get("content") if isinstance(entry, dict) else entry
            bos = tok.token_to_id(entry) if isinstance(entry, str) else None
        return LocalTokenizer(tok, str(file), add_bos and bos is not None, bos)
    if not path.is_file():
        raise ProfileError(f"{key}: {path} not found (expected a Hugging Face tokenizer folder, a "
                           "tokenizer.json or a GGUF file)")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        from moebench.zoo.tokenizer import ZooTokenizerError, build_tokenizer, read_gguf_vocab
        try:
            vocab = read_gguf_vocab(path)
            tok = build_tokenizer(vocab)
        except ZooTokenizerError as e:
            raise ProfileError(f"{key}: {e}") from None
        return LocalTokenizer(tok, str(path), False, vocab.bos_id)
    return LocalTokenizer(_read_json_tokenizer(Tokenizer, path, key), str(path))


def _read_json_tokenizer(cls: Any, file: Path, key: str) -> Any:
    try:
        return cls.from_file(str(file))
    except Exception as e:          # tokenizers raises a bare Exception on malformed files
        raise ProfileError(f"{key}: {file} cannot be read as a tokenizer.json ({e})") from None
