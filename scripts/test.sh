#!/usr/bin/env bash
# The whole suite, as CI runs it, in two lanes at once:
#   stack: the tests that start a vLLM engine (marker `vllm`: whole `async-rl train` runs,
#          inference servers), one after another: on 2 cores two of them at once starve each
#          other past their bounds (an engine replaced within 300 s, a server added in time);
#   rest:  everything else (pure logic, Redis, Ray with fake servers, process groups), beside it.
# Each lane is a pytest process of its own; a test counts as left behind only the processes
# of its own lane (tests/run_helpers.py, ASYNC_RL_TEST_LANE). Arguments go to both lanes
# (e.g. -x, -k NAME, a path; not -m). Their outputs are in .pytest-lanes/, printed as each
# lane ends. Exit status 0 when both passed (a lane that selected no test passes).
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
logs=.pytest-lanes
mkdir -p "$logs"

lane() {  # lane NAME MARK-EXPRESSION [pytest args...]
    local name=$1 mark=$2
    shift 2
    ASYNC_RL_TEST_LANE=$name "$python" -m pytest -m "$mark" "$@" >"$logs/$name.log" 2>&1
    local rc=$?
    [ "$rc" -eq 5 ] && rc=0  # no test of this lane selected
    echo "== lane $name (pytest -m \"$mark\"): exit $rc, $(date -u +%T)" >>"$logs/$name.log"
    return "$rc"
}

started=$(date +%s)
lane stack "vllm" "$@" &
stack=$!
lane rest "not vllm" "$@"
rest=$?
cat "$logs/rest.log"
echo "[test.sh] lane rest ended after $(( $(date +%s) - started )) s; waiting for lane stack (log: $logs/stack.log)"
wait "$stack"
stack_rc=$?
cat "$logs/stack.log"
echo "[test.sh] both lanes ended after $(( $(date +%s) - started )) s: rest exit $rest, stack exit $stack_rc"
[ "$rest" -eq 0 ] && [ "$stack_rc" -eq 0 ]
