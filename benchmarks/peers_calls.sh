#!/usr/bin/env bash
# The peers procedure (docs/peers-h200.md, "Reproduce") as two device calls on one machine, each
# under the 10-minute limit; the second within 30 s of the first, while the machine is still held:
#   bash benchmarks/peers_calls.sh build     # the llama.cpp CUDA build in the background at nice 19,
#                                            # the six files, the CUDA tests, then wait for the build
#   bash benchmarks/peers_calls.sh measure   # the engine's five sides, llama.cpp's three, the table
#   bash benchmarks/peers_calls.sh engine    # one call: the engine's files alone (no GGUFs) and its five
#                                            # sides, for a table whose llama.cpp sides an earlier call measured
# Carry .peers (`python3 benchmarks/peers_h200.py stage-source --to .peers`) and .gpu_data (a copy of
# ../shared/datasets, for the CUDA tests; SKIP_TESTS=1 leaves them out). Under $OUT: build.log, the
# CUDA tests' logs and gpu_checks.json; engine.json and llama.json (one measure each: `peers_h200.py table
# engine.json llama.json` prints them as one, the copy bandwidth the engine's) and each one's runs as a tar.
# With llama.cpp built here instead (benchmarks/llama_cuda_prebuilt.py: `pack --to .peers --cuda-to
# .peers-cuda`, then .peers without llama-src.tar.gz), the first call is `prepare` (the pack's binaries
# and source files unpacked, the six files; carry .peers) and `measure` installs the second pack first
# (carry .peers-cuda alone: .peers stays on the machine from the first call).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 MOEBENCH_CACHE=/root/mbc MOEBENCH_DATA_DIR=$PWD/.peers/datasets
export PATH=$PATH:/usr/local/cuda/bin
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
WORK=/root/peers-work
t0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - t0) )); }
nvidia-smi -L
prepare() {
    timeout 300 python3 benchmarks/peers_h200.py prepare --work /root/peers --work /dev/shm/peers --link $WORK "$@" \
        2>&1 | tail -8
    echo "prepare done at $(( $(date +%s) - t0 )) s"
}
# one measure within $1 seconds, skipping the sides $3; $2 names its folder, JSON and runs tar under $OUT
sides() {
    timeout "$1" python3 benchmarks/peers_h200.py measure --work $WORK --out "/root/$2" --reps 3 --skip "$3" \
        2>&1 | tail -12
    cp "/root/$2/peers_h200.json" "$OUT/$2.json"; tar -czf "$OUT/$2-runs.tgz" -C "/root/$2" .
}
LLAMA_SIDES=llama-bf16,llama-Q8_0,llama-Q4_0
ENGINE_SIDES=engine-bf16,engine-int8,engine-int4,engine-int8-a8,engine-int4-a8
case "${1:-}" in
build)
    setsid nohup nice -n 19 python3 benchmarks/peers_h200.py build --carry .peers --jobs 15 \
        > /root/build.log 2>&1 < /dev/null &
    prepare
    if [ "${SKIP_TESTS:-0}" != 1 ]; then
        TESTS_ONLY=1 bash benchmarks/gpu_checks.sh "$PWD/.gpu_data" 2>&1 | tail -15
        echo "tests done at $(( $(date +%s) - t0 )) s"
    fi
    python3 benchmarks/peers_h200.py wait-build --timeout "$(left 585)"; rc=$?
    tail -3 /root/build.log; cp /root/build.log "$OUT/"
    echo "build call took $(( $(date +%s) - t0 )) s"
    exit $rc ;;
prepare)
    python3 benchmarks/llama_cuda_prebuilt.py unpack --carry .peers || exit 1
    prepare
    echo "prepare call took $(( $(date +%s) - t0 )) s" ;;
engine)
    prepare --engine-only
    sides "$(left 590)" engine $LLAMA_SIDES
    echo "engine call took $(( $(date +%s) - t0 )) s" ;;
measure)
    if [ -f .peers-cuda/llama-cuda-lib.tar.xz ]; then
        python3 benchmarks/peers_h200.py build --carry .peers --carry .peers-cuda 2>&1 | tail -3
        python3 benchmarks/peers_h200.py wait-build --timeout 1 || exit 1
        echo "install done at $(( $(date +%s) - t0 )) s"
    fi
    # The engine first: llama.cpp's build does not change between code versions, the engine does.
    sides "$(( $(left 590) - 330 ))" engine $LLAMA_SIDES
    echo "the engine's sides took $(( $(date +%s) - t0 )) s"
    sides "$(left 590)" llama $ENGINE_SIDES
    python3 benchmarks/peers_h200.py table "$OUT/engine.json" "$OUT/llama.json"
    echo "measure call took $(( $(date +%s) - t0 )) s" ;;
*)
    echo "usage: bash benchmarks/peers_calls.sh build|prepare|measure|engine" >&2; exit 2 ;;
esac
