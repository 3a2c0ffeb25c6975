"""A guarded process pool for the user's reward function.

The reward function runs in ``rollout.reward.num_workers`` worker processes (started with
multiprocessing's ``spawn`` context: the parent runs Ray and threads, so never ``fork``).
Each process loads the function itself (:func:`~async_rl.rewards.registry.load_reward_function`)
and calls it with ``**rollout.reward.kwargs`` (EasyR1's interface):

* ``type: batch``: ``fn(list_of_dicts, **kwargs) -> list_of_dicts``, one call;
* ``type: sequential``: ``fn(dict, **kwargs) -> dict`` once per input, looped in the child
  (one call from the parent's view).

:meth:`RewardPool.call` awaits the reply on the event loop (``add_reader`` on the pipe,
no thread), so a slow or hung function never blocks generation, and every outcome other
than a reply is a typed exception: :class:`RewardCallError` (the function raised, or
could not be loaded), :class:`RewardTimeout` (longer than ``timeout_s``: the process is
SIGKILLed and replaced) and :class:`RewardWorkerDied` (the process exited mid-call:
replaced). Worker processes die with the parent (``PR_SET_PDEATHSIG``), so a SIGKILLed
driver leaves none behind.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import pickle
import signal
import sys
import traceback
from collections import deque
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any

from async_rl.rewards.registry import load_reward_function

if TYPE_CHECKING:
    from async_rl.config import RewardConfig

START_TIMEOUT_S = 60.0
"""Seconds a new worker process may take to start and load the function (at least ``timeout_s``)."""
KILL_JOIN_S = 5.0
"""Seconds :meth:`RewardPool.close` waits for each SIGKILLed process to be reaped."""


class RewardError(Exception):
    """A reward call failed. ``signature`` (``ExceptionType: message``) is what a failed
    sample carries; ``traceback_text`` is the child's traceback, where there is one."""

    traceback_text: str = ""

    @property
    def signature(self) -> str:
        """``ExceptionType: message``."""
        return f"{type(self).__name__}: {self}"


class RewardCallError(RewardError):
    """The function raised in the worker process (or could not be loaded there)."""

    def __init__(self, signature: str, traceback_text: str):
        super().__init__(signature)
        self.traceback_text = traceback_text

    @property
    def signature(self) -> str:
        """The child's ``ExceptionType: message``."""
        return str(self)


class RewardTimeout(RewardError):
    """The call took longer than ``timeout_s``; its process was SIGKILLed and replaced."""


class RewardWorkerDied(RewardError):
    """The worker process exited mid-call (``os._exit``, a crash, the OOM killer); it was replaced."""


class _Slot:
    """One worker process and the parent's end of its pipe; replaced in place, so the
    slot a call holds stays valid across a restart."""

    def __init__(self, index: int):
        self.index = index
        self.process: BaseProcess | None = None
        self.conn: Connection | None = None
        self.ready = False
        """Whether the process has reported that it is waiting for inputs."""


