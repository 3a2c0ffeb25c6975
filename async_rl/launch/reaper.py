"""Every process a run starts ends with it, also when the driver is killed with SIGKILL.

A SIGKILLed driver runs no shutdown code. Most of what it started notices on its own
(Ray's GCS server, raylet and workers watch their parent; the embedded redis-server has a
parent-death signal), but not everything: Ray's ``ray::DashboardAgent`` and
``ray::RuntimeEnvAgent`` are reparented to init and outlive the driver for 30-60 s, and
they catch SIGTERM without exiting.

:func:`reap_on_exit` starts a watchdog process (this module run as a script: standard
library only, no torch or Ray) in a session of its own, so nothing aimed at the driver's
process group reaches it. Every :data:`SCAN_INTERVAL_S` seconds it records the driver's
descendants by identity (pid, start time): a process keeps its recorded identity after it
is reparented, so one that detaches (``setsid``, a double fork) or outlives its parent is
still known. Processes started from the driver after the context was entered also carry
:data:`TOKEN_ENV` in their environment, which catches a double fork that detaches between
two scans (unless it clears its environment, or ``setproctitle`` overwrites it, as Ray's
agents do; those stay children of the raylet long enough to be recorded).

Once the driver is gone, the watchdog sends SIGTERM to every recorded process still alive
with the same start time, to their current descendants (started since the last scan) and
to the token holders, waits up to :data:`GRACE_S` seconds, and SIGKILLs what is left. On
a normal exit of the context the driver tells the watchdog to stop (its own shutdown
stops what it started) and waits for it.

Linux only (``/proc``); elsewhere :func:`reap_on_exit` does nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

TOKEN_ENV = "ASYNC_RL_REAPER_TOKEN"
"""Environment variable holding the run's random token in every process started from the driver."""
SCAN_INTERVAL_S = 0.5
"""Seconds between two records of the driver's descendants."""
GRACE_S = 3.0
"""Seconds between SIGTERM and SIGKILL when the watchdog reaps."""
STOP_TIMEOUT_S = 10.0
"""Longest the driver waits for the watchdog to exit after telling it to stop, seconds."""
START_TIMEOUT_S = 60.0
"""Longest the driver waits for the watchdog to start (an interpreter's start, well under a second), seconds."""

_STOP = b"stop\n"
_READY = b"ready\n"

_Table = dict[int, tuple[int, int]]
"""A snapshot of the live processes: pid -> (parent pid, start time)."""


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, start time in clock ticks since boot, state) of ``pid``, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces and ')'.
    fields = raw[raw.rindex(b")") + 2 :].split()
    return int(fields[1]), int(fields[19]), fields[0].decode()


def start_time(pid: int) -> int | None:
    """Start time of a live (not zombie) process (``/proc/<pid>/stat`` field 22), or None."""
    stat = _stat(pid)
    return None if stat is None or stat[2] in ("Z", "X") else stat[1]


def process_table() -> _Table:
    """The live (not zombie) processes: pid -> (parent pid, start time)."""
    table: _Table = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (stat := _stat(int(name))) is not None and stat[2] not in ("Z", "X"):
            table[int(name)] = (stat[0], stat[1])
    return table


def descendants(table: _Table, roots: set[int]) -> set[int]:
    """Pids in ``table`` below any of ``roots`` (the roots themselves excluded)."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    todo = [child for root in roots for child in children.get(root, ())]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, ()))
    return found


def _has_token(pid: int, entry: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return entry in b"\0" + f.read()
    except OSError:  # gone, or another user's
        return False


class _Tracker:
    """The watchdog's record of the run's processes (everything but itself)."""

    def __init__(self, driver: int, driver_start: int, token: str) -> None:
        self.driver, self.driver_start = driver, driver_start
        self.entry = f"\0{TOKEN_ENV}={token}\0".encode()
        self.known: dict[int, int] = {}
        """pid -> start time of every process recorded as the run's and seen alive last."""

    def driver_alive(self) -> bool:
        return start_time(self.driver) == self.driver_start

    def update(self, roots: set[int]) -> None:
        """Forget what exited; record the live descendants of ``roots`` and of the known
        processes, and the token holders started since the driver."""
        table = process_table()
        self.known = {pid: start for pid, start in self.known.items() if pid in table and table[pid][1] == start}
        found = descendants(table, roots | set(self.known))
        found.update(pid for pid, (_, start) in table.items()
                     if start >= self.driver_start and pid not in found and pid not in self.known and _has_token(pid, self.entry))
        found.discard(os.getpid())
        found.discard(self.driver)
        self.known.update((pid, table[pid][1]) for pid in found)

    def signal_all(self, sig: signal.Signals) -> None:
        for pid, start in self.known.items():
            _signal(pid, start, sig)


