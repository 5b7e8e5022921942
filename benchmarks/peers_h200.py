"""The engine beside a real peer, llama.cpp CUDA, on the same weights and the same GPU (issue 43 part 1).

One random Qwen3-30B-A3B-shaped checkpoint (the attention, expert and vocabulary sizes of the real
model, at the largest layer and expert count the disk holds, stated in the output) is
written once and served by both sides:

  - llama.cpp b11434 built with CUDA for sm_90 by `moebench tools build-llamacpp --cuda`, as GGUF bf16
    and as Q8_0 / Q4_0 with only the expert tensors quantized (attention, router, embeddings and the
    output matrix stay bf16, as in the engine's plans), through `llama-bench` and through moebench's
    own llama-server runner and speed suite (the product's real use, NVML energy included);
  - the in-repo engine at bf16 (the checkpoint) and with every expert int8 / int4 on the GPU (packed
    artifacts), through the engine runner and the same speed suite.

Batch-1 decode tok/s at 128 and 4,096 prompt tokens, each against its roofline (the weight and KV
bytes one decode step reads at that precision and context, over the device copy bandwidth measured in
the same call), the engine over llama.cpp at matching precision, and the harness's llama-server
figure over llama-bench's for the same build and flags.

Stages (each fits a device call; the work folder persists while the machine is held):
    python3 benchmarks/peers_h200.py stage-source --to .peers      # here: what a device call carries
    python3 benchmarks/peers_h200.py build --carry .peers --jobs 16 # there: llama.cpp CUDA build (or, with
                                         # --carry .peers-cuda too, llama_cuda_prebuilt.py's packs installed)
    python3 benchmarks/peers_h200.py wait-build --timeout 600      # there: until a background build ends
    python3 benchmarks/peers_h200.py prepare --work /root/peers --work /dev/shm/peers --link /root/peers-work
    python3 benchmarks/peers_h200.py measure --work /root/peers-work --out $OUT
`--small` makes a small shape on the CPU (with the CPU build of llama.cpp) to check the whole path.
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

from moebench.bench.checkpoint import TOKENIZER_FILES, tokenizer_dir, write_checkpoint

ROOT = Path(__file__).resolve().parent.parent

# Qwen3-30B-A3B's shape (its config.json); layers and experts are cut to what the disk holds (SHAPE_CHOICES).
QWEN3_30B_A3B = dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                     vocab_size=151936)
SMALL = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256, vocab_size=50257)
PROMPT_LENGTHS = (128, 4096)
OUTPUT_TOKENS = 128
LLAMA_FLAGS = ("-ngl", "99", "-fa", "on")           # the same for llama-bench and llama-server
# llama-server's own switch (llama-bench has no sampling step): run the sampler chain in the model's
# graph on the GPU; with the runner's greedy chain (an argmax, `greedy_argmax`) a token then costs no
# copy of the logits and no CPU pass over the vocabulary.
BACKEND_SAMPLING = ("-bs",)
# Bytes per weight of each expert format, scales included (docs/engine.md; GGUF block sizes).
FORMAT_BYTES = {"bf16": 2.0, "int8": 1.001, "int4": 0.531, "Q8_0": 34 / 32, "Q4_0": 18 / 32}
PAIRS = (("bf16", "bf16"), ("int8", "Q8_0"), ("int4", "Q4_0"))   # engine plan, llama.cpp type
# What measure's --skip names: each llama.cpp type, each engine plan, each quantized plan with int8 activations.
SIDES = ({f"llama-{q}" for _, q in PAIRS} | {f"engine-{e}" for e, _ in PAIRS}
         | {f"engine-{e}-a8" for e, _ in PAIRS if e != "bf16"})


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd: list[str], env: dict[str, str] | None = None, timeout: float | None = None, **kw) -> str:
    log("$ " + " ".join(str(c) for c in cmd))
    res = subprocess.run([str(c) for c in cmd], env=env, timeout=timeout, text=True, capture_output=True, **kw)
    if res.returncode != 0:
        raise RuntimeError(f"{cmd[0]} exited {res.returncode}:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return res.stdout


# --- shape and bytes ---------------------------------------------------------------------------

def layer_params(shape: dict[str, int]) -> dict[str, int]:
    H, D, I = shape["hidden_size"], shape["head_dim"], shape["moe_intermediate_size"]
    attn = H * shape["num_attention_heads"] * D * 2 + H * shape["num_key_value_heads"] * D * 2
    return {"attn": attn, "router": shape["num_experts"] * H, "expert": 3 * H * I, "norms": 2 * H + 2 * D}


def checkpoint_bytes(shape: dict[str, int], expert_bytes: float) -> float:
    p = layer_params(shape)
    per_layer = 2 * (p["attn"] + p["router"] + p["norms"]) + shape["num_experts"] * p["expert"] * expert_bytes
    return shape["num_hidden_layers"] * per_layer + 2 * 2 * shape["vocab_size"] * shape["hidden_size"]


def disk_need(shape: dict[str, int]) -> float:
    """Bytes the work folder holds at its fullest: the checkpoint, three GGUFs, two engine artifacts."""
    return sum(checkpoint_bytes(shape, FORMAT_BYTES[f]) for f in ("bf16", "bf16", "Q8_0", "Q4_0", "int8", "int4"))


def step_bytes(shape: dict[str, int], fmt: str, context: int) -> float:
    """Bytes one batch-1 decode step reads: bf16 attention, router, norms, lm_head and embedding row,
    top-k experts at `fmt`, and the bf16 K/V cache of `context` tokens."""
    p, L, H = layer_params(shape), shape["num_hidden_layers"], shape["hidden_size"]
    dense = L * (p["attn"] + p["router"] + p["norms"]) + shape["vocab_size"] * H + 2 * H
    experts = L * shape["num_experts_per_tok"] * p["expert"] * FORMAT_BYTES[fmt]
    kv = L * 2 * shape["num_key_value_heads"] * shape["head_dim"] * 2 * context
    return 2 * dense + experts + kv


# --- stage-source (here) -----------------------------------------------------------------------

def stage_source(to: Path) -> None:
    """What a device call carries: a llama.cpp source tree without docs, tests and vocab files (the
    sdist is 37 MB; the call carries at most 64 MiB), the CPU llama-quantize, the haystack data."""
    from moebench.tools import llamacpp
    to.mkdir(parents=True, exist_ok=True)
    src = llamacpp.source_dir(cuda=False)
    skip = ("docs", "media", "benches", "tests", ".git", "tools/ui/node_modules")
    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        rel = info.name.split("/", 1)[1] if "/" in info.name else ""
        if any(rel == s or rel.startswith(s + "/") for s in skip):
            return None
        if rel.startswith("models/") and rel.rsplit(".", 1)[-1] in ("gguf", "inp", "out"):
            return None
        return info
    with tarfile.open(to / "llama-src.tar.gz", "w:gz", compresslevel=6) as tar:
        tar.add(src, arcname="llama.cpp", filter=keep)
    shutil.copy2(llamacpp.bin_dir(cuda=False) / "llama-quantize", to / "llama-quantize")
    (to / "tokenizer").mkdir(exist_ok=True)
    for f in ("config.json", *TOKENIZER_FILES):
        shutil.copy2(ROOT / "models" / "zoo" / "tiny-moe" / f, to / "tokenizer" / f)
    data = Path(os.environ.get("MOEBENCH_DATA_DIR", ROOT.parent / "shared" / "datasets"))
    (to / "datasets").mkdir(exist_ok=True)
    for f in ("SHA256SUMS", "README.md"):
        shutil.copy2(data / f, to / "datasets" / f)
    shutil.copytree(data / "haystack", to / "datasets" / "haystack", dirs_exist_ok=True)
    for f in sorted(to.rglob("*")):
        if f.is_file():
            print(f"{f.stat().st_size:>12,d}  {f}")


# --- build (there) -----------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def prebuilt():
    """benchmarks/llama_cuda_prebuilt.py, the script beside this one (benchmarks/ is not a package)."""
    path = Path(__file__).with_name("llama_cuda_prebuilt.py")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(carries: list[Path], jobs: int) -> None:
    """Install the carried prebuilt llama.cpp (llama_cuda_prebuilt.py's two packs, in any of carries)
    where it runs here; otherwise extract the carried source (carries[0]'s llama-src.tar.gz) where
    `moebench tools build-llamacpp --cuda` looks, then build."""
    from moebench.tools import llamacpp
    carry = carries[0]
    done = build_status_file()
    done.unlink(missing_ok=True)
    if prebuilt().find_pack(carries, prebuilt().PACK_NAME) is not None:
        t = time.monotonic()
        if prebuilt().install(carries):
            done.write_text(json.dumps({"ok": True, "prebuilt": True, "seconds": round(time.monotonic() - t)}))
            return
        if not (carry / "llama-src.tar.gz").is_file():
            done.write_text(json.dumps({"ok": False, "error": "the prebuilt llama.cpp does not run here and "
                                        f"{carry} holds no llama-src.tar.gz to build from"}))
            raise SystemExit(1)
    src_root = llamacpp.variant_dir(cuda=True) / "src"
    if not (src_root / "llama.cpp" / "CMakeLists.txt").is_file():
        src_root.mkdir(parents=True, exist_ok=True)
        with tarfile.open(carry / "llama-src.tar.gz") as tar:
            tar.extractall(src_root, filter="data")
    t = time.monotonic()
    try:
        run([sys.executable, "-m", "moebench.cli", "tools", "build-llamacpp", "--cuda", "--jobs", str(jobs)])
    except (RuntimeError, OSError) as e:
        done.write_text(json.dumps({"ok": False, "error": str(e)[-2000:]}))
        raise
    log(f"llama.cpp CUDA build: {time.monotonic() - t:.0f} s")
    done.write_text(json.dumps({"ok": True, "seconds": round(time.monotonic() - t)}))


def build_status_file() -> Path:
    """What `build` leaves when it ends, for `wait-build` (a background build outlives its call)."""
    from moebench.tools import llamacpp
    return llamacpp.variant_dir(cuda=True) / "peers-build.json"


def wait_build(timeout: float) -> int:
    """Wait for a background `build` to end: 0 once it succeeded, 1 if it failed or is still running
    after `timeout` seconds. (Polling the process list for it would match the caller's own command.)"""
    done, end = build_status_file(), time.monotonic() + timeout
    while not done.is_file():
        if time.monotonic() > end:
            log(f"wait-build: no {done} after {timeout:.0f} s")
            return 1
        time.sleep(2)
    status = json.loads(done.read_text())
    log(f"wait-build: {status}")
    return 0 if status.get("ok") else 1


# --- prepare (there) ---------------------------------------------------------------------------

SHAPE_CHOICES = ((48, 128), (48, 64), (48, 32), (48, 16), (24, 16), (12, 16))   # (layers, experts)


def pick_shape(candidates: list[Path], small: bool) -> tuple[Path, dict[str, int]]:
    """The largest shape (layers first, then experts per layer) whose files fit one of the candidate
    folders, with 10% to spare; the folder with the most free space wins a tie."""
    if small:
        candidates[0].mkdir(parents=True, exist_ok=True)
        return candidates[0], dict(SMALL)
    free = {}
    for c in candidates:
        try:
            c.mkdir(parents=True, exist_ok=True)
            # A RAM-backed folder keeps 48 GB of memory for the processes that load the models.
            free[c] = shutil.disk_usage(c).free - (48e9 if str(c).startswith("/dev/shm") else 0)
        except OSError as e:
            log(f"{c}: not usable ({e})")
    for layers, experts in SHAPE_CHOICES:
        shape = dict(QWEN3_30B_A3B, num_hidden_layers=layers, num_experts=experts)
        for c, f in sorted(free.items(), key=lambda kv: -kv[1]):
            if disk_need(shape) < 0.9 * f:
                log(f"{c}: {f / 1e9:.1f} GB free: {layers} layers, {experts} experts per layer "
                    f"({disk_need(shape) / 1e9:.1f} GB of files)")
                return c, shape
    raise RuntimeError(f"too little space in {', '.join(f'{c} ({f / 1e9:.1f} GB)' for c, f in free.items())}")


def quantize_experts(binary: Path, src: Path, out: Path, qtype: str) -> None:
    """Only the expert tensors at `qtype`: attention, embeddings and the output matrix stay bf16
    (the router and norms are F32 in the converted file already), as in the engine's int8/int4 plans."""
    run([binary, "--pure", "--output-tensor-type", "bf16", "--token-embedding-type", "bf16",
         "--tensor-type", "attn_=bf16", src, out, qtype, str(os.cpu_count() or 2)])


def pack_engine(hf: Path, out: Path, fmt: str, device: str) -> None:
    """Every expert at `fmt` on the GPU: the engine's all-int8 / all-int4 plan."""
    from moebench.engine.tiering import Plan, pack
    cfg = json.loads((hf / "config.json").read_text())
    L, E = cfg["num_hidden_layers"], cfg["num_experts"]
    plan = Plan(layers=list(range(L)), precision=[[fmt] * E for _ in range(L)], home=[["gpu"] * E for _ in range(L)],
                info={"rule": f"every expert {fmt} on the GPU (benchmarks/peers_h200.py)"})
    pack(hf, plan, out, device=device)


def prepare(candidates: list[Path], link: Path, carry: Path, small: bool, seed: int, engine_only: bool = False
            ) -> None:
    """Write the checkpoint, the GGUFs and the engine artifacts into the roomiest candidate folder;
    `link` (a symlink) names the folder chosen for `measure --work`. engine_only: no GGUFs (for a
    measure of the engine's sides alone); the shape is still picked for all six files, so it is the
    one a full prepare on the same machine picks."""
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    work, shape = pick_shape(candidates, small)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(work.resolve())
    (work / "shape.json").write_text(json.dumps(shape))
    hf = work / "hf"
    t = time.monotonic()
    write_checkpoint(hf, shape, seed, device, tokenizer_dir(ROOT))
    log(f"checkpoint: {time.monotonic() - t:.0f} s")
    if not engine_only:
        write_ggufs(hf, work, carry, small)
    for fmt in ("int8", "int4"):
        t = time.monotonic()
        pack_engine(hf, work / f"engine-{fmt}", fmt, device)
        log(f"engine pack {fmt}: {time.monotonic() - t:.0f} s")
    run(["du", "-sh", *sorted(str(p) for p in work.iterdir())])


def write_ggufs(hf: Path, work: Path, carry: Path, small: bool) -> None:
    """The checkpoint as GGUF bf16 (llama.cpp's converter), then Q8_0 and Q4_0 of its experts."""
    from moebench.tools import llamacpp
    src = llamacpp.variant_dir(cuda=not small) / "src" / "llama.cpp"
    if not (src / "convert_hf_to_gguf.py").is_file():
        src = llamacpp.source_dir(cuda=False)
    env = dict(os.environ, PYTHONPATH=str(src / "gguf-py") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t = time.monotonic()
    run([sys.executable, src / "convert_hf_to_gguf.py", hf, "--outfile", work / "bf16.gguf", "--outtype", "bf16"],
        env=env)
    log(f"convert_hf_to_gguf: {time.monotonic() - t:.0f} s")
    quant = carry / "llama-quantize" if (carry / "llama-quantize").is_file() else llamacpp.tool("llama-quantize")
    for qtype in ("Q8_0", "Q4_0"):
        t = time.monotonic()
        quantize_experts(quant, work / "bf16.gguf", work / f"{qtype}.gguf", qtype)
        log(f"llama-quantize {qtype}: {time.monotonic() - t:.0f} s")


# --- measure (there) ---------------------------------------------------------------------------

SUITE = """name = "peers-speed"
description = "batch-1 decode and prefill at {lengths} prompt tokens, {out} output tokens"
[[tasks]]
task = "speed"
prompt_lengths = {lengths}
output_tokens = {out}
repeats = {repeats}
clients = 1
warmup = 1
seed = 1234
[probes]
nvml = true
interval_ms = 100
idle_s = 3.0
"""


def copy_bandwidth(nbytes: int = 4 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    import torch
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    torch.cuda.synchronize()
    bw = 2 * nbytes * iters / (time.perf_counter() - t)
    del src, dst
    torch.cuda.empty_cache()
    return bw


def llama_bench(binary: Path, gguf: Path, lengths: tuple[int, ...], flags: tuple[str, ...], reps: int) -> dict[int, float]:
    """tg tok/s after `depth` context tokens (llama-bench -d), per depth."""
    out = run([binary, "-m", gguf, "-p", "0", "-n", str(OUTPUT_TOKENS), "-d", ",".join(map(str, lengths)),
               "-r", str(reps), "-o", "json", *flags], timeout=900)
    rows = json.loads(out)
    return {int(r["n_depth"]): float(r["avg_ts"]) for r in rows if int(r.get("n_gen", 0)) > 0}


def moebench_speed(profile: str, suite: Path, out: Path, label: str) -> dict[str, Any]:
    """`moebench run` of the speed suite; per prompt length the median decode and prefill tok/s, and
    the run's decode J/token (NVML, gross)."""
    prof = out.parent / f"{label}.toml"
    prof.write_text(profile)
    run_dir = out / label
    t = time.monotonic()
    run([sys.executable, "-m", "moebench.cli", "run", suite, "--runner", prof, "--label", label, "--out", run_dir],
        timeout=1800)
    res: dict[str, Any] = {"wall_s": round(time.monotonic() - t, 1), "run_dir": str(run_dir)}
    by_len: dict[int, dict[str, list[float]]] = {}
    for line in (run_dir / "items.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec.get("task") != "speed" or rec.get("status") != "ok":
            continue
        # llama-server's own decode rate (timings.predicted_per_second) beside the client's: a gap
        # between the two is the HTTP path's, a gap between the server's and llama-bench's the server's.
        server_rate = (rec.get("timings") or {}).get("predicted_per_second")
        for k, v in (*((k, rec.get(k)) for k in ("decode_tok_s", "prefill_tok_s", "ttft_s", "prompt_tokens")),
                     ("server_decode_tok_s", server_rate)):
            if v is not None:
                by_len.setdefault(int(rec["prompt_length"]), {}).setdefault(k, []).append(float(v))
    res["by_length"] = {n: {k: statistics.median(v) for k, v in d.items()} | {"n": len(d.get("decode_tok_s", []))}
                        for n, d in sorted(by_len.items())}
    manifest = json.loads((run_dir / "manifest.json").read_text())
    energy = (((manifest.get("probes") or {}).get("nvml") or {}).get("summary") or {}).get("energy") or {}
    res["decode_j_per_token"] = ((energy.get("per_token") or {}).get("decode") or {}).get("gross_j_per_token")
    res["peak_memory_bytes"] = ((((manifest.get("probes") or {}).get("nvml") or {}).get("summary") or {})
                                .get("memory") or {}).get("peak_used_bytes")
    return res


def engine_profile(work: Path, eng_fmt: str, cuda: bool, lengths: tuple[int, ...]) -> str:
    """The engine runner's profile for one plan: the bf16 checkpoint or a packed int8 / int4 folder."""
    model = work / "hf" if eng_fmt == "bf16" else work / f"engine-{eng_fmt}"
    return (f'kind = "engine"\nmodel = "{model}"\ndtype = "auto"\ndevice = "{"cuda" if cuda else "cpu"}"\n'
            f'max_seq_len = {max(lengths) + 1024}\n')


def measure(work: Path, out: Path, small: bool, reps: int, skip: set[str]) -> dict[str, Any]:
    from moebench.tools import llamacpp
    shape = json.loads((work / "shape.json").read_text())
    lengths = (64, 256) if small else PROMPT_LENGTHS
    cuda = not small
    flags = ("-ngl", "0") if small else LLAMA_FLAGS
    out.mkdir(parents=True, exist_ok=True)
    suite = out / "peers-speed.toml"
    suite.write_text(SUITE.format(lengths=list(lengths), out=OUTPUT_TOKENS if not small else 16,
                                  repeats=3 if small else 5))
    runs = out / "runs"
    runs.mkdir(exist_ok=True)
    res: dict[str, Any] = {"shape": shape, "lengths": list(lengths), "output_tokens": OUTPUT_TOKENS,
                           "llama_flags": list(flags), "backend_sampling_flags": list(BACKEND_SAMPLING),
                           "llama": {}, "engine": {}, "engine_a8": {}}
    if cuda:
        import torch
        res["device"] = torch.cuda.get_device_name(0)
        res["copy_Bps"] = copy_bandwidth()
        log(f"copy bandwidth {res['copy_Bps'] / 1e12:.2f} TB/s")
    bin_dir = llamacpp.bin_dir(cuda=cuda)
    stamp = llamacpp.read_stamp(bin_dir)
    res["llama_build"] = stamp.to_json() if stamp is not None else None

    def save() -> None:
        # after every side: a call cut short by its time limit still brings back what it measured
        (out / "peers_h200.json").write_text(json.dumps(res, indent=1, default=str) + "\n")

    def speed(where: dict[str, Any], key: str, profile: str, label: str) -> None:
        try:
            where[key] = moebench_speed(profile, suite, runs, label)
            log(f"{label}: {where[key]['by_length']}")
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            where[key] = {"error": str(e)[-2000:]}
            log(f"{label} FAILED: {e}")
        save()

    for eng_fmt, qtype in PAIRS:
        gguf = work / f"{qtype}.gguf"
        if f"llama-{qtype}" not in skip:
            side: dict[str, Any] = {}
            res["llama"][qtype] = side
            side["llama_bench"] = llama_bench(bin_dir / "llama-bench", gguf, lengths, flags, reps)
            log(f"llama-bench {qtype}: {side['llama_bench']}")
            # the harness with the server's default (CPU) sampling, then with backend sampling
            for key, server_flags in (("harness", flags), ("harness_bs", flags + BACKEND_SAMPLING)):
                profile = (f'kind = "llama-server"\nbinary = "{bin_dir / "llama-server"}"\nmodel = "{gguf}"\n'
                           f'ctx_size = {max(lengths) + 1024}\nconcurrency = 1\nargs = {json.dumps(list(server_flags))}\n')
                speed(side, key, profile, f"llama-{qtype}" + ("-bs" if key == "harness_bs" else ""))
        if f"engine-{eng_fmt}" not in skip:
            speed(res["engine"], eng_fmt, engine_profile(work, eng_fmt, cuda, lengths), f"engine-{eng_fmt}")
        # W8A8 / W4A8: activations rounded to int8 per 64 columns, as llama.cpp's CUDA Q8_0 / Q4_0
        # kernels round theirs (q8_1, blocks of 32); the fused Triton kernels only, so on the GPU only
        if eng_fmt != "bf16" and cuda and f"engine-{eng_fmt}-a8" not in skip:
            speed(res["engine_a8"], eng_fmt, engine_profile(work, eng_fmt, cuda, lengths) + "int8_activations = true\n",
                  f"engine-{eng_fmt}-a8")
    save()
    print(table(res))
    return res


def _at(row: dict[str, Any] | None, n: int) -> Any:
    """row[n], where n may be an int (just measured) or a string (read back from JSON)."""
    row = row or {}
    return row.get(n) if n in row else row.get(str(n))


def _rate(side: dict[str, Any] | None, n: int, key: str = "decode_tok_s") -> float | None:
    return (_at((side or {}).get("by_length"), n) or {}).get(key)


def merge(calls: list[dict[str, Any]]) -> dict[str, Any]:
    """Several measure calls' results as one (a measure that does not fit one device call runs as
    two with --skip): the same shape and lengths, each side from the last call that measured it."""
    res = dict(calls[0])
    for other in calls[1:]:
        for key in ("shape", "lengths"):
            if other[key] != res[key]:
                raise SystemExit(f"peers_h200 table: calls with different {key}: {res[key]} and {other[key]}")
        for key in ("llama", "engine", "engine_a8"):
            res[key] = {**res.get(key, {}), **other.get(key, {})}
    return res


# Printed under the engine table: which of its columns is llama.cpp's precision (see measure's a8 sides).
MATCHING_PRECISION = ("matching precision: llama.cpp's Q8_0 / Q4_0 decode multiplies 8-bit activations (q8_1, "
                      "ggml-cuda/mmvq.cu), as the engine's a8 plans do; bf16 is bf16 on both sides")


def table(res: dict[str, Any]) -> str:
    """Two tables: the harness against llama-bench (same build, same GGUF, same flags), then the
    engine against llama.cpp through the harness, both against the roofline."""
    shape, bw = res["shape"], res.get("copy_Bps")
    fmt = lambda v, spec: "–" if v is None else format(v, spec)
    ratio = lambda a, b: a / b if a and b else None
    times = lambda v: "–" if v is None else f"{v:.2f}x"
    bs = " ".join(res.get("backend_sampling_flags") or BACKEND_SAMPLING)
    notes: list[str] = []
    lines = [f"shape: {shape['num_hidden_layers']} layers, {shape['num_experts']} experts of "
             f"{shape['moe_intermediate_size']} (top-{shape['num_experts_per_tok']}), hidden {shape['hidden_size']}, "
             f"vocab {shape['vocab_size']}; llama.cpp flags {' '.join(res['llama_flags'])}"
             + (f"; copy bandwidth {bw / 1e12:.2f} TB/s" if bw else ""),
             "",
             f"| llama.cpp | prompt | llama-bench tok/s | harness tok/s | harness {bs} tok/s | harness / llama-bench "
             f"| harness {bs} / llama-bench | server-reported {bs} / llama-bench |",
             "|---|---|---|---|---|---|---|---|"]
    for _, qtype in PAIRS:
        lla = res["llama"].get(qtype) or {}
        for n in res["lengths"]:
            b = _at(lla.get("llama_bench"), n)
            h, hb = _rate(lla.get("harness"), n), _rate(lla.get("harness_bs"), n)
            srv = _rate(lla.get("harness_bs"), n, "server_decode_tok_s")
            lines.append(f"| {qtype} | {n} | {fmt(b, '.1f')} | {fmt(h, '.1f')} | {fmt(hb, '.1f')} "
                         f"| {fmt(ratio(h, b), '.3f')} | {fmt(ratio(hb, b), '.3f')} | {fmt(ratio(srv, b), '.3f')} |")
    lines += ["",
              f"| precision | prompt | engine tok/s | engine a8 tok/s | llama.cpp (harness {bs}) tok/s "
              f"| engine / llama.cpp | engine a8 / llama.cpp | engine / llama-bench | engine % roof "
              f"| llama.cpp % roof | J/token engine / llama.cpp | engine a8 / llama-bench |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for eng_fmt, qtype in PAIRS:
        eng, eng8, lla = res["engine"].get(eng_fmt), res.get("engine_a8", {}).get(eng_fmt), res["llama"].get(qtype) or {}
        peer = lla.get("harness_bs")
        if "by_length" not in (peer or {}):
            peer = lla.get("harness")
            if peer:
                notes.append(f"{qtype}: no backend-sampling run; llama.cpp's column is the default harness run")
        for n in res["lengths"]:
            e, e8, h = _rate(eng, n), _rate(eng8, n), _rate(peer, n)
            b = _at(lla.get("llama_bench"), n)
            ctx = n + OUTPUT_TOKENS // 2
            roof_e = bw / step_bytes(shape, eng_fmt, ctx) if bw else None
            roof_l = bw / step_bytes(shape, qtype, ctx) if bw else None
            lines.append(
                f"| {eng_fmt} / {qtype} | {n} | {fmt(e, '.1f')} | {fmt(e8, '.1f')} | {fmt(h, '.1f')} "
                f"| {times(ratio(e, h))} | {times(ratio(e8, h))} | {times(ratio(e, b))} "
                f"| {fmt(100 * e / roof_e if e and roof_e else None, '.1f')} "
                f"| {fmt(100 * h / roof_l if h and roof_l else None, '.1f')} "
                f"| {fmt((eng or {}).get('decode_j_per_token'), '.3f')} "
                f"/ {fmt((peer or {}).get('decode_j_per_token'), '.3f')} | {times(ratio(e8, b))} |")
    notes.append(MATCHING_PRECISION)
    return "\n".join(lines + notes)


def side_of(res: dict[str, Any], label: str) -> dict[str, Any] | None:
    """The JSON side a run label names (llama-<type>[-bs], engine-<fmt>[-a8]), or None."""
    kind, _, rest = label.partition("-")
    if kind == "llama":
        qtype, bs = (rest[:-3], "harness_bs") if rest.endswith("-bs") else (rest, "harness")
        return (res.get("llama") or {}).get(qtype, {}).get(bs)
    fmt, a8 = (rest[:-3], "engine_a8") if rest.endswith("-a8") else (rest, "engine")
    return (res.get(a8) or {}).get(fmt)


def rephased_decode_j(run_dir: Path) -> float | None:
    """Decode J/token of a speed run from its NVML samples, each request's phases moved to when its
    answer was sent: runs before the speed task marked them so started each request's prefill and
    decode at the call (a llama-server request sent again after a dropped connection waited about
    1 s first) and ended its decode after the stream's close. The answer was sent `wall_s` before
    the request's end (the old idle mark); its decode ran from ttft_s to e2e_s after that."""
    from moebench.probes.energy import summarize
    from moebench.probes.nvml import read_samples
    samples, phases = read_samples(run_dir)
    items = [json.loads(line) for line in (run_dir / "items.jsonl").read_text().splitlines() if line.strip()]
    items = [r for r in items if r.get("task") == "speed" and r.get("status") == "ok"]
    marks = sorted(phases, key=lambda m: float(m["t"]))
    starts = [i for i, m in enumerate(marks) if m["phase"] == "prefill"]
    if len(starts) != len(items):
        raise RuntimeError(f"{run_dir}: {len(starts)} prefill marks for {len(items)} speed records")
    out = [m for i, m in enumerate(marks) if not any(s <= i <= s + 2 for s in starts)]
    for s, r in zip(starts, items):
        call, end = float(marks[s]["t"]), float(marks[s + 2]["t"])
        if [marks[s + 1]["phase"], marks[s + 2]["phase"]] != ["decode", "idle"]:
            raise RuntimeError(f"{run_dir}: request at {call:.3f} s is not marked prefill, decode, idle")
        sent = end - float(r["timings"]["wall_s"])
        out += [{"phase": "idle", "t": call}, {"phase": "prefill", "t": sent},
                {"phase": "decode", "t": sent + float(r["ttft_s"])}, {"phase": "idle", "t": sent + float(r["e2e_s"])}]
    tokens = json.loads((run_dir / "manifest.json").read_text())["probes"]["nvml"]["tokens"]
    energy = summarize(samples, out, tokens=tokens).energy
    per = energy.per_token.get("decode") if energy is not None else None
    return per.gross_j_per_token if per is not None else None


def rephase(runs: Path, path: Path) -> None:
    """Each side's decode J/token in `path` recomputed from its run under `runs` (rephased_decode_j);
    the figure the run recorded stays as decode_j_per_token_recorded."""
    res = json.loads(path.read_text())
    for run_dir in sorted(d for d in runs.iterdir() if (d / "nvml_phases.json").is_file()):
        side = side_of(res, run_dir.name)
        if side is None or "error" in side:
            continue
        j = rephased_decode_j(run_dir)
        side.setdefault("decode_j_per_token_recorded", side.get("decode_j_per_token"))
        side["decode_j_per_token"] = j
        log(f"{run_dir.name}: decode J/token {side['decode_j_per_token_recorded']} as recorded, {j} rephased")
    path.write_text(json.dumps(res, indent=1, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="stage", required=True)
    s = sub.add_parser("stage-source")
    s.add_argument("--to", type=Path, default=ROOT / ".peers")
    b = sub.add_parser("build")
    b.add_argument("--carry", type=Path, action="append",
                   help="a carried folder (give several for llama_cuda_prebuilt.py's two packs); default .peers")
    b.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    w = sub.add_parser("wait-build", help="wait for a background `build` to end (exit 1 if it failed or timed out)")
    w.add_argument("--timeout", type=float, default=600)
    p = sub.add_parser("prepare")
    p.add_argument("--work", type=Path, action="append", required=True,
                   help="a candidate folder (give several: the roomiest that fits the largest shape is used)")
    p.add_argument("--link", type=Path, required=True, help="a symlink made to the folder chosen")
    p.add_argument("--carry", type=Path, default=ROOT / ".peers")
    p.add_argument("--small", action="store_true")
    p.add_argument("--seed", type=int, default=43)
    p.add_argument("--engine-only", action="store_true", help="no GGUFs: for `measure --skip llama-bf16,...`")
    m = sub.add_parser("measure")
    m.add_argument("--work", type=Path, required=True)
    m.add_argument("--out", type=Path, required=True)
    m.add_argument("--small", action="store_true")
    m.add_argument("--reps", type=int, default=5, help="llama-bench repetitions")
    m.add_argument("--skip", default="", help="comma list of llama-<type> / engine-<fmt> to leave out")
    t = sub.add_parser("table", help="print the tables of one measure call's JSON, or of several calls' "
                       "(later files' sides replace earlier ones'; each call's figures stay its own)")
    t.add_argument("json", type=Path, nargs="+")
    r = sub.add_parser("rephase", help="decode J/token of each side recomputed from its run's NVML samples "
                       "with each request's phases from when its answer was sent (runs before that fix)")
    r.add_argument("--runs", type=Path, required=True, help="the measure call's runs folder")
    r.add_argument("json", type=Path, help="that call's JSON, updated in place")
    a = ap.parse_args(argv)
    if a.stage == "stage-source":
        stage_source(a.to)
    elif a.stage == "build":
        build(a.carry or [ROOT / ".peers"], a.jobs)
    elif a.stage == "wait-build":
        return wait_build(a.timeout)
    elif a.stage == "prepare":
        prepare(a.work, a.link, a.carry, a.small, a.seed, a.engine_only)
    elif a.stage == "measure":
        skip = {x for x in a.skip.split(",") if x}
        unknown = sorted(skip - SIDES)
        if unknown:
            ap.error(f"--skip: unknown side(s) {', '.join(unknown)}; the sides are {', '.join(sorted(SIDES))}")
        measure(a.work, a.out, a.small, a.reps, skip)
    elif a.stage == "rephase":
        rephase(a.runs, a.json)
    else:
        print(table(merge([json.loads(f.read_text()) for f in a.json])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
