#!/usr/bin/env bash
# The GPU checks of one lent H100/H200 session, in one call (about 6 minutes on an H200): build tracelock._C
# with CUDA, run the GPU parity tests (the CUDA commits, the Triton kernels at real shapes, fused == reference on
# the GPU), then time the kernels, the TraceLock step and the decode loops at LLaDA-8B's shape, random bf16 weights.
#
#   OUT=/some/dir bash bench/studies/gpu_session.sh       # results (JSON, logs) land in $OUT
#
# Each stage has its own time limit, so a failure or a slow stage leaves the others their time.
set -uo pipefail
OUT=${OUT:-bench/results/gpu-session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 MAX_JOBS=16 NVCC_THREADS=4 TRACELOCK_CUDA_ARCHS=90
stage() { printf '\n=== %s (%s)\n' "$1" "$(date +%T)"; }

stage "machine"
nvidia-smi -L
python3 -c "import torch, triton, sys; print(sys.version.split()[0], torch.__version__, 'cuda', torch.version.cuda,
  'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/machine.txt"

stage "build tracelock._C with CUDA"
start=$SECONDS
if ! TRACELOCK_BUILD_CUDA=1 timeout 180 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . \
  >"$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"
  echo "the CUDA build failed: installing without the extension, so the Triton and torch paths still run"
  TRACELOCK_BUILD_EXT=0 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . 2>&1 | tail -5
fi
echo "build: $((SECONDS - start)) s"
python3 -c "from tracelock import _ext; print('cpp', _ext.has_cpp(), 'cuda', _ext.has_cuda_ext(), _ext.ext_error())"

stage "GPU parity tests"
timeout 200 python3 -m pytest -q -p no:cacheprovider --junitxml="$OUT/tests.xml" tests/test_csrc.py \
  tests/test_cuda_decode.py tests/test_kernel_window_stats.py tests/test_kernel_tap_project.py \
  tests/test_kernel_commit_step.py tests/test_fused_forward.py 2>&1 | tail -25

# random weights at LLaDA-8B's shape, B=8, 128-token prompts, gen 128, blocks / window of 32
SHAPE=(--shape llada-8b --bench-items 8 --gen-length 128 --width 32)
stage "kernels (they read only the LM head and the hidden size: 3 layers)"
timeout 100 python3 -m pytest -q -p no:cacheprovider bench/test_bench_kernels.py --benchmark "${SHAPE[@]}" \
  --shape-layers 3 --benchmark-json="$OUT/llada8b-kernels.json" --benchmark-columns=median,iqr,rounds 2>&1 | tail -25

stage "TraceLock step vs bare forward, all 32 layers"
timeout 130 python3 -m pytest -q -p no:cacheprovider bench/test_bench_step.py --benchmark "${SHAPE[@]}" \
  --bench-rounds 3 --benchmark-json="$OUT/llada8b-step.json" --benchmark-columns=median,iqr,rounds 2>&1 | tail -12

stage "decode loops, first 8 layers"
timeout 150 python3 -m pytest -q -p no:cacheprovider bench/test_bench_decode.py --benchmark "${SHAPE[@]}" \
  --bench-rounds 2 --shape-layers 8 --benchmark-json="$OUT/llada8b-8layers-decode.json" \
  --benchmark-columns=median,iqr,rounds 2>&1 | tail -30
stage "done"