def _signal(pid: int, start: int, sig: signal.Signals) -> None:
    """Send ``sig`` to ``pid`` if it is still the process that started at ``start``."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            return
        except OSError:  # a kernel without pidfds (< 5.3): a pid reused in between is hit
            if start_time(pid) == start:
                os.kill(pid, sig)
            return
        try:  # the pidfd pins the process: checked, then signalled, with no reuse in between
            if start_time(pid) == start:
                signal.pidfd_send_signal(fd, sig)
        finally:
            os.close(fd)


def watch(driver: int, driver_start: int, token: str, control: int, grace_s: float = GRACE_S) -> int:
    """The watchdog: record the run's processes until the driver stops it (returns 0) or is
    gone (reaps them; returns how many it had to signal). ``control`` is the read end of the
    driver's pipe: ``stop`` means a normal exit; end of file without it means the driver died."""
    tracker = _Tracker(driver, driver_start, token)
    tracker.update({driver})
    os.write(sys.stdout.fileno(), _READY)
    received, control_open = b"", True
    while tracker.driver_alive():
        if not control_open:
            time.sleep(SCAN_INTERVAL_S)
        elif select.select([control], [], [], SCAN_INTERVAL_S)[0]:
            chunk = os.read(control, 64)
            received += chunk
            if received.startswith(_STOP):
                return 0
            control_open = bool(chunk)  # closed without a stop: the driver is exiting
        tracker.update({driver})
    return _reap(tracker, grace_s)


def _reap(tracker: _Tracker, grace_s: float) -> int:
    tracker.update(set())
    reaped = dict(tracker.known)
    tracker.signal_all(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while tracker.known and time.monotonic() < deadline:
        time.sleep(0.1)
        before = set(tracker.known)
        tracker.update(set())  # children started meanwhile get SIGTERM too
        for pid in set(tracker.known) - before:
            _signal(pid, tracker.known[pid], signal.SIGTERM)
        reaped.update(tracker.known)
    for _ in range(10):  # until no new process appears
        if not tracker.known:
            break
        tracker.signal_all(signal.SIGKILL)
        time.sleep(0.1)
        tracker.update(set())
        reaped.update(tracker.known)
    if reaped:
        with contextlib.suppress(OSError):  # the driver's stderr may be a closed pipe now
            print(f"async-rl reaper: driver {tracker.driver} is gone; stopped {len(reaped)} of its processes: "
                  f"{' '.join(map(str, sorted(reaped)))}", file=sys.stderr, flush=True)
    return len(reaped)


@contextlib.contextmanager
def reap_on_exit(grace_s: float = GRACE_S) -> Iterator[None]:
    """Within the context, processes started by this process are stopped (SIGTERM, SIGKILL
    after ``grace_s``) by a watchdog if this process dies without leaving the context,
    SIGKILL included. Enter it before starting anything. Does nothing outside Linux."""
    pid = os.getpid()
    me = start_time(pid) if sys.platform.startswith("linux") else None
    if me is None:
        yield
        return
    token = secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    control_r, control_w = os.pipe()
    ready_r, ready_w = os.pipe()
    try:
        watchdog = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__), str(pid), str(me), token, f"--grace-s={grace_s}"],
            stdin=control_r, stdout=ready_w, env=env,
            # A process group of its own, so a Ctrl-C to the driver's group does not reach it.
            # Not a session: with the kernel's scheduler autogroups a new session is scheduled
            # as a group of its own, and on a loaded 2-core machine the watchdog got 50 ms of
            # CPU in 90 s and the driver waited for it forever.
            preexec_fn=os.setpgrp,
        )
    except BaseException:
        os.close(control_w)
        os.close(ready_r)
        raise
    finally:
        os.close(control_r)
        os.close(ready_w)
    try:
        with open(ready_r, "rb") as ready:
            if not select.select([ready], [], [], START_TIMEOUT_S)[0]:
                watchdog.kill()
                raise RuntimeError(f"the process reaper (pid {watchdog.pid}) did not start within {START_TIMEOUT_S:.0f} s: "
                                   "is the machine overloaded?")
            if ready.readline() != _READY:
                raise RuntimeError(f"the process reaper did not start (exit code {watchdog.wait()})")
        previous = os.environ.get(TOKEN_ENV)
        os.environ[TOKEN_ENV] = token
        try:
            yield
        finally:
            if previous is None:
                os.environ.pop(TOKEN_ENV, None)
            else:
                os.environ[TOKEN_ENV] = previous
    finally:
        with contextlib.suppress(BrokenPipeError):
            os.write(control_w, _STOP)
        os.close(control_w)
        try:
            watchdog.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            watchdog.kill()
            watchdog.wait()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the watchdog process (started by :func:`reap_on_exit`)."""
    parser = argparse.ArgumentParser(description="Stop the processes of a run whose driver died.")
    parser.add_argument("driver", type=int, help="pid of the process to watch")
    parser.add_argument("driver_start", type=int, help="its start time (/proc/<pid>/stat field 22)")
    parser.add_argument("token", help=f"the value of {TOKEN_ENV} in the run's processes")
    parser.add_argument("--grace-s", type=float, default=GRACE_S, help="seconds from SIGTERM to SIGKILL")
    args = parser.parse_args(argv)
    watch(args.driver, args.driver_start, args.token, sys.stdin.fileno(), args.grace_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
