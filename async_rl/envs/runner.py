"""Episodes against environments held in worker processes, with their failures contained.

An environment instance holds one episode's state and a server runs up to a few hundred
episodes at once, so a process per episode does not fit in memory, and a thread per call
cannot be stopped when the user's code hangs. :class:`EnvPool` starts
``rollout.env.num_workers`` environment processes per server (:mod:`async_rl.envs.process`),
each holding many episodes' instances; the server's event loop only reads their pipes
(``add_reader``: no thread of its own per call).

Every call (``reset`` with the constructor and ``get_prompt_prefix``; each ``step``) is bounded
by ``rollout.env.step_timeout_s``. On a timeout the server asks the process to abandon the
call and say where it was:

* an ``async`` call (or one still queued for a thread) is cancelled: only its episode fails
  (``env_timeout``), the process serves on;
* a synchronous call still holds its thread, which Python cannot stop: its episode fails
  (``env_timeout``), the process takes no new episode (a fresh one replaces it), finishes its
  other episodes and is then killed with its process group (after :data:`RETIRE_GRACE_S` at most);
* no answer within :data:`CANCEL_REPLY_S`: the process's event loop is blocked (an ``async``
  method that never awaits) or the process is wedged; it is killed at once with its process
  group and replaced. The blocking call's episode fails naming the method; the process's
  other episodes end with :class:`EnvLost`, and :class:`~async_rl.rollout.episodes.EpisodeSampler`
  plays them again from the start on the new process, once.

An ``async`` method that blocks the process's event loop for :data:`~async_rl.envs.process.BLOCK_LIMIT_S`
or longer fails its episode (``env_error``) even when it returns, naming the method and the fix.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING, Any, Self

import msgspec

from async_rl.envs.base import Trajectory
from async_rl.envs.process import (
    INPUT_CHARS,
    TO_PARENT,
    Blocked,
    Call,
    Cancel,
    Drop,
    Error,
    Frames,
    Opening,
    Ready,
    Reply,
    StepOut,
    Stuck,
    ToChild,
    blocked_message,
    frame,
    main,
)
from async_rl.records import Failure

if TYPE_CHECKING:
    from async_rl.config import EnvConfig

Message = dict[str, str]
Act = Callable[[list[Message]], Awaitable["str | None"]]
"""``await act(new_messages) -> reply text``: one model turn after the messages added since
the last; None when the model cannot take another turn (its token budget is spent)."""

START_TIMEOUT_S = 60.0
"""Seconds an environment process may take to start and load the class."""
CANCEL_REPLY_S = 2.0
"""Seconds a process has to answer for a call the server gave up on, before it is killed."""
RETIRE_GRACE_S = 120.0
"""Seconds a process whose thread hangs keeps serving its other episodes before it is killed."""
KILL_JOIN_S = 5.0
"""Seconds :meth:`EnvPool.close` waits for each killed process to be reaped."""


class EnvStartupError(RuntimeError):
    """The environment processes could not start or load ``rollout.env.name``; ``traceback_text``
    is the loading error's traceback in the environment process, where there is one."""

    def __init__(self, message: str, traceback_text: str = ""):
        super().__init__(message)
        self.traceback_text = traceback_text


class EnvFailed(Exception):
    """An environment call failed: ``failure`` says how (``env_error`` or ``env_timeout``);
    ``blocked``: an ``async`` method blocked its process's event loop; ``restarted``: the call
    hung or blocked its process, which was replaced."""

    def __init__(self, failure: Failure, *, blocked: bool = False, restarted: bool = False):
        super().__init__(failure.signature)
        self.failure = failure
        self.blocked = blocked
        self.restarted = restarted


class EnvLost(Exception):
    """The episode's environment process was killed under it (another episode's call blocked
    or hung it, or it crashed); the message names why. The episode can be played again."""


