#!/usr/bin/env bash
# The verdict's 128-token cells on one lent H100/H200 in one call: the test frontier at 128/32 and 128/64 on both
# bundled models and both tasks (8 cells, the arguments of bench/studies/testbed_frontier.sh: 500 random items per task, seed
# 2026, the shipped controllers as TraceLock-ST), added to the 64-token cells decoded on a CPU
# (bench/results/verdict-testbed-*/). Beside it, a cross-check: two 64/16 points per model decoded again on the GPU
# and compared item by item with the CPU's records.
#
# The 8 cells run as 8 processes side by side (one GPU, fp32, TF32 off: torch's default), each under DEADLINE
# seconds; a cell cut off keeps its finished points (each point is one batch of all 500 items) and a second call of
# the same script resumes it (RUNS is outside $OUT, so it survives on a machine still warm). Only when every cell is
# complete does a read-back call write each family's frontier.json and records.json with all 16 cells. What comes
# back: $OUT/verdict-<family>-<setting>.tar.xz (the run folders without traces, with the logs), results.tar.xz
# (results/<family>/frontier.json and records.json, compact, when complete; machine.txt), crosscheck.json: 6 files,
# 7 with the caller's log.
#
#   OUT=/some/dir L2P=.verdict-in bash bench/studies/gpu_verdict.sh     # L2P holds l2p-llada/ and l2p-dream/ (blocks 32, 64)
#   DRY_RUN=1 OUT=/tmp/x L2P=... bash bench/studies/gpu_verdict.sh      # on a CPU: 4 items, two points per curve
set -uo pipefail
OUT=${OUT:?set OUT to the folder whose files come back}
L2P=${L2P:?set L2P to a folder with l2p-llada/ and l2p-dream/ (tracelock train-l2p --out folders)}
RUNS=${RUNS:-/work/runs/gpu-verdict}  # the CPU machine's path too: a cut-off cell can be finished on either
DEADLINE=${DEADLINE:-470}
DRY_RUN=${DRY_RUN:-0}
SEED=2026 LIMIT=500 BATCH=500 DEVICE=cuda SETTINGS=(128/32 128/64)
PER_STEP=1,2,4
TAUS=0.5,0.55,0.6,0.65,0.7,0.75,0.8,0.85,0.9,0.95
L2P_THRESHOLDS=0.8,0.9,0.96
THETAS=0.3,0.5,0.55,0.6,0.65,0.7,0.75,0.8,0.85,0.9,0.95,0.99
# the verdict judged the paper's commit rule; the shipped controllers now carry hold_end and their family's fallback
# (docs/frontier.md, "The shipped commit rule"), so the paper's rule is asked for by name (ST_RULE= for theirs)
ST_RULE=${ST_RULE-hold_end=false:fallback=score}
if [ "$DRY_RUN" = 1 ]; then
  LIMIT=4 BATCH=4 DEVICE=cpu PER_STEP=1,4 TAUS=0.5,0.9 L2P_THRESHOLDS=0.9 THETAS=0.5,0.9
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
mkdir -p "$OUT"
stage() { printf '\n=== %s (%s)\n' "$1" "$(date +%T)"; }
# a bare device machine needs the package installed (kernels/ becomes tracelock.kernels; no C++ extension needed)
python3 -c "import tracelock.kernels" 2>/dev/null \
  || TRACELOCK_BUILD_EXT=0 timeout 60 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . \
     >/tmp/pip.log 2>&1 || { tail -20 /tmp/pip.log; exit 1; }
L2P=$(realpath "$L2P")
mkdir -p "$RUNS" 2>/dev/null || RUNS=$PWD/.verdict-runs
mkdir -p "$RUNS"
RUNS=$(realpath "$RUNS")

stage "machine"
nvidia-smi -L 2>/dev/null || echo "no nvidia-smi (dry run?)"
python3 -c "import torch, sys, os; print(sys.version.split()[0], torch.__version__, os.cpu_count(), 'CPUs',
  torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu', 'code at', os.environ.get('REV', '?'))" \
  | tee "$RUNS/machine.txt"

# the shipped controllers under the path the CPU's cells named them by (their point labels hold it), so the labels
# of all 16 cells and of the cross-check match
CTRL=/work/wt-verdict/tracelock/testbed
[ -e /work/wt-verdict ] || { mkdir -p /work && ln -s "$PWD" /work/wt-verdict; } 2>/dev/null || CTRL=$PWD/tracelock/testbed
model_of() { [ "$1" = dream ] && echo testbed-dream || echo testbed; }
for fam in llada dream; do  # the study folder: filters, controller and the CPU's cells, copied once
  W=$RUNS/$fam
  mkdir -p "$W/frontier-test"
  [ -d "$W/l2p" ] || cp -r "$L2P/l2p-$fam" "$W/l2p"
  [ -f "$W/frontier-test/frontier.json" ] || cp bench/results/verdict-testbed-$fam/{frontier,records}.json "$W/frontier-test/"
done

