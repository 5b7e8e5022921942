"""llama.cpp's CUDA build made on a machine without a GPU, for device calls to carry (docs/peers-h200.md).

Compiled in a device call, llama.cpp's CUDA backend took 286-443 s of the call's 600. Here it is
compiled once (about 40 min on 2 cores) with pip's CUDA 13.0 compiler (the device's toolkit is 13.0,
its driver 580), for sm_90 only and with shared libraries (one copy of the CUDA kernels for all the
binaries), and packed xz-compressed in two files: the binaries, the other libraries and the two files
`peers_h200.py prepare` needs from the source (convert_hf_to_gguf.py, gguf-py), a few MB; and
libggml-cuda alone, ~39 MB. Each fits one call's 64 MiB carry beside the checkout, not both, so the
first call carries the first and prepares the model files while the second carries libggml-cuda:

    python3 benchmarks/llama_cuda_prebuilt.py build --jobs 2                  # here
    python3 benchmarks/llama_cuda_prebuilt.py pack --to .peers --cuda-to .peers-cuda  # here
    python3 benchmarks/llama_cuda_prebuilt.py unpack --carry .peers           # there, call 1 (then prepare)
    python3 benchmarks/peers_h200.py build --carry .peers --carry .peers-cuda # there, call 2 (then measure)

`build` there installs the packs where `moebench tools build-llamacpp --cuda` puts its own build, with a
stamp whose flags are this build's (shared libraries; compiler and place in `built_at`), links the
device's cuBLAS and CUDA runtime beside them (the binaries look in their own folder first), and runs
`llama-server --version`; packs that do not run there are removed and the source is compiled instead.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

PACK_NAME = "llama-cuda-bin.tar.xz"
CUDA_LIB_PACK = "llama-cuda-lib.tar.xz"
CUDA_LIB = "libggml-cuda.so"
# pip's CUDA 13.0 toolchain, the device's major and minor version (a newer minor would need a newer driver)
CUDA_WHEELS = ("nvidia-cuda-nvcc==13.0.88", "nvidia-cuda-runtime==13.0.96", "nvidia-cublas==13.0.2.14",
               "nvidia-cuda-cccl==13.0.85", "nvidia-cuda-crt==13.0.88", "nvidia-nvvm==13.0.88")
# the libraries the binaries need from the machine they run on (not packed: cuBLAS and cuBLASLt are 594 MB)
DEVICE_LIBS = ("libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13")
DEVICE_LIB_DIRS = ("/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib")
SOURCE_FILES = ("convert_hf_to_gguf.py", "gguf-py")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def prebuilt_dir() -> Path:
    from moebench.tools import llamacpp
    return llamacpp.cache_root() / "llamacpp" / f"{llamacpp.BUILD_COMMIT}-cuda-prebuilt"


def build_flags(cuda_root: Path) -> list[str]:
    """`moebench tools build-llamacpp --cuda`'s flags with shared libraries, found beside the binaries."""
    from moebench.tools import llamacpp
    flags = [f for f in llamacpp.build_flags(cuda=True) if f != "-DBUILD_SHARED_LIBS=OFF"]
    # the executables' link resolves libggml-cuda's own libraries (cuBLAS, the libcuda stub) by rpath-link
    libs = f"{cuda_root / 'lib'}:{cuda_root / 'lib' / 'stubs'}"
    return flags + ["-DBUILD_SHARED_LIBS=ON", "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON", "-DCMAKE_INSTALL_RPATH=$ORIGIN",
                    f"-DCMAKE_EXE_LINKER_FLAGS=-Wl,-rpath-link,{libs}",
                    f"-DCMAKE_CUDA_COMPILER={cuda_root / 'bin' / 'nvcc'}", f"-DCUDAToolkit_ROOT={cuda_root}"]


# --- here ---------------------------------------------------------------------------------------

