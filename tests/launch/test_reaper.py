"""Processes a run starts end with it, also when its driver is SIGKILLed (async_rl.launch.reaper).

A whole training run SIGKILLed is in tests/launch/test_live_run.py (it shares that run)."""

from __future__ import annotations

import subprocess
import sys
import time

from processes import alive, commands, identity, kill, table, wait_gone
from run_helpers import ROOT

from async_rl.launch.reaper import GRACE_S, SCAN_INTERVAL_S, TOKEN_ENV

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


def test_processes_of_a_sigkilled_parent_are_stopped() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    procs = {"parent": identity(parent.pid)}
    try:
        assert parent.stdout is not None
        while len(procs) < 6:  # child, stubborn, daemon, orphan_parent, orphan
            line = parent.stdout.readline()
            assert line, f"the process tree did not start (parent exit code {parent.poll()})"
            name, pid = line.split()
            procs[name] = identity(int(pid))
        watchdog = [pid for pid, (ppid, _, cmd) in table().items() if ppid == parent.pid and "reaper.py" in cmd]
        assert len(watchdog) == 1
        procs["watchdog"] = identity(watchdog[0])
        assert wait_gone([procs["orphan_parent"]], 10.0) == []  # the orphan is now outside the parent's tree

        parent.kill()
        parent.wait()
        left = wait_gone(procs.values(), GRACE_S + 7.0)
        assert left == [], {name: ident for name, ident in procs.items() if ident in left}
    finally:
        kill(procs.values())


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
    child = identity(int(out))
    try:
        time.sleep(2 * SCAN_INTERVAL_S)
        assert alive([child]) == [child]  # left running: the driver's own shutdown stops what it started
        assert not [cmd for cmd in commands() if "reaper.py" in cmd and str(parent.pid) in cmd.split()]
    finally:
        kill([child])
