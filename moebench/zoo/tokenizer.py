"""The zoo's tokenizer: GPT-2's byte-level BPE, rebuilt offline from llama.cpp's own vocabulary file.

No tokenizer can be downloaded here, but the llama.cpp source tree ships `models/ggml-vocab-gpt-2.gguf`
(50,257 tokens, 50,000 merges). We read its metadata directly and rebuild the Hugging Face
`tokenizers` pipeline GPT-2 uses (ByteLevel pre-tokenizer with the GPT-2 split regex, BPE, ByteLevel
decoder). Rebuilt exactly, it hashes like openai-community/gpt2 in convert_hf_to_gguf's pre-tokenizer
check (tokenizer.ggml.pre = "gpt-2"), so the GGUF and the HF checkpoint tokenize alike.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moebench import jsonout
from moebench.gguf_header import GgufFormatError, read_gguf

VOCAB_NAME = "gpt-2"
COMMITTED_TOKENIZER = Path(__file__).parent / "weights" / "tokenizer.json.gz"
GPT2_SPECIAL = "<|endoftext|>"     # GPT-2's only special token: BOS, EOS and UNK
# gguf-py token types (gguf.TokenType): 1 normal, 3 control.
_TOKEN_TYPE_NORMAL = 1
_TOKEN_TYPE_CONTROL = 3


class ZooTokenizerError(RuntimeError):
    pass


def llamacpp_source_dir() -> Path:
    """The llama.cpp source folder (convert_hf_to_gguf.py, gguf-py/, models/)."""
    from moebench.tools import llamacpp  # lazy: the tool module shells out and is heavier

    return Path(llamacpp.source_dir())


@dataclass(frozen=True)
class GgufVocab:
    path: Path
    model: str            # tokenizer.ggml.model, "gpt2" for byte-level BPE
    pre: str              # tokenizer.ggml.pre, the pre-tokenizer name llama.cpp dispatches on
    tokens: list[str]
    token_types: list[int]
    merges: list[str]     # "left right", in rank order
    bos_id: int
    eos_id: int


def read_gguf_vocab(path: Path) -> GgufVocab:
    """Read the tokenizer of a GGUF (e.g. a ggml-vocab-*.gguf, which holds only tokenizer metadata)."""
    path = Path(path)
    if not path.is_file():
        raise ZooTokenizerError(f"{path}: vocabulary GGUF not found")
    try:
        meta = read_gguf(path).metadata
    except GgufFormatError as e:
        raise ZooTokenizerError(str(e)) from None

    def get(key: str):
        if key not in meta:
            raise ZooTokenizerError(f"{path}: key {key!r} missing")
        return meta[key]

    vocab = GgufVocab(
        path=path, model=get("tokenizer.ggml.model"), pre=get("tokenizer.ggml.pre"),
        tokens=get("tokenizer.ggml.tokens"), token_types=[int(t) for t in get("tokenizer.ggml.token_type")],
        merges=get("tokenizer.ggml.merges"), bos_id=int(get("tokenizer.ggml.bos_token_id")),
        eos_id=int(get("tokenizer.ggml.eos_token_id")),
    )
    if vocab.model != "gpt2":
        raise ZooTokenizerError(f"{path}: tokenizer.ggml.model is {vocab.model!r}; expected 'gpt2' (byte-level BPE)")
    if len(vocab.tokens) != len(vocab.token_types):
        raise ZooTokenizerError(f"{path}: {len(vocab.tokens)} tokens but {len(vocab.token_types)} token types")
    odd = sorted({t for t in vocab.token_types if t not in (_TOKEN_TYPE_NORMAL, _TOKEN_TYPE_CONTROL)})
    if odd:
        raise ZooTokenizerError(f"{path}: token types {odd} not handled (expected only 1 normal, 3 control)")
    return vocab


def build_tokenizer(vocab: GgufVocab):
    """A `tokenizers.Tokenizer` equal to GPT-2's tokenizer.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    bpe_vocab = {tok: i for i, (tok, t) in enumerate(zip(vocab.tokens, vocab.token_types)) if t == _TOKEN_TYPE_NORMAL}
    merges = []
    for n, m in enumerate(vocab.merges):
        left, sep, right = m.partition(" ")
        if not sep or not left or not right:
            raise ZooTokenizerError(f"{vocab.path}: merge {n} {m!r} is not 'left right'")
        merges.append((left, right))
    tok = Tokenizer(models.BPE(vocab=bpe_vocab, merges=merges, dropout=None, unk_token=None,
                               continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                               byte_fallback=False, ignore_merges=False))
    # GPT-2: no normalizer; ByteLevel with the GPT-2 regex and no prefix space.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [AddedToken(t, special=True, normalized=True) for t, ty in zip(vocab.tokens, vocab.token_types)
                if ty == _TOKEN_TYPE_CONTROL]
    tok.add_special_tokens(specials)
    for t in specials:
        want = vocab.tokens.index(t.content)
        if tok.token_to_id(t.content) != want:
            raise ZooTokenizerError(f"{vocab.path}: special token {t.content!r} got id "
                                    f"{tok.token_to_id(t.content)}, expected {want}")
    return tok


def write_hf_tokenizer(out_dir: Path, src: Path | None = None, vocab_name: str = VOCAB_NAME) -> list[Path]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into out_dir, rebuilt
    from llama.cpp's vocabulary file (the source is downloaded if `src` is not given)."""
    src = Path(src) if src else llamacpp_source_dir()
    vocab = read_gguf_vocab(src / "models" / f"ggml-vocab-{vocab_name}.gguf")
    tok = build_tokenizer(vocab)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    return [out_dir / "tokenizer.json", *_write_configs(out_dir, vocab.tokens[vocab.bos_id], vocab.tokens[vocab.eos_id])]


def write_committed_tokenizer(out_dir: Path) -> list[Path]:
    """The same three files from the committed copy of tokenizer.json (weights/tokenizer.json.gz), so
    the zoo's HF checkpoint needs no llama.cpp source; tests/test_zoo.py checks the copy is exactly
    what `write_hf_tokenizer` rebuilds."""
    import gzip

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_bytes(gzip.decompress(COMMITTED_TOKENIZER.read_bytes()))
    return [out_dir / "tokenizer.json", *_write_configs(out_dir, GPT2_SPECIAL, GPT2_SPECIAL)]


def _write_configs(out_dir: Path, bos: str, eos: str) -> list[Path]:
    paths = [out_dir / "tokenizer_config.json", out_dir / "special_tokens_map.json"]
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": bos, "eos_token": eos, "unk_token": eos,
        # GPT-2 adds no BOS; saying so explicitly makes convert_hf_to_gguf write
        # tokenizer.ggml.add_bos_token = false, so llama.cpp adds none either.
        "add_bos_token": False, "add_eos_token": False, "add_prefix_space": False,
        "model_max_length": 1024, "clean_up_tokenization_spaces": False,
    }
    paths[0].write_text(jsonout.dumps(config, indent=2) + "\n")
    paths[1].write_text(jsonout.dumps({"bos_token": bos, "eos_token": eos, "unk_token": eos}, indent=2) + "\n")
    return paths
