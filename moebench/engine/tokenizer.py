"""Text <-> token ids from a checkpoint's `tokenizer.json` (the `tokenizers` library; no transformers).

BOS/EOS come from `tokenizer_config.json` (token strings or {"content": ...} objects) where present,
else from the model config.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class TokenizerError(ValueError):
    pass


class Tokenizer:
    def __init__(self, tok: _HFTokenizer, bos_token_id: int | None, eos_token_ids: tuple[int, ...],
                 add_bos: bool, source: str):
        self._tok = tok
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos = add_bos          # tokenizer_config's add_bos_token: prepend BOS when add_special
        self.source = source

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, path: str | Path, bos_token_id: int | None = None,
                 eos_token_ids: tuple[int, ...] = ()) -> "Tokenizer":
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise TokenizerError(f"{path}: no tokenizer.json (the engine reads tokenizers' JSON format)")
        try:
            tok = _HFTokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise TokenizerError(f"{file}: cannot be read by the tokenizers library ({e})") from e
        add_bos = False
        tc_file = path / "tokenizer_config.json"
        if tc_file.is_file():
            try:
                tc = json.loads(tc_file.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise TokenizerError(f"{tc_file}: not valid JSON ({e})") from e
            add_bos = bool(tc.get("add_bos_token", False))
            bos = _token_id(tok, tc.get("bos_token"))
            eos = _token_id(tok, tc.get("eos_token"))
            if bos is not None:
                bos_token_id = bos
            if eos is not None and eos not in eos_token_ids:
                eos_token_ids = (eos,) + tuple(eos_token_ids)
        return cls(tok, bos_token_id, tuple(eos_token_ids), add_bos, str(file))

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        """`add_special`: apply the tokenizer's post-processor (and BOS where the config asks for it)."""
        ids = self._tok.encode(text, add_special_tokens=add_special).ids
        if add_special and self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


def _token_id(tok: _HFTokenizer, entry) -> int | None:
    if isinstance(entry, dict):
        entry = entry.get("content")
    if isinstance(entry, str):
        return tok.token_to_id(entry)
    return None