def toolchain(root: Path) -> Path:
    """pip's CUDA 13.0 compiler, runtime and cuBLAS in root (once), laid out as CMake's FindCUDAToolkit
    and nvcc's own profile expect: unversioned library names, lib64, and a libcuda stub to link against
    (the driver's real libcuda.so.1 is loaded where the binaries run)."""
    cuda = root / "nvidia" / "cu13"
    if not (cuda / "bin" / "nvcc").is_file():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(root),
                        *CUDA_WHEELS], check=True)
    lib = cuda / "lib"
    for name in ("cudart", "cublas", "cublasLt"):
        link = lib / f"lib{name}.so"
        if not link.exists():
            link.symlink_to(f"lib{name}.so.13")
    if not (cuda / "lib64").exists():
        (cuda / "lib64").symlink_to("lib")
    stub = lib / "stubs" / "libcuda.so"
    if not stub.is_file():
        stub.parent.mkdir(exist_ok=True)
        # every driver function cuda.h declares (after its _v2 renames), as an empty function
        pre = subprocess.run(["gcc", "-E", "-I", str(cuda / "include"), "-x", "c", "-"], input="#include <cuda.h>\n",
                             capture_output=True, text=True, check=True).stdout
        names = sorted(set(re.findall(r"\b(cu[A-Z]\w*)\s*\(", pre)))
        c_file = stub.with_suffix(".c")
        c_file.write_text("".join(f"void {n}(void) {{}}\n" for n in names))
        subprocess.run(["gcc", "-shared", "-fPIC", "-w", "-o", str(stub), "-Wl,-soname,libcuda.so.1", str(c_file)],
                       check=True)
    if not (stub.parent / "libcuda.so.1").exists():
        (stub.parent / "libcuda.so.1").symlink_to("libcuda.so")
    return cuda


def build(jobs: int) -> Path:
    """Configure and build every target moebench uses; returns the folder of binaries and libraries."""
    from moebench.tools import llamacpp
    # resolved paths: CMake rebuilds everything when the compiler's or the folder's path string changes
    cuda = toolchain(prebuilt_dir() / "toolchain").resolve()
    src = llamacpp.source_dir(cuda=False)
    out = (prebuilt_dir() / "build").resolve()
    env = dict(os.environ, PATH=f"{cuda / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    t = time.monotonic()
    subprocess.run(["cmake", "-S", str(src), "-B", str(out), *build_flags(cuda)], env=env, check=True)
    subprocess.run(["cmake", "--build", str(out), f"-j{jobs}", "--target", *llamacpp.TARGETS], env=env, check=True)
    nvcc = subprocess.run([str(cuda / "bin" / "nvcc"), "--version"], capture_output=True, text=True).stdout
    stamp = llamacpp.BuildStamp(
        build_number=llamacpp.BUILD_NUMBER, build_commit=llamacpp.BUILD_COMMIT, variant="cuda",
        flags=build_flags(cuda), targets=list(llamacpp.TARGETS), sdist=llamacpp.SDIST_NAME,
        sdist_sha256=llamacpp.SDIST_SHA256, build_seconds=round(time.monotonic() - t, 1), fresh_build=None,
        built_at=f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} on {platform.node()} (no GPU), "
                 f"{nvcc.strip().splitlines()[-1]}")
    (out / "bin" / llamacpp.STAMP).write_text(json.dumps(stamp.to_json(), indent=2) + "\n")
    log(f"built in {stamp.build_seconds} s: {out / 'bin'}")
    return out / "bin"


def pack(to: Path, cuda_to: Path) -> tuple[Path, Path]:
    """Two tar.xz files: to/PACK_NAME, the binaries, the other libraries, the stamp and prepare's two
    source files (a few MB); cuda_to/CUDA_LIB_PACK, libggml-cuda alone (~39 MB: its kernels are already
    compressed). Apart because together with the checkout they pass one call's 64 MiB carry."""
    from moebench.tools import llamacpp
    bins = prebuilt_dir() / "build" / "bin"
    missing = [t for t in (*llamacpp.TARGETS, llamacpp.STAMP, CUDA_LIB) if not (bins / t).exists()]
    if missing:
        raise SystemExit(f"{bins}: no {', '.join(missing)}; run `{Path(__file__).name} build` first")
    src = llamacpp.source_dir(cuda=False)
    out = []
    for dest, cuda_lib in ((to / PACK_NAME, False), (cuda_to / CUDA_LIB_PACK, True)):
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(dest, "w:xz", preset=6) as tar:
            for f in sorted(bins.iterdir()):
                if f.name.startswith(CUDA_LIB) != cuda_lib:
                    continue
                if f.name in (*llamacpp.TARGETS, llamacpp.STAMP) or ".so" in f.name:
                    tar.add(f, arcname=f"bin/{f.name}")
            if not cuda_lib:
                for name in SOURCE_FILES:
                    tar.add(src / name, arcname=f"src/llama.cpp/{name}",
                            filter=lambda i: None if "__pycache__" in i.name else i)
        log(f"{dest}: {dest.stat().st_size / 1e6:.1f} MB")
        out.append(dest)
    return out[0], out[1]


