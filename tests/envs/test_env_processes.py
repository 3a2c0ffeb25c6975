"""Environments contained in real environment processes: failures stay per episode, hung
calls are abandoned without a thread leak in the server's process, a blocking ``async``
method is named while the caller's event loop keeps running, and killed processes take
their process group with them.

The environments are ``sample_envs.py``'s, loaded by name in the child processes as a
user's would be; the model is a scripted ``act``. Short ``step_timeout_s`` values keep the
tests about the mechanism quick.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Self

import msgspec
import pytest
from run_helpers import process_alive

from async_rl.config import EnvConfig
from async_rl.envs import EnvLost, EnvPool, EnvStartupError, Trajectory, run_episode
from async_rl.envs.process import BLOCK_LIMIT_S, MAX_FRAME_BYTES, Cancel, Frames, frame

SAMPLES = Path(__file__).with_name("sample_envs.py")


def _at(code: str) -> str:
    """``sample_envs.py:LINE in step`` of the first line holding ``code``."""
    line = next(i for i, text in enumerate(SAMPLES.read_text().splitlines(), 1) if code in text)
    return f"sample_envs.py:{line} in step"


def _with_pool(cls: str, fn: Callable[[EnvPool], Awaitable[Any]], **cfg: Any) -> Any:
    async def go() -> Any:
        async with EnvPool(EnvConfig(name=f"{SAMPLES}:{cls}", **cfg)) as pool:
            return await fn(pool)

    return asyncio.run(go())


async def _play(pool: EnvPool, actions: list[str], row: dict[str, str] | None = None) -> Trajectory:
    """One episode whose model says ``actions`` in turn."""
    said = iter(actions)

    async def act(messages: list[dict[str, str]]) -> str | None:
        return next(said, None)

    env = pool.open()
    try:
        return await run_episode(env, act, max_turns=len(actions), row=row or {"problem": "p", "answer": "a"})
    finally:
        env.close()


class LoopLag:
    """The largest gap between ticks of a 10 ms ticker on the running loop (the test's own)."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(0.01)
            now = time.monotonic()
            self.worst = max(self.worst, now - last - 0.01)
            last = now

    def __enter__(self) -> Self:
        self._task = asyncio.get_running_loop().create_task(self._tick())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


def test_a_sync_step_that_raises_fails_only_its_episodes():
    async def go(pool: EnvPool) -> list[Trajectory]:
        return await asyncio.gather(*(_play(pool, ["ok", "raise" if i % 3 == 0 else "ok"]) for i in range(6)))

    trajectories = _with_pool("Faulty", go)
    failed = [t for t in trajectories if t.failure is not None]
    assert len(failed) == 2 and all(t.success and t.total_reward() == 2.0 for t in trajectories if t.failure is None)
    f = failed[0].failure
    assert (f.kind, f.signature, f.input) == ("env_error", "RuntimeError: cannot apply 'raise' on turn 2", "raise")
    assert f.where.endswith(_at('raise RuntimeError(f"cannot apply')) and 'raise RuntimeError' in f.traceback, f
    assert "process.py" not in f.traceback  # the user's frames only
    assert failed[0].rewards == [1.0]  # the turn before the failure is kept in the text view


def test_a_failing_reset_and_a_wrong_return_shape_are_env_errors_naming_the_code():
    async def go(pool: EnvPool) -> tuple[Trajectory, int]:
        return await _play(pool, ["shape"]), pool.restarts

    shape, restarts = _with_pool("Faulty", go)
    assert shape.failure.kind == "env_error" and shape.failure.signature.startswith("EnvBadReturn: step must return (observation")
    assert shape.failure.where.endswith("in step") and restarts == 0
    flood = _with_pool("Faulty", lambda pool: _play(pool, ["flood"])).failure  # never sent, rendered or tokenised
    assert flood.kind == "env_error" and flood.signature == "EnvBadReturn: step returned an observation of 2000000 characters, more than 1000000"
    reset = _with_pool("Faulty", lambda pool: _play(pool, ["ok"]), kwargs={"mode": "reset"})
    f = reset.failure
    assert (f.kind, f.signature, f.input) == ("env_error", "KeyError: 'no such level'", "reset") and "in reset" in f.where
    assert reset.num_turns == 0


def test_a_hung_sync_step_fails_alone_at_the_timeout_without_leaking_a_thread():
    """The hung call's thread is in the environment process, which takes no new episode, lets
    the others finish, and is killed; the server's process gains no thread."""

    async def go(pool: EnvPool) -> tuple[list[tuple[Trajectory, float]], int, list[int], list[int]]:
        threads = threading.active_count()
        first = pool.pids()
        t0 = time.monotonic()

        async def timed(actions: list[str]) -> tuple[Trajectory, float]:
            trajectory = await _play(pool, actions)
            return trajectory, time.monotonic() - t0

        with LoopLag() as lag:  # the others' 5 steps of 0.3 s straddle the hung call's timeout
            out = await asyncio.gather(timed(["hang"]), *(timed(["slow"] * 5) for _ in range(4)))
            later = await timed(["ok"] * 5)  # a new episode: on the fresh process
        assert lag.worst < 0.25, lag.worst
        return [*out, later], threading.active_count() - threads, first, pool.pids()

    played, new_threads, first, now = _with_pool("Faulty", go, step_timeout_s=1.0, num_workers=1, kwargs={"turns": 5})
    (hung, hung_s), *others = played
    f = hung.failure
    assert (f.kind, f.input) == ("env_timeout", "hang") and f.signature == "EnvTimeout: Faulty.step took longer than rollout.env.step_timeout_s=1 s"
    assert f.where.endswith(_at('time.sleep(3600)')), f.where  # where the thread was stuck: time.sleep's line
    assert 1.0 <= hung_s < 2.0  # it failed at the timeout (plus the process's answer)
    assert all(t.failure is None and t.success and t.num_turns == 5 for t, _ in others)  # the others finished on the old process
    assert all(s > hung_s for _, s in others)
    assert new_threads <= 0  # no thread left behind in this (the server's) process
    assert first[0] not in now and len(now) == 1 and not process_alive(first[0])  # retired and killed once its episodes ended


def test_a_killed_process_takes_its_process_group(tmp_path: Path):
    pid_file = tmp_path / "child.pid"

    async def go(pool: EnvPool) -> tuple[Trajectory, int]:
        trajectory = await _play(pool, ["spawn"])
        return trajectory, pool.restarts

    trajectory, restarts = _with_pool("Faulty", go, step_timeout_s=1.0, num_workers=1, kwargs={"pid_file": str(pid_file)})
    assert trajectory.failure.kind == "env_timeout" and restarts == 1
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while process_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_alive(child)  # the environment's own subprocess died with its process group


def test_a_blocking_async_step_is_named_and_the_callers_loop_stays_responsive():
    """``time.sleep`` inside ``async def step`` for 1.5 s: the other episodes wait (they share the
    environment process's loop) but this loop never does; the episode fails naming the method
    and the fix."""

    async def go(pool: EnvPool) -> tuple[list[Trajectory], float, int, int]:
        with LoopLag() as lag:
            out = await asyncio.gather(_play(pool, ["block"]), *(_play(pool, ["ok"]) for _ in range(3)))
        return out, lag.worst, pool.blocked, pool.restarts

    (blocked, *others), lag, detections, restarts = _with_pool("AsyncFaulty", go, step_timeout_s=10.0, num_workers=1,
                                                               kwargs={"block_s": 1.5})
    f = blocked.failure
    assert f.kind == "env_error" and f.signature.startswith("EnvBlockedLoop: AsyncFaulty.step blocked the event loop for 1.")
    assert "make it a plain def (it then runs on a thread) or await its I/O" in f.signature
    assert f.where.endswith(_at('time.sleep(float(self.config.get("block_s"')) and f.input == "block", f
    assert all(t.failure is None and t.success for t in others)
    assert lag < 0.25 and detections == 1 and restarts == 0 and BLOCK_LIMIT_S <= 1.5


def test_an_async_step_blocked_past_the_timeout_kills_the_process_and_the_others_are_lost():
    """A loop blocked for good cannot answer: the process is killed at the timeout, the blocking
    call fails as ``env_timeout`` naming the method, the process's other episodes end with
    :class:`EnvLost` (the sampler plays them again) and new episodes run on a fresh process."""

    async def go(pool: EnvPool) -> tuple[list[Any], float, list[int], list[int], int, Trajectory]:
        first = pool.pids()

        async def play(actions: list[str]) -> Any:
            try:
                return await _play(pool, actions)
            except EnvLost as exc:
                return exc

        with LoopLag() as lag:
            out = await asyncio.gather(play(["block"]), *(play(["ok"]) for _ in range(3)))
        after = await _play(pool, ["ok"])
        return out, lag.worst, first, pool.pids(), pool.restarts, after

    (blocked, *others), lag, first, now, restarts, after = _with_pool("AsyncFaulty", go, step_timeout_s=1.5, num_workers=1)
    f = blocked.failure
    assert f.kind == "env_timeout" and "AsyncFaulty.step blocked the event loop for" in f.signature
    assert "longer than rollout.env.step_timeout_s=1.5 s" in f.signature and f.where.endswith(_at('time.sleep(float(self.config.get("block_s"'))
    assert all(isinstance(o, EnvLost) and "restarted because AsyncFaulty.step blocked the event loop" in str(o) for o in others)
    assert lag < 0.25 and restarts == 1 and first != now and not process_alive(first[0])
    assert after.failure is None and after.success


def test_an_async_step_that_raises_or_hangs_fails_alone_and_the_process_serves_on():
    async def go(pool: EnvPool) -> tuple[list[Trajectory], list[int], list[int], int]:
        first = pool.pids()
        out = await asyncio.gather(_play(pool, ["raise"]), _play(pool, ["hang"]), _play(pool, ["ok"]))
        return out, first, pool.pids(), pool.restarts

    (raised, hung, ok), first, now, restarts = _with_pool("AsyncFaulty", go, step_timeout_s=1.0, num_workers=1)
    assert (raised.failure.kind, raised.failure.signature) == ("env_error", "ValueError: async boom")
    assert raised.failure.where.endswith(_at('raise ValueError("async boom")')) and "raise ValueError" in raised.failure.traceback
    assert hung.failure.kind == "env_timeout" and hung.failure.where.endswith(_at('await asyncio.sleep(3600)')), hung.failure
    assert ok.failure is None and first == now and restarts == 0  # a cancelled coroutine needs no new process


def test_a_class_that_cannot_be_loaded_stops_the_start_naming_the_key(tmp_path: Path):
    bad = tmp_path / "bad_env.py"
    bad.write_text("import no_such_module_here\n")

    async def go() -> None:
        async with EnvPool(EnvConfig(name=f"{bad}:Env")):
            pass

    with pytest.raises(EnvStartupError, match=r"rollout.env.name=.*ModuleNotFoundError: No module named 'no_such_module_here'"):
        asyncio.run(go())
    with pytest.raises(EnvStartupError, match="unknown environment 'nope'"):
        asyncio.run(_start_only("nope"))


async def _start_only(name: str) -> None:
    async with EnvPool(EnvConfig(name=name)):
        pass


def test_many_episodes_share_the_processes():
    async def go(pool: EnvPool) -> tuple[list[Trajectory], list[int]]:
        return await asyncio.gather(*(_play(pool, ["ok", "ok"]) for _ in range(40))), pool.pids()

    trajectories, pids = _with_pool("Faulty", go, num_workers=2)
    assert all(t.success for t in trajectories) and len(pids) == 2
    served = {int(t.states[1].rsplit(" ", 1)[1]) for t in trajectories}  # "turn 1 from PID"
    assert served == set(pids)  # both processes held episodes
    assert os.getpid() not in served


def test_a_process_that_stops_reading_never_blocks_the_callers_loop():
    """While a blocking ``async`` step holds the process, 40 episodes send it 50 kB actions
    each (far past a socket's buffer): the server's writes are buffered, its loop runs on."""

    async def go(pool: EnvPool) -> tuple[list[Trajectory], float]:
        with LoopLag() as lag:
            blocker = asyncio.create_task(_play(pool, ["block"]))
            await asyncio.sleep(0.2)  # the process's loop is blocked now
            out = await asyncio.gather(*(_play(pool, ["x" * 50_000]) for _ in range(40)))
            await blocker
        return out, lag.worst

    trajectories, lag = _with_pool("AsyncFaulty", go, step_timeout_s=10.0, num_workers=1, kwargs={"block_s": 1.5})
    assert all(t.failure is None and t.success for t in trajectories) and lag < 0.25, lag


def test_a_crashed_process_loses_its_episodes_and_is_replaced():
    async def go(pool: EnvPool) -> tuple[list[Any], Trajectory, int]:
        async def play(actions: list[str]) -> Any:
            try:
                return await _play(pool, actions)
            except EnvLost as exc:
                return exc

        out = await asyncio.gather(play(["exit"]), play(["slow", "slow"]))
        return out, await _play(pool, ["ok", "ok"]), pool.restarts

    (crashed, other), after, restarts = _with_pool("Faulty", go, num_workers=1)
    assert all(isinstance(e, EnvLost) and str(e) == "the environment process exited (exit code 3)" for e in (crashed, other)), (crashed, other)
    assert after.success and restarts == 1


def test_a_call_started_as_its_process_dies_is_lost_at_once():
    """The process dies in the loop turn between a call's start and its send (Python 3.11's
    ``wait_for`` yields there): the call is lost at once, not left waiting ``step_timeout_s``."""

    async def go(pool: EnvPool) -> tuple[Any, float]:
        env = pool.open()
        await env.reset({"problem": "p", "answer": "a"})
        t0 = time.monotonic()
        step = asyncio.ensure_future(env.step("ok"))
        asyncio.get_running_loop().call_soon(pool._kill, env.proc, "killed under the call")
        try:
            return await step, time.monotonic() - t0
        except EnvLost as exc:
            return exc, time.monotonic() - t0
        finally:
            env.close()

    out, seconds = _with_pool("Faulty", go, num_workers=1)
    assert isinstance(out, EnvLost) and str(out) == "killed under the call" and seconds < 5, (out, seconds)


def test_a_retiring_process_kills_its_last_episodes_after_the_grace(monkeypatch: pytest.MonkeyPatch):
    """A hung thread's process serves its other episodes for ``RETIRE_GRACE_S`` at most; those
    still running then are lost (to be played again), naming the hung method."""
    from async_rl.envs import runner

    monkeypatch.setattr(runner, "RETIRE_GRACE_S", 0.5)

    async def go(pool: EnvPool) -> list[Any]:
        async def play(actions: list[str]) -> Any:
            try:
                return await _play(pool, actions)
            except EnvLost as exc:
                return exc

        return await asyncio.gather(play(["hang"]), play(["slow"] * 10))

    hung, long = _with_pool("Faulty", go, step_timeout_s=0.5, num_workers=1, kwargs={"turns": 10})
    assert hung.failure.kind == "env_timeout"
    assert isinstance(long, EnvLost) and str(long).startswith("the environment process was restarted because Faulty.step hung in a thread (at ")


def test_frames_split_the_stream_and_refuse_a_length_over_the_bound_before_buffering_it():
    data = frame(Cancel(1)) + frame(Cancel(2))
    frames = Frames()
    assert frames.feed(data[:3]) == [] and len(frames.feed(data[3:])) == 2
    with pytest.raises(msgspec.DecodeError, match="more than"):
        Frames().feed((MAX_FRAME_BYTES + 1).to_bytes(4, "little") + b"x")
