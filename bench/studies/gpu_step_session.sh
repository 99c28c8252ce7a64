#!/usr/bin/env bash
# The decode step at the weight-read floor, on one lent H100/H200, in one call (stage limits sum to 9 min 25 s):
#  1. bench/studies/gpu_backbone.py at LLaDA-8B's shape: the weight-read floor two ways (datasheet, a measured copy) and the
#     cached step of each way of running the backbone (hand-written kernels as CUDA graphs, plus the Triton
#     products; regional torch.compile with the specs or the kernels) at B = 1 and 32, the fastest recorded;
#  2. bench/studies/gpu_race.py at LLaDA-8B's shape: Fast-dLLM's own code (tokens checked equal first, fp32 on two layers)
#     against tracelock's eager loop and engine at k = 2 and 4 tokens per step, B = 1, 32, 8, each cell's
#     speedup_vs_fastdllm;
#  3. bench/studies/gpu_gemm.py: the four products at 1-32 rows: cuBLAS, max-autotune and the Triton weight-streaming
#     kernel, with their epilogues;
#  4. the Triton kernels' parity tests natively, each autotune config on its own (against kernels/ref.py);
#  5. bench/studies/gpu_step.py at LLaDA-8B's shape: torch.profiler on one refresh and one cached step (profile-llada-8b.md),
#     the head and tap kernels against their roofline, TraceLock's step with the shipped commit rule against the bare
#     step (goal 1.05x) and the commit kernel per step;
#  6. bench/studies/gpu_quant.py at LLaDA-8B's shape: torchao's int8, int4 (tile_packed_to_4d) and fp8 (per row): quantizing's
#     seconds, the cached step per format against its own floor and against bf16, B = 1 then 32;
#  7. Dream-7B's shape: the backbone variants at B = 1 and the race.
# Every script rewrites its JSON after each stage and skips a stage its time budget cannot fit, so a stage cut off
# by its timeout keeps what the earlier stages measured.
#
#   bash bench/studies/stage_peers.sh          # here, first: Fast-dLLM and its wheels into bench/.peers (git-ignored)
#   run(carry=["bench/.peers"], command="OUT=$OUT bash bench/studies/gpu_step_session.sh")       # on the device
#   DRY_RUN=1 OUT=/tmp/x bash bench/studies/gpu_step_session.sh        # the same stages on a CPU at tiny shapes
#
# Fast-dLLM's code is not in this repository: PEER names a checkout (default bench/.peers/fast-dllm, which
# bench/studies/stage_peers.sh fills; ../shared/peers/fast-dllm when that exists). Without one the session stops at once
# (NO_PEER=1 runs it without the race's Fast-dLLM rows).
set -uo pipefail
OUT=${OUT:-bench/results/gpu-step-session}
DRY_RUN=${DRY_RUN:-0}
INDUCTOR=${INDUCTOR:-0}
NO_PEER=${NO_PEER:-0}
PEER=${PEER:-}
if [ -z "$PEER" ]; then
  for p in bench/.peers/fast-dllm ../shared/peers/fast-dllm; do [ -f "$p/llada/generate.py" ] && PEER=$p && break; done
fi
if [ -z "$PEER" ] && [ "$NO_PEER" != 1 ] && [ "$DRY_RUN" != 1 ]; then
  echo "gpu_step_session: no Fast-dLLM checkout (bench/.peers/fast-dllm): run 'bash bench/studies/stage_peers.sh' here and" \
       "carry bench/.peers to the device, or set PEER=DIR, or NO_PEER=1 to run without Fast-dLLM" >&2
  exit 2
fi
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
stage() { printf '\n=== %s (%s)\n' "$1" "$(date +%T)"; }
quiet() { grep -v "Warning\|warnings.warn\|USDT"; }
# a bare device machine needs the package installed (no C++ extension needed: the engine runs torch and Triton ops)
python3 -c "import tracelock.kernels" 2>/dev/null \
  || TRACELOCK_BUILD_EXT=0 timeout 30 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . \
     >/tmp/pip.log 2>&1 || { tail -20 /tmp/pip.log; exit 1; }
