"""CPU placement of a local CPU run: which cores the servers, the learner ranks and the
rest (driver, Redis, Ray's daemons, rollout workers) run on.

vLLM's OpenMP threads spin, so a server and a learner rank that share a core slow each
other down by far more than their share of it. :func:`cpu_layout` gives each its own
cores; everything else goes to the servers' cores, so a learner rank's step takes as long as
it does alone: :class:`SupportCores` moves it there once the run has started (the start
itself, where no rank steps yet, uses every core: a 4-step run on 2 cores took 80 s pinned
from the beginning, 62-68 s so; benchmarks/train_start.py), :func:`pinned_to` for the length
of a block.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Collection, Iterator
from types import TracebackType
from typing import NamedTuple

from async_rl.config import Config
from async_rl.launch.reaper import descendants, process_table
from async_rl.rollout.engine_args import on_gpu

__all__ = ["CpuLayout", "SupportCores", "cpu_layout", "pinned_to", "set_process_cores", "support_cores"]


class CpuLayout(NamedTuple):
    """Disjoint cores of the servers and the learner ranks."""

    servers: list[str]
    """``VLLM_CPU_OMP_THREADS_BIND`` value of each server (e.g. ``"0,1"``)."""
    ranks: list[list[int]]
    """Cores of each learner rank."""


def cpu_layout(cfg: Config) -> CpuLayout | None:
    """Disjoint CPU cores for each server's vLLM threads and each learner rank, or None.

    On a local CPU run whose actors fit on this machine, servers get the first cores and
    learner ranks the next ones (``rollout.cpus_per_server`` / ``learner.cpus_per_rank``
    each, rounded up), so the two pools never fight over a core. None on a GPU, on a Ray
    cluster, or when they do not fit: nothing is pinned then.
    """
    if on_gpu() or cfg.ray.address is not None:
        return None
    per_server = math.ceil(cfg.rollout.cpus_per_server)
    per_rank = math.ceil(cfg.learner.cpus_per_rank)
    available = sorted(os.sched_getaffinity(0))
    needed = per_server * cfg.rollout.num_servers + per_rank * cfg.learner.world_size
    if needed > len(available) or per_server < 1 or per_rank < 1:
        return None
    cores = iter(available)
    servers = [",".join(str(next(cores)) for _ in range(per_server)) for _ in range(cfg.rollout.num_servers)]
    ranks = [[next(cores) for _ in range(per_rank)] for _ in range(cfg.learner.world_size)]
    return CpuLayout(servers, ranks)


def support_cores(layout: CpuLayout) -> set[int]:
    """Cores for everything but the learner ranks and vLLM's compute threads: the driver,
    Ray's daemons, the servers' engine front ends and rollout workers. They share the rollout
    cores, so a learner rank's cores are its own (its step time is then what it is alone).
    The embedded Redis is the exception: the driver lets it run on every core (it answers
    every admission, put and read, and waited seconds for a busy rollout core)."""
    return {int(core) for bind in layout.servers for core in bind.split(",")}


@contextlib.contextmanager
def pinned_to(cores: set[int]) -> Iterator[None]:
    """Run every thread of this process on ``cores`` until the block ends (processes started
    meanwhile keep them: Redis, Ray's daemons and workers, vLLM's engine processes)."""
    before = os.sched_getaffinity(0)
    set_process_cores(os.getpid(), cores)
    try:
        yield
    finally:
        set_process_cores(os.getpid(), before)


class SupportCores:
    """Puts this process and what it started on ``cores`` once a run has started.

    Within the block, :meth:`place` moves every thread of this process and of the descendants
    it started within the block that nobody placed (its cores are still those this process had
    when the block began) to ``cores``: Ray's daemons and workers, the servers' actors and engine front ends, reward
    workers. A thread placed on purpose keeps its cores: a learner rank's, vLLM's OpenMP
    threads (bound to their server's cores), and the processes in ``keep`` (the embedded Redis,
    which runs anywhere). Processes started afterwards inherit ``cores`` from their parent. On
    leaving, this process gets its cores back (a test may call ``train`` in its own process).
    """

    def __init__(self, cores: set[int]):
        self.cores = set(cores)
        self._before: set[int] = set()
        self._older: set[tuple[int, int]] = set()
        """(pid, start time) of the descendants that ran before the block: not this run's to move."""

    def __enter__(self) -> SupportCores:
        self._before = os.sched_getaffinity(0)
        table = process_table()
        self._older = {(pid, table[pid][1]) for pid in descendants(table, {os.getpid()})}
        return self

    def place(self, keep: Collection[int] = ()) -> int:
        """Move the unplaced threads (see the class) to the support cores; returns how many moved."""
        me = os.getpid()
        table = process_table()
        moved = 0
        for pid in {me} | {p for p in descendants(table, {me}) if (p, table[p][1]) not in self._older} - set(keep):
            try:
                tids = os.listdir(f"/proc/{pid}/task")
            except OSError:  # it ended
                continue
            for tid in map(int, tids):
                with contextlib.suppress(OSError):  # a thread that just ended, or one we may not move
                    if os.sched_getaffinity(tid) == self._before:
                        os.sched_setaffinity(tid, self.cores)
                        moved += 1
        return moved

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        set_process_cores(os.getpid(), self._before)


def set_process_cores(pid: int, cores: set[int]) -> None:
    """Move every thread of process ``pid`` (not only its main thread) to ``cores``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(tid), cores)
