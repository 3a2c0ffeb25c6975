"""A guarded, elastic process pool for the user's reward function.

The reward function runs in worker processes (started with multiprocessing's ``spawn``
context: the parent runs Ray and threads, so never ``fork``), each in a process group of
its own. Each process loads the function itself
(:func:`~async_rl.rewards.registry.load_reward_function`) and calls it with
``**rollout.reward.kwargs`` (EasyR1's interface):

* ``type: batch``: ``fn(list_of_dicts, **kwargs) -> list_of_dicts``, one call;
* ``type: sequential``: ``fn(dict, **kwargs) -> dict`` once per input, looped in the child,
  which answers each input as soon as it is done.

Timeouts, in two stages. ``rollout.reward.timeout_s`` bounds one input of a sequential
function, or one batch call. When it passes, a watchdog thread in the worker sends the
worker's main thread :data:`TIMER_SIGNAL`, whose handler raises in the function wherever it
is (``time.sleep``, a pure-Python loop, a blocking read): the input (or the batch call)
gets :class:`RewardTimeout` with the file and line it was interrupted at, and the process
lives on, so a hang costs ``timeout_s`` of one worker and no new interpreter. What a signal
cannot interrupt (C code that holds the GIL, e.g. a regular expression backtracking; a
function that blocks or swallows the signal) meets the parent's deadline ``kill_grace_s``
later: the worker's whole process group is SIGKILLed (the subprocesses the function
started die with it) and a fresh process replaces it.

The pool is elastic: it keeps ``num_workers`` processes, and while a call has waited
``grow_after_s`` for a worker and every worker has been on its call for ``grow_after_s`` (slow
or hung calls, not a queue of fast ones, nor processes still starting) it starts one more, up to ``max_workers``; a process beyond ``num_workers`` idle for ``extra_idle_s`` is stopped.

:meth:`RewardPool.call` awaits replies on the event loop (``add_reader`` on the pipe, no
thread), so a slow or hung function never blocks generation. Worker processes die with
the parent (``PR_SET_PDEATHSIG``), so a SIGKILLed driver leaves none behind.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from async_rl.plugins import where_in_user_code
from async_rl.rewards.registry import load_reward_function

if TYPE_CHECKING:
    from async_rl.config import RewardConfig

TIMER_SIGNAL = signal.SIGUSR2
"""The signal a worker's watchdog sends its main thread when the function runs past
``timeout_s``. Not SIGALRM: checkers such as math_verify time themselves with
``signal.alarm``, and keep doing so inside the pool."""
START_TIMEOUT_S = 60.0
"""Seconds a new worker process may take to start and load the function."""
KILL_GRACE_S = 5.0
"""Seconds past ``timeout_s`` the parent waits for the interrupted function before it kills
the worker's process group."""
GROW_AFTER_S = 0.5
"""Seconds a call waits for a busy pool before the pool starts one more process: a burst of
fast calls clears sooner, so only slow or hung calls make the pool grow."""
EXTRA_IDLE_S = 60.0
"""Seconds a process beyond ``num_workers`` may stay idle before it is stopped."""
KILL_JOIN_S = 5.0
"""Seconds :meth:`RewardPool.close` waits for each killed process to be reaped."""


class RewardError(Exception):
    """A reward call failed. ``signature`` (``ExceptionType: message``) is what a failed
    sample carries; ``traceback_text`` is the child's traceback and ``where``
    (``path/file.py:123 in name``) the innermost frame of the user's code in it, where known."""

    traceback_text: str = ""
    where: str = ""

    @property
    def signature(self) -> str:
        """``ExceptionType: message``."""
        return f"{type(self).__name__}: {self}"


class RewardCallError(RewardError):
    """The function raised in the worker process (or could not be loaded there)."""

    def __init__(self, signature: str, traceback_text: str, where: str = ""):
        super().__init__(signature)
        self.traceback_text = traceback_text
        self.where = where

    @property
    def signature(self) -> str:
        """The child's ``ExceptionType: message``."""
        return str(self)


