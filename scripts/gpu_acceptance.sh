#!/usr/bin/env bash
# Every GPU-checkable part of the learner and the one-GPU weight hand-off, proven on a GPU machine in phases (issue 33;
# benchmarks/gpu_acceptance.py says what each phase runs and writes).
#
# On a machine with the package registry, fetch the pure wheels the GPU machine lacks
# (it has torch, transformers, triton, numpy, pyyaml, safetensors; no registry):
#     bash scripts/gpu_acceptance.sh wheels
# On the GPU machine (the `device` tool: run(command="bash scripts/gpu_acceptance.sh all",
# carry=[".gpu_wheels"], timeout_s=600)), install them and run phases, in order:
#     bash scripts/gpu_acceptance.sh all | PHASE...        PHASE: matrix throughput vlm kernels handoff
# Each phase is one process bounded by 540 s and writes
# benchmarks/results/gpu_acceptance_<gpu>.json (merged phase by phase, as it goes) and a
# markdown table beside it, both copied into $OUT when set (with the planner's
# async_rl/learner/memory_calibration.json after `throughput`). The call keeps within
# GPU_ACCEPTANCE_CALL_S (570 s; the machine allows 600 a command): a phase gets what is left
# of it, and phases that would start with under 120 s left are skipped and named, to run as
# the next call (exit status 3). A cold machine spends about 200 s before the first phase
# starts (H100, 2026-11-26).
#
# The same code on the CPU, tiny shapes, gloo (tests/benchmarks/test_gpu_acceptance.py runs it):
#     bash scripts/gpu_acceptance.sh all --cpu-smoke     # results in $GPU_ACCEPTANCE_DIR (default: a temporary folder)
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=.gpu_wheels

if [[ "${1:-}" == wheels ]]; then
    mkdir -p "$WHEELS"
    .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$WHEELS" msgspec omegaconf pyzmq
    .venv/bin/python -m pip wheel --no-deps -w "$WHEELS" antlr4-python3-runtime==4.9.3
    ls -l "$WHEELS"
    exit 0
fi

phases=() smoke=()
for arg in "$@"; do
    case "$arg" in
        all) phases+=(matrix throughput vlm kernels handoff) ;;
        matrix|throughput|vlm|kernels|handoff) phases+=("$arg") ;;
        --cpu-smoke) smoke=(--cpu-smoke) ;;
        *) echo "usage: $0 wheels | {all|matrix|throughput|vlm|kernels|handoff}... [--cpu-smoke]" >&2; exit 2 ;;
    esac
done
[[ ${#phases[@]} -gt 0 ]] || { echo "usage: $0 wheels | {all|matrix|throughput|vlm|kernels|handoff}... [--cpu-smoke]" >&2; exit 2; }

export ASYNC_RL_STRICT_DEVICES=1  # a tensor of the learner's group off its device fails loudly
if [[ ${#smoke[@]} -gt 0 ]]; then
    python=${PYTHON:-.venv/bin/python}
    out_dir=${GPU_ACCEPTANCE_DIR:-$(mktemp -d)}
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
else
    python=python3
    out_dir=benchmarks/results
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
        pip install --quiet --no-index --no-deps --target /tmp/site "$WHEELS"/*.whl
    fi
    export PYTHONPATH=/tmp/site:$PWD
    nvidia-smi --query-gpu=name,memory.total --format=csv
fi

call_s=${GPU_ACCEPTANCE_CALL_S:-570}
failed=() skipped=()
for phase in "${phases[@]}"; do
    left=$((call_s - SECONDS))
    if (( left < 120 )); then skipped+=("$phase"); continue; fi
    echo "=== $phase ($(date -u +%H:%M:%S), ${left} s left of this call)"
    "$python" benchmarks/gpu_acceptance.py "$phase" "${smoke[@]}" --out-dir "$out_dir" --budget-s $((left < 540 ? left : 540)) \
        || failed+=("$phase")
done
echo "results: $out_dir/gpu_acceptance_*.json"
if [[ ${#failed[@]} -gt 0 ]]; then
    echo "FAILED phases: ${failed[*]}" >&2
    exit 1
fi
if [[ ${#skipped[@]} -gt 0 ]]; then
    echo "out of this call's time; run next: bash scripts/gpu_acceptance.sh ${skipped[*]} ${smoke[*]}" >&2
    exit 3
fi
