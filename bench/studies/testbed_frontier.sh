#!/usr/bin/env bash
# The TEST-split frontier of a bundled testbed model: every policy along its knob, after the recipe was chosen on
# validation (bench/studies/testbed_recipe.sh). Learn2PD's filters for each width of SETTINGS are trained first where the
# study's l2p/ folder lacks them (training-split traces, as in the study).
#
#   MODEL=testbed WORK=runs/recipe-llada CONTROLLER=runs/recipe-llada/ctrl-small-2k-conf \
#     ST=runs/recipe-llada/st/controller bash bench/studies/testbed_frontier.sh
#   MODEL=testbed WORK=runs/verdict-llada ST=tracelock/testbed/controller-llada SEED=2026 \
#     bash bench/studies/testbed_frontier.sh      # the shipped controller only (the verdict's TraceLock-ST)
#   MODEL=testbed WORK=runs/verdict-llada SEED=2026 bash bench/studies/testbed_frontier.sh   # the heuristics and Learn2PD
#     only: their points do not depend on a controller, so they can run while one is chosen (a later call with ST
#     resumes them and adds the TraceLock curves to the same frontier.json)
#
# Environment: MODEL, WORK (the study folder: l2p/ is read and completed there), CONTROLLER and ST (optional:
# TraceLock and TraceLock-ST run folders), OUT ($WORK/frontier-test), LIMIT (500 items per task, a random draw with SEED, 0),
# SETTINGS (64/16,64/32,128/32,128/64), PER_STEP, TAUS, L2P_THRESHOLDS, THETAS (the grids; theta as dense as tau where the curves move), N_TRAIN (200: Learn2PD's
# training items), ST_RULE (tracelock policy arguments added to the TraceLock-ST curve; default none: the
# controller's own commit rule; hold_end=false:fallback=score: the paper's, as in the verdict's committed records),
# ST_VARIANT (tracelock policy arguments, e.g. hold_end=true:fallback=confidence: a second TraceLock-ST curve with
# them, "TraceLock-ST (variant)"), BATCH (50 rows per decode call), JOBS (2: math and code decoded side by side, one torch thread each; 1: one after the other).
# The family's one-per-step rule (LLaDA: confidence; Dream: neg-entropy, one token per step) is swept along
# per_step; on a Dream model Fast-dLLM's Dream variant (the block's first token from the refresh) runs beside its
# LLaDA form. Each run writes records.json (per item) beside frontier.json; `python -m tracelock.eval.matched OUT`
# prints the verdict (accuracy at matched steps against the strongest heuristic) from them.
set -euo pipefail
MODEL=${MODEL:-testbed}
WORK=${WORK:?set WORK to the recipe study folder}
CONTROLLER=${CONTROLLER:-}
ST=${ST:-}
OUT=${OUT:-$WORK/frontier-test}
LIMIT=${LIMIT:-500}
SEED=${SEED:-0}
SETTINGS=${SETTINGS:-64/16,64/32,128/32,128/64}
PER_STEP=${PER_STEP:-1,2,4}
TAUS=${TAUS:-0.5,0.55,0.6,0.65,0.7,0.75,0.8,0.85,0.9,0.95}
L2P_THRESHOLDS=${L2P_THRESHOLDS:-0.8,0.9,0.96}
THETAS=${THETAS:-0.3,0.5,0.55,0.6,0.65,0.7,0.75,0.8,0.85,0.9,0.95,0.99}
N_TRAIN=${N_TRAIN:-200}
BATCH=${BATCH:-50}
JOBS=${JOBS:-2}
export OMP_NUM_THREADS=1
OUT=$(realpath -m "$OUT")
FAMILY=$(python -c "import sys; from tracelock.eval.frontier import _family; print(_family(sys.argv[1]))" "$MODEL")
RULE=confidence
PEERS=()
LEARNED=()   # the TraceLock curves: TraceLock-ST (ST), its variant (ST_VARIANT), the supervised controller (CONTROLLER)
if [ -n "$ST" ]; then
  ST=$(realpath "$ST")
  if [ -n "${ST_VARIANT:-}" ]; then
    LEARNED+=(--sweep "tracelock:theta=$THETAS:controller=$ST:$ST_VARIANT:curve=TraceLock-ST (variant)")
  fi
  LEARNED+=(--sweep "tracelock:theta=$THETAS:controller=$ST${ST_RULE:+:$ST_RULE}:curve=TraceLock-ST")
fi
if [ -n "$CONTROLLER" ]; then
  LEARNED+=(--sweep "tracelock:theta=$THETAS:controller=$(realpath "$CONTROLLER"):curve=TraceLock")
fi
if [ "$FAMILY" = dream ]; then
  RULE=confidence:score=neg_entropy
  PEERS=(--sweep "threshold:tau=$TAUS:first_token=true:curve=Fast-dLLM (Dream)")
fi
cd "$WORK"
say() { printf '[frontier %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

for width in $(printf '%s\n' ${SETTINGS//,/ } | cut -d/ -f2 | sort -un); do
  if [ ! -f "l2p/block-$width.json" ]; then
    say "Learn2PD filter for blocks of $width"
    tracelock collect --model "$MODEL" --prompts testbed:math,code --limit "$N_TRAIN" --out "l2p-traces-b$width" \
      --fraction 0.3 --confidence --batch-size 50 --block "$width" --no-filters > "l2p-traces-b$width.log" 2>&1
    tracelock train-l2p --traces "l2p-traces-b$width" --model "$MODEL" --block "$width" --out l2p \
      > "l2p-$width.log" 2>&1
  fi
done

frontier() {  # tasks
  tracelock frontier --model "$MODEL" --tasks "$1" --split test --limit "$LIMIT" --seed "$SEED" \
    --settings "$SETTINGS" --l2p "$PWD/l2p" --batch-size "$BATCH" --workers 1 --threads 1 --out "$OUT" \
    --sweep "$RULE:per_step=$PER_STEP" --sweep "threshold:tau=$TAUS" "${PEERS[@]}" \
    --sweep "l2p:threshold=$L2P_THRESHOLDS" \
    "${LEARNED[@]}"
}
say "frontier (test) -> $OUT"
if [ "$JOBS" -ge 2 ]; then
  # one process per task, each in its own OUT/<task>/ run folders; the last call only reads them back
  frontier testbed:math > "$OUT.math.log" 2>&1 &
  frontier testbed:code > "$OUT.code.log" 2>&1 &
  wait
fi
frontier testbed:math,testbed:code > "$OUT.log" 2>&1
say "done: $OUT/frontier.json"
