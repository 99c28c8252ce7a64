#!/usr/bin/env bash
# The fused backbone step on one lent H100/H200, in one call whose results cannot be lost: the stages, their budgets
# (475 s in all) and what comes back are in bench/studies/step_session.py. $OUT receives three files: session.tar.gz
# (every stage's JSON, tables, kernel-test reports and console, rewritten after each stage and each measured cell),
# session.json (each stage's status) and session.log.
#
#   bash bench/studies/stage_peers.sh          # here, first: Fast-dLLM and its wheels into bench/.peers (git-ignored)
#   run(carry=["bench/.peers"], timeout_s=560, command="bash bench/studies/gpu_step_session.sh")    # on the device
#   DRY_RUN=1 OUT=/tmp/x bash bench/studies/gpu_step_session.sh        # the same stages on a CPU at tiny shapes
#
# Fast-dLLM's code is not in this repository: PEER names a checkout (default bench/.peers/fast-dllm, which
# bench/studies/stage_peers.sh fills). Without one the session stops at once (NO_PEER=1 runs it without the race's
# Fast-dLLM rows).
set -uo pipefail
OUT=${OUT:-bench/results/gpu-step-session}
DRY_RUN=${DRY_RUN:-0}
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
ARGS=(--out "$OUT")
[ -n "$PEER" ] && ARGS+=(--peer "$PEER")
[ "$DRY_RUN" = 1 ] && ARGS+=(--dry-run)
exec python3 "$(dirname "$0")/step_session.py" "${ARGS[@]}"