class RewardPool:
    """``cfg.num_workers`` processes running the reward function, used from one event loop.

    Start it (``start()`` or ``with RewardPool(cfg) as pool:``) from a long-lived thread,
    e.g. the one that runs the event loop: the kernel's parent-death signal follows the
    thread that started a process. Calls are ``await pool.call(inputs)``; ``close()`` kills
    and reaps every process. The processes are daemonic (they end with the interpreter), so
    the reward function cannot start multiprocessing children of its own (``subprocess`` works).
    """

    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg
        self.restarts = 0
        """Worker processes replaced: timed out, died, or killed because their call was cancelled."""
        self._ctx = multiprocessing.get_context("spawn")
        self._slots: list[_Slot] = []
        self._idle: list[_Slot] = []
        self._waiters: deque[asyncio.Future[_Slot]] = deque()
        self._dying: set[BaseProcess] = set()
        self._closed = False

    def start(self) -> None:
        """Start the worker processes (returns at once; each loads the function as it starts)."""
        if self._slots:
            raise RuntimeError("RewardPool.start() called twice")
        if self.cfg.num_workers < 1:
            raise ValueError(f"rollout.reward.num_workers={self.cfg.num_workers} must be at least 1")
        self._slots = [_Slot(i) for i in range(self.cfg.num_workers)]
        for slot in self._slots:
            self._spawn(slot)
        self._idle = list(self._slots)

    def close(self) -> None:
        """SIGKILL and reap every worker process. Calls still waiting for a worker raise
        RuntimeError; a call in flight raises :class:`RewardWorkerDied`."""
        self._closed = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(RuntimeError("the reward pool was closed"))
        procs = [slot.process for slot in self._slots if slot.process is not None] + list(self._dying)
        for proc in procs:
            proc.kill()
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

    async def call(self, inputs: list[dict[str, Any]]) -> list[Any]:
        """Run the function on ``inputs`` in an idle worker process; its raw outputs.

        Waits (without blocking the loop) for an idle worker; then ``cfg.timeout_s`` seconds
        bound the call itself (a new process first gets ``max(timeout_s, START_TIMEOUT_S)``
        to start and load the function). Raises :class:`RewardCallError`,
        :class:`RewardTimeout` or :class:`RewardWorkerDied`. If the awaiting task is
        cancelled mid-call, the process is killed and replaced.
        """
        if not self._slots or self._closed:
            raise RuntimeError("RewardPool.call() needs a started, open pool")
        slot = await self._acquire()
        try:
            if slot.process is None or not slot.process.is_alive():
                self._replace(slot)
            return await self._roundtrip(slot, inputs)
        finally:
            self._release(slot)

    async def _acquire(self) -> _Slot:
        if self._idle:
            return self._idle.pop()
        waiter: asyncio.Future[_Slot] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # handed a slot just as we were cancelled
                self._release(waiter.result())
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def _release(self, slot: _Slot) -> None:
        if self._closed:
            if slot.conn is not None:
                slot.conn.close()
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(slot)
                return
        self._idle.append(slot)

    async def _roundtrip(self, slot: _Slot, inputs: list[dict[str, Any]]) -> list[Any]:
        completed = False
        try:
            if not slot.ready:
                try:
                    await asyncio.wait_for(self._receive(slot), max(self.cfg.timeout_s, START_TIMEOUT_S))
                except asyncio.TimeoutError:
                    raise RewardTimeout(f"the reward process did not start within {max(self.cfg.timeout_s, START_TIMEOUT_S):g} s; "
                                        "it was killed and replaced") from None
                slot.ready = True
            try:
                reply = await asyncio.wait_for(self._exchange(slot, inputs), self.cfg.timeout_s)
            except asyncio.TimeoutError:
                raise RewardTimeout(f"the reward call took longer than rollout.reward.timeout_s={self.cfg.timeout_s:g} s; "
                                    "its process was killed and replaced") from None
            completed = True
        except (EOFError, OSError):
            raise RewardWorkerDied(f"the reward process exited mid-call ({await self._exit_status(slot)}); it was replaced") from None
        finally:
            if not completed:
                self._replace(slot)
        try:
            status, *payload = pickle.loads(reply)
        except Exception as exc:  # noqa: BLE001 - e.g. an output of a class the driver cannot import
            raise RewardCallError(f"{type(exc).__name__}: reward output could not be unpickled in the driver: {exc}",
                                  traceback.format_exc()) from None
        if status == "error":
            raise RewardCallError(*payload)
        return payload[0]

    async def _exchange(self, slot: _Slot, inputs: list[dict[str, Any]]) -> bytes:
        if slot.conn is None:
            raise EOFError
        slot.conn.send(inputs)  # the child is blocked in recv(), so this only streams into it
        return await self._receive(slot)

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
        """SIGKILL the slot's process, reap it without blocking, start a fresh one."""
        proc, conn = slot.process, slot.conn
        if conn is not None:
            conn.close()
        if proc is not None:
            proc.kill()
            self._reap_later(proc)
        slot.process, slot.conn, slot.ready = None, None, False
        if not self._closed:
            self.restarts += 1
            self._spawn(slot)

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

    def _spawn(self, slot: _Slot) -> None:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=_child_main,
            args=(child_conn, self.cfg.function, self.cfg.type, dict(self.cfg.kwargs), os.getpid()),
            name=f"async-rl-reward-{slot.index}",
            daemon=True,
        )
        proc.start()
        child_conn.close()
        slot.process, slot.conn, slot.ready = proc, parent_conn, False


# -- the worker process ---------------------------------------------------------------

_PR_SET_PDEATHSIG = 1


def _child_main(conn: Connection, function: str, kind: str, kwargs: dict[str, Any], parent_pid: int) -> None:
    """Worker process: load the function, then answer each request until the pipe closes.

    Messages to the parent are pickled tuples: ``("ready",)`` once, then per request
    ``("ok", outputs)`` or ``("error", "ExceptionType: message", traceback_text)``. A
    function that cannot be loaded answers every request with the loading error.
    """
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent decides
    try:
        fn = load_reward_function(function)
        load_error = None
    except BaseException:  # noqa: BLE001 - reported on every call, never a hang
        fn, load_error = None, _error_reply()
    conn.send_bytes(pickle.dumps(("ready",)))
    while True:
        try:
            inputs = conn.recv()
        except EOFError:
            return
        if load_error is not None:
            conn.send_bytes(load_error)
            continue
        try:
            outputs = fn(inputs, **kwargs) if kind == "batch" else [fn(item, **kwargs) for item in inputs]
            reply = pickle.dumps(("ok", outputs))
        except BaseException:  # noqa: BLE001 - also SystemExit: a reward bug must not end the worker silently
            reply = _error_reply()
        conn.send_bytes(reply)


def _error_reply() -> bytes:
    exc = sys.exc_info()[1]
    return pickle.dumps(("error", f"{type(exc).__name__}: {exc}"[:2000], traceback.format_exc()))


def _die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this process when the thread that started it dies (Linux),
    and exit at once if the parent is already gone."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)
