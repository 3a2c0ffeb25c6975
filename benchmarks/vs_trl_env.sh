#!/usr/bin/env bash
# The environment of benchmarks/vs_trl.py's TRL side: TRL's GRPOTrainer in a venv of its own,
# so that TRL's pins (transformers, accelerate, datasets) never meet async-rl's.
#   benchmarks/vs_trl_env.sh [VENV]      (default runs/trl-venv, from the repository root: vs_trl.py's default)
#   python benchmarks/vs_trl.py [--trl-python VENV/bin/python] ...
# TORCH: the torch release of the python on PATH (run this with async-rl's venv active), so both
# sides run the same kernels; without one there, pip picks the release.
# msgspec: what async_rl.rewards needs (the TRL side scores with async-rl's reward, the repository
# root on PYTHONPATH); math-verify: the `math` reward's (the running-sum task of where_async_wins.py);
# requests: TRL's GRPO trainer imports it (its vLLM client) without requiring it.
set -euo pipefail
VENV=${1:-runs/trl-venv}
TRL=${TRL:-1.13.0}
TORCH=${TORCH:-$(python -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)}
python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet "torch${TORCH:+==$TORCH}" "trl==$TRL" msgspec math-verify requests
"$VENV/bin/python" -c 'import torch, transformers, trl; print("trl", trl.__version__, "transformers", transformers.__version__, "torch", torch.__version__)'
