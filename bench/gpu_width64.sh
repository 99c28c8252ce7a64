#!/usr/bin/env bash
# LLaDA-family controllers for windows of 64 (the 128/64 setting), on one lent GPU in one short call: traces of 200
# training items per task in a window of 64 at gen 128, a controller trained on them (`--preset testbed`, the shipped
# controller's encoder, as the width study of docs/frontier.md did at 16 and 32), its self-training at 64, and both
# decoded on 300 validation math items (seed 44) at 128/64 under the paper's rule and `hold_end` + confidence
# fallback. Every stage runs inside one DEADLINE; what is done by then comes back as $OUT/width64.tar.xz (controllers,
# run folders without traces, logs). The heuristics and the shipped controller on the same items need no GPU.
#
#   OUT=/some/dir bash bench/gpu_width64.sh
#   DRY_RUN=1 OUT=/tmp/x W=/tmp/w bash bench/gpu_width64.sh     # on a CPU: 4 items, 20 training steps
set -uo pipefail
OUT=${OUT:?set OUT to the folder whose files come back}
W=${W:-/tmp/width64}
DEADLINE=${DEADLINE:-200}
DEVICE=cuda LIMIT=200 VAL=300 TRAIN=() ST_STEPS=1000
if [ "${DRY_RUN:-0}" = 1 ]; then
  DEVICE=cpu LIMIT=4 VAL=4 TRAIN=(--steps 20) ST_STEPS=10
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
python3 -c "import tracelock.kernels" 2>/dev/null \
  || TRACELOCK_BUILD_EXT=0 timeout 60 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . \
     >/tmp/pip.log 2>&1 || { tail -20 /tmp/pip.log; exit 1; }
mkdir -p "$OUT" "$W"
ENC=$PWD/tracelock/testbed/controller-llada
end=$((SECONDS + DEADLINE))
stage() { printf '\n=== %s (%s, %ss left)\n' "$1" "$(date +%T)" $((end - SECONDS)); }
run() {  # log command...: the command under what is left of DEADLINE
  local log=$1 t=$((end - SECONDS)); shift
  [ "$t" -gt 5 ] || { echo "no time left for $log"; return 1; }
  timeout "$t" python3 -m tracelock "$@" >"$W/$log.log" 2>&1 || { echo "$log failed or cut off:"; tail -3 "$W/$log.log"; return 1; }
}
RULES="tracelock:theta=0.9"
for t in 0.7 0.9 0.95 0.99; do RULES="$RULES,tracelock:theta=$t:hold_end=true:fallback=confidence"; done
VALIDATION=(eval --model testbed --tasks testbed:math@validation --limit "$VAL" --seed 44 --settings 128/64
            --policies "$RULES" --batch-size 300 --threads 1 --device "$DEVICE" --quiet)

stage "traces: window 64, gen 128"
nvidia-smi -L 2>/dev/null
run collect collect --model testbed --prompts testbed:math,code --limit "$LIMIT" --out "$W/traces-win64" \
  --fraction 0.3 --confidence --batch-size 100 --window 64 --gen-length 128 --device "$DEVICE" --threads 1
stage "featurize (the shipped controller's encoder)"
run featurize featurize --traces "$W/traces-win64" --model testbed --encoder "$ENC" --cache-dtype fp16 \
  --out "$W/cache-win64" --device "$DEVICE" --threads 1
stage "train (--preset testbed)"
run train train --cache "$W/cache-win64" --out "$W/ctrl-win64" --encoder "$ENC" --preset testbed "${TRAIN[@]}" \
  --device "$DEVICE" --threads 1
stage "self-train at 64, and the window-64 controller on validation, side by side"
run self-train self-train --model testbed --controller "$W/ctrl-win64" --cache "$W/cache-win64" \
  --prompts testbed:math,code --limit "$LIMIT" --out "$W/st-win64" --window 64 --gen-length 128 \
  --steps "$ST_STEPS" --device "$DEVICE" --threads 1 &
run eval-win64 "${VALIDATION[@]}" --controller "$W/ctrl-win64" --out "$W/eval-win64"
wait
stage "the self-trained controller on validation"
run eval-st64 "${VALIDATION[@]}" --controller "$W/st-win64/controller" --out "$W/eval-st64"

stage "pack"
( cd "$W" && find . \( -name '*.log' -o -path './ctrl-win64/*' -o -path './st-win64/controller/*' \
    -o -path './eval-*' \( -name manifest.json -o -name 'summary.*' -o -name 'items-rank*.jsonl' \) \) -type f \
    | grep -v '/state-' | tar -cJf "$OUT/width64.tar.xz" -T - )   # not the optimiser states
for f in "$W"/eval-*/summary.csv; do echo "$f"; cat "$f"; done
ls -la "$OUT"
