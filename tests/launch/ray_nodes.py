"""Ray nodes started as a user would (`ray start ... --block`), each in its own session, and
stopped without leaving a process behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

RAY = str(Path(sys.executable).parent / "ray")


def start_node(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """``ray start ARGS --block`` in a new session, output to ``log``; ``env`` adds to the
    environment the node (and so its actors) gets."""
    with open(log, "w") as out:
        return subprocess.Popen([RAY, "start", *args, "--block"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})


def wait_for_log(log: Path, proc: subprocess.Popen[bytes], pattern: str) -> re.Match[str]:
    """The first match of ``pattern`` in ``log`` (waits up to 2 min; fails if ``proc`` exits)."""
    deadline = time.monotonic() + 120
    while not (found := re.search(pattern, log.read_text())):
        if proc.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"`ray start` did not come up:\n{log.read_text()}")
        time.sleep(0.5)
    return found


def stop_nodes(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGKILL every node's session (a graceful `ray start --block` exit takes ~15 s a node),
    then wait until none of their processes is left."""
    for proc in reversed(procs):
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(60)
    _wait_sessions_gone({p.pid for p in procs})


def _wait_sessions_gone(sessions: set[int], seconds: float = 30.0) -> None:
    """Every process of the killed ``ray start`` sessions is gone (zombies aside)."""
    deadline = time.monotonic() + seconds
    while True:
        left = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) in sessions and fields[0] != "Z":  # fields[3]: session id
                left.append(stat.parent.name)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not left, f"processes of the Ray nodes still running: {left}"
