#!/bin/bash
# The second hold-out's decoding as one queue that several processes share: every process walks the 16 cells of
# bench/results/holdout2/protocol.json, cheapest first (its cost_cpu_seconds), skips a cell whose records are written,
# joins the others (holdout.py's decode_shared splits a cell's policies between the processes on it) and writes the
# cell's records under bench/results/holdout2-testbed-<family>/ when it is done. Resumable: a killed process loses only
# the items in flight. One torch thread per process; start as many as there are cores to spare, and commit each
# cell's records as they appear (do not read them before all 16 are in):
#
#   WORK=/path/to/runs nohup bash bench/studies/holdout2_queue.sh > queue-a.log 2>&1 &
#   WORK=/path/to/runs nohup bash bench/studies/holdout2_queue.sh > queue-b.log 2>&1 &
set -u
cd "$(dirname "$0")/../.."
: "${WORK:?set WORK to a folder for the run folders}"
export OMP_NUM_THREADS=1
PY=${PYTHON:-python}
P=bench/results/holdout2

$PY -c "import json; c = json.load(open('$P/protocol.json'))['cost_cpu_seconds']; print('\n'.join(sorted(c, key=c.get)))" |
while read -r family task setting; do
  out="bench/results/holdout2-testbed-$family/holdout2-$task-${setting/\//-}.json"
  [ -e "$out" ] && continue
  echo "$(date -Is) join $family $task $setting"
  start=$(date +%s)
  if $PY bench/studies/holdout.py --protocol "$P" run --family "$family" --task "$task" --setting "$setting" --work "$WORK" &&
     $PY bench/studies/holdout.py --protocol "$P" records --family "$family" --task "$task" --setting "$setting" --work "$WORK"; then
    echo "$(date -Is) done $family $task $setting in $(( $(date +%s) - start )) s"
  else
    echo "$(date -Is) FAILED $family $task $setting: run the queue again to retry"
  fi
done
