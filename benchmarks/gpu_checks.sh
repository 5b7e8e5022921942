#!/usr/bin/env bash
# The GPU-machine checks, in one call (device tool): CUDA parity/tiering tests, the NVML probe test,
# then the needle/speed/energy benchmark. Logs under $OUT. Usage: bash benchmarks/gpu_checks.sh [DATA_DIR]
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MOEBENCH_DATA_DIR=${1:-$PWD/.gpu_data}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi -L; python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())'
timeout 300 python3 -m pytest -q -p no:cacheprovider -k "cuda or nvml" tests/test_engine_parity.py tests/test_engine_generate.py \
    tests/test_engine_tiering.py tests/test_probes.py 2>&1 | tee "$OUT/cuda_tests.log" | tail -25
timeout 420 python3 benchmarks/needle_speed_gpu.py --out "$OUT" 2>&1 | tee "$OUT/needle_speed.log" | tail -40
