#!/usr/bin/env bash
# An elastic restart by hand: two trainer "nodes" on this host under --max-restarts 1;
# after the first checkpoint one rank is SIGKILLed, both agents restart their workers, and
# the run resumes from that checkpoint on its own. Prints the restart lines and the summary.
# Usage: scripts/elastic.sh [STEPS [neorec train flags...]]   (from the repository root, after `make data`)
set -euo pipefail
STEPS=${1:-150}
shift || true
NEOREC=${NEOREC:-.venv/bin/neorec}
PYTHON=${PYTHON:-.venv/bin/python}
RUN=runs/elastic
PORT=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
mkdir -p runs
rm -rf "$RUN"  # this script's own run: its LATEST marks the new first checkpoint
nodes=()
for node in 0 1; do
  $NEOREC train configs/demo.toml --nproc 1 --nnodes 2 --node-rank "$node" --rdzv "127.0.0.1:$PORT" \
    --max-restarts 1 --overwrite --set "run.dir='$RUN'" --set "train.max_steps=$STEPS" \
    --set "checkpoint.every_steps=$((STEPS / 3))" --set "checkpoint.mode='full'" "$@" > "$RUN-node$node.log" 2>&1 &
  nodes+=($!)
done
trap 'kill "${nodes[@]}" 2>/dev/null' EXIT  # a node that failed leaves none behind
until [ -f "$RUN/checkpoint/LATEST" ]; do
  for node in 0 1; do
    if ! kill -0 "${nodes[$node]}" 2>/dev/null; then
      echo "node $node ended before the first checkpoint: see $RUN-node$node.log" >&2
      exit 1
    fi
  done
  sleep 0.2
done
agent=$(pgrep -P "${nodes[1]}")
worker=$(pgrep -P "$agent")
echo "first checkpoint $(cat "$RUN/checkpoint/LATEST"); SIGKILL to node 1's worker (pid $worker)"
kill -KILL "$worker"
for node in 0 1; do
  wait "${nodes[$node]}" || { echo "node $node failed: see $RUN-node$node.log" >&2; exit 1; }
done
trap - EXIT
grep -h "resuming\|starting the run over" "$RUN"-node*.log
cat "$RUN/summary.json"