class RewardTimeout(RewardError):
    """The function ran longer than ``timeout_s`` on an input (or a batch call).

    ``killed`` False: the timer interrupted it in its process (``where`` and
    ``traceback_text`` say where it was); True: it did not stop within ``kill_grace_s`` of
    the interrupt, so its process group was killed and the process replaced (no traceback).
    """

    def __init__(self, message: str, *, killed: bool, traceback_text: str = "", where: str = ""):
        super().__init__(message)
        self.killed = killed
        self.traceback_text = traceback_text
        self.where = where


class RewardWorkerDied(RewardError):
    """The worker process exited mid-call or while starting (``os._exit``, a crash, the OOM killer); it was replaced."""


class _Slot:
    """One worker process and the parent's end of its pipe; replaced in place, so the
    slot a call holds stays valid across a restart."""

    def __init__(self, index: int):
        self.index = index
        self.process: BaseProcess | None = None
        self.conn: Connection | None = None
        self.ready = False
        """Whether the process has reported that it is waiting for inputs."""
        self.idle_since = 0.0
        """``time.monotonic()`` when the slot last became idle."""
        self.busy_since = 0.0
        """``time.monotonic()`` when the slot's current call began (0.0 while idle)."""


class RewardPool:
    """Reward worker processes (``cfg.num_workers``, up to ``cfg.max_workers`` while calls
    wait), used from one event loop at a time.

    Start it (``start()`` or ``with RewardPool(cfg) as pool:``) from a long-lived thread,
    e.g. the one that runs the event loop: the kernel's parent-death signal follows the
    thread that started a process (processes the pool adds later are started by the
    thread that runs the call). Calls are ``await pool.call(inputs)``; ``close()`` kills
    every process group and reaps the processes. The processes are daemonic (they end with
    the interpreter), so the reward function cannot start multiprocessing children of its
    own (``subprocess`` works).

    Args:
        cfg: ``rollout.reward``.
        kill_grace_s: seconds past ``cfg.timeout_s`` before an interrupted call's process group is killed.
        grow_after_s: seconds a call waits for a busy pool before one more process is started.
        extra_idle_s: seconds a process beyond ``cfg.num_workers`` stays idle before it is stopped.
    """

    def __init__(self, cfg: RewardConfig, *, kill_grace_s: float = KILL_GRACE_S, grow_after_s: float = GROW_AFTER_S,
                 extra_idle_s: float = EXTRA_IDLE_S):
        self.cfg = cfg
        self.kill_grace_s = kill_grace_s
        self.grow_after_s = grow_after_s
        self.extra_idle_s = extra_idle_s
        self.restarts = 0
        """Worker processes replaced: killed after a timeout, died, or killed because their call was cancelled."""
        self.interrupted = 0
        """Calls (a sequential function's inputs, or batch calls) the worker's timer interrupted in-process."""
        self.killed = 0
        """Worker processes (with their process groups) killed because an interrupted call did not stop."""
        self.peak_workers = 0
        """The most worker processes the pool has held at once."""
        self._ctx = multiprocessing.get_context("spawn")
        self._slots: list[_Slot] = []
        self._idle: list[_Slot] = []
        """Idle slots, the longest idle first (calls take from the end)."""
        self._waiters: deque[asyncio.Future[_Slot]] = deque()
        self._dying: set[BaseProcess] = set()
        self._next_index = 0
        self._retire_timer: asyncio.TimerHandle | None = None
        self._closed = False

    @property
    def workers(self) -> int:
        """Worker processes now (started, idle or busy)."""
        return len(self._slots)

    def start(self) -> None:
        """Start ``cfg.num_workers`` processes (returns at once; each loads the function as it starts)."""
        if self._slots:
            raise RuntimeError("RewardPool.start() called twice")
        if not 1 <= self.cfg.num_workers <= self.cfg.max_workers:
            raise ValueError(f"rollout.reward.num_workers={self.cfg.num_workers} must be in [1, rollout.reward.max_workers={self.cfg.max_workers}]")
        for _ in range(self.cfg.num_workers):
            self._idle.append(self._new_slot())

    def close(self) -> None:
        """Kill every worker's process group and reap the processes. Calls still waiting
        for a worker raise RuntimeError; a call in flight raises :class:`RewardWorkerDied`."""
        self._closed = True
        if self._retire_timer is not None:
            self._retire_timer.cancel()
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(RuntimeError("the reward pool was closed"))
        procs = [slot.process for slot in self._slots if slot.process is not None] + list(self._dying)
        for proc in procs:
            _kill_group(proc)
        for proc in procs:
            proc.join(KILL_JOIN_S)
        self._dying.clear()
        for slot in self._idle:
            if slot.conn is not None:
                slot.conn.close()

    def __enter__(self) -> RewardPool:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def pids(self) -> list[int]:
        """Process ids of the current worker processes."""
        return [slot.process.pid for slot in self._slots if slot.process is not None and slot.process.pid is not None]

    async def call(self, inputs: list[dict[str, Any]]) -> Any:
        """Run the function on ``inputs`` in an idle worker process.

        ``type: batch``: returns the function's output (unchecked) or raises
        :class:`RewardCallError`, :class:`RewardTimeout` or :class:`RewardWorkerDied` for
        the call. ``type: sequential``: returns one entry per input, the function's output
        or the :class:`RewardError` of that input; a process killed or dead on one input is
        replaced and the inputs after it go to another worker.

        Waits (without blocking the loop) for an idle worker, growing the pool if that takes
        ``grow_after_s``; a new process first gets :data:`START_TIMEOUT_S` to start. If the
        awaiting task is cancelled mid-call, the process group is killed and replaced.
        """
        if not self._slots or self._closed:
            raise RuntimeError("RewardPool.call() needs a started, open pool")
        sequential = self.cfg.type == "sequential"
        outcomes: list[Any] = []
        while not sequential or len(outcomes) < len(inputs):
            rest = inputs[len(outcomes):]
            slot = await self._acquire()
            slot.busy_since = time.monotonic()
            if slot.process is None or not slot.process.is_alive():  # exited while idle (e.g. the OOM killer)
                self._replace(slot)
                continue
            healthy = False
            try:
                got, healthy = await self._roundtrip(slot, rest, len(rest) if sequential else 1)
            finally:
                if healthy:
                    self._release(slot)
                else:
                    self._replace(slot)
            if not sequential:
                if isinstance(got[0], RewardError):
                    raise got[0]
                return got[0]
            outcomes += got
        return outcomes

    async def _acquire(self) -> _Slot:
        if self._idle:
            return self._take_idle()
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[_Slot] = loop.create_future()
        self._waiters.append(waiter)
        grow: list[asyncio.TimerHandle] = []  # the pending growth check (_grow replaces it)
        grow.append(loop.call_later(self.grow_after_s, self._grow, waiter, grow))
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # handed a slot just as we were cancelled
                self._release(waiter.result())
            raise
        finally:
            grow[0].cancel()
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def _take_idle(self) -> _Slot:
        """The most recently idle slot whose process is ready (a new one may still be starting), else the most recent."""
        for i in range(len(self._idle) - 1, -1, -1):
            slot = self._idle[i]
            if slot.ready or (slot.conn is not None and slot.conn.poll()):
                return self._idle.pop(i)
        return self._idle.pop()

    def _grow(self, waiter: asyncio.Future[_Slot], check: list[asyncio.TimerHandle]) -> None:
        """``waiter`` has waited ``grow_after_s``: start one more process if the pool may grow
        and every worker is held by a call older than ``grow_after_s`` (slow or hung). While a
        worker is on a fresh call the queue is moving (many fast calls, a busy CPU), and while a
        process is still starting it will serve soon: check again later instead, since a new
        interpreter costs seconds of CPU that generation needs (counting starting processes as
        hung, a run's first calls grew the pool to 5 on 2 cores, each new one slowing the next)."""
        if waiter.done() or self._closed or len(self._slots) >= self.cfg.max_workers:
            return
        now = time.monotonic()
        if any(not slot.ready or (slot.busy_since and now - slot.busy_since < self.grow_after_s) for slot in self._slots):
            check[0] = asyncio.get_running_loop().call_later(self.grow_after_s, self._grow, waiter, check)
            return
        self._release(self._new_slot())

    def _release(self, slot: _Slot) -> None:
        slot.busy_since = 0.0
        if self._closed:
            if slot.conn is not None:
                slot.conn.close()
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(slot)
                return
        slot.idle_since = time.monotonic()
        self._idle.append(slot)
        if len(self._slots) > self.cfg.num_workers:
            self._retire_idle()

    def _retire_idle(self) -> None:
        """Stop processes beyond ``num_workers`` idle for ``extra_idle_s``; check again when the next one will be."""
        now = time.monotonic()
        while len(self._slots) > self.cfg.num_workers and self._idle and now - self._idle[0].idle_since >= self.extra_idle_s:
            slot = self._idle.pop(0)
            self._slots.remove(slot)
            self._stop(slot)
        if self._retire_timer is not None:
            self._retire_timer.cancel()
            self._retire_timer = None
        if len(self._slots) > self.cfg.num_workers and self._idle and not self._closed:
            wait = self._idle[0].idle_since + self.extra_idle_s - now
            self._retire_timer = asyncio.get_running_loop().call_later(wait, self._retire_idle)

    async def _roundtrip(self, slot: _Slot, inputs: list[dict[str, Any]], expected: int) -> tuple[list[Any], bool]:
        """Send ``inputs``, read ``expected`` replies (each an output or a :class:`RewardError`).

        Returns the replies and whether the process is fit for another call; on a start
        failure every reply is that error, on a kill or death the last one is.
        """
        if not slot.ready:
            error = await self._wait_ready(slot)
            if error is not None:
                return [error] * expected, False
        replies: list[Any] = []
        deadline_s = self.cfg.timeout_s + self.kill_grace_s
        while len(replies) < expected:
            try:
                if not replies:
                    if slot.conn is None:
                        raise EOFError
                    slot.conn.send(inputs)  # the child is blocked in recv(), so this only streams into it
                reply = await asyncio.wait_for(self._receive(slot), deadline_s)
            except asyncio.TimeoutError:
                self.killed += 1
                replies.append(RewardTimeout(
                    f"the reward function ran longer than rollout.reward.timeout_s={self.cfg.timeout_s:g} s and did not stop within "
                    f"{self.kill_grace_s:g} s of the timer's interrupt (C code or a blocked signal); its process group was killed",
                    killed=True))
                return replies, False
            except (EOFError, OSError):
                replies.append(RewardWorkerDied(f"the reward process exited mid-call ({await self._exit_status(slot)}); it was replaced"))
                return replies, False
            replies.append(self._decode(reply))
        return replies, True

    async def _wait_ready(self, slot: _Slot) -> RewardWorkerDied | None:
        """Wait for a new process's ``ready`` message; the error if it does not come."""
        try:
            await asyncio.wait_for(self._receive(slot), START_TIMEOUT_S)
        except asyncio.TimeoutError:
            return RewardWorkerDied(f"the reward process did not start within {START_TIMEOUT_S:g} s; it was replaced")
        except (EOFError, OSError):
            return RewardWorkerDied(f"the reward process exited while starting ({await self._exit_status(slot)}); it was replaced")
        slot.ready = True
        return None

    def _decode(self, reply: bytes) -> Any:
        try:
            status, *payload = pickle.loads(reply)
        except Exception as exc:  # noqa: BLE001 - e.g. an output of a class the driver cannot import
            return RewardCallError(f"{type(exc).__name__}: reward output could not be unpickled in the driver: {exc}", traceback.format_exc())
        if status == "error":
            return RewardCallError(*payload)
        if status == "timeout":
            self.interrupted += 1
            text, where = payload
            return RewardTimeout(f"the reward function ran longer than rollout.reward.timeout_s={self.cfg.timeout_s:g} s; "
                                 "the timer interrupted it", killed=False, traceback_text=text, where=where)
        return payload[0]

    async def _receive(self, slot: _Slot) -> bytes:
        """The next message from the child, awaited with ``add_reader`` (EOF: EOFError)."""
        if slot.conn is None:
            raise EOFError
        loop = asyncio.get_running_loop()
        fd = slot.conn.fileno()
        readable: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, lambda: readable.done() or readable.set_result(None))
        try:
            await readable
        finally:
            loop.remove_reader(fd)
        return slot.conn.recv_bytes()

    async def _exit_status(self, slot: _Slot) -> str:
        """How the slot's process ended, waiting up to a second for it to be reapable."""
        proc = slot.process
        if proc is None:
            return "not started"
        loop = asyncio.get_running_loop()
        gone: asyncio.Future[None] = loop.create_future()
        loop.add_reader(proc.sentinel, lambda: gone.done() or gone.set_result(None))
        deadline = loop.time() + 1.0
        try:
            await asyncio.wait_for(gone, 1.0)
        except asyncio.TimeoutError:
            return "still running"
        finally:
            loop.remove_reader(proc.sentinel)
        # The sentinel is readable once the child's end of it closes, a moment before the
        # process can be reaped: until then exitcode is None.
        while proc.exitcode is None and loop.time() < deadline:
            await asyncio.sleep(0.005)
        code = proc.exitcode
        if code is not None and code < 0:
            return f"killed by signal {signal.Signals(-code).name}"
        return f"exit code {code}"

    def _replace(self, slot: _Slot) -> None:
        """Kill the slot's process group; start a fresh process in its place, or, for a
        process beyond ``num_workers`` that no call waits for, drop the slot."""
        self._stop(slot)
        if self._closed:
            return
        if len(self._slots) > self.cfg.num_workers and not self._waiters:
            self._slots.remove(slot)
            return
        self.restarts += 1
        self._spawn(slot)
        self._release(slot)

    def _stop(self, slot: _Slot) -> None:
        """Kill the slot's process group and reap the process without blocking."""
        proc, conn = slot.process, slot.conn
        if conn is not None:
            conn.close()
        if proc is not None:
            _kill_group(proc)
            self._reap_later(proc)
        slot.process, slot.conn, slot.ready = None, None, False

    def _reap_later(self, proc: BaseProcess) -> None:
        """Join ``proc`` once its sentinel is readable (it exited); close() joins the rest."""
        self._dying.add(proc)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return

        def reap() -> None:
            loop.remove_reader(proc.sentinel)
            proc.join(0)
            self._dying.discard(proc)

        loop.add_reader(proc.sentinel, reap)

    def _new_slot(self) -> _Slot:
        slot = _Slot(self._next_index)
        self._next_index += 1
        self._slots.append(slot)
        self.peak_workers = max(self.peak_workers, len(self._slots))
        self._spawn(slot)
        return slot

    def _spawn(self, slot: _Slot) -> None:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=_child_main,
            args=(child_conn, self.cfg.function, self.cfg.type, dict(self.cfg.kwargs), self.cfg.timeout_s, os.getpid()),
            name=f"async-rl-reward-{slot.index}",
            daemon=True,
        )
        proc.start()
        child_conn.close()
        slot.process, slot.conn, slot.ready = proc, parent_conn, False


