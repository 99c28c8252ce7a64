#!/usr/bin/env bash
# The controller recipe study on a bundled testbed model, on the VALIDATION split only (nothing here reads test).
#
#   MODEL=testbed WORK=runs/recipe-llada bash bench/studies/testbed_recipe.sh        # or MODEL=testbed-dream
#
# Stages (each resumes or is skipped when its output is complete, so a rerun finishes an interrupted study):
#   1. traces of N_TRAIN training items per task: fine blocks of 8 (the paper's collection) and the deployment
#      window (W, one token per step);
#   2. one PCA encoder (fit on the fine traces), a feature cache per trace set;
#   3. controllers: the variants below (train), Learn2PD's filters (train-l2p), self-training (self-train);
#   4. `tracelock frontier` on N_VAL validation items per task at SETTINGS: the reference rule, Fast-dLLM's
#      threshold, Learn2PD and every controller variant along theta; writes $WORK/frontier/frontier.{json,csv,png}.
# Environment: MODEL, WORK, N_TRAIN (200), N_VAL (200), SETTINGS (64/16), W (16), DEVICE (cpu), JOBS (1:
# controller trainings run one at a time; 2 runs two side by side, one torch thread each), ONLY (the variant names
# to train and sweep, space-separated; default all), ST_FROM (the variant self-training starts from), THETAS, TAUS,
# L2P_THRESHOLDS (the frontier's grids). Window traces are collected only when a chosen variant or ST_FROM uses them.
set -euo pipefail
MODEL=${MODEL:-testbed}
WORK=${WORK:?set WORK to the study folder}
N_TRAIN=${N_TRAIN:-200}
N_VAL=${N_VAL:-200}
SETTINGS=${SETTINGS:-64/16}
W=${W:-16}
DEVICE=${DEVICE:-cpu}
JOBS=${JOBS:-1}
ONLY=${ONLY:-}
ST_FROM=${ST_FROM:-small-2k-conf-win}
THETAS=${THETAS:-0.5,0.8,0.9,0.95,0.99}
TAUS=${TAUS:-0.5,0.7,0.8,0.9,0.95,0.99}
L2P_THRESHOLDS=${L2P_THRESHOLDS:-0.5,0.8,0.9,0.96,0.99}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$WORK"
cd "$WORK"
say() { printf '[recipe %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# The controller variants. The paper's size (width 384, 3 layers) costs as much per step as the 1.3 M-parameter backbone;
# "small" is scaled to the backbone (width 64, 2 layers). Each: name, cache, extra `tracelock train` arguments.
SMALL="--width 64 --layers 2 --heads 4 --ffn 128"
VARIANTS=(
  "paper-400 cache-b8 --steps 400 --eval-every 100"
  "paper-400-conf cache-b8 --steps 400 --eval-every 100 --confidence-input"
  "small-2k-conf cache-b8 --steps 2000 --eval-every 250 --confidence-input $SMALL"
  "small-10k-conf cache-b8 --steps 10000 --eval-every 500 --confidence-input $SMALL"
  "small-2k-conf-win cache-win --steps 2000 --eval-every 250 --confidence-input $SMALL"
)
chosen() { [ -z "$ONLY" ] || [[ " $ONLY " == *" $1 "* ]]; }
cache_of() { for v in "${VARIANTS[@]}"; do set -- $v; [ "$1" = "$ST_FROM" ] && echo "$2"; done; }
needs_win=0
for v in "${VARIANTS[@]}"; do
  set -- $v
  if chosen "$1" && [ "$2" = cache-win ]; then needs_win=1; fi
done
[ "$(cache_of)" = cache-win ] && needs_win=1

# 1. traces
collect() {  # out, schedule args...
  local out=$1; shift
  say "collect $out"
  tracelock collect --model "$MODEL" --prompts testbed:math,code --limit "$N_TRAIN" --out "$out" --fraction 0.3 \
    --confidence --batch-size 50 --device "$DEVICE" "$@" > "$out.log" 2>&1
}
collect traces-b8 --block 8
if [ "$needs_win" = 1 ]; then collect traces-win --window "$W"; fi

# 2. encoder and caches
if [ ! -f encoder/encoder.json ]; then
  say "fit-encoder"
  tracelock fit-encoder --traces traces-b8 --model "$MODEL" --out encoder > encoder.log 2>&1
fi
for t in b8 win; do
  [ -d "traces-$t" ] || continue
  say "featurize $t"
  tracelock featurize --traces "traces-$t" --model "$MODEL" --encoder encoder --cache-dtype fp16 --out "cache-$t" \
    > "cache-$t.log" 2>&1
done

# 3. controllers
train_variant() {
  local name=$1 cache=$2; shift 2
  chosen "$name" || [ "$name" = "$ST_FROM" ] || return 0
  if [ -f "ctrl-$name/metrics.json" ]; then return; fi
  say "train ctrl-$name"
  local resume=""; [ -f "ctrl-$name/state.json" ] && resume=--resume
  tracelock train --cache "$cache" --encoder encoder --out "ctrl-$name" --batch-size 32 --device "$DEVICE" $resume \
    "$@" > "ctrl-$name.log" 2>&1
}
running=0
for v in "${VARIANTS[@]}"; do
  # shellcheck disable=SC2086
  train_variant $v &
  running=$((running + 1))
  if [ "$running" -ge "$JOBS" ]; then wait -n; running=$((running - 1)); fi
done
wait
# Learn2PD: one filter per block size of SETTINGS, from traces decoded in blocks of that size (as upstream)
for width in $(printf '%s\n' ${SETTINGS//,/ } | cut -d/ -f2 | sort -un); do
  if [ ! -f "l2p/block-$width.json" ]; then
    collect "l2p-traces-b$width" --block "$width" --no-filters
    say "train-l2p block $width"
    tracelock train-l2p --traces "l2p-traces-b$width" --model "$MODEL" --block "$width" --out l2p \
      --device "$DEVICE" > "l2p-$width.log" 2>&1
  fi
done
# self-training (TraceLock-ST) from ST_FROM on its own deployment traces, keeping ST_FROM's cache as the original pool
if [ ! -f st/controller/metrics.json ]; then
  say "self-train from ctrl-$ST_FROM"
  tracelock self-train --model "$MODEL" --controller "ctrl-$ST_FROM" --cache "$(cache_of)" --prompts testbed:math,code \
    --limit "$N_TRAIN" --seed 1 --out st --window "$W" --steps 1000 --device "$DEVICE" > st.log 2>&1
fi

# 4. the validation frontier
sweeps=(--sweep "threshold:tau=$TAUS" --sweep "l2p:threshold=$L2P_THRESHOLDS")
for v in "${VARIANTS[@]}"; do
  name=${v%% *}
  chosen "$name" || [ "$name" = "$ST_FROM" ] || continue
  sweeps+=(--sweep "tracelock:theta=$THETAS:controller=$PWD/ctrl-$name:curve=TL-$name")
done
sweeps+=(--sweep "tracelock:theta=$THETAS:controller=$PWD/st/controller:curve=TL-ST")
say "frontier (validation)"
tracelock frontier --model "$MODEL" --tasks testbed:math,testbed:code --split validation --limit "$N_VAL" \
  --settings "$SETTINGS" --l2p "$PWD/l2p" --batch-size 50 --workers 1 \
  --device "$DEVICE" --out frontier "${sweeps[@]}" > frontier.log 2>&1
say "done: $WORK/frontier/frontier.json"
