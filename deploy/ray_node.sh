#!/usr/bin/env bash
# Start Ray on one node of an async-rl cluster (docs/training.md#a-ray-cluster).
#   deploy/ray_node.sh head              # on the head node (run `async-rl train` here)
#   deploy/ray_node.sh worker HEAD_IP    # on every other node
# Every node needs the same async-rl install (scripts/setup.sh) and the model/data paths.
set -euo pipefail
VENV="${VENV:-.venv}"
RAY="$VENV/bin/ray"
PORT="${RAY_PORT:-6379}"
# Ray starts workers at nice 15; our actors (vLLM servers, learner ranks) need normal
# priority or the driver and Redis take their CPU (async_rl/launch/ray_cluster.py).
export RAY_worker_niceness="${RAY_worker_niceness:-0}"
case "${1:-}" in
  head)
    "$RAY" start --head --port="$PORT" --include-dashboard=false
    ;;
  worker)
    HEAD="${2:?usage: deploy/ray_node.sh worker HEAD_IP}"
    "$RAY" start --address="$HEAD:$PORT"
    ;;
  stop)
    "$RAY" stop
    ;;
  *)
    echo "usage: deploy/ray_node.sh head | worker HEAD_IP | stop" >&2
    exit 2
    ;;
esac
