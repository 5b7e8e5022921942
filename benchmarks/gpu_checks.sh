#!/usr/bin/env bash
# The GPU-machine checks in one device call (under its 10-minute limit): the engine's CUDA tests
# (the CUDA-named tests of the kernel, parity, generate, tiering, SSD and probe files, and the decode
# attention's file whole: each of its tests runs on the GPU where there is one), then the
# benchmarks waiting for a GPU: engine_paths_h200.py (where the speed suite's engine rate goes)
# and tiered_prefill.py --device cuda (prefill of packed experts, per-expert against grouped).
# Logs and JSON under $OUT, and all of it in $OUT/gpu_checks.json (benchmarks/results/gpu_checks.json
# is the latest of record). Carry .gpu_data (a copy of ../shared/datasets) and .peers
# (`python3 benchmarks/peers_h200.py stage-source --to .peers`: the tokenizer the checkpoints take).
# Usage: [TESTS_ONLY=1] bash benchmarks/gpu_checks.sh [DATA_DIR]   (TESTS_ONLY=1: the tests alone)
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MOEBENCH_DATA_DIR=${1:-$PWD/.gpu_data}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi -L; python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())'
timeout 170 python3 -m pytest -q -p no:cacheprovider -rs \
    -k 'cuda or nvml or gpu or l2_prefetch or prefetch_programs or packed_evict_first or early or expert_ffn or fused_experts' \
    tests/test_engine_kernels.py tests/test_engine_parity.py tests/test_engine_generate.py tests/test_engine_tiering.py \
    tests/test_engine_ssd_tier.py tests/test_probes.py tests/test_probes_gpus.py 2>&1 | tee "$OUT/cuda_tests.log" | tail -5
timeout 120 python3 -m pytest -q -p no:cacheprovider -rs tests/test_attention_kernel.py \
    tests/test_prefill_attention.py::test_cuda_tail_causal_uses_no_cudnn_and_matches 2>&1 | tee "$OUT/attention_tests.log" | tail -3
if [ "${TESTS_ONLY:-0}" != 1 ]; then
    timeout 180 python3 benchmarks/engine_paths_h200.py --out "$OUT" 2>&1 | tee "$OUT/engine_paths.log" | tail -7
    timeout 240 python3 benchmarks/tiered_prefill.py --device cuda --out "$OUT" 2>&1 | tee "$OUT/tiered_prefill.log" | tail -14
fi
python3 - "$OUT" <<'PY'
import json, sys, torch
from pathlib import Path
out = Path(sys.argv[1])

def tests(name):
    f = out / f"{name}.log"
    log = f.read_text().splitlines() if f.is_file() else []
    return {"summary": log[-1] if log else None, "skipped": [l for l in log if l.startswith("SKIPPED")],
            "failed": [l for l in log if l.startswith("FAILED")]}


doc = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "torch": torch.__version__,
       "cuda_tests": tests("cuda_tests"), "attention_tests": tests("attention_tests")}
for name in ("engine_paths", "tiered_prefill"):
    f = out / f"{name}.json"
    doc[name] = json.loads(f.read_text()) if f.is_file() else None
(out / "gpu_checks.json").write_text(json.dumps(doc, indent=1) + "\n")
PY