class _Proc:
    """One environment process and the server's end of its pipe."""

    def __init__(self, index: int, process: BaseProcess, ready: asyncio.Future[Ready]):
        self.index = index
        self.process = process
        self.connecting: asyncio.Task[Any] | None = None
        self.exiting: asyncio.Task[None] | None = None
        self.transport: asyncio.Transport | None = None
        """The server's end of the socket (buffered writes: a process that does not read never blocks the loop)."""
        self.ready = ready
        self.pending: dict[int, asyncio.Future[Opening | StepOut]] = {}
        self.inputs: dict[int, str] = {}
        """call id -> the start of its input (``reset`` or the action), for failures the server words."""
        self.stuck: dict[int, asyncio.Future[Stuck | None]] = {}
        self.episodes: dict[int, EnvEpisode] = {}
        self.blocked: Blocked | None = None
        """The last call reported blocking the process's event loop."""
        self.retiring = False
        self.dead = False
        self.class_name = ""


class EnvPool:
    """``cfg.num_workers`` environment processes of one server, used from one event loop.

    Use it as ``async with EnvPool(cfg) as envs:`` or ``await envs.start()`` ... ``envs.close()``,
    from the thread that runs the event loop for the pool's life (the processes get the
    kernel's parent-death signal of that thread). :meth:`open` gives an episode's handle.
    """

    def __init__(self, cfg: EnvConfig):
        if not cfg.name:
            raise ValueError("EnvPool needs rollout.env.name")
        self.cfg = cfg
        self.restarts = 0
        """Processes replaced because a call hung in a thread, blocked the event loop, or the process died."""
        self.blocked = 0
        """Calls whose ``async`` method blocked a process's event loop for ``BLOCK_LIMIT_S`` or longer."""
        self._ctx = multiprocessing.get_context("spawn")  # the server runs threads (vLLM, Ray): never fork it
        self._active: list[_Proc] = []
        self._retiring: set[_Proc] = set()
        self._dying: set[BaseProcess] = set()
        self._ids = itertools.count()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        """Start the processes and wait until each has loaded the class; :class:`EnvStartupError`
        names what failed (the class's import error, or a start slower than :data:`START_TIMEOUT_S`)."""
        if self._active:
            raise RuntimeError("EnvPool.start() called twice")
        self._loop = asyncio.get_running_loop()
        self._active = [self._spawn(i) for i in range(self.cfg.num_workers)]
        try:
            for proc in self._active:
                try:
                    ready = await asyncio.wait_for(asyncio.shield(proc.ready), START_TIMEOUT_S)
                except asyncio.TimeoutError:
                    raise EnvStartupError(f"the environment process did not load rollout.env.name={self.cfg.name!r} "
                                          f"within {START_TIMEOUT_S:g} s") from None
                except EnvLost as exc:
                    raise EnvStartupError(f"rollout.env.name={self.cfg.name!r}: {exc}") from None
                if ready.error:
                    raise EnvStartupError(f"rollout.env.name={self.cfg.name!r}: {ready.error}", ready.traceback)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Kill every process with its process group and reap it; calls in flight raise :class:`EnvLost`."""
        self._closed = True
        procs = [*self._active, *self._retiring]
        for proc in procs:
            self._kill(proc, "the environment pool was closed")
        for process in list(self._dying):
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(process.sentinel)
            process.join(KILL_JOIN_S)
        self._dying.clear()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()
        await asyncio.sleep(0)  # the aborted transports close their sockets on the loop's next turn

    def pids(self) -> list[int]:
        """Process ids of the live environment processes (retiring ones included)."""
        return [p.process.pid for p in (*self._active, *self._retiring) if not p.dead and p.process.pid is not None]

    def open(self) -> EnvEpisode:
        """A new episode on the process that holds the fewest."""
        if self._closed or not self._active:
            raise RuntimeError("EnvPool.open() needs a started, open pool")
        proc = min(self._active, key=lambda p: len(p.episodes))
        episode = EnvEpisode(self, proc, next(self._ids))
        proc.episodes[episode.id] = episode
        return episode

    # -- processes ---------------------------------------------------------------------

    def _spawn(self, index: int) -> _Proc:
        loop = asyncio.get_running_loop()  # only ever on the pool's loop
        ours, theirs = socket.socketpair()
        process = self._ctx.Process(target=main, args=(theirs, self.cfg.name, dict(self.cfg.kwargs), os.getpid()),
                                    name=f"async-rl-env-{index}", daemon=True)
        process.start()
        theirs.close()
        ours.setblocking(False)
        proc = _Proc(index, process, loop.create_future())
        # The process's first message (Ready) waits in the socket until the transport is up.
        proc.connecting = loop.create_task(loop.create_unix_connection(lambda: _Protocol(self, proc), sock=ours))
        proc.connecting.add_done_callback(lambda task: self._connected(proc, task))
        return proc

    def _connected(self, proc: _Proc, task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:
            self._kill(proc, f"the environment process's socket could not be set up: {exc}")

    def _dispatch(self, proc: _Proc, msg: Any) -> None:
        if isinstance(msg, (Reply, Error)):
            proc.inputs.pop(msg.id, None)
        if isinstance(msg, Reply):
            fut = proc.pending.pop(msg.id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg.opening if msg.opening is not None else msg.step)  # type: ignore[arg-type]
        elif isinstance(msg, Error):
            fut = proc.pending.pop(msg.id, None)
            if msg.blocked:
                self.blocked += 1
            if fut is not None and not fut.done():
                fut.set_exception(EnvFailed(msg.failure, blocked=msg.blocked))
        elif isinstance(msg, Stuck):
            waiter = proc.stuck.pop(msg.id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(msg)
        elif isinstance(msg, Blocked):
            proc.blocked = msg
        elif isinstance(msg, Ready):
            proc.class_name = msg.class_name
            if not proc.ready.done():
                proc.ready.set_result(msg)

    async def _exited(self, proc: _Proc) -> None:
        """The process closed its socket: wait up to a second for its exit status, then kill
        (its group) and replace it, failing its calls with the status."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 1.0
        while proc.process.exitcode is None and loop.time() < deadline and not proc.dead:
            await asyncio.sleep(0.01)  # join(0) inside exitcode reaps it once it has exited; never waits
        code = proc.process.exitcode
        status = "" if code is None else f" (killed by signal {signal.Signals(-code).name})" if code < 0 else f" (exit code {code})"
        self._kill(proc, f"the environment process exited{status}")

    def _retire(self, proc: _Proc, reason: str) -> None:
        """Take ``proc`` out of service: a fresh process takes new episodes; ``proc`` is killed
        when its last episode ends, or after :data:`RETIRE_GRACE_S`."""
        if proc.retiring or proc.dead:
            return
        proc.retiring = True
        self._replace(proc)
        self._retiring.add(proc)
        asyncio.get_running_loop().call_later(RETIRE_GRACE_S, self._kill, proc, reason)
        if not proc.episodes:
            self._kill(proc, reason)

    def _replace(self, proc: _Proc) -> None:
        if proc in self._active and not self._closed:
            self._active[self._active.index(proc)] = self._spawn(proc.index)
            self.restarts += 1

    def _kill(self, proc: _Proc, reason: str, blame: dict[int, BaseException] | None = None) -> None:
        """Kill ``proc`` with its process group; calls in flight raise ``blame[call id]`` or
        :class:`EnvLost` (``reason``), its episodes are lost; an active process is replaced."""
        if proc.dead:
            return
        proc.dead = True
        if proc.transport is not None:
            proc.transport.abort()
        pid = proc.process.pid
        if pid is not None:
            try:
                os.killpg(pid, signal.SIGKILL)  # the environment's own children too
            except (ProcessLookupError, PermissionError):
                pass  # it died, or had not made its group yet: kill() below
        proc.process.kill()
        self._reap_later(proc.process)
        for call_id, fut in proc.pending.items():
            if not fut.done():
                fut.set_exception((blame or {}).get(call_id) or EnvLost(reason))
                fut.exception()  # marked retrieved: a caller cancelled meanwhile no longer awaits it
        for waiter in proc.stuck.values():
            if not waiter.done():
                waiter.set_result(None)
        if not proc.ready.done():
            proc.ready.set_exception(EnvLost(reason))
            proc.ready.exception()  # retrieved: start() or a call reads it, or nobody needs to
        for episode in proc.episodes.values():
            episode.lost = reason
        proc.pending.clear()
        proc.inputs.clear()
        proc.stuck.clear()
        self._retiring.discard(proc)
        self._replace(proc)

    def _reap_later(self, process: BaseProcess) -> None:
        self._dying.add(process)
        loop = self._loop
        if loop is None or loop.is_closed() or self._closed:
            return  # close() joins it

        def reap() -> None:
            loop.remove_reader(process.sentinel)
            process.join(0)
            self._dying.discard(process)

        loop.add_reader(process.sentinel, reap)

    # -- calls -------------------------------------------------------------------------

    async def _call(self, episode: EnvEpisode, method: str, action: str = "", row: Mapping[str, Any] | None = None) -> Any:
        proc = episode.proc
        try:
            ready = await asyncio.wait_for(asyncio.shield(proc.ready), START_TIMEOUT_S)
        except asyncio.TimeoutError:
            self._kill(proc, f"the environment process did not start within {START_TIMEOUT_S:g} s")
            raise EnvLost(f"the environment process did not start within {START_TIMEOUT_S:g} s") from None
        # Checked after that await: on Python 3.11 wait_for yields even to a done future, and the
        # process may die meanwhile; a call registered on a dead process would wait step_timeout_s.
        if episode.lost is not None:
            raise EnvLost(episode.lost)
        if ready.error:
            raise EnvFailed(Failure("env_error", ready.error[:500], "", "reset", ready.traceback))
        call = Call(next(self._ids), episode.id, method, action, dict(row or {}))
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        proc.pending[call.id] = fut
        proc.inputs[call.id] = "reset" if method == "reset" else action[:INPUT_CHARS]
        _send(proc, call)
        t0 = time.monotonic()
        try:
            try:
                return await asyncio.wait_for(asyncio.shield(fut), self.cfg.step_timeout_s)
            except asyncio.TimeoutError:
                return await self._give_up(proc, call, fut, time.monotonic() - t0)
        except EnvFailed as exc:
            episode.blocked |= exc.blocked
            episode.restarted |= exc.restarted
            raise

    async def _give_up(self, proc: _Proc, call: Call, fut: asyncio.Future[Any], elapsed: float) -> Any:
        """Call ``call`` took longer than ``step_timeout_s``: abandon it (see the module) and raise."""
        waiter: asyncio.Future[Stuck | None] = asyncio.get_running_loop().create_future()
        proc.stuck[call.id] = waiter
        _send(proc, Cancel(call.id))
        try:
            stuck = await asyncio.wait_for(asyncio.shield(waiter), CANCEL_REPLY_S)
        except asyncio.TimeoutError:
            stuck = None
        finally:
            proc.stuck.pop(call.id, None)
        if fut.done():  # answered meanwhile, or the process was killed: the answer stands
            return fut.result()
        proc.pending.pop(call.id, None)
        input_ = proc.inputs.pop(call.id, "")
        limit = f"rollout.env.step_timeout_s={self.cfg.step_timeout_s:g} s"
        if stuck is None:  # the loop is blocked or the process is wedged: kill it now
            blocker = proc.blocked
            blame: dict[int, BaseException] = {}
            if blocker is not None:
                message = blocked_message(blocker.label, blocker.seconds + elapsed)
                blame[blocker.id] = EnvFailed(Failure("env_timeout", f"EnvTimeout: {message} (longer than {limit})"[:500],
                                                      blocker.where, proc.inputs.get(blocker.id, input_)),
                                              blocked=True, restarted=True)
                reason = f"the environment process was restarted because {message} (at {blocker.where})"
                self.blocked += 1
            else:
                label = f"{proc.class_name}.{call.method}"
                blame[call.id] = EnvFailed(Failure("env_timeout", f"EnvTimeout: {label} took longer than {limit} and its "
                                                   "environment process stopped answering (a call holding the GIL?); it was restarted",
                                                   "", input_), restarted=True)
                reason = f"the environment process was restarted because {label} hung it"
            self._kill(proc, reason, blame)
            raise blame.get(call.id) or EnvLost(reason)
        label = stuck.label or f"{proc.class_name}.{call.method}"
        failure = Failure("env_timeout", f"EnvTimeout: {label} took longer than {limit}"[:500], stuck.where, input_)
        if not stuck.abandoned:  # a thread still runs it: retire the process
            self._retire(proc, f"the environment process was restarted because {label} hung in a thread (at {stuck.where})")
        raise EnvFailed(failure, restarted=not stuck.abandoned)

    def _closed_episode(self, episode: EnvEpisode) -> None:
        proc = episode.proc
        proc.episodes.pop(episode.id, None)
        if proc.dead:
            return
        if proc.retiring and not proc.episodes:
            self._kill(proc, "retired")
            return
        _send(proc, Drop(episode.id))