def _kill_group(proc: BaseProcess) -> None:
    """SIGKILL the worker's process group (it leads a group of its own, see :func:`_child_main`),
    so that subprocesses the reward function started die too. The kernel keeps a group's
    id from being reused while any member, the unreaped worker included, exists."""
    if proc.pid is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # not yet in a group of its own (just spawned), or all gone
        proc.kill()


# -- the worker process ---------------------------------------------------------------

_PR_SET_PDEATHSIG = 1


def _child_main(conn: Connection, function: str, kind: str, kwargs: dict[str, Any], timeout_s: float, parent_pid: int) -> None:
    """Worker process: load the function, then answer each request until the pipe closes.

    Messages to the parent are pickled tuples: ``("ready",)`` once, then one reply per
    batch call or per input of a sequential function: ``("ok", output)``,
    ``("error", "ExceptionType: message", traceback_text, where)`` or
    ``("timeout", traceback_text, where)``. A function that cannot be loaded answers with
    the loading error.
    """
    # A process group of its own: the parent kills the group, subprocesses included; and
    # Ctrl-C in the terminal reaches the driver, not the workers. Not a session (setsid):
    # with the kernel's scheduler autogroups each session is scheduled as one group, and
    # the quickstart's synchronous mode ran 1.7x slower (30 steps: 27.5 s against 16.7 s).
    os.setpgid(0, 0)
    _die_with_parent(parent_pid)
    timer = _Timer(timeout_s)
    try:
        fn = load_reward_function(function)
        load_error = None
    except BaseException as exc:  # noqa: BLE001 - reported on every call, never a hang
        fn, load_error = None, _error_reply(exc)
    conn.send_bytes(pickle.dumps(("ready",)))
    while True:
        try:
            inputs = conn.recv()
        except (EOFError, ConnectionResetError):  # the parent closed the pipe or went away: nothing more to do
            return
        for arg in [inputs] if kind == "batch" else inputs:
            conn.send_bytes(load_error or timer.run(fn, arg, kwargs))