# the peer's imports, from the wheels bench/studies/stage_peers.sh put beside it (the device has no network)
if [ -n "$PEER" ] && ! python3 -c "import einops" 2>/dev/null && [ -d bench/.peers/wheels ]; then
  timeout 30 python3 -m pip install -q --no-index --find-links bench/.peers/wheels einops >/tmp/pip-peer.log 2>&1 \
    || tail -5 /tmp/pip-peer.log
fi
# torchao (the quant extra) for stage 6, from the same wheels
if ! python3 -c "import torchao" 2>/dev/null && ls bench/.peers/wheels/torchao-*.whl >/dev/null 2>&1; then
  timeout 30 python3 -m pip install -q --no-deps --no-index --find-links bench/.peers/wheels torchao \
    >/tmp/pip-torchao.log 2>&1 || tail -5 /tmp/pip-torchao.log
fi

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

stage "LLaDA-8B shape: the floor two ways and the cached step of each backbone variant, B = 1 and 32"
timeout 140 python3 bench/studies/gpu_backbone.py --out "$OUT" --shape llada-8b --budget 125 "${COMMON[@]}" 2>&1 | quiet | tail -12

stage "LLaDA-8B shape: k per step against Fast-dLLM's own code, B = 1, 32, 8"
timeout 120 python3 bench/studies/gpu_race.py --out "$OUT" --shape llada-8b --budget 105 "${RACE[@]}" 2>&1 | quiet | tail -16

stage "the four products at 1-32 rows: cuBLAS, max-autotune, the Triton weight-streaming kernel"
timeout 55 python3 bench/studies/gpu_gemm.py --out "$OUT" --budget 45 "${COMMON[@]}" 2>&1 | quiet | tail -12

stage "Triton kernels against their specs, each autotune config on its own (natively: the bf16 tensor-core path)"
if [ "$DRY_RUN" = 1 ]; then
  echo "dry run: tests/test_kernel_*.py run under TRITON_INTERPRET=1 in CI; skipped here"
else
  TRACELOCK_SKIP_AUTOTUNE=1 timeout 35 python3 -m pytest -q -p no:cacheprovider --junitxml="$OUT/kernel-tests.xml" \
    tests/test_kernel_tap_project.py tests/test_kernel_window_stats.py tests/test_kernel_add_rms_norm.py \
    tests/test_kernel_rope_qkv.py tests/test_kernel_silu_mul.py tests/test_kernel_commit_step.py \
    -k "every_config or real_vocab or rule or matches" 2>&1 | tail -4
fi

stage "LLaDA-8B shape: profile of a refresh and a cached step, kernels vs roofline, TraceLock's step"
timeout 80 python3 bench/studies/gpu_step.py --out "$OUT" --shape llada-8b --budget 70 "${COMMON[@]}" 2>&1 | quiet | tail -45

stage "LLaDA-8B shape: quantized weights (torchao int8, int4, fp8): the cached step per format, B = 1 then 32"
timeout 45 python3 bench/studies/gpu_quant.py --out "$OUT" --shape llada-8b --budget 38 "${COMMON[@]}" 2>&1 | quiet | tail -16

stage "Dream-7B shape: the backbone variants at B = 1, then k per step against Fast-dLLM's own code"
timeout 35 python3 bench/studies/gpu_backbone.py --out "$OUT" --shape dream-7b --budget 30 --batches 1 "${COMMON[@]}" 2>&1 | quiet | tail -8
timeout 55 python3 bench/studies/gpu_race.py --out "$OUT" --shape dream-7b --budget 45 "${RACE[@]}" 2>&1 | quiet | tail -16
stage "done"
ls "$OUT"