def _send(proc: _Proc, msg: ToChild) -> None:
    if proc.transport is not None and not proc.dead:
        proc.transport.write(frame(msg))  # buffered: never blocks the loop


class _Protocol(asyncio.Protocol):
    """The server's end of one process's socket: messages go to :meth:`EnvPool._dispatch`;
    a closed socket (the process exited) kills and replaces it."""

    def __init__(self, pool: EnvPool, proc: _Proc):
        self.pool = pool
        self.proc = proc
        self.frames = Frames()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.proc.transport = transport  # type: ignore[assignment]
        if self.proc.dead:
            transport.abort()  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        try:
            for raw in self.frames.feed(data):
                self.pool._dispatch(self.proc, TO_PARENT.decode(raw))
        except msgspec.DecodeError as exc:
            self.pool._kill(self.proc, f"the environment process sent an unreadable message ({exc})")

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.proc.dead:
            self.proc.exiting = asyncio.get_running_loop().create_task(self.pool._exited(self.proc))


class EnvEpisode:
    """One episode's environment, in a process of :class:`EnvPool`. Call :meth:`close` when the episode ends."""

    def __init__(self, pool: EnvPool, proc: _Proc, episode_id: int):
        self.pool = pool
        self.proc = proc
        self.id = episode_id
        self.lost: str | None = None
        """Why the episode's process was killed under it (its calls raise :class:`EnvLost`)."""
        self.restarted = False
        """A call of this episode hung or blocked its process, which was replaced."""
        self.blocked = False
        """An ``async`` method of this episode blocked its process's event loop."""
        self.tools: list[dict[str, Any]] | None = None
        """The tools' JSON schemas of a :class:`~async_rl.envs.tools.ToolEnvironment`, after :meth:`reset`."""

    async def reset(self, row: Mapping[str, Any]) -> Opening:
        """Make the instance, ``reset`` (with ``row`` when it takes one), the system prompt and tools."""
        opening: Opening = await self.pool._call(self, "reset", row=row)
        self.tools = opening.tools
        return opening

    async def step(self, action: str) -> StepOut:
        """``step(action)``, its return checked."""
        return await self.pool._call(self, "step", action=action)

    def close(self) -> None:
        """The episode is over: its process forgets the instance."""
        self.pool._closed_episode(self)


