#!/usr/bin/env bash
# The whole suite, as CI runs it, in two lanes at once (tests/lanes.py says why and how):
#   stack: the tests that start vLLM engines under Ray and assert a wall-clock bound at
#          default settings (markers `vllm and ray and timed`), one after another: on 2 cores
#          two runs at once starve each other past such bounds (an engine replaced in 300 s);
#   rest:  everything else that starts no run (pure logic, Redis, Ray with fake servers,
#          process groups, a vLLM engine of its own in the test process), beside it.
# The other runs (`vllm and ray and not timed`: the tail) come last in both lanes; each is run
# by whichever lane reaches it first, lane rest only once lane stack's timed tests are over.
# Each lane is a pytest process of its own; a test counts as left behind only the processes
# of its own lane (tests/run_helpers.py, ASYNC_RL_TEST_LANE). Arguments go to both lanes
# (e.g. -x, -k NAME, a path; not -m). Their outputs are in .pytest-lanes/, printed as each
# lane ends. Exit status 0 when both passed (a lane that selected no test passes).
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
logs=.pytest-lanes
mkdir -p "$logs"
tail_dir=$PWD/$logs/tail  # the lanes' claims on the tail (who ran what), kept until the next run
rm -rf "$tail_dir" && mkdir -p "$tail_dir"
export ASYNC_RL_TEST_TAIL=$tail_dir

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
# Lane stack touches timed-done itself before its first tail test; here too, so that lane
# rest never waits on a lane that ended early (failed, or selected no tail test).
(lane stack "vllm and ray" "$@"; rc=$?; touch "$tail_dir/timed-done"; exit "$rc") &
stack=$!
lane rest "not (vllm and ray and timed)" "$@"
rest=$?
cat "$logs/rest.log"
echo "[test.sh] lane rest ended after $(( $(date +%s) - started )) s; waiting for lane stack (log: $logs/stack.log)"
wait "$stack"
stack_rc=$?
cat "$logs/stack.log"
echo "[test.sh] both lanes ended after $(( $(date +%s) - started )) s: rest exit $rest, stack exit $stack_rc"
[ "$rest" -eq 0 ] && [ "$stack_rc" -eq 0 ]
