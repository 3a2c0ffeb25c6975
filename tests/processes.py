"""Processes by identity, for the tests of what a run leaves running: (pid, start time) pairs
read from /proc, so a reused pid is never mistaken for the process that had it."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

from async_rl.launch.reaper import start_time

Identity = tuple[int, int]
"""(pid, start time): a process, not a reused pid."""


def identity(pid: int) -> Identity:
    start = start_time(pid)
    if start is None:
        raise AssertionError(f"process {pid} is not running")
    return pid, start


def alive(procs: Iterable[Identity]) -> list[Identity]:
    return [(pid, start) for pid, start in procs if start_time(pid) == start]


def wait_gone(procs: Iterable[Identity], seconds: float) -> list[Identity]:
    """Those of ``procs`` still alive once they are all gone or ``seconds`` passed."""
    deadline = time.monotonic() + seconds
    while (left := alive(procs)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def kill(procs: Iterable[Identity]) -> None:
    """Clean-up after a failed test: SIGKILL what it started and is still running."""
    for pid, _ in alive(procs):
        os.kill(pid, signal.SIGKILL)


def table() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, start time, command line) of every live process."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_bytes()
            cmd = Path(f"/proc/{name}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()
        if fields[0] not in (b"Z", b"X"):
            found[int(name)] = (int(fields[1]), int(fields[19]), cmd)
    return found


def commands() -> list[str]:
    return [cmd for _, _, cmd in table().values()]


def descendants(procs: dict[int, tuple[int, int, str]], root: int) -> set[int]:
    found, todo = set(), [root]
    while todo:
        parent = todo.pop()
        for pid, (ppid, _, _) in procs.items():
            if ppid == parent and pid not in found:
                found.add(pid)
                todo.append(pid)
    return found


class RunProcesses:
    """Every process a training run (its driver ``driver_pid``, writing ``run_dir``) started,
    as seen by :meth:`record`: the driver's descendants, and the processes started after it
    that belong to its Ray session (named after the driver's pid) or name its run directory
    (the raylet and Ray's workers are not the driver's children). Record after every start
    of a process (a server added, a restart) to see it."""

    def __init__(self, driver_pid: int, run_dir: Path):
        self.driver = identity(driver_pid)
        self.run_dir = str(run_dir)
        self.seen: set[Identity] = {self.driver}

    def record(self) -> list[str]:
        """Add the run's live processes to :attr:`seen`; their command lines."""
        procs = table()
        session = f"_{self.driver[0]}/"  # Ray names its session directory after the pid of the driver that started it
        mine = descendants(procs, self.driver[0]) if start_time(self.driver[0]) == self.driver[1] else set()
        mine.update(pid for pid, (_, start, cmd) in procs.items()
                    if start >= self.driver[1] and ("/tmp/ray/session_" in cmd and session in cmd or self.run_dir in cmd))
        self.seen.update((pid, procs[pid][1]) for pid in mine)
        return [procs[pid][2] for pid in mine]

    def left(self, seconds: float) -> list[str]:
        """The command lines of those seen still alive after up to ``seconds``."""
        left = set(wait_gone(self.seen, seconds))
        return [cmd for pid, (_, start, cmd) in table().items() if (pid, start) in left]
