#!/usr/bin/env bash
# Start Ray on one node of an async-rl cluster (docs/training.md#a-ray-cluster).
#   deploy/ray_node.sh head              # on the head node (run `async-rl train` here)
#   deploy/ray_node.sh worker HEAD_IP    # on every other node
# Every node needs the same async-rl install (scripts/setup.sh) and the model/data paths.
# Every node must reach queue.redis_url: the inference servers on it write their groups there.
set -euo pipefail
VENV="${VENV:-.venv}"
RAY="$VENV/bin/ray"
PORT="${RAY_PORT:-6379}"
# Ray starts workers at nice 15; our actors (vLLM servers, learner ranks) need normal
# priority or the driver and Redis take their CPU (async_rl/launch/ray_cluster.py).
export RAY_worker_niceness="${RAY_worker_niceness:-0}"
# The GCS keeps the events of this many tasks (Ray's 100,000 grow it by ~340 MB over a long run).
export RAY_task_events_max_num_task_in_gcs="${RAY_task_events_max_num_task_in_gcs:-1000}"
# Ray 2.60 clusters use token authentication: every node and every driver (`async-rl train`)
# needs RAY_AUTH_MODE=token and the head's ~/.ray/auth_token (copy it to each node).
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-token}"
# What the run's actors write (checkpoints, logs) is this user's only (docs/security.md).
umask 077
case "${1:-}" in
  head)
    "$RAY" get-auth-token --generate >/dev/null  # ~/.ray/auth_token, unless there is one
    "$RAY" start --head --port="$PORT" --include-dashboard=false
    ;;
  worker)
    HEAD="${2:?usage: deploy/ray_node.sh worker HEAD_IP}"
    [[ -n "${RAY_AUTH_TOKEN:-}" || -f "${RAY_AUTH_TOKEN_PATH:-$HOME/.ray/auth_token}" ]] || \
      { echo "no Ray auth token: copy ~/.ray/auth_token from the head node (or set RAY_AUTH_TOKEN)" >&2; exit 2; }
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
