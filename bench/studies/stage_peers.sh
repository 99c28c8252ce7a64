#!/usr/bin/env bash
# Put the peers' code a GPU run needs where it travels with the working tree: Fast-dLLM's checkout (unmodified, from
# ../shared/peers, or PEER_SRC) and the wheels its code imports, under bench/.peers/ (git-ignored, never committed).
# The device tool carries ignored paths only when named: run(carry=["bench/.peers"], command="bash
# bench/studies/gpu_step_session.sh"); the session script finds bench/.peers/fast-dllm and installs bench/.peers/wheels.
#
#   bash bench/studies/stage_peers.sh          # then check: ls bench/.peers
set -euo pipefail
cd "$(dirname "$0")/../.."
SRC=${PEER_SRC:-../shared/peers/fast-dllm}
if [ ! -f "$SRC/llada/generate.py" ]; then
  echo "stage_peers: no Fast-dLLM checkout at $SRC (llada/generate.py missing); set PEER_SRC=DIR" >&2
  exit 1
fi
rm -rf bench/.peers/fast-dllm
mkdir -p bench/.peers/wheels
cp -r "$SRC" bench/.peers/fast-dllm
# Fast-dLLM's LLaDA model imports einops; the device machine has no network
python3 -m pip download -q --no-deps --only-binary=:all: -d bench/.peers/wheels "einops==0.8.2"
# bench/studies/gpu_quant.py's torchao (the quant extra, pinned in constraints.txt)
python3 -m pip download -q --no-deps --only-binary=:all: -d bench/.peers/wheels "torchao==0.18.0"
du -sh bench/.peers
