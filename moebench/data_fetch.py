"""`moebench data fetch`: build the dataset mirror from its public sources, checking every file.

The project carries the mirror's list of files and their SHA-256 (moebench/mirror/SHA256SUMS), where
each file comes from (moebench/mirror/sources.json: a GitHub repository at a pinned commit) and the
mirror's README (provenance, licenses). A fetch downloads each file, checks its hash and only then
moves it into place, so a mirror folder never holds a file that does not match. Files already present
with the right hash are kept (a fetch resumes).

Sources:
- github (default): `<base>/<owner>/<repo>/<commit>/<path>`, base `https://raw.githubusercontent.com`
  (`--base-url` or `MOEBENCH_GITHUB_RAW` for a mirror or a local stand-in).
- hub: one Hugging Face dataset repository holding the mirror's layout,
  `<endpoint>/datasets/<repo>/resolve/<revision>/<mirror path>`, endpoint `HF_ENDPOINT` or
  `https://huggingface.co`. The bytes must be the same: the same SHA256SUMS decides.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable

DEFAULT_GITHUB_RAW = "https://raw.githubusercontent.com"
DEFAULT_HUB = "https://huggingface.co"
CHECKSUMS = "SHA256SUMS"
ATTEMPTS = 3


class FetchError(RuntimeError):
    """A file could not be fetched or did not match its hash; the message names the file and URL."""


@dataclass(frozen=True)
class MirrorFile:
    path: str          # relative to the mirror root, e.g. "gsm8k/test.jsonl"
    sha256: str


@dataclass(frozen=True)
class Source:
    """Maps a mirror path to the URL it is downloaded from."""
    name: str
    url_for: Callable[[str], str]


def _package_file(name: str) -> str:
    return resources.files("moebench").joinpath("mirror", name).read_text(encoding="utf-8")


def mirror_files() -> list[MirrorFile]:
    """Every file of the mirror with its SHA-256 (the project's own copy of SHA256SUMS)."""
    out = []
    for n, line in enumerate(_package_file(CHECKSUMS).splitlines(), start=1):
        if not line.strip():
            continue
        digest, sep, path = line.partition("  ")
        if not sep or len(digest) != 64 or not path or path.startswith("/") or ".." in Path(path).parts:
            raise FetchError(f"moebench/mirror/{CHECKSUMS}: line {n} is not '<sha256>  <relative path>': {line!r}")
        out.append(MirrorFile(path.strip(), digest.lower()))
    return out


def github_locations() -> list[dict[str, str]]:
    """sources.json's entries (prefix, repo, commit, path), longest prefix first."""
    doc = json.loads(_package_file("sources.json"))
    return sorted(doc["sources"], key=lambda s: len(s["prefix"]), reverse=True)


def github_source(base_url: str | None = None) -> Source:
    base = (base_url or os.environ.get("MOEBENCH_GITHUB_RAW") or DEFAULT_GITHUB_RAW).rstrip("/")
    locations = github_locations()

    def url_for(path: str) -> str:
        for loc in locations:
            if path.startswith(loc["prefix"]):
                in_repo = loc["path"] + path[len(loc["prefix"]):]
                return f"{base}/{loc['repo']}/{loc['commit']}/{urllib.parse.quote(in_repo)}"
        raise FetchError(f"{path}: no source in moebench/mirror/sources.json covers it")

    return Source(f"github ({base})", url_for)


def hub_source(repo: str | None, revision: str = "main", endpoint: str | None = None) -> Source:
    if not repo:
        raise FetchError("--source hub needs --hub-repo: a dataset repository holding the mirror's layout")
    base = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_HUB).rstrip("/")

    def url_for(path: str) -> str:
        return f"{base}/datasets/{repo}/resolve/{urllib.parse.quote(revision, safe='')}/{urllib.parse.quote(path)}"

    return Source(f"hub {repo}@{revision} ({base})", url_for)


def _sha256(path: Path) -> str:
    from moebench.datasets import sha256_stream

    return sha256_stream(path)


def _download(client, url: str, dest: Path, want: str, rel: str) -> int:
    """Download url to dest through a .part file; keep it only when its hash is `want`."""
    import httpx

    part = dest.with_name(dest.name + ".part")
    dest.parent.mkdir(parents=True, exist_ok=True)
    last = ""
    for attempt in range(1, ATTEMPTS + 1):
        try:
            with client.stream("GET", url) as r:
                if r.status_code != 200:
                    last = f"HTTP {r.status_code}"
                    if r.status_code in (404, 403, 401, 410):
                        break            # not there: retrying will not help
                    raise httpx.TransportError(last)
                h = hashlib.sha256()
                with part.open("wb") as f:
                    for chunk in r.iter_bytes(1 << 16):
                        h.update(chunk)
                        f.write(chunk)
            got = h.hexdigest()
            if got != want:
                part.unlink(missing_ok=True)
                raise FetchError(f"{rel}: downloaded from {url} has sha256 {got}, expected {want} "
                                 f"(SHA256SUMS); the file was not written")
            size = part.stat().st_size
            os.replace(part, dest)
            return size
        except httpx.HTTPError as e:
            last = f"{type(e).__name__}: {e}"
            part.unlink(missing_ok=True)
            if attempt < ATTEMPTS:
                time.sleep(0.5 * attempt)
    raise FetchError(f"{rel}: cannot download {url}: {last}")


def fetch_mirror(to: Path, source: Source, only: list[str] | None = None, jobs: int = 8,
                 log: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)) -> Path:
    """Fill `to` with the mirror's files (all, or those under the `only` prefixes); returns `to`.

    Raises FetchError after trying every file when any failed, naming each; files that arrived and
    matched stay (a second fetch resumes).
    """
    import httpx

    files = [f for f in mirror_files() if not only or any(f.path.startswith(p) for p in only)]
    if not files:
        raise FetchError(f"no mirror file starts with {', '.join(only or [])}")
    to = Path(to)
    to.mkdir(parents=True, exist_ok=True)
    todo = [f for f in files if not ((to / f.path).is_file() and _sha256(to / f.path) == f.sha256)]
    log(f"data fetch: {len(files)} files from {source.name} into {to} "
        f"({len(files) - len(todo)} already present and matching)")
    started = time.monotonic()
    errors: list[str] = []
    total = 0
    with httpx.Client(follow_redirects=True, timeout=httpx.Timeout(60.0, connect=20.0)) as client:
        def one(f: MirrorFile) -> int:
            return _download(client, source.url_for(f.path), to / f.path, f.sha256, f.path)

        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            futures = [(f, pool.submit(one, f)) for f in todo]
            for n, (f, fut) in enumerate(futures, start=1):
                try:
                    total += fut.result()
                except FetchError as e:
                    errors.append(str(e))
                if n % 50 == 0 or n == len(futures):
                    log(f"data fetch: {n}/{len(futures)} done, {total / 1e6:.1f} MB, "
                        f"{time.monotonic() - started:.0f}s")
    if errors:
        raise FetchError(f"{len(errors)} of {len(todo)} files failed:\n" + "\n".join(errors))
    # A whole mirror documents itself: the same README and checksum list as the original.
    for name in ((CHECKSUMS, "README.md") if not only else ("README.md",)):
        (to / name).write_text(_package_file(name), encoding="utf-8")
    log(f"data fetch: {to} ready ({len(files)} files verified); use it with MOEBENCH_DATA_DIR={to.resolve()}. "
        f"Licenses differ per dataset (CMMLU is non-commercial; see {to / 'README.md'})")
    return to
