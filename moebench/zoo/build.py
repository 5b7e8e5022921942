"""Build the tiny MoE zoo: one set of trained weights, in Hugging Face and GGUF form.

    models/zoo/
      tiny-moe/             HF checkpoint (Qwen3MoeForCausalLM, GPT-2 tokenizer), loads with transformers
      tiny-moe-bf16.gguf    convert_hf_to_gguf.py --outtype bf16 of tiny-moe/
      tiny-moe-q8_0.gguf    llama-quantize --pure ... Q8_0
      tiny-moe-q4_0.gguf    llama-quantize --pure ... Q4_0
      zoo.json              hashes, config, training summary, tensor types

The weights come from `moebench/zoo/weights/` (trained once by train.py and committed), so a build is
a copy, a conversion and two quantizations. Each output is reused when zoo.json records it with the
same hash, built from inputs with the same hashes.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, TypedDict

from moebench import jsonout
from moebench.gguf_header import read_gguf
from moebench.json_types import JsonObject, JsonValue
from moebench.zoo.checked import ZooFileError
from moebench.zoo.train import TRAINING_FILE, WEIGHTS_FILE, TrainingRecord

SCHEMA_VERSION = 1
HF_DIRNAME = "tiny-moe"
GGUF_NAMES = {"bf16": "tiny-moe-bf16.gguf", "q8_0": "tiny-moe-q8_0.gguf", "q4_0": "tiny-moe-q4_0.gguf"}
QUANT_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0"}
WEIGHTS_DIR = Path(__file__).parent / "weights"


class ZooBuildError(RuntimeError):
    pass


def _sha256(path: Path) -> str:
    from moebench.datasets import sha256_file

    return sha256_file(Path(path))


def _digest(hashes: dict[str, str]) -> str:
    """One hash over several files' hashes (the identity of a set of inputs)."""
    import hashlib

    return hashlib.sha256(jsonout.dumps(hashes, sort_keys=True).encode()).hexdigest()


def _write_if_changed(path: Path, data: bytes) -> None:
    if path.is_file() and path.read_bytes() == data:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _run(cmd: list[str], what: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", env=env)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        tail = "\n".join(log.splitlines()[-30:])
        raise ZooBuildError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    return log


def read_weights(weights_dir: Path = WEIGHTS_DIR) -> TrainingRecord:
    """The committed training record (training.json); checks the weights file beside it exists."""
    weights_dir = Path(weights_dir)
    doc_path = weights_dir / TRAINING_FILE
    if not doc_path.is_file() or not (weights_dir / WEIGHTS_FILE).is_file():
        raise ZooBuildError(f"{weights_dir}: expected {WEIGHTS_FILE} and {TRAINING_FILE} (trained weights); "
                            f"run `python -m moebench.zoo.train --out {weights_dir}` or build_zoo(retrain=True)")
    try:
        doc = json.loads(doc_path.read_text())
    except ValueError as e:
        raise ZooBuildError(f"{doc_path}: not valid JSON ({e})") from None
    try:
        return TrainingRecord.from_json(doc, str(doc_path))
    except ZooFileError as e:
        raise ZooBuildError(str(e)) from None


def write_hf_dir(hf_dir: Path, weights_dir: Path) -> dict[str, str]:
    """Fill the HF checkpoint folder (no llama.cpp needed); returns {file name: sha256}."""
    from moebench.zoo.tokenizer import write_committed_tokenizer

    hf_dir.mkdir(parents=True, exist_ok=True)
    hf_config = read_weights(weights_dir).hf_config
    _write_if_changed(hf_dir / "config.json", (jsonout.dumps(hf_config, indent=2) + "\n").encode())
    gen = {"bos_token_id": hf_config["bos_token_id"], "eos_token_id": hf_config["eos_token_id"], "do_sample": False}
    _write_if_changed(hf_dir / "generation_config.json", (jsonout.dumps(gen, indent=2) + "\n").encode())
    src_w, dst_w = weights_dir / WEIGHTS_FILE, hf_dir / WEIGHTS_FILE
    if not dst_w.is_file() or _sha256(dst_w) != _sha256(src_w):
        shutil.copyfile(src_w, dst_w.with_name(WEIGHTS_FILE + ".tmp"))
        os.replace(dst_w.with_name(WEIGHTS_FILE + ".tmp"), dst_w)
    with tempfile.TemporaryDirectory() as tmp:
        for p in write_committed_tokenizer(Path(tmp)):
            _write_if_changed(hf_dir / p.name, p.read_bytes())
    names = ["config.json", "generation_config.json", WEIGHTS_FILE,
             "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    return {n: _sha256(hf_dir / n) for n in names}


def gguf_tensor_types(path: Path) -> dict[str, str]:
    """{tensor name: ggml type name} of a GGUF."""
    return {t.name: t.type_name for t in read_gguf(path).tensors}


def check_quant_types(path: Path, want: str) -> None:
    """Every matrix but the router is `want`; vectors stay F32 (llama-quantize never quantizes them)."""
    wrong = {t.name: t.type_name for t in read_gguf(path).tensors
             if len(t.shape) >= 2 and "ffn_gate_inp" not in t.name and t.type_name != want}
    if wrong:
        raise ZooBuildError(f"{path}: tensors not {want}: {wrong}")


def convert_bf16(hf_dir: Path, out: Path, src: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(src / "gguf-py") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    tmp = out.with_name(out.name + ".tmp")
    _run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf_dir), "--outfile", str(tmp),
          "--outtype", "bf16"], "convert_hf_to_gguf.py", env)
    os.replace(tmp, out)


