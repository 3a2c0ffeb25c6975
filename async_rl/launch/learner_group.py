"""The learner group as the driver sees it: its rank actors, started and killed together, and
one call per rank under a hang bound. A rank whose process died, or that answers no call
within the bound, ends the group: the driver restarts it from its last checkpoint
(:mod:`async_rl.launch.supervision`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from async_rl.config import Config
from async_rl.learner.actor import start_learners
from async_rl.sync.auth import RunSecret

log = logging.getLogger(__name__)

LEARNER_SLOW_FACTOR = 3.0
"""A learner call may take this many times the slowest call so far before its silent ranks count as hung."""
LEARNER_FIRST_CALL_FACTOR = 10.0
"""The first learner call of a learner group may take this many times ``trainer.learner_hang_timeout_s``."""
RANK_DEATH_GRACE_S = 10.0
"""After one rank's call failed, how long the driver waits for the others' outcome (a rank
blocked in a collective with a dead peer fails within seconds), seconds."""


class RankDied(RuntimeError):
    """A learner rank's process died or hung (the message names the rank and the cause)."""


class RankHung(RankDied):
    """Learner ranks answered no call within the hang bound (the message names them)."""


def cause(exc: BaseException) -> str:
    """The original error of a Ray task failure, as ``Type: message``."""
    inner = getattr(exc, "cause", None) or exc
    return f"{type(inner).__name__}: {inner}"


@dataclass
class HangBound:
    """How long one learner call may take before its silent ranks count as hung, seconds:
    ``floor_s`` (``trainer.learner_hang_timeout_s``), or 3x the slowest call so far if longer
    (a step with its weight send and checkpoint); 10x the floor before a call has finished
    (the first loads and warms the model). The first call counts only until a later one
    finished: a load slowed by a busy machine (a restart on 2 cores: over 100 s) must not
    stretch the bound of every step after it past the 60 s in which a hang is to be named.
    One per learner group: a restarted group loads and warms its model again."""

    floor_s: float
    first_call_s: float | None = None
    """The group's first call, seconds (None: not finished)."""
    slowest_call_s: float | None = None
    """The slowest of the group's later calls, seconds (None: none finished)."""

    def bound_s(self) -> float:
        if self.first_call_s is None:
            return LEARNER_FIRST_CALL_FACTOR * self.floor_s
        slowest = self.slowest_call_s if self.slowest_call_s is not None else self.first_call_s
        return max(self.floor_s, LEARNER_SLOW_FACTOR * slowest)

    def record(self, took_s: float) -> None:
        """A call of the group finished after ``took_s`` seconds."""
        if self.first_call_s is None:
            self.first_call_s = took_s
        else:
            self.slowest_call_s = max(self.slowest_call_s or 0.0, took_s)


