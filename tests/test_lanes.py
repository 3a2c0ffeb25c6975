"""The lanes of scripts/test.sh share their tail (tests/lanes.py): in two pytest runs of a small
suite at once, as scripts/test.sh starts them, every tail test runs exactly once, in one lane or
the other; lane rest enters the tail only after lane stack's timed tests ended; each lane names
the tail tests the other ran; a module fixture of the tail is set up and torn down in pairs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent

SUITE = '''
import os
import time

import pytest

LOG = os.environ["LANES_TEST_LOG"]


def _log(what):
    with open(LOG, "a") as f:
        f.write(f"{time.time():.3f} {os.environ['ASYNC_RL_TEST_LANE']} {what}\\n")


@pytest.fixture(scope="module")
def pool():
    _log("pool-up")
    yield
    _log("pool-down")


@pytest.mark.vllm
@pytest.mark.ray
@pytest.mark.timed
def test_timed():
    time.sleep(1.0)
    _log("timed-end")


def test_plain():
    _log("plain")


@pytest.mark.vllm
@pytest.mark.ray
@pytest.mark.parametrize("i", range(8))
def test_tail(pool, i):
    _log(f"tail-{i}")
    time.sleep(0.7)
'''


def test_two_lanes_run_each_tail_test_once_and_the_timed_ones_alone(tmp_path: Path) -> None:
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(
        "import lanes\n\n\ndef pytest_configure(config):\n"
        "    config.pluginmanager.register(lanes.plugin(), 'lanes')\n")
    (suite / "test_suite.py").write_text(SUITE)
    shared, log = tmp_path / "shared", tmp_path / "log"
    shared.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "ASYNC_RL_TEST_TAIL": str(shared), "LANES_TEST_LOG": str(log)}
    env.pop("ASYNC_RL_TEST_RESOURCES", None)

    def lane(name: str, mark: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q", "-m", mark,
                                 "-W", "ignore::pytest.PytestUnknownMarkWarning", str(suite)],
                                cwd=suite, env={**env, "ASYNC_RL_TEST_LANE": name}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    stack, rest = lane("stack", "vllm and ray"), lane("rest", "not (vllm and ray and timed)")
    outputs = {name: proc.communicate(timeout=120)[0] for name, proc in (("stack", stack), ("rest", rest))}
    assert stack.returncode == 0 and rest.returncode == 0, outputs
    rows = [line.split() for line in log.read_text().splitlines()]
    tails = [(float(t), lane_, what) for t, lane_, what in rows if what.startswith("tail-")]
    assert sorted(what for _, _, what in tails) == [f"tail-{i}" for i in range(8)], rows  # each once
    timed_end = next(float(t) for t, lane_, what in rows if what == "timed-end" and lane_ == "stack")
    assert all(t >= timed_end for t, lane_, _ in tails if lane_ == "rest"), rows
    assert [lane_ for _, lane_, what in rows if what == "plain"] == ["rest"] and sum(what == "timed-end" for *_, what in rows) == 1
    for name in ("stack", "rest"):
        ups = [what for _, lane_, what in rows if lane_ == name and what.startswith("pool-")]
        assert ups == ["pool-up", "pool-down"] * (len(ups) // 2), rows  # the module fixture: set up and torn down in pairs
        ran_here = sum(lane_ == name for _, lane_, _ in tails)
        assert f"lane {name}: {ran_here} tail tests run here" in outputs[name], outputs[name]
        assert f"{8 - ran_here} run by the other lane" in outputs[name], outputs[name]
    assert {lane_ for _, lane_, _ in tails} == {"stack", "rest"}, rows  # both took part


def test_without_the_shared_directory_nothing_changes() -> None:
    import lanes

    saved = os.environ.pop(lanes.TAIL_ENV, None)
    try:
        assert lanes.plugin() is None
    finally:
        if saved is not None:
            os.environ[lanes.TAIL_ENV] = saved
