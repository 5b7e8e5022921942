#!/bin/bash
# One H200 call of record for the decode goals (docs/engine-speed.md), from the repository root:
# the CUDA tests of the engine, decode_ab.py's defaults, tiers_h200.py's tier plans, then
# decode_goals.py's table. Files go to $OUT (8 of them at most come back from a lent machine).
#
#     MOEBENCH_DATA_DIR=<a copy of shared/datasets> OUT=<dir> bash benchmarks/goals_h200.sh
#
# Each step has its own time limit (575 s in all, under a call's 600), and a failed step
# does not stop the others. On a machine whose Triton cache is cold the decode plans can need more
# than 215 s: SKIP_TESTS=1 leaves out the CUDA tests (run them in a call of their own) and gives the
# decode plans 360 s and the tier plans 225 s, without the route-tail-skip plan (not a goal).
set -u
: "${OUT:?set OUT to the output directory}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"    # the checkout's moebench (and moebench.bench), installed or not
t0=$(date +%s)
stamp() { echo "$1 rc $2 at $(( $(date +%s) - t0 )) s"; }
if [ "${SKIP_TESTS:-0}" = 1 ]; then
    decode_s=360; tiers_s=225; tiers_skip=plan_gpu_only,plan_gpu_host_skip
else
    decode_s=215; tiers_s=270; tiers_skip=plan_gpu_only
    timeout 90 python3 -m pytest -q -k 'cuda or gpu' tests/test_engine_generate.py tests/test_engine_kernels.py \
        tests/test_engine_ssd_tier.py tests/test_engine_telemetry.py > "$OUT/cuda_tests_h200.log" 2>&1
    stamp "cuda tests" $?; tail -1 "$OUT/cuda_tests_h200.log"; grep FAILED "$OUT/cuda_tests_h200.log"
fi
timeout $decode_s python3 benchmarks/decode_ab.py --tree . --out "$OUT/decode_ab_defaults.json" --variants \
    bf16,int4,int8hot_ternarycold_gpu,int8hot_ternary2cold_gpu,int8hot_ternary2cold_gpu_a8,int8hot_ternarycold_host_randomhot,int8hot_ternary2cold_host_a8 \
    > "$OUT/decode_ab_defaults.log" 2>&1
stamp "decode_ab defaults" $?
timeout $tiers_s python3 benchmarks/tiers_h200.py --out "$OUT" --ssd-lookahead 2 --skip $tiers_skip > "$OUT/tiers_h200.log" 2>&1
stamp "tier plans" $?
python3 benchmarks/decode_goals.py --decode-ab "$OUT/decode_ab_defaults.json" --tiers "$OUT/tiers_h200.json" \
    | tee "$OUT/goals_h200.txt"