class LearnerGroup:
    """``learner.world_size`` rank actors, rank 0 first (it hosts the weight sender)."""

    def __init__(self, actors: list[Any], version: int, sender_address: str | None, pids: list[int], hang_timeout_s: float):
        self.actors = actors
        self.version = version
        """The version the group started at (> 0 after a resume)."""
        self.sender_address = sender_address
        """Rank 0's weight sender, which the servers register with (None: no sender)."""
        self.pids = pids
        self.bound = HangBound(hang_timeout_s)

    @classmethod
    async def start(cls, cfg: Config, redis_url: str, secret: RunSecret, rank_cores: list[list[int]] | None,
                    previous_sender: str | None = None) -> LearnerGroup:
        """Start the ranks, which load the latest checkpoint (or the model); ``previous_sender``:
        a dead group's weight sender, whose port the new one takes (the servers reconnect to it)."""
        actors = await asyncio.to_thread(start_learners, cfg, redis_url, secret, rank_cores, previous_sender)
        starts = await asyncio.gather(*(a.run.remote(0) for a in actors))
        group = cls(actors, starts[0]["version"], await actors[0].sync_address.remote(),
                    await asyncio.gather(*(a.pid.remote() for a in actors)), cfg.trainer.learner_hang_timeout_s)
        started = await actors[0].started_from.remote()
        for line in started["swept"]:  # a checkpoint save was killed in an earlier run
            log.warning("checkpoints: %s", line)
        if started["checkpoint"] is not None:
            log.info("the learner resumed from %s (version %d)", started["checkpoint"], group.version)
        if started["resharded"] is not None:  # learner.world_size changed since the checkpoint
            log.info("%s", started["resharded"])
        return group

    async def step(self, wait_s: float, queue_back_at: Callable[[], float]) -> list[dict[str, Any]]:
        """One ``run(1, wait_s)`` call on every rank (a step, or a wait of ``wait_s`` for a
        batch), bounded by :class:`HangBound`; raises :class:`RankDied` (or :class:`RankHung`)."""
        start = time.monotonic()
        results = await all_ranks([a.run.remote(1, wait_s) for a in self.actors], self.bound.bound_s(), queue_back_at)
        self.bound.record(time.monotonic() - start)
        return results

    async def finish(self) -> int:
        """The final checkpoint and commit on every rank; the version saved."""
        return (await asyncio.gather(*(a.finish.remote() for a in self.actors)))[0]

    def kill(self, graceful: bool = True) -> None:
        """Close (``graceful``: checkpoint-free, leave the process group) and kill every rank."""
        for rank, actor in enumerate(self.actors):
            if graceful:
                try:
                    ray.get(actor.close.remote(), timeout=30)
                except ray.exceptions.RayError as exc:  # it died, its close raised or hung: it is killed below either way
                    log.warning("learner rank %d did not close cleanly (%s); killing it", rank, cause(exc))
            ray.kill(actor, no_restart=True)


async def all_ranks(calls: list[Any], timeout_s: float | None = None, queue_back_at: Callable[[], float] | None = None) -> list[Any]:
    """The results of one call per learner rank. Raises :class:`RankDied` when a rank's
    process died (the others then fail in a collective, or hang in one: they are killed and
    restarted anyway) or when some rank has not answered within ``timeout_s`` seconds (hung:
    a stopped process, a stuck kernel or collective), else the first rank's error.
    ``queue_back_at()``: when the run's queue last answered again after an outage (monotonic
    seconds; now while it is down): a rank waiting on the queue is not hung, so the hang
    clock runs from the later of the call's start and that moment."""
    futures = [asyncio.ensure_future(c) for c in calls]
    start = time.monotonic()
    while True:
        since = max(start, queue_back_at()) if queue_back_at is not None else start
        left = None if timeout_s is None else max(0.0, since + timeout_s - time.monotonic())
        done, _ = await asyncio.wait(futures, timeout=left, return_when=asyncio.FIRST_EXCEPTION)
        if len(done) == len(futures) or any(f.exception() is not None for f in done):
            break
        if queue_back_at is None or max(start, queue_back_at()) == since:  # the queue answered throughout: hung
            break
    if all(f in done and f.exception() is None for f in futures):
        return [f.result() for f in futures]
    if not any(f.done() and f.exception() is not None for f in futures):  # timed out: no rank failed, some never answered
        silent = [rank for rank, f in enumerate(futures) if not f.done()]
        for f in futures:
            f.cancel()
        raise RankHung(f"learner rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} answered no call for "
                       f"{time.monotonic() - since:.0f} s (trainer.learner_hang_timeout_s, or 3x the slowest call so far): declared hung")
    await asyncio.wait(futures, timeout=RANK_DEATH_GRACE_S)
    errors = [(rank, f.exception()) for rank, f in enumerate(futures) if f.done() and f.exception() is not None]
    for f in futures:
        if not f.done():
            f.cancel()
    dead = [(rank, exc) for rank, exc in errors if isinstance(exc, ray.exceptions.RayActorError)]
    if dead:
        rank, exc = dead[0]
        raise RankDied(f"learner rank {rank} died ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
    raise errors[0][1]
