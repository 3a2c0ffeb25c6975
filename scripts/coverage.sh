#!/usr/bin/env bash
# Line coverage of async_rl over a test command, every Python process of it included: the
# pytest lanes, the `async-rl train` drivers they start, Ray's workers and actors, vLLM's
# engine processes, spawned reward pools. coverage.py's own a1_coverage.pth starts coverage in
# any Python process that finds COVERAGE_PROCESS_START in its environment (Ray's raylet and
# multiprocessing pass it on); each saves its data at exit, on SIGTERM and on os._exit (a
# SIGKILLed process's is lost: the same for every run measured). A thread saving every 10 s
# was tried and segfaulted pytest at its first save.
#
#   bash scripts/coverage.sh OUT_DIR [command ...]     default command: bash scripts/test.sh
#
# Run it from the checkout to measure (PYTHONPATH=. is set, so an older checkout or worktree
# measures its own async_rl with this one's .venv; PYTHON names another interpreter).
# Writes OUT_DIR/report.txt (per file) and OUT_DIR/coverage.json, prints the total; exit status
# that of the command. Timed tests run slower under coverage, so a bound may fail: the figure
# is the coverage, the command's failures are listed in its own output.
set -uo pipefail
out=$(realpath -m "${1:?usage: coverage.sh OUT_DIR [command ...]}")
shift
[ "$#" -gt 0 ] || set -- bash scripts/test.sh
python=${PYTHON:-$(dirname "$(realpath "$0")")/../.venv/bin/python}
"$python" -c 'import coverage' 2>/dev/null || "$python" -m pip install -q "coverage>=7.10" || exit 1
rm -rf "$out" && mkdir -p "$out"
cat >"$out/coveragerc" <<EOF
[run]
source = async_rl
parallel = true
data_file = $out/.coverage
sigterm = true
patch = fork, _exit
disable_warnings = module-not-imported, no-data-collected, module-not-measured
EOF
started=$(date +%s)
COVERAGE_PROCESS_START=$out/coveragerc PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} "$@"
rc=$?
echo "[coverage.sh] command exit $rc after $(( $(date +%s) - started )) s"
cd "$out" || exit 1
"$python" -m coverage combine -q --rcfile=coveragerc >/dev/null
"$python" -m coverage report --rcfile=coveragerc >report.txt
"$python" -m coverage json -q --rcfile=coveragerc -o coverage.json
tail -n 1 report.txt
exit "$rc"
