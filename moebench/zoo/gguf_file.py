"""Read a GGUF file's metadata and tensor table (not the tensor data).

A direct reader: gguf-py's GGUFReader builds a numpy view per array element and took over 30 s on a
50k-token vocabulary on this machine; this takes a fraction of a second.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Metadata value types (GGUF spec): scalar struct formats; 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# ggml_type ids (ggml.h) of the types the zoo writes or may meet.
GGML_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
                   10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 20: "IQ4_NL",
                   30: "BF16", 34: "TQ1_0", 35: "TQ2_0"}


class GgufFormatError(ValueError):
    pass


@dataclass(frozen=True)
class GgufTensorInfo:
    name: str
    shape: tuple[int, ...]   # ggml order: ne0 (the row length, a matrix's input dimension) first
    type_name: str


@dataclass(frozen=True)
class GgufFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[GgufTensorInfo]


def read_gguf(path: Path) -> GgufFile:
    path = Path(path)
    try:
        with path.open("rb") as f:
            data = f.read()
    except OSError as e:
        raise GgufFormatError(f"{path}: cannot read ({e})") from None
    if data[:4] != b"GGUF":
        raise GgufFormatError(f"{path}: not a GGUF file (magic {data[:4]!r})")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
    if version not in (2, 3):
        raise GgufFormatError(f"{path}: GGUF version {version} not supported (expected 2 or 3)")
    pos = 24

    def unpack(fmt: str):
        nonlocal pos
        vals = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return vals

    def read_string() -> str:
        nonlocal pos
        (n,) = unpack("<Q")
        s = data[pos:pos + n].decode("utf-8")
        pos += n
        return s

    def read_value(vtype: int) -> Any:
        if vtype == _STRING:
            return read_string()
        if vtype == _ARRAY:
            etype, n = unpack("<IQ")
            if etype in _SCALARS:
                return list(unpack("<" + _SCALARS[etype][1] * n))
            return [read_value(etype) for _ in range(n)]
        if vtype not in _SCALARS:
            raise GgufFormatError(f"{path}: unknown metadata value type {vtype} at byte {pos}")
        return unpack(_SCALARS[vtype])[0]

    meta: dict[str, Any] = {}
    tensors: list[GgufTensorInfo] = []
    try:
        for _ in range(n_kv):
            key = read_string()
            (vtype,) = unpack("<I")
            meta[key] = read_value(vtype)
        for _ in range(n_tensors):
            name = read_string()
            (n_dims,) = unpack("<I")
            shape = unpack("<" + "Q" * n_dims)
            ttype, _offset = unpack("<IQ")
            tensors.append(GgufTensorInfo(name, tuple(shape), GGML_TYPE_NAMES.get(ttype, f"type{ttype}")))
    except (struct.error, UnicodeDecodeError) as e:
        raise GgufFormatError(f"{path}: truncated or corrupt GGUF header ({e})") from None
    return GgufFile(path, version, meta, tensors)
