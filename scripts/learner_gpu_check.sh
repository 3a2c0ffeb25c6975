#!/usr/bin/env bash
# The learner's GPU checks (issue 13), in two halves.
#
# On a machine with the package registry, fetch the pure wheels the GPU machine lacks
# (it has torch, transformers, triton, numpy, pyyaml; no registry):
#     bash scripts/learner_gpu_check.sh wheels
# On the GPU machine (the `device` tool: run(command="bash scripts/learner_gpu_check.sh run",
# carry=[".gpu_wheels"])), install them and run the NCCL device matrix and the benchmarks;
# JSON lands in benchmarks/results/ (and in $OUT when set):
#     bash scripts/learner_gpu_check.sh run
# Time it needs (H100, 2026-11-26): about 450 s in all, of which a cold machine spends over 200 s
# before the first line of output; a second call on a fresh machine pays that again, so give it one
# call of timeout_s=600 rather than several short ones.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpu_wheels

if [[ "${1:-}" == wheels ]]; then
    mkdir -p "$WHEELS"
    .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$WHEELS" msgspec omegaconf
    .venv/bin/python -m pip wheel --no-deps -w "$WHEELS" antlr4-python3-runtime==4.9.3
    ls -l "$WHEELS"
    exit 0
fi
[[ "${1:-}" == run ]] || { echo "usage: $0 wheels|run" >&2; exit 2; }

pip install --quiet --no-index --no-deps --target /tmp/site "$WHEELS"/*.whl
export PYTHONPATH=/tmp/site:$PWD
export ASYNC_RL_STRICT_DEVICES=1  # a tensor of the learner's group off the GPU fails loudly
nvidia-smi --query-gpu=name,memory.total --format=csv
results=benchmarks/results
python3 benchmarks/learner_gpu.py --shape qwen2.5-0.5b --matrix --json $results/learner_gpu_matrix_h100.json
python3 benchmarks/learner_gpu.py --shape qwen2.5-0.5b --json $results/learner_gpu_qwen2.5-0.5b_h100.json
python3 benchmarks/learner_gpu.py --shape qwen2.5-1.5b --sequential --set learner.fsdp.gradient_checkpointing=on \
    --json $results/learner_gpu_qwen2.5-1.5b_h100.json
if [[ -n "${OUT:-}" ]]; then cp $results/learner_gpu_*h100.json "$OUT"/; fi