def quantize(binary: Path, src_gguf: Path, out: Path, qtype: str) -> str:
    """llama-quantize --pure: every matrix to qtype; a shape fallback is an error, not a silent type."""
    tmp = out.with_name(out.name + ".tmp")
    log = _run([str(binary), "--pure", str(src_gguf), str(tmp), qtype], f"llama-quantize {qtype}")
    if "falling back" in log or "required fallback" in log:
        lines = [ln for ln in log.splitlines() if "fall" in ln]
        raise ZooBuildError(f"llama-quantize {qtype} used fallback types for {src_gguf}:\n" + "\n".join(lines))
    os.replace(tmp, out)
    return log


@dataclass(frozen=True)
class GgufEntry:
    """One GGUF of the zoo as zoo.json's `gguf` lists it."""

    file: str
    sha256: str
    built_from: str                 # the sha256 of what it was made from (the HF files' digest, or the bf16 GGUF)
    bytes: int
    metadata: dict[str, str | int | bool]       # _gguf_metadata's keys
    tensor_types: list[str]

    @classmethod
    def of(cls, value: JsonValue) -> "GgufEntry | None":
        """An entry of an earlier zoo.json; None where it is not one of this shape (that GGUF is built again)."""
        names = {f.name for f in fields(cls)}
        if not isinstance(value, dict) or set(value) != names:
            return None
        return cls(**value)

    def to_json(self) -> JsonObject:
        return asdict(self)


class LlamaCppProvenance(TypedDict):
    """How the GGUFs were made: the llama.cpp build, the converter and the quantizer as run."""

    build: str
    converter: str
    quantize: str


@dataclass(frozen=True)
class ZooDoc:
    """zoo.json: the HF files' hashes, the GGUFs, the model config and training record, llama.cpp's part."""

    hf_files: dict[str, str]
    gguf: dict[str, GgufEntry]
    training: TrainingRecord
    llama_cpp: LlamaCppProvenance
    schema: int = SCHEMA_VERSION
    hf_dir: str = HF_DIRNAME

    def to_json(self) -> JsonObject:
        """zoo.json's content: the training record's config.json under "config", the rest under "training"."""
        training = self.training.to_json()
        config = training.pop("hf_config")
        return {"schema": self.schema, "hf_dir": self.hf_dir, "hf_files": self.hf_files,
                "gguf": {kind: e.to_json() for kind, e in self.gguf.items()}, "config": config,
                "training": training, "llama_cpp": dict(self.llama_cpp)}


def _gguf_metadata(path: Path) -> dict[str, str | int | bool]:
    meta = read_gguf(path).metadata
    keep = ("general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token",
            "qwen3moe.expert_count", "qwen3moe.expert_used_count", "qwen3moe.block_count",
            "qwen3moe.embedding_length", "qwen3moe.expert_feed_forward_length")
    return {k: meta[k] for k in keep if k in meta}