frontier() {  # family out tasks settings timeout [sweeps...]: the frontier, TraceLock-ST's curve first
  local fam=$1 out=$2 tasks=$3 settings=$4 limit=$5; shift 5
  local W=$RUNS/$fam rule=confidence peers=()
  if [ "$fam" = dream ]; then
    rule=confidence:score=neg_entropy
    peers=(--sweep "threshold:tau=$TAUS:first_token=true:curve=Fast-dLLM (Dream)")
  fi
  timeout "$limit" python3 -m tracelock frontier --model "$(model_of "$fam")" --tasks "$tasks" --split test \
    --limit "$LIMIT" --seed "$SEED" --settings "$settings" --l2p "$W/l2p" --batch-size "$BATCH" --workers 3 \
    --threads 1 --device "$DEVICE" --out "$out" --quiet "$@" \
    --sweep "tracelock:theta=$THETAS:controller=$CTRL/controller-$fam${ST_RULE:+:$ST_RULE}:curve=TraceLock-ST" \
    --sweep "threshold:tau=$TAUS" \
    "${peers[@]}" --sweep "$rule:per_step=$PER_STEP" --sweep "l2p:threshold=$L2P_THRESHOLDS"
}

stage "8 cells side by side (each under ${DEADLINE}s) and the cross-check"
pids=()
for fam in llada dream; do
  for task in math code; do
    for s in "${SETTINGS[@]}"; do
      log=$RUNS/$fam/$task-${s/\//-}.log
      frontier $fam "$RUNS/$fam/frontier-test" testbed:$task "$s" "$DEADLINE" >"$log" 2>&1 &
      pids+=($!)
    done
  done
done
# the cross-check: 64/16, LLaDA math and Dream code, the reference and two points (its own folder)
for fam in llada dream; do
  task=math; [ $fam = dream ] && task=code
  timeout "$DEADLINE" python3 -m tracelock frontier --model "$(model_of $fam)" --tasks testbed:$task --split test \
    --limit "$LIMIT" --seed "$SEED" --settings 64/16 --batch-size "$BATCH" --workers 2 --threads 1 \
    --device "$DEVICE" --out "$RUNS/$fam/crosscheck" --quiet --sweep "threshold:tau=0.9" \
    --sweep "tracelock:theta=0.9:controller=$CTRL/controller-$fam${ST_RULE:+:$ST_RULE}:curve=TraceLock-ST" \
    >"$RUNS/$fam/crosscheck.log" 2>&1 &
done
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=$((failed + 1)); done
wait  # the cross-check
echo "cells not finished: $failed of ${#pids[@]}"
tail -n 3 "$RUNS"/*/*.log

stage "cross-check against the CPU's records"
for fam in llada dream; do
  task=math; [ $fam = dream ] && task=code
  cpu=bench/results/verdict-testbed-$fam/records.json
  [ "$DRY_RUN" = 1 ] && cpu=$RUNS/$fam/crosscheck/records.json  # other items: the dry run checks the plumbing only
  python3 bench/studies/records_agreement.py "$RUNS/$fam/crosscheck/records.json" "$cpu" \
    testbed:$task 64/16 --out "$RUNS/crosscheck-$fam.json" >/dev/null || echo "no cross-check: see $RUNS/$fam/crosscheck.log"
done
python3 - "$RUNS" "$OUT/crosscheck.json" <<'PY'
import json, sys
from pathlib import Path
runs = Path(sys.argv[1])
both = {f: json.loads((runs / f"crosscheck-{f}.json").read_text()) for f in ("llada", "dream")
        if (runs / f"crosscheck-{f}.json").exists()}
Path(sys.argv[2]).write_text(json.dumps(both, indent=1))
for fam, r in both.items():
    for label, v in r["points"].items():
        print(f"{fam} {r['task']} {r['setting']} {label}: same verdict {v['same_correct']}/{v['items']}, same steps "
              f"{v['same_steps']}/{v['items']}, accuracy GPU {v['accuracy'][0]:.3f} CPU {v['accuracy'][1]:.3f}")
PY

if [ "$failed" = 0 ]; then
  stage "read back: each family's frontier.json with all 16 cells (decodes nothing)"
  for fam in llada dream; do
    frontier $fam "$RUNS/$fam/frontier-test" testbed:math,testbed:code 128/32,128/64 120 \
      >"$RUNS/$fam/readback.log" 2>&1 || { echo "read-back $fam failed"; tail -5 "$RUNS/$fam/readback.log"; }
    mkdir -p "$RUNS/results/$fam"
    cp "$RUNS/$fam/frontier-test/frontier.json" "$RUNS/results/$fam/"
    python3 -c "import json, sys; json.dump(json.load(open(sys.argv[1])), open(sys.argv[2], 'w'), separators=(',', ':'))" \
      "$RUNS/$fam/frontier-test/records.json" "$RUNS/results/$fam/records.json"
    python3 -m tracelock.eval.matched "$RUNS/$fam/frontier-test" 2>&1 | tail -14
  done
fi

stage "pack (run folders without traces)"
for fam in llada dream; do
  for s in "${SETTINGS[@]}"; do
    slug=${s/\//-}
    ( cd "$RUNS/$fam" && find frontier-test -path "*/$slug/*" \( -name manifest.json -o -name 'summary.*' \
        -o -name 'items-rank*.jsonl' \) | tar -cJf "$OUT/verdict-$fam-$slug.tar.xz.tmp" -T - *.log ) \
      && mv "$OUT/verdict-$fam-$slug.tar.xz.tmp" "$OUT/verdict-$fam-$slug.tar.xz"
  done
done
mkdir -p "$RUNS/results" && cp "$RUNS/machine.txt" "$RUNS/results/"
tar -C "$RUNS" -cJf "$OUT/results.tar.xz" results
ls -la "$OUT"
stage "done"
