"""What the driver's roles share: the config, the stop event and the first failure, the
learner's version and last step, the counts of what was recovered, and the parts of the run
once started (the queue, the server pool, the learner group, the tracker). One object, made
and filled by the driver (:mod:`async_rl.launch.driver`, the lifecycle), read and written by
the roles it hands it to: supervision (:mod:`~async_rl.launch.supervision`), reporting
(:mod:`~async_rl.launch.reporting`), validation (:mod:`~async_rl.launch.validating`) and scale
requests (:mod:`~async_rl.launch.scale_requests`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from async_rl.config import Config
from async_rl.queue.client import QueueUnavailableError

if TYPE_CHECKING:
    from async_rl.launch.learner_group import LearnerGroup
    from async_rl.launch.outages import Outages
    from async_rl.launch.served_models import ServedModels
    from async_rl.launch.tracking import Tracker
    from async_rl.queue import ReplayQueue
    from async_rl.rollout.pool import ServerPool

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class RunContext:
    cfg: Config
    run_dir: Path
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the run is to end (its steps done, a signal, a failure)."""
    interrupted: bool = False
    """A signal ended the run."""
    failure: str | None = None
    """Why the run stopped early (exit status 1), or None."""
    version: int = 0
    """The learner's version (its steps taken)."""
    last_step: float = field(default_factory=time.monotonic)
    """When the learner's last step was logged (or the rollout workers started), monotonic seconds."""
    workers_started: bool = False
    """The rollout workers were started (after the first validation)."""
    recoveries: Counter[str] = field(default_factory=Counter)
    """What the driver recovered from without a restart (``recoveries/*``)."""
    learner_restarts: int = 0
    """Times the learner group was restarted from its checkpoint after a rank died or hung."""
    # The parts, set by the driver as it starts them.
    outages: Outages = field(init=False)
    queue: ReplayQueue = field(init=False)
    pool: ServerPool = field(init=False)
    learners: LearnerGroup = field(init=False)
    models: ServedModels = field(init=False)
    tracker: Tracker | None = None
    """The tracker (console, metrics.jsonl, W&B, Prometheus); None until it starts, after Redis and Ray."""

    def fail(self, reason: str) -> None:
        """End the run with exit status 1 and ``reason`` (the first failure wins)."""
        if self.failure is None:
            log.error("%s; stopping", reason)
            self.failure = reason
        self.stop.set()

    def say(self, line: str) -> None:
        """A line the user must see: on the console (or in the log when the console is off)."""
        if self.cfg.logging.console and self.tracker is not None:
            self.tracker.console.print(line, highlight=False, soft_wrap=True, markup=False)
        else:
            log.warning("%s", line)

    async def redis(self, call: Callable[..., T], *args: Any) -> T:
        """``call(*args)``, a queue call, in a thread: it may retry for ``queue.timeout_s``, and
        the event loop must stay free to take a signal meanwhile. While the embedded Redis waits
        for disk space (:meth:`Outages.space_returned`, bounded there) the call is tried again
        once it is back: a full disk pauses the driver's reads instead of ending the run.
        Raises :class:`~async_rl.queue.QueueUnavailableError` otherwise, or once the run stops."""
        while True:
            try:
                return await asyncio.to_thread(call, *args)
            except QueueUnavailableError:
                if not (self.outages.waiting_for_disk and await self.outages.space_returned()):
                    raise