class _Interrupted(BaseException):
    """Raised in the function by :data:`TIMER_SIGNAL`'s handler; a BaseException, so that
    the function's ``except Exception`` does not swallow it."""


class _Timer:
    """Runs the function in the main thread with a deadline kept by a watchdog thread.

    :data:`TIMER_SIGNAL` is blocked in the main thread except while the function runs, and
    the handler blocks it again before it raises, so the interrupt lands only in the
    function; a signal left pending from a call that has ended is ignored (``_fired`` is
    the call the watchdog fired for, ``_call`` the one running; 0: none).
    """

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s
        self._main = threading.get_ident()
        self._cond = threading.Condition()
        self._call = 0
        self._calls = 0
        self._fired = 0
        self._deadline = 0.0
        self._stack: traceback.StackSummary | None = None
        signal.pthread_sigmask(signal.SIG_BLOCK, {TIMER_SIGNAL})  # before the watchdog starts, so it inherits the block
        signal.signal(TIMER_SIGNAL, self._on_signal)
        threading.Thread(target=self._watch, name="reward-timer", daemon=True).start()

    def run(self, fn: Any, arg: Any, kwargs: dict[str, Any]) -> bytes:
        """``fn(arg, **kwargs)`` as a pickled reply (see :func:`_child_main`)."""
        with self._cond:
            self._calls += 1
            self._call = call = self._calls
            self._deadline = time.monotonic() + self.timeout_s
            self._cond.notify()
        self._stack = None
        reply: bytes | None = None
        try:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {TIMER_SIGNAL})
            try:
                output = fn(arg, **kwargs)
            finally:
                signal.pthread_sigmask(signal.SIG_BLOCK, {TIMER_SIGNAL})
            reply = _dumps_output(output)
        except _Interrupted:
            pass
        except BaseException as exc:  # noqa: BLE001 - also SystemExit: a reward bug must not end the worker silently
            reply = _error_reply(exc)
        with self._cond:
            fired = self._fired == call
            self._call = 0
        if fired or reply is None:  # past the deadline even if the function swallowed the interrupt and returned
            frames = _user_frames(self._stack or traceback.StackSummary())
            text = f"Interrupted after rollout.reward.timeout_s={self.timeout_s:g} s at (most recent call last):\n" + "".join(frames.format())
            return pickle.dumps(("timeout", text, _where(frames)))
        return reply

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._call == 0 or self._fired != self._call:
            return  # left pending by a call that ended before it could land
        signal.pthread_sigmask(signal.SIG_BLOCK, {TIMER_SIGNAL})
        self._stack = traceback.extract_stack(frame)
        raise _Interrupted

    def _watch(self) -> None:
        with self._cond:
            while True:
                if self._call == 0 or self._fired == self._call:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self._fired = self._call
                signal.pthread_kill(self._main, TIMER_SIGNAL)


def _dumps_output(output: Any) -> bytes:
    try:
        return pickle.dumps(("ok", output))
    except Exception as exc:  # noqa: BLE001 - an output pickle cannot carry is the function's error
        return _error_reply(exc)


def _error_reply(exc: BaseException) -> bytes:
    te = traceback.TracebackException.from_exception(exc)
    te.stack = _user_frames(te.stack)
    where = _where(te.stack)
    if isinstance(exc, SyntaxError) and exc.filename:  # the frames are the importer's; the error is in the file
        where = f"{exc.filename}:{exc.lineno}"
    return pickle.dumps(("error", f"{type(exc).__name__}: {exc}"[:2000], "".join(te.format()), where))


def _where(stack: traceback.StackSummary) -> str:
    return where_in_user_code((f.filename, f.lineno or 0, f.name) for f in stack)


def _user_frames(stack: traceback.StackSummary) -> traceback.StackSummary:
    """The frames of ``stack`` below this module's (the process start-up and the worker
    loop around the function), the function's own first."""
    last = max((i for i, f in enumerate(stack) if f.filename == __file__), default=-1)
    return traceback.StackSummary.from_list(list(stack)[last + 1:])


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when the thread that started it dies (Linux),
    and exit at once if the parent is already gone."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)