async def run_episode(env: EnvEpisode, act: Act, *, max_turns: int, row: Mapping[str, Any] | None = None) -> Trajectory:
    """One episode of ``env`` with the model behind ``act``; at most ``max_turns`` model turns
    (fewer when ``act`` returns None). ``row`` (the dataset row) goes to ``reset`` when it takes one.

    An environment failure ends the episode (``Trajectory.failure``). :class:`EnvLost` (the
    process was killed under the episode) and the model's own failures (``act`` raising)
    propagate: they are the caller's to retry or count.
    """
    if max_turns < 1:
        raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    trajectory = Trajectory()
    try:
        opening = await env.reset(row or {})
    except EnvFailed as exc:
        trajectory.failure = exc.failure
        return trajectory
    observation = opening.observation
    new: list[Message] = ([{"role": "system", "content": opening.prefix}] if opening.prefix else []) + [{"role": "user", "content": observation}]
    for _ in range(max_turns):
        action = await act(new)
        if action is None:
            break
        trajectory.states.append(observation)
        trajectory.actions.append(action)
        t0 = time.monotonic()
        try:
            out = await env.step(action)
        except EnvFailed as exc:
            trajectory.failure = exc.failure
            break
        finally:
            trajectory.step_s += time.monotonic() - t0
        trajectory.rewards.append(out.reward)
        trajectory.dones.append(out.done)
        trajectory.infos.append(out.info)
        if out.done:
            break
        new = out.messages
        observation = "\n".join(m["content"] for m in new)
    return trajectory