# --- there --------------------------------------------------------------------------------------

def device_lib_dirs() -> list[Path]:
    dirs = [Path(d) for d in DEVICE_LIB_DIRS]
    try:
        import nvidia    # PyTorch's CUDA wheels: nvidia/cu13/lib
        dirs += [Path(p) / "cu13" / "lib" for p in nvidia.__path__]
    except ImportError:
        pass
    return dirs


def find_pack(carries: list[Path], name: str) -> Path | None:
    return next((c / name for c in carries if (c / name).is_file()), None)


def unpack(carries: list[Path]) -> None:
    """PACK_NAME (and CUDA_LIB_PACK where one of carries holds it) into place: the binaries where
    `moebench tools build-llamacpp --cuda` puts its build, the source files beside them (what prepare
    needs before libggml-cuda has come)."""
    from moebench.tools import llamacpp
    main_pack, lib_pack = find_pack(carries, PACK_NAME), find_pack(carries, CUDA_LIB_PACK)
    if main_pack is None:
        raise SystemExit(f"no {PACK_NAME} in {', '.join(map(str, carries))}")
    bins = llamacpp.bin_dir(cuda=True)
    shutil.rmtree(bins, ignore_errors=True)
    bins.mkdir(parents=True)
    for path in (main_pack, lib_pack):
        if path is None:
            continue
        with tarfile.open(path) as tar:
            members = tar.getmembers()
            tar.extractall(bins.parent, members=[m for m in members if m.name.startswith("bin/")], filter="data")
            tar.extractall(llamacpp.variant_dir(cuda=True), members=[m for m in members if m.name.startswith("src/")],
                           filter="data")


def install(carries: list[Path]) -> bool:
    """unpack, then link the device's CUDA libraries beside the binaries; True when llama-server then
    runs here (--version). Otherwise the installed binaries are removed and the reason is printed: the
    caller compiles from source instead."""
    from moebench.tools import llamacpp
    bins = llamacpp.bin_dir(cuda=True)

    def refuse(why: str) -> bool:
        log(f"prebuilt llama.cpp: {why}")
        shutil.rmtree(bins, ignore_errors=True)
        return False

    if find_pack(carries, PACK_NAME) is None or find_pack(carries, CUDA_LIB_PACK) is None:
        return refuse(f"{PACK_NAME} and {CUDA_LIB_PACK} are not both in {', '.join(map(str, carries))}")
    unpack(carries)
    for name in DEVICE_LIBS:
        found = next((d / name for d in device_lib_dirs() if (d / name).is_file()), None)
        if found is None:
            return refuse(f"no {name} in {', '.join(map(str, device_lib_dirs()))}")
        (bins / name).symlink_to(found)
    res = subprocess.run([str(bins / "llama-server"), "--version"], capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        return refuse(f"does not run here (exit {res.returncode}): {(res.stdout + res.stderr)[-1500:]}")
    log(f"prebuilt llama.cpp installed in {bins}: {(res.stdout + res.stderr).strip().splitlines()[-2:]}")
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="stage", required=True)
    b = sub.add_parser("build")
    b.add_argument("--jobs", type=int, default=2)
    p = sub.add_parser("pack")
    p.add_argument("--to", type=Path, required=True, help=f"the folder for {PACK_NAME}")
    p.add_argument("--cuda-to", type=Path, required=True, help=f"the folder for {CUDA_LIB_PACK}")
    u = sub.add_parser("unpack", help=f"there: {PACK_NAME} alone, before {CUDA_LIB_PACK} has come")
    u.add_argument("--carry", type=Path, action="append", required=True)
    i = sub.add_parser("install", help="there: what `peers_h200.py build` runs first")
    i.add_argument("--carry", type=Path, action="append", required=True)
    a = ap.parse_args(argv)
    if a.stage == "build":
        build(a.jobs)
    elif a.stage == "pack":
        pack(a.to, a.cuda_to)
    elif a.stage == "unpack":
        unpack(a.carry)
    else:
        return 0 if install(a.carry) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
