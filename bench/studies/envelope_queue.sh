#!/bin/bash
# Issue 59's CPU runs as one queue that several processes share: the verdict's cells filled up to the frozen
# protocol's grid (bench/studies/envelope_runs.py, test split, the verdict's items), then the clean hold-out
# (bench/studies/holdout.py), the 64-token cells first. Each process claims the next job (mkdir is atomic), decodes it
# (resumable: a killed job is claimed again on the next start once its claim is removed) and writes its records
# under bench/results. One torch thread per process; start at most as many processes as there are cores to spare:
#
#   WORK=/path/to/runs nohup bash bench/studies/envelope_queue.sh > queue-a.log 2>&1 &
#   WORK=/path/to/runs nohup bash bench/studies/envelope_queue.sh > queue-b.log 2>&1 &
#
# A job's claim is $WORK/claims/<job>; its end $WORK/done/<job>. A verdict job is one process's; a hold-out cell
# claimed by another process is joined (holdout.py's decode_shared splits its policies), so the processes finish the
# earliest cells first. To resume after a crash, remove the claims of the verdict jobs not done (ls $WORK/claims
# $WORK/done); a hold-out cell's claim is simply joined again. The time in done/<job> is one process's wall clock.
set -u
cd "$(dirname "$0")/../.."
: "${WORK:?set WORK to a folder for the run folders}"
export OMP_NUM_THREADS=1
PY=${PYTHON:-python}
mkdir -p "$WORK/claims" "$WORK/done"

jobs() {
  for stage in "verdict 64/16 64/32" "holdout 64/16 64/32" "verdict 128/32 128/64" "holdout 128/32 128/64"; do
    set -- $stage
    kind=$1; shift
    for setting in "$@"; do
      for task in math code; do
        for family in llada dream; do
          echo "$kind $family $task $setting"
        done
      done
    done
  done
}

jobs | while read -r kind family task setting; do
  name="$kind-$family-$task-${setting/\//-}"
  [ -e "$WORK/done/$name" ] && continue
  if mkdir "$WORK/claims/$name" 2>/dev/null; then
    echo "$(date -Is) start $name"
  elif [ "$kind" = holdout ]; then  # a hold-out cell is shared: this process takes the policies no other one holds
    echo "$(date -Is) join $name"
  else
    continue
  fi
  start=$(date +%s)
  if [ "$kind" = verdict ]; then
    $PY bench/studies/envelope_runs.py run --family "$family" --task "$task" --setting "$setting" --work "$WORK/verdict" &&
      $PY bench/studies/envelope_runs.py records --family "$family" --task "$task" --setting "$setting" --work "$WORK/verdict"
  else
    $PY bench/studies/holdout.py run --family "$family" --task "$task" --setting "$setting" --work "$WORK/holdout" &&
      $PY bench/studies/holdout.py records --family "$family" --task "$task" --setting "$setting" --work "$WORK/holdout"
  fi
  rc=$?
  if [ $rc -eq 0 ]; then
    echo "$(( $(date +%s) - start ))" > "$WORK/done/$name"
    echo "$(date -Is) done $name in $(( $(date +%s) - start )) s"
  else
    echo "$(date -Is) FAILED $name (exit $rc): the claim stays; remove it to retry"
  fi
done