def build_zoo(out_dir: str | os.PathLike[str] = "models/zoo", retrain: bool = False,
              log: Callable[[str], None] = lambda m: print(m, file=sys.stderr), gguf: bool = True) -> JsonObject:
    """Build (or reuse) the zoo in out_dir; returns zoo.json's content plus absolute paths under "paths"
    (the JSON `moebench zoo build` answers with).

    With `gguf=False` only the HF checkpoint is written (what the engine reads): no llama.cpp source or
    build is touched, and GGUFs an earlier build made from the same weights stay recorded.
    """
    from moebench.tools import llamacpp

    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()

    weights_dir = WEIGHTS_DIR
    if retrain:
        from moebench.zoo.train import TrainConfig, save_weights, train
        from moebench.zoo.tokenizer import write_committed_tokenizer

        weights_dir = out / "retrained-weights"
        with tempfile.TemporaryDirectory() as tok_dir:
            write_committed_tokenizer(Path(tok_dir))
            cfg = TrainConfig()
            model, summary = train(Path(tok_dir), cfg, log=log)
        save_weights(model, summary, weights_dir, cfg.shape)
    training = read_weights(weights_dir)

    old_path = out / "zoo.json"
    try:
        old = json.loads(old_path.read_text())
    except (OSError, ValueError):
        old = {}
    old_gguf = _entries(old.get("gguf")) if old.get("schema") == SCHEMA_VERSION else {}

    hf_dir = out / HF_DIRNAME
    hf_hashes = write_hf_dir(hf_dir, weights_dir)
    inputs = {"bf16": _digest(hf_hashes)}
    if not gguf:
        return _finish_hf_only(out, hf_dir, hf_hashes, inputs, old_gguf, training, started, log)
    src = Path(llamacpp.source_dir())
    built: dict[str, GgufEntry] = {}
    for kind, name in GGUF_NAMES.items():
        path = out / name
        if kind != "bf16":
            inputs[kind] = built["bf16"].sha256
        prev = old_gguf.get(kind)
        if prev is not None and path.is_file() and prev.built_from == inputs[kind] and prev.sha256 == _sha256(path):
            built[kind] = prev
            continue
        t0 = time.monotonic()
        if kind == "bf16":
            convert_bf16(hf_dir, path, src)
        else:
            check = QUANT_TYPES[kind]
            quantize(llamacpp.tool("llama-quantize", build=True), out / GGUF_NAMES["bf16"], path, check)
            check_quant_types(path, check)
        log(f"zoo: built {name} in {time.monotonic() - t0:.1f}s")
        built[kind] = GgufEntry(file=name, sha256=_sha256(path), built_from=inputs[kind],
                                bytes=path.stat().st_size, metadata=_gguf_metadata(path),
                                tensor_types=sorted(set(gguf_tensor_types(path).values())))
    meta = built["bf16"].metadata
    if meta.get("tokenizer.ggml.pre") != "gpt-2" or meta.get("general.architecture") != "qwen3moe":
        raise ZooBuildError(f"{out / GGUF_NAMES['bf16']}: expected qwen3moe with pre-tokenizer 'gpt-2', got {meta}")

    doc = _zoo_doc(hf_hashes, built, training).to_json()
    _write_if_changed(old_path, (jsonout.dumps(doc, indent=2) + "\n").encode())
    log(f"zoo: {out} ready in {time.monotonic() - started:.1f}s")
    return {**doc, "paths": {"out_dir": str(out), "hf_dir": str(hf_dir), "zoo_json": str(old_path),
                             **{k: str(out / n) for k, n in GGUF_NAMES.items()}}}


def _entries(value: JsonValue) -> dict[str, GgufEntry]:
    """An earlier zoo.json's `gguf` entries that have this build's shape."""
    if not isinstance(value, dict):
        return {}
    entries = {kind: GgufEntry.of(v) for kind, v in value.items()}
    return {kind: e for kind, e in entries.items() if e is not None}


def _zoo_doc(hf_hashes: dict[str, str], gguf: dict[str, GgufEntry], training: TrainingRecord) -> ZooDoc:
    from moebench.tools import llamacpp

    return ZooDoc(hf_files=hf_hashes, gguf=gguf, training=training, llama_cpp=LlamaCppProvenance(
        build=llamacpp.BUILD_COMMIT, converter="convert_hf_to_gguf.py --outtype bf16",
        quantize="llama-quantize --pure"))


def _finish_hf_only(out: Path, hf_dir: Path, hf_hashes: dict[str, str], inputs: dict[str, str],
                    old_gguf: dict[str, GgufEntry], training: TrainingRecord, started: float, log) -> JsonObject:
    """zoo.json for an HF-only build: GGUFs on disk that were built from these weights stay listed."""
    kept: dict[str, GgufEntry] = {}
    for kind, name in GGUF_NAMES.items():
        prev = old_gguf.get(kind)
        want = inputs["bf16"] if kind == "bf16" else (kept["bf16"].sha256 if "bf16" in kept else None)
        if want and prev is not None and prev.built_from == want and (out / name).is_file() \
                and prev.sha256 == _sha256(out / name):
            kept[kind] = prev
    doc = _zoo_doc(hf_hashes, kept, training).to_json()
    _write_if_changed(out / "zoo.json", (jsonout.dumps(doc, indent=2) + "\n").encode())
    log(f"zoo: {hf_dir} ready in {time.monotonic() - started:.1f}s (HF checkpoint only; "
        f"{'GGUFs current' if len(kept) == len(GGUF_NAMES) else 'GGUFs are built by `moebench zoo build`'})")
    paths = {"out_dir": str(out), "hf_dir": str(hf_dir), "zoo_json": str(out / "zoo.json"),
             **{k: str(out / GGUF_NAMES[k]) for k in kept}}
    return {**doc, "paths": paths}


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Build the tiny MoE zoo (HF + GGUF).")
    ap.add_argument("--out", default="models/zoo")
    ap.add_argument("--retrain", action="store_true")
    ap.add_argument("--hf-only", action="store_true", help="only the HF checkpoint (no llama.cpp)")
    args = ap.parse_args(argv)
    res = build_zoo(args.out, retrain=args.retrain, gguf=not args.hf_only)
    print(res["paths"]["out_dir"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
