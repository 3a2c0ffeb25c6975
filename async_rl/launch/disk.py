"""Disk space of a run's output directory: what a run needs there, checked before it starts
(:func:`need`, the plan) and while it runs (:func:`shortage`, the driver's watch).

The estimate: two checkpoints (the one being written beside the one kept), the embedded
Redis's append-only file, and the logs. A checkpoint holds the float32 weights and AdamW state
of what is trained (:func:`~async_rl.learner.memory.checkpoint_bytes`); the AOF holds the
groups waiting and the ones read but not yet committed, and Redis rewrites it once it doubled.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from async_rl.config import Config
from async_rl.learner.memory import checkpoint_bytes
from async_rl.queue.embedded import disk_space

MB = 2**20
AOF_BYTES_PER_TOKEN = 16
"""A queued group's bytes per token in the AOF: token id, behaviour log-probability, version, MessagePack framing."""
AOF_FLOOR_BYTES = 64 * MB
"""Redis rewrites its AOF once it doubled past this size (``auto-aof-rewrite-min-size``)."""
LOGS_BYTES = 256 * MB
"""Room kept for metrics, console logs, W&B's offline run and the plots."""


@dataclass(frozen=True)
class DiskNeed:
    """Bytes a run writes into its output directory at most at once."""

    checkpoint: int
    """One checkpoint."""
    aof: int
    """The embedded Redis's append-only file (0 with an external Redis)."""
    logs: int = LOGS_BYTES

    @property
    def total(self) -> int:
        """Two checkpoints (one written beside the one kept), the AOF and the logs."""
        return 2 * self.checkpoint + self.aof + self.logs

    def describe(self) -> str:
        """What :attr:`total` is made of."""
        aof = f", the queue's append-only file {size(self.aof)}" if self.aof else ""
        return f"2 checkpoints of {size(self.checkpoint)}{aof}, logs {size(self.logs)}"


def need(cfg: Config, model_config: Mapping[str, Any]) -> DiskNeed:
    """What a run of ``cfg`` on the model of ``model_config`` needs in ``trainer.output_dir``."""
    aof = 0
    if cfg.queue.redis_url is None:  # the embedded Redis keeps its AOF in the run directory
        live_groups = cfg.queue.max_depth + cfg.trainer.save_every * cfg.learner.batch_size  # waiting + read, not yet committed
        tokens = cfg.rollout.n * cfg.max_sample_tokens
        aof = 2 * max(AOF_FLOOR_BYTES, live_groups * tokens * AOF_BYTES_PER_TOKEN)
    return DiskNeed(checkpoint_bytes(model_config, cfg.learner, cfg.algorithm.needs_critic), aof)


def free_bytes(path: str | os.PathLike[str]) -> tuple[str, int]:
    """``(mount point, free bytes)`` of the file system ``path`` is (or will be) on: its nearest
    existing ancestor's."""
    where = Path(path).absolute()
    while not where.exists():
        where = where.parent
    return disk_space(where)


def shortage(path: str | os.PathLike[str], needed: int, what: str) -> str | None:
    """Why ``path``'s file system cannot hold ``needed`` more bytes (``what``: of what), or None when it can."""
    mount, free = free_bytes(path)
    if free >= needed:
        return None
    return (f"the disk of {path} (mounted at {mount}) has {size(free)} free and the run needs about {size(needed)} there "
            f"({what})")


def size(n: int) -> str:
    """``n`` bytes for a person: MB, or GB from 1 GB."""
    return f"{n / 2**30:.1f} GB" if n >= 2**30 else f"{n / MB:.0f} MB"
