"""Datasets from the local mirror (docs/design.md section 7).

The mirror is `MOEBENCH_DATA_DIR`, else `../shared/datasets` beside the checkout, else
`./shared/datasets`, else a `data/` folder made by `moebench data fetch` (moebench/data_fetch.py). Every file a task reads is hashed (sha256) into the run manifest. There is no
silent hub fallback: a missing file is an error naming the path and the variable to set. Before a run
asks anything, moebench/data_check.py checks the files it read against SHA256SUMS.
"""
from __future__ import annotations

import csv
import gzip
import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path

from moebench.config import repo_root
from moebench.json_types import JsonObject


class DatasetError(FileNotFoundError):
    pass


# The text KLD scores by default (teacher-forced windows, or the prompts of the sampled method).
KLD_DEFAULT_CORPUS = "wikitext2/wiki.test.raw"

def data_dir() -> Path:
    env = os.environ.get("MOEBENCH_DATA_DIR")
    if env:
        return Path(env)
    for cand in (repo_root().parent / "shared" / "datasets", Path.cwd() / "shared" / "datasets",
                 Path.cwd().parent / "shared" / "datasets"):
        if cand.is_dir():
            return cand
    # A mirror made by `moebench data fetch --to data` (a complete one carries SHA256SUMS).
    for cand in (Path.cwd() / "data", repo_root() / "data"):
        if (cand / "SHA256SUMS").is_file():
            return cand
    return repo_root().parent / "shared" / "datasets"


def data_file(root: Path, rel: str) -> Path:
    p = Path(root) / rel
    if not p.is_file():
        raise DatasetError(
            f"dataset file {p} not found: set MOEBENCH_DATA_DIR to a mirror holding {rel}, "
            f"or make one with `moebench data fetch --to data` (see moebench/mirror/README.md for the layout)"
        )
    return p


def sha256_stream(path: Path | str) -> str:
    """sha256 of a file, read in 1 MiB blocks (never cached: for checking what was just written)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@lru_cache(maxsize=512)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    return sha256_stream(path)


def sha256_file(path: Path) -> str:
    st = path.stat()
    return _sha256(str(path), st.st_size, st.st_mtime_ns)


def register(ctx_files: dict[str, str], root: Path, path: Path) -> None:
    """Record a data file's hash under its path relative to the mirror."""
    try:
        rel = str(path.relative_to(root))
    except ValueError:
        rel = str(path)
    ctx_files[rel] = sha256_file(path)


def read_jsonl(path: Path) -> list[JsonObject]:
    """Each line's JSON as read (a blank line skipped), for its task to parse into its items."""
    opener = gzip.open if path.suffix == ".gz" else open
    out = []
    with opener(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}: line {n} is not valid JSON ({e})") from None
    return out


def read_csv_rows(path: Path, columns: tuple[str, ...]) -> list[dict[str, str]]:
    """Rows of a CSV with a header; the named columns must be present."""
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in columns if c not in (reader.fieldnames or [])]
        if missing:
            raise DatasetError(f"{path}: missing column(s) {', '.join(missing)}; header is {reader.fieldnames}")
        return list(reader)


def read_text(path: Path) -> str:
    """Text with CRLF normalised to LF (wiki.test.raw ships with CRLF)."""
    return path.read_bytes().decode("utf-8").replace("\r\n", "\n")
