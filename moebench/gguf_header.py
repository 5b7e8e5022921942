"""Read a GGUF file's header: metadata and tensor table, never the tensor data.

The one GGUF reader of moebench (the zoo's checks, the zoo tokenizer, the llama-server runner's model
identity). It maps the file instead of reading it, so a 100 GB model costs only the header's pages.
gguf-py's GGUFReader builds a numpy view per array element and took 10-30 s on a 50k-token
vocabulary on a 2-core machine; this takes a fraction of a second, and with `arrays="lengths"` (what
a run's identity needs) it skips the arrays' contents altogether.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

# Metadata value types (GGUF spec): scalar struct formats; 8 = string, 9 = array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# ggml_type ids (ggml.h) of a tensor, for the types the zoo writes or may meet.
GGML_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
                   10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 20: "IQ4_NL",
                   30: "BF16", 34: "TQ1_0", 35: "TQ2_0"}
# llama_ftype ids (llama.h) of `general.file_type`, the whole file's quantization as llama-quantize names it.
FILE_TYPE_NAMES = {0: "ALL_F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
                   15: "Q4_K_M", 17: "Q5_K_M", 18: "Q6_K", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4_MOE"}


class GgufFormatError(ValueError):
    """Not a GGUF file, an unsupported version, or a truncated or corrupt header (names the file)."""


@dataclass(frozen=True)
class GgufTensorInfo:
    name: str
    shape: tuple[int, ...]   # ggml order: ne0 (the row length, a matrix's input dimension) first
    type_name: str           # GGML_TYPE_NAMES, or "type<N>" for an id not listed

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


# A metadata value as GGUF stores it: a number, a bool, a string, or an array of them (arrays of arrays
# nest); with arrays="lengths" an array is the string "<array of N>".
GgufValue = Union[int, float, bool, str, "list[GgufValue]"]


@dataclass(frozen=True)
class GgufFile:
    path: Path
    version: int
    metadata: dict[str, GgufValue]
    tensors: list[GgufTensorInfo]


def read_gguf(path: str | Path, arrays: Literal["values", "lengths"] = "values") -> GgufFile:
    """The header of the GGUF at `path`. arrays="values" reads metadata arrays as lists;
    "lengths" skips their contents (a vocabulary's 50k strings) and keeps only their length."""
    path = Path(path)
    if arrays not in ("values", "lengths"):
        raise ValueError(f"read_gguf: arrays must be 'values' or 'lengths', got {arrays!r}")
    try:
        with path.open("rb") as f:
            if f.seek(0, 2) < 24:
                raise GgufFormatError(f"{path}: not a GGUF file ({f.tell()} bytes, shorter than a GGUF header)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                return _parse(path, m, arrays == "values")
    except OSError as e:
        raise GgufFormatError(f"{path}: cannot read ({e})") from None


def _parse(path: Path, data: Any, keep_arrays: bool) -> GgufFile:
    if data[:4] != b"GGUF":
        raise GgufFormatError(f"{path}: not a GGUF file (magic {bytes(data[:4])!r})")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
    if version not in (2, 3):
        raise GgufFormatError(f"{path}: GGUF version {version} not supported (expected 2 or 3)")
    pos = 24

    def unpack(fmt: str) -> tuple:
        nonlocal pos
        vals = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return vals

    def read_string() -> str:
        nonlocal pos
        (n,) = unpack("Q")
        if pos + n > len(data):
            raise struct.error(f"a string of {n} bytes runs past the end of the file")
        s = bytes(data[pos:pos + n]).decode("utf-8")
        pos += n
        return s

    def skip_elements(etype: int, n: int) -> None:
        nonlocal pos
        if etype in _SCALARS:
            pos += n * struct.calcsize("<" + _SCALARS[etype])
        elif etype == _STRING:
            for _ in range(n):
                (length,) = unpack("Q")
                pos += length
        elif etype == _ARRAY:                   # an array of arrays
            for _ in range(n):
                skip_elements(*unpack("IQ"))
        else:
            raise GgufFormatError(f"{path}: unknown metadata value type {etype} at byte {pos}")

    def read_value(vtype: int) -> GgufValue:
        if vtype == _STRING:
            return read_string()
        if vtype == _ARRAY:
            etype, n = unpack("IQ")
            if not keep_arrays:
                skip_elements(etype, n)
                return f"<array of {n}>"
            if etype in _SCALARS:
                return list(unpack(_SCALARS[etype] * n))
            return [read_value(etype) for _ in range(n)]
        if vtype not in _SCALARS:
            raise GgufFormatError(f"{path}: unknown metadata value type {vtype} at byte {pos}")
        return unpack(_SCALARS[vtype])[0]

    meta: dict[str, GgufValue] = {}
    tensors: list[GgufTensorInfo] = []
    try:
        for _ in range(n_kv):
            key = read_string()
            (vtype,) = unpack("I")
            meta[key] = read_value(vtype)
        for _ in range(n_tensors):
            name = read_string()
            (n_dims,) = unpack("I")
            shape = unpack("Q" * n_dims)
            ttype, _offset = unpack("IQ")
            tensors.append(GgufTensorInfo(name, tuple(shape), GGML_TYPE_NAMES.get(ttype, f"type{ttype}")))
    except (struct.error, UnicodeDecodeError) as e:
        raise GgufFormatError(f"{path}: truncated or corrupt GGUF header ({e})") from None
    return GgufFile(path, version, meta, tensors)
