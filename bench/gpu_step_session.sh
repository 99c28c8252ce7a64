#!/usr/bin/env bash
# The decode step at the weight-read floor, on one lent H100/H200, in one call (stage limits sum to 9 min 20 s;
# expected about 7.5 min on an H100):
#  1. the Triton kernels' parity tests natively, each autotune config on its own (against kernels/ref.py);
#  2. bench/gpu_step.py at LLaDA-8B's shape: torch.profiler on one refresh and one cached step (every kernel's time,
#     calls, bytes where derivable, GB/s, share of the step; profile-llada-8b.md), window_logits_stats and
#     tap_project against their roofline at B = 1, 8, 32, TraceLock's step with the shipped commit rule in the engine
#     against the bare step (goal 1.05x) and the commit kernel's time per step,
#     torchao's weight-only int8 (only if torchao imports on the device);
#  3. bench/gpu_race.py at LLaDA-8B's and then Dream-7B's shape: k = 2 and 4 tokens per step on both sides, Fast-dLLM's
#     own code (its steps argument) against tracelock's eager loop and engine (CUDA graphs; inductor with
#     INDUCTOR=1) at B = 1, 32, 8.
# Every script rewrites its JSON after each stage and skips a stage its time budget cannot fit, so a stage cut off
# by its timeout keeps what the earlier stages measured.
#
#   OUT=/some/dir PEER=/path/to/fast-dllm bash bench/gpu_step_session.sh
#   DRY_RUN=1 OUT=/tmp/x bash bench/gpu_step_session.sh        # the same stages on a CPU at tiny shapes
#
# Fast-dLLM's code is not in this repository: PEER names a checkout on the device (default ../shared/peers/fast-dllm
# when it exists; it needs einops). Without it its rows say why they were skipped.
set -uo pipefail
OUT=${OUT:-bench/results/gpu-step-session}
PEER=${PEER:-}
DRY_RUN=${DRY_RUN:-0}
INDUCTOR=${INDUCTOR:-0}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
stage() { printf '\n=== %s (%s)\n' "$1" "$(date +%T)"; }
quiet() { grep -v "Warning\|warnings.warn\|USDT"; }
# a bare device machine needs the package installed (no C++ extension needed: the engine runs torch and Triton ops)
python3 -c "import tracelock.kernels" 2>/dev/null \
  || TRACELOCK_BUILD_EXT=0 timeout 30 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . \
     >/tmp/pip.log 2>&1 || { tail -20 /tmp/pip.log; exit 1; }

stage "machine"
nvidia-smi -L 2>/dev/null || echo "no nvidia-smi (dry run?)"
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__,
  torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" | tee "$OUT/machine.txt"
python3 -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1 | tee -a "$OUT/machine.txt"

COMMON=()
[ "$DRY_RUN" = 1 ] && COMMON+=(--dry-run)
RACE=("${COMMON[@]}")
[ -n "$PEER" ] && RACE+=(--peer-fastdllm "$PEER")
[ "$INDUCTOR" = 1 ] && RACE+=(--inductor)

stage "Triton kernels against their specs, each autotune config on its own (natively: the bf16 tensor-core path)"
if [ "$DRY_RUN" = 1 ]; then
  echo "dry run: tests/test_kernel_*.py run under TRITON_INTERPRET=1 in CI; skipped here"
else
  TRACELOCK_SKIP_AUTOTUNE=1 timeout 50 python3 -m pytest -q -p no:cacheprovider --junitxml="$OUT/kernel-tests.xml" \
    tests/test_kernel_tap_project.py tests/test_kernel_window_stats.py -k "every_config or real_vocab" 2>&1 | tail -4
fi

stage "LLaDA-8B shape: profile of a refresh and a cached step, kernels vs roofline, TraceLock's step, int8"
timeout 140 python3 bench/gpu_step.py --out "$OUT" --shape llada-8b --budget 115 "${COMMON[@]}" 2>&1 | quiet | tail -45

stage "LLaDA-8B shape: k per step against Fast-dLLM's own code, B = 1, 32, 8"
timeout 180 python3 bench/gpu_race.py --out "$OUT" --shape llada-8b --budget 150 "${RACE[@]}" 2>&1 | quiet | tail -16

stage "Dream-7B shape: k per step against Fast-dLLM's own code, B = 1, 32, 8"
timeout 160 python3 bench/gpu_race.py --out "$OUT" --shape dream-7b --budget 130 "${RACE[@]}" 2>&1 | quiet | tail -16
stage "done"
ls "$OUT"
