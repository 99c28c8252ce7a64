#!/usr/bin/env bash
# Testbed training on one lent H100/H200, in one call of under 10 minutes: run the CUDA training test, then train
# three runs side by side on the one GPU: A (the shipped model's size, batch 128), A again from the same seed (does
# the run reproduce?), and W (a wider model). The step counts are sized from a short timed run of the same three, so
# the runs end inside TRAIN_SECONDS. Each finished run is decoded on the GPU (confidence 1/step, 4/step, threshold
# 0.5 at gen 64 / block 16 on the 300 test items) and comes back as a tarball without its optimiser state.
#
#   OUT=/some/dir TRAIN_SECONDS=380 bash bench/studies/gpu_testbed_train.sh
set -uo pipefail
OUT=${OUT:-/tmp/gpu-testbed}
TRAIN_SECONDS=${TRAIN_SECONDS:-380}
# a dry run on a CPU: AR_STEPS=3 DEVICE=cpu BATCH=8 CAL_STEPS=6 MIN_STEPS=10 EVAL_N=4 TRAIN_SECONDS=1
AR_STEPS=${AR_STEPS:-800} DEVICE=${DEVICE:-cuda} BATCH=${BATCH:-128} CAL_STEPS=${CAL_STEPS:-300} MIN_STEPS=${MIN_STEPS:-1000} EVAL_N=${EVAL_N:-300}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# a bare device machine needs the package installed (kernels/ becomes tracelock.kernels; training needs no C++
# extension); an environment that already has it, e.g. a CPU dry run's, is left as it is
python3 -c "import tracelock.kernels" 2>/dev/null \
  || TRACELOCK_BUILD_EXT=0 python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/tmp/pip.log 2>&1 \
  || { tail -20 /tmp/pip.log; exit 1; }
WORK=/tmp/testbed-runs
rm -rf "$WORK"; mkdir -p "$WORK"
stage() { printf '\n=== %s (%s)\n' "$1" "$(date +%T)"; }

COMMON=(--seed 0 --batch-size "$BATCH" --ar-steps "$AR_STEPS" --device "$DEVICE" --workers 4 --save-every 500)
A=(--d-model 128 --n-layers 4 --n-heads 2 --mlp 512)
W=(--d-model 192 --n-layers 4 --n-heads 3 --mlp 768)

stage "machine"
nvidia-smi -L
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name())" \
  | tee "$OUT/machine.txt"

stage "CUDA training test"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_testbed_train.py -k cuda 2>&1 | tail -5

stage "timed short runs (steps/s with all three side by side)"
for run in a a2 w; do
  arch=("${A[@]}"); [ $run = w ] && arch=("${W[@]}")
  timeout 120 python3 -m tracelock testbed-train --out "$WORK/cal-$run" "${COMMON[@]}" "${arch[@]}" \
    --steps "$CAL_STEPS" --ar-steps $((CAL_STEPS / 3)) >"$WORK/cal-$run.log" 2>&1 &
done
wait
steps_for() {  # the largest multiple of 500 that fits TRAIN_SECONDS at the timed rate (AR steps included)
  python3 -c "import json; s = json.load(open('$WORK/cal-$1/train_state.json'))['seconds'] / $CAL_STEPS
print(max($MIN_STEPS, int($TRAIN_SECONDS / s) // 500 * 500))"
}
STEPS_A=$(steps_for a); STEPS_W=$(steps_for w)
echo "steps: A $STEPS_A, W $STEPS_W" | tee "$OUT/steps.txt"

stage "training"
start=$SECONDS
for run in a a2 w; do
  arch=("${A[@]}"); steps=$STEPS_A
  [ $run = w ] && arch=("${W[@]}") && steps=$STEPS_W
  echo "tracelock testbed-train --out RUN ${COMMON[*]} ${arch[*]} --steps $steps" >"$WORK/$run.command"
  timeout $((TRAIN_SECONDS + 90)) python3 -m tracelock testbed-train --out "$WORK/$run" "${COMMON[@]}" "${arch[@]}" \
    --steps "$steps" >"$WORK/$run.log" 2>&1 &
done
wait
echo "training: $((SECONDS - start)) s"
sha256sum "$WORK"/{a,a2,w}/model.safetensors | tee "$OUT/sha256.txt"

stage "decode the test items on the GPU"
python3 - "$WORK" "$DEVICE" "$EVAL_N" <<'EOF' 2>&1 | tee "$OUT/gpu-eval.txt"
import json, sys, time
from pathlib import Path
import tracelock
from tracelock.testbed.evaluate import evaluate_policy
from tracelock.tasks import held_out

rows = {}
for run in ("a", "a2", "w"):
    path = Path(sys.argv[1]) / run
    if not (path / "model.safetensors").exists():
        print(run, "did not finish")
        continue
    model, tok = tracelock.load_model(path).to(sys.argv[2]).eval(), tracelock.load_tokenizer(path)
    log = json.loads((path / "train_state.json").read_text())
    rows[run] = {"steps": log["step"], "train_seconds": log["seconds"], "final_loss": log["loss"][-1][1]}
    for task, policies in (("math", [("confidence 1/step", "confidence", {}), ("confidence 4/step", "confidence",
                                      {"steps": 16}), ("threshold 0.5", "threshold", {"tau": 0.5})]),
                           ("code", [("confidence 1/step", "confidence", {})])):
        items = held_out(task, "test", int(sys.argv[3]))
        for label, name, args in policies:
            t = time.perf_counter()
            r = evaluate_policy(model, tok, items, label, name, args, gen_length=64, block=16, batch_size=100)
            rows[run][f"{task} {label}"] = r.accuracy
            print(f"{run} {task} {label}: {r.accuracy:.1%} ({r.avg_steps:.1f} steps, {time.perf_counter() - t:.0f} s)")
json.dump(rows, open(sys.argv[1] + "/gpu-eval.json", "w"), indent=1)
EOF
cp "$WORK/gpu-eval.json" "$OUT/" 2>/dev/null

stage "pack"
for run in a a2 w; do
  tail -c 3000 "$WORK/$run.log" | tr '\r' '\n' | grep -v '^$' | tail -3
  # the optimiser state stays behind when the run finished (the weights are exported); an unfinished run keeps it
  exclude=(--exclude train_state.safetensors); [ -e "$WORK/$run/model.safetensors" ] || exclude=()
  tar -czf "$OUT/$run.tgz" -C "$WORK" "${exclude[@]}" "$run" "$run.command" "$run.log"
done
ls -la "$OUT"
stage "done"
