#!/usr/bin/env bash
# The static-shape decode step on one lent H100/H200, in one call (8.5 minutes on an H100, 2026-11-26):
#  1. the engine on CUDA (tests/test_engine_cuda.py: uncompiled, CUDA-graph capture and torch.compile, each row equal
#     to fused_generate on the tiny checkpoints in fp32; one sync per step);
#  2. bench/studies/gpu_decode.py at LLaDA-8B's shape, random bf16 weights, B = 1, gen 256, blocks of 32, Fast-dLLM's 0.9 rule
#     with the dual cache: the cached step against the weight-read floor, Fast-dLLM's own dual-cache code on the same
#     weights, tokens/s at B = 1, 8, 32, host syncs per step.
#
#   OUT=/some/dir PEER=/path/to/fast-dllm bash bench/studies/gpu_compile_session.sh
#   DRY_RUN=1 OUT=/tmp/x bash bench/studies/gpu_compile_session.sh        # the same stages on a CPU at tiny shapes
#
# Fast-dLLM's code is not in this repository: PEER names a checkout on the device (default ../shared/peers/fast-dllm
# when it exists; it needs einops). Without it its row says why it was skipped. Each stage has its own time limit.
set -uo pipefail
OUT=${OUT:-bench/results/gpu-compile-session}
PEER=${PEER:-}
DRY_RUN=${DRY_RUN:-0}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
stage() { printf '\n=== %s (%s)\n' "$1" "$(date +%T)"; }
# a bare device machine needs the package installed (no C++ extension needed: the engine runs torch and Triton ops)
python3 -c "import tracelock.kernels" 2>/dev/null \
  || TRACELOCK_BUILD_EXT=0 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/tmp/pip.log 2>&1 \
  || { tail -20 /tmp/pip.log; exit 1; }

stage "machine"
nvidia-smi -L 2>/dev/null || echo "no nvidia-smi (dry run?)"
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__,
  torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" | tee "$OUT/machine.txt"

stage "the engine on CUDA (skipped without a GPU)"
timeout 240 python3 -m pytest -q -p no:cacheprovider --junitxml="$OUT/engine-cuda-tests.xml" \
  tests/test_engine_cuda.py 2>&1 | tail -8

stage "LLaDA-8B shape: cached step vs floor, Fast-dLLM dual cache, tokens/s, syncs"
ARGS=(--out "$OUT")
[ -n "$PEER" ] && ARGS+=(--peer-fastdllm "$PEER")
[ "$DRY_RUN" = 1 ] && ARGS+=(--dry-run)
timeout 330 python3 bench/studies/gpu_decode.py "${ARGS[@]}" 2>&1 | grep -v "Warning\|warnings.warn" | tail -30
stage "done"
