"""Processes a run starts end with it, also when its driver is SIGKILLed (async_rl.launch.reaper)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import pytest
from run_helpers import ROOT, write_config

from async_rl.launch.reaper import GRACE_S, SCAN_INTERVAL_S, TOKEN_ENV, start_time

Identity = tuple[int, int]
"""(pid, start time): a process, not a reused pid."""

# The parent enters reap_on_exit and starts CHILD, which starts every kind of process that
# escapes a plain "kill my children": its own session ignoring SIGTERM, a double fork that
# detaches at once, and a detached fork whose parent exits (an orphan without the token).
# Each reports "name pid" in one write(2): print() under PYTHONUNBUFFERED=1 writes word by
# word, and the lines of concurrent processes interleave.
PARENT = """
import subprocess, sys, time
from async_rl.launch.reaper import reap_on_exit
with reap_on_exit():
    subprocess.Popen([sys.executable, "-c", sys.argv[1]])
    time.sleep(600)
"""
ORPHAN = """
import os, time
os.write(1, f"orphan_parent {os.getpid()}\\n".encode())
if os.fork() == 0:
    os.setsid(); os.write(1, f"orphan {os.getpid()}\\n".encode()); time.sleep(600); os._exit(0)
time.sleep(1.5)  # the watchdog records the fork before it is orphaned
"""
CHILD = f"""
import os, signal, subprocess, sys, time
def say(name):
    os.write(1, f"{{name}} {{os.getpid()}}\\n".encode())
say("child")
subprocess.Popen([sys.executable, "-c", "import os, signal, time; os.setsid(); signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "os.write(1, b'stubborn %d\\\\n' % os.getpid()); time.sleep(600)"])
if os.fork() == 0:
    if os.fork() == 0:
        os.setsid(); say("daemon"); time.sleep(600); os._exit(0)
    os._exit(0)
env = {{k: v for k, v in os.environ.items() if k != {TOKEN_ENV!r}}}
subprocess.Popen([sys.executable, "-c", {ORPHAN!r}], env=env)
time.sleep(600)
"""


def _identity(pid: int) -> Identity:
    start = start_time(pid)
    if start is None:
        raise AssertionError(f"process {pid} is not running")
    return pid, start


def _alive(procs: Iterable[Identity]) -> list[Identity]:
    return [(pid, start) for pid, start in procs if start_time(pid) == start]


def _wait_gone(procs: Iterable[Identity], seconds: float) -> list[Identity]:
    deadline = time.monotonic() + seconds
    while (left := _alive(procs)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _kill(procs: Iterable[Identity]) -> None:
    """Clean-up after a failed test: SIGKILL what it started and is still running."""
    for pid, _ in _alive(procs):
        os.kill(pid, signal.SIGKILL)


def _table() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, start time, command line) of every live process."""
    table = {}
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
            table[int(name)] = (int(fields[1]), int(fields[19]), cmd)
    return table


def _commands() -> list[str]:
    return [cmd for _, _, cmd in _table().values()]


def _descendants(table: dict[int, tuple[int, int, str]], root: int) -> set[int]:
    found, todo = set(), [root]
    while todo:
        parent = todo.pop()
        for pid, (ppid, _, _) in table.items():
            if ppid == parent and pid not in found:
                found.add(pid)
                todo.append(pid)
    return found


def test_processes_of_a_sigkilled_parent_are_stopped() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    procs = {"parent": _identity(parent.pid)}
    try:
        assert parent.stdout is not None
        while len(procs) < 6:  # child, stubborn, daemon, orphan_parent, orphan
            line = parent.stdout.readline()
            assert line, f"the process tree did not start (parent exit code {parent.poll()})"
            name, pid = line.split()
            procs[name] = _identity(int(pid))
        watchdog = [pid for pid, (ppid, _, cmd) in _table().items() if ppid == parent.pid and "reaper.py" in cmd]
        assert len(watchdog) == 1
        procs["watchdog"] = _identity(watchdog[0])
        assert _wait_gone([procs["orphan_parent"]], 10.0) == []  # the orphan is now outside the parent's tree

        parent.kill()
        parent.wait()
        left = _wait_gone(procs.values(), GRACE_S + 7.0)
        assert left == [], {name: ident for name, ident in procs.items() if ident in left}
    finally:
        _kill(procs.values())


def test_a_normal_exit_stops_the_watchdog_and_kills_nothing() -> None:
    script = """
import subprocess, sys, time
from async_rl.launch.reaper import reap_on_exit
with reap_on_exit():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], stdout=subprocess.DEVNULL)
    print(child.pid, flush=True)
"""
    started = time.monotonic()
    parent = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    out, _ = parent.communicate(timeout=60)
    assert parent.returncode == 0
    assert time.monotonic() - started < 10.0
    child = _identity(int(out))
    try:
        time.sleep(2 * SCAN_INTERVAL_S)
        assert _alive([child]) == [child]  # left running: the driver's own shutdown stops what it started
        assert not [cmd for cmd in _commands() if "reaper.py" in cmd and str(parent.pid) in cmd.split()]
    finally:
        _kill([child])


@pytest.mark.integration
def test_a_sigkilled_training_run_leaves_no_process(tiny_assets, tmp_path: Path) -> None:
    config = write_config(tiny_assets, tmp_path, steps=1000)
    run_dir = tmp_path / "run"
    log = tmp_path / "train.log"
    with log.open("wb") as out:
        driver = subprocess.Popen([sys.executable, "-m", "async_rl.cli", "train", str(config)], cwd=ROOT,
                                  stdout=out, stderr=subprocess.STDOUT)
    driver_id = _identity(driver.pid)
    session = f"_{driver.pid}/"  # Ray names its session directory after the pid of the driver that started it
    seen: set[Identity] = {driver_id}

    def record() -> list[str]:
        """Add the run's processes to ``seen``; their command lines."""
        table = _table()
        mine = _descendants(table, driver.pid)
        mine.update(pid for pid, (_, start, cmd) in table.items()
                    if start >= driver_id[1] and ("/tmp/ray/session_" in cmd and session in cmd or str(run_dir) in cmd))
        seen.update((pid, table[pid][1]) for pid in mine)
        return [table[pid][2] for pid in mine]

    try:
        deadline = time.monotonic() + 600
        while not any((run_dir / name).is_file() and (run_dir / name).read_text().strip()
                      for name in ("metrics.jsonl", "learner_steps.jsonl")):
            assert driver.poll() is None, f"the run exited with {driver.returncode}: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "the run did not start training within 10 minutes"
            record()
            time.sleep(1.0)
        commands = record()
        assert any("raylet" in cmd for cmd in commands) and any(cmd.startswith("ray::") for cmd in commands), commands
        driver.kill()
        driver.wait()
        left = _wait_gone(seen, 30.0)
        assert left == [], [cmd for pid, (_, start, cmd) in _table().items() if (pid, start) in left]
    finally:
        _kill(seen)
