#!/usr/bin/env bash
# Controllers per deployment width, on one lent GPU in one short call. For each study FAMILY:WIDTH:GEN of STUDIES
# (default: the two width-64 studies side by side; each has also run on a CPU, docs/frontier.md): traces of 200 training
# items per task in a window of WIDTH at gen GEN under the family's own one-per-step rule (LLaDA: confidence; Dream:
# neg-entropy), a controller trained on them (`--preset testbed`, the shipped controller's encoder, as
# docs/frontier.md's width study did), its self-training at WIDTH, and, on 300 validation math items (seed 44) at
# GEN/WIDTH: the heuristics (one per step at 1/2/4 tokens, Fast-dLLM tau 0.7-0.95, on Dream both forms), the shipped
# controller, the new controller and its self-trained one (each under its own commit rule at theta 0.7, 0.8, 0.9, 0.95,
# and the paper's at 0.9). Everything runs inside one DEADLINE; what is done by then comes back as $OUT/<study>.tar.xz
# (controllers, run folders without traces, logs), and $OUT/stages.json (the card, each stage's status and seconds) is
# written after every stage.
#
#   OUT=/some/dir DEADLINE=420 bash bench/studies/gpu_width_study.sh
#   STUDIES=llada:64:128 OUT=/some/dir bash bench/studies/gpu_width_study.sh     # one study (the first H200 call's)
#   DRY_RUN=1 OUT=/tmp/x W=/tmp/w bash bench/studies/gpu_width_study.sh          # on a CPU: 4 items, 20 training steps
set -uo pipefail
OUT=${OUT:?set OUT to the folder whose files come back}
W=${W:-/tmp/width-study}
DEADLINE=${DEADLINE:-420}
STUDIES=${STUDIES:-llada:64:128 dream:64:128}
DEVICE=cuda LIMIT=200 VAL=300 TRAIN=() ST_STEPS=1000 TAUS=(0.7 0.8 0.9 0.95)
if [ "${DRY_RUN:-0}" = 1 ]; then
  DEVICE=cpu LIMIT=4 VAL=4 TRAIN=(--steps 20) ST_STEPS=10 TAUS=(0.9)
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
python3 -c "import tracelock.kernels" 2>/dev/null \
  || TRACELOCK_BUILD_EXT=0 timeout 60 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . \
     >/tmp/pip.log 2>&1 || { tail -20 /tmp/pip.log; exit 1; }
mkdir -p "$OUT" "$W"
end=$((SECONDS + DEADLINE))
say() { printf '[%s %s, %ss left] %s\n' "$1" "$(date +%T)" $((end - SECONDS)) "$2"; }
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
mark() {  # study stage status seconds: $OUT/stages.json after every stage (under a lock: studies run side by side)
  python3 - "$OUT/stages.json" "$W/stages.lock" "$@" "${CARD:-cpu}" <<'PY'
import fcntl, json, os, sys
path, lock_path, study, stage, status, seconds, card = sys.argv[1:]
with open(lock_path, "w") as lock:  # beside the work, not in $OUT (what comes back)
    fcntl.flock(lock, fcntl.LOCK_EX)
    data = json.load(open(path)) if os.path.exists(path) else {"device": card, "stages": {}}
    data["stages"].setdefault(study, {})[stage] = {"status": status, "seconds": int(seconds)}
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(path + ".tmp", path)
PY
}
run() {  # dir log command...: the command under what is left of DEADLINE
  local dir=$1 log=$2 t=$((end - SECONDS)) start=$SECONDS; shift 2
  [ "$t" -gt 5 ] || { echo "no time left for $dir/$log"; mark "${dir##*/}" "$log" skipped 0; return 1; }
  if timeout "$t" python3 -m tracelock "$@" >"$dir/$log.log" 2>&1; then
    mark "${dir##*/}" "$log" ok $((SECONDS - start))
  else
    echo "$dir/$log failed or cut off:"; tail -3 "$dir/$log.log"
    mark "${dir##*/}" "$log" failed $((SECONDS - start)); return 1
  fi
}

study() {  # family width gen
  local fam=$1 width=$2 gen=$3 model=testbed rule=confidence d="$W/$1-$2"
  [ "$fam" = dream ] && model=testbed-dream rule=confidence:score=neg_entropy
  local enc=$PWD/tracelock/testbed/controller-$fam points="tracelock:theta=0.9:hold_end=false:fallback=score"
  local heur="$rule:per_step=1,$rule:per_step=2,$rule:per_step=4" t
  for t in "${TAUS[@]}"; do
    points="$points,tracelock:theta=$t"
    heur="$heur,threshold:tau=$t"
    [ "$fam" = dream ] && heur="$heur,threshold:tau=$t:first_token=true"
  done
  local val=(eval --model $model --tasks testbed:math@validation --limit "$VAL" --seed 44 --settings "$gen/$width"
             --batch-size 300 --threads 1 --device "$DEVICE" --quiet)
  mkdir -p "$d"
  say "$fam:$width" "traces, and the heuristics and the shipped controller on validation beside them"
  run "$d" heuristics "${val[@]}" --policies "$heur" --out "$d/eval-heuristics" &
  run "$d" shipped "${val[@]}" --policies "$points" --controller $model --out "$d/eval-shipped" &
  run "$d" collect collect --model $model --prompts testbed:math,code --limit "$LIMIT" --out "$d/traces" \
    --fraction 0.3 --confidence --batch-size 100 --window "$width" --gen-length "$gen" --policy "$rule" \
    --device "$DEVICE" --threads 1 || return 1
  say "$fam:$width" "featurize, train"
  run "$d" featurize featurize --traces "$d/traces" --model $model --encoder "$enc" --cache-dtype fp16 \
    --out "$d/cache" --device "$DEVICE" --threads 1 || return 1
  run "$d" train train --cache "$d/cache" --out "$d/ctrl" --encoder "$enc" --preset testbed "${TRAIN[@]}" \
    --device "$DEVICE" --threads 1 || return 1
  say "$fam:$width" "self-train, and the new controller on validation beside it"
  run "$d" eval-ctrl "${val[@]}" --policies "$points" --controller "$d/ctrl" --out "$d/eval-ctrl" &
  run "$d" self-train self-train --model $model --controller "$d/ctrl" --cache "$d/cache" \
    --prompts testbed:math,code --limit "$LIMIT" --out "$d/st" --window "$width" --gen-length "$gen" \
    --steps "$ST_STEPS" --device "$DEVICE" --threads 1 \
    && run "$d" eval-st "${val[@]}" --policies "$points" --controller "$d/st/controller" --out "$d/eval-st"
  wait
  say "$fam:$width" "pack"
  ( cd "$W" && find "$fam-$width" \( -name '*.log' -o -path '*/ctrl/*' -o -path '*/st/controller/*' \
      -o -path '*/eval-*' \( -name manifest.json -o -name 'summary.*' -o -name 'items-rank*.jsonl' \) \) -type f \
      | grep -v '/state-' | tar -cJf "$OUT/$fam-$width.tar.xz" -T - )   # not the optimiser states
}

nvidia-smi -L 2>/dev/null
for s in $STUDIES; do
  IFS=: read -r fam width gen <<<"$s"
  study "$fam" "$width" "$gen" &
done
wait
for f in "$W"/*/eval-*/summary.csv; do echo "$f"; cat "$f"; done
ls -la "$OUT"
