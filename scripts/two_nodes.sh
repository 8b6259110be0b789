#!/usr/bin/env bash
# Two trainer "nodes" of NPROC ranks each on this host (c10d rendezvous on loopback), then
# the same job as one node of 2 * NPROC ranks; prints both wall times (on one host: the
# overhead of the rendezvous and the second agent, not network speed) and checks that the
# two runs ended with the same summary.
# Usage: scripts/two_nodes.sh [NPROC [STEPS [neorec train flags...]]]   (from the repository root, after `make data`)
set -euo pipefail
NPROC=${1:-2}
STEPS=${2:-200}
shift 2 || shift $#
NEOREC=${NEOREC:-.venv/bin/neorec}
PYTHON=${PYTHON:-.venv/bin/python}
PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
SETTINGS=(--set "train.max_steps=$STEPS" --overwrite "$@")
mkdir -p runs

start=$(date +%s.%N)
nodes=()
for node in 0 1; do
  $NEOREC train configs/demo.toml --nproc "$NPROC" --nnodes 2 --node-rank "$node" --rdzv "127.0.0.1:$PORT" \
    --set "run.dir='runs/two-nodes'" "${SETTINGS[@]}" > "runs/two-nodes-node$node.log" 2>&1 &
  nodes+=($!)
done
trap 'kill "${nodes[@]}" 2>/dev/null' EXIT  # a node that failed leaves none behind
for node in 0 1; do
  wait "${nodes[$node]}" || { echo "node $node failed: see runs/two-nodes-node$node.log" >&2; exit 1; }
done
trap - EXIT
two=$(awk "BEGIN { print $(date +%s.%N) - $start }")

start=$(date +%s.%N)
$NEOREC train configs/demo.toml --nproc $((2 * NPROC)) --set "run.dir='runs/one-node'" "${SETTINGS[@]}" \
  > runs/one-node.log 2>&1
one=$(awk "BEGIN { print $(date +%s.%N) - $start }")

printf '2 nodes x %d ranks: %6.1f s\n1 node  x %d ranks: %6.1f s\n' "$NPROC" "$two" $((2 * NPROC)) "$one"
"$PYTHON" - <<'PY'
import json
untimed = lambda s: {k: v for k, v in s.items() if "qps" not in k and "wait" not in k and not k.endswith("_s")}
a, b = (untimed(json.load(open(f"runs/{r}/summary.json"))) for r in ("two-nodes", "one-node"))
print("same summary:", a == b)
PY
