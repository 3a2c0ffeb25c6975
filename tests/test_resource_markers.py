"""The resource markers stay true (tests/resource_markers.py): in a pytest run of its own, a
test that starts a real redis-server without ``@pytest.mark.redis`` fails at its teardown,
naming the marker to add; the same test with the marker passes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent

STARTS_REDIS = '''
import subprocess

import pytest


def _start_redis():
    proc = subprocess.Popen(["redis-server", "--port", "0", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL)
    try:
        proc.wait(2.0)  # running: seen by the 0.5 s sampler as well as by the Popen hook
    except subprocess.TimeoutExpired:
        pass
    proc.terminate()
    proc.wait(10)


def test_unmarked():
    _start_redis()


@pytest.mark.redis
def test_marked():
    _start_redis()


def test_starts_nothing():
    pass
'''


@pytest.mark.redis
def test_a_test_that_starts_redis_without_its_marker_fails(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(
        "import resource_markers\n\n\ndef pytest_configure(config):\n"
        "    config.pluginmanager.register(resource_markers.MarkerPlugin(), 'resource-markers')\n")
    (tmp_path / "test_starts.py").write_text(STARTS_REDIS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    env.pop("ASYNC_RL_TEST_RESOURCES", None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q", "-W", "ignore::pytest.PytestUnknownMarkWarning", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "ERROR test_starts.py::test_unmarked" in out and "add @pytest.mark.redis" in out, out
    assert "3 passed, 1 error" in out, out  # test_marked and test_starts_nothing pass; test_unmarked's teardown fails
