"""The queue's Redis away and the run's disk full, as the driver waits them out: the embedded
Redis's exits (restarted on its AOF, or waiting for disk space), when the queue last came
back (a learner waiting on it meanwhile is not hung), and the waits for disk space after a
write failed for want of it."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from async_rl.launch import disk
from async_rl.launch.cores import set_process_cores
from async_rl.queue import RedisExit
from async_rl.queue.embedded import MIN_FREE_BYTES, SPACE_WAIT_S


class Outages:
    """``say``: a line to the console; ``fail``: end the run with a reason; ``recoveries``: the
    run's counts of what it recovered from; ``stop``: set when the run is to end;
    ``queue_timeout_s``: ``queue.timeout_s`` (how long a queue call retries)."""

    def __init__(self, run_dir: Path, disk_need: disk.DiskNeed | None, queue_timeout_s: float, stop: asyncio.Event,
                 say: Callable[[str], None], fail: Callable[[str], None], recoveries: Counter[str]):
        self.run_dir = run_dir
        self.queue_timeout_s = queue_timeout_s
        self.stop = stop
        self.say = say
        self.fail = fail
        self.recoveries = recoveries
        self.disk_need = disk_need
        """What the run writes into its directory (None: unknown, the model's config.json is not here)."""
        self.disk_full_since: float | None = None
        """When the embedded Redis stopped for want of disk space (its restart waits for it), or None."""
        self.redis_back_at = -math.inf
        """When the embedded Redis last came back after exiting (monotonic seconds)."""
        self.redis_restarts = 0
        """Times the embedded Redis was restarted after it exited on its own."""
        self.redis_pid: int | None = None
        """The embedded Redis's process (None: an external one), which runs on every core."""
        self._disk_low = False
        """The run's disk has less room than it needs (said once until it clears)."""

    @property
    def waiting_for_disk(self) -> bool:
        """The embedded Redis waits for disk space: what fails meanwhile was said already."""
        return self.disk_full_since is not None

    def on_redis_exit(self, event: RedisExit, cores: set[int] | None) -> None:
        """The embedded Redis exited on its own: restarted on its AOF (clients retry), waiting
        for disk space first when its disk is full, or the run ends."""
        if event.error is not None:
            self.fail(f"{event.describe()} (its data and redis.log are in {self.run_dir / 'redis'})")
            return
        if event.disk_full is not None:
            self.disk_full_since = time.monotonic()
            self.recoveries["disk_full"] += 1
            self.say(event.describe())
            return
        if self.disk_full_since is not None:
            self.say(f"disk space is back after {time.monotonic() - self.disk_full_since:.0f} s")
            self.disk_full_since = None
        self.redis_back_at = time.monotonic()
        self.redis_restarts = event.restarts
        self.redis_pid = event.new_pid
        if cores and event.new_pid is not None:
            with contextlib.suppress(OSError):  # it may have died again; the watcher restarts it
                set_process_cores(event.new_pid, cores)
        self.say(event.describe())

    def queue_back_at(self) -> float:
        """When the run's queue last answered again after an outage, monotonic seconds: now while
        the embedded Redis waits for disk space (a learner waiting on it is not hung)."""
        return time.monotonic() if self.disk_full_since is not None else self.redis_back_at

    def queue_lost_lately(self) -> bool:
        """The queue is down for want of disk space, or came back within ``queue.timeout_s``:
        a learner that failed on it meanwhile lost the queue, not its own state."""
        return self.disk_full_since is not None or time.monotonic() - self.redis_back_at < self.queue_timeout_s

    def watch_disk(self) -> None:
        """Say once (again only after it cleared) when the run's disk has less room than a
        checkpoint and the queue's AOF need: the run would pause at the next full write."""
        if self.disk_need is None:
            return
        needed = self.disk_need.checkpoint + self.disk_need.aof
        problem = disk.shortage(self.run_dir, needed, f"a checkpoint of {disk.size(self.disk_need.checkpoint)} and the queue's "
                                                      f"append-only file")
        if problem is not None and not self._disk_low:
            self.say(f"{problem}: free space there, or the run pauses when the disk is full")
        self._disk_low = problem is not None

    async def wait_for_space(self, what: str) -> bool:
        """A write failed for want of space (``what``): say which disk and how much a checkpoint
        needs, then wait up to :data:`~async_rl.queue.embedded.SPACE_WAIT_S` for that much to be
        free; True once it is (False: the run stops, resumable from its last checkpoint)."""
        needed = MIN_FREE_BYTES + (self.disk_need.checkpoint if self.disk_need is not None else 0)
        mount, free = disk.free_bytes(self.run_dir)
        self.recoveries["disk_full"] += 1
        self.say(f"{what}: the disk of {self.run_dir} (mounted at {mount}) has {disk.size(free)} free and a checkpoint needs "
                f"about {disk.size(needed)}; the checkpoints kept are intact. Free space there: the run waits up to "
                f"{SPACE_WAIT_S / 60:.0f} min, then restarts the learner from its last checkpoint")
        start = time.monotonic()
        while time.monotonic() - start < SPACE_WAIT_S and not self.stop.is_set():
            if disk.free_bytes(self.run_dir)[1] >= needed:
                self.say(f"disk space is back after {time.monotonic() - start:.0f} s")
                return True
            await asyncio.sleep(1.0)
        if not self.stop.is_set():
            self.fail(f"{what}; the disk of {self.run_dir} stayed full for {SPACE_WAIT_S:.0f} s: free space, then resume the run "
                     "(its last checkpoint is intact)")
        return False

    async def space_returned(self) -> bool:
        """Wait while the embedded Redis waits for disk space; True once it is back (False: the run stops)."""
        while self.disk_full_since is not None and not self.stop.is_set():
            await asyncio.sleep(1.0)
        return not self.stop.is_set()
