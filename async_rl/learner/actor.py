"""Ray actors of the learner job: one :class:`LearnerActor` per rank around :class:`LearnerLoop`.

    actors = start_learners(cfg, redis_url)            # world_size actors, process group formed
    address = ray.get(actors[0].sync_address.remote())  # give it to the inference servers
    summaries = ray.get([a.run.remote() for a in actors])
"""

from __future__ import annotations

import os
from typing import Any

import ray
import torch

from async_rl.config import Config
from async_rl.learner.loop import LearnerLoop
from async_rl.learner.model import host_rendezvous_store
from async_rl.sync.auth import RunSecret
from async_rl.sync.sender import WeightSender


class LearnerActor:
    """One learner rank. Rank 0 owns the queue consumer and the :class:`WeightSender`."""

    def __init__(self, cfg: Config, rank: int, world_size: int, redis_url: str, cpu_cores: list[int] | None = None) -> None:
        """``cpu_cores``: pin this rank to these cores, with one torch thread each (CPU runs)."""
        self.cfg, self.rank, self.world_size, self.redis_url = cfg, rank, world_size, redis_url
        if cpu_cores:
            os.sched_setaffinity(0, cpu_cores)
            torch.set_num_threads(len(cpu_cores))
        self.loop: LearnerLoop | None = None
        self.sender: WeightSender | None = None

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: bind the process group's TCP store on a free port of this actor's node
        (before :meth:`setup`); the address and port every rank's :meth:`setup` gets."""
        if self.rank != 0:
            raise RuntimeError(f"rank {self.rank} cannot host the rendezvous: rank 0 does")
        host = ray.util.get_node_ip_address()
        return host, host_rendezvous_store(host, self.world_size, self.cfg.sync.timeout_s)

    def setup(self, master_addr: str, master_port: int, secret: RunSecret | None = None, sender_port: int = 0) -> None:
        """Join the process group, load and shard the model, resume (collective: call on all ranks at once).
        ``secret``: the run's, for rank 0's weight sender (None: no sender, as on the other ranks);
        ``sender_port``: the sender binds it (a restarted learner keeps the
        address the servers already reach; 0: any free port)."""
        if self.rank == 0 and secret is not None:
            s = self.cfg.sync
            self.sender = WeightSender(secret=secret, host=master_addr, port=sender_port, bucket_mb=s.bucket_mb, backend=s.backend,
                                       timeout_s=s.timeout_s)
        self.loop = LearnerLoop(self.cfg, self.rank, self.world_size, master_addr, master_port, self.redis_url, self.sender)

    def _loop(self) -> LearnerLoop:
        if self.loop is None:
            raise RuntimeError("LearnerActor: call setup() first")
        return self.loop

    def pid(self) -> int:
        """This rank's process id (listed in the run's ``servers.json``)."""
        return os.getpid()

    def sync_address(self) -> str | None:
        """ZeroMQ control endpoint of the weight sender (rank 0), for the inference servers."""
        return None if self.sender is None else self.sender.address

    def run(self, max_steps: int | None = None, wait_s: float | None = None) -> dict[str, Any]:
        """Run the loop (see :meth:`LearnerLoop.run`); returns ``{"version", "steps"}``."""
        summary = self._loop().run(max_steps, wait_s)
        return {"version": summary.version, "steps": summary.steps}

    def started_from(self) -> dict[str, Any]:
        """``{"checkpoint": the checkpoint loaded (None: the base model), "swept": what the
        start's sweep of killed checkpoint saves did, "resharded": a line when the checkpoint
        was saved by another number of ranks (else None)}`` (rank 0; elsewhere the sweep is
        empty and "resharded" None)."""
        loop = self._loop()
        return {"checkpoint": None if loop.head is None else str(loop.head), "swept": loop.swept, "resharded": loop.resharded}

    def finish(self) -> int:
        """Checkpoint and commit what the last checkpoint does not hold (collective); the version."""
        return self._loop().finish()

    def close(self) -> None:
        """Leave the process group and close the sender."""
        if self.loop is not None:
            self.loop.close()
        if self.sender is not None:
            self.sender.close()


def start_learners(cfg: Config, redis_url: str, secret: RunSecret | None, cpu_cores: list[list[int]] | None = None,
                   sender_address: str | None = None) -> list[Any]:
    """Start ``learner.world_size`` actors (resources from ``learner.cpus_per_rank`` and
    ``gpus_per_rank``; ``cpu_cores[rank]`` pins a rank), form their process group and return
    the handles, rank 0 first. ``secret``: the run's, given to rank 0's weight sender as an
    actor argument (None: no sender). ``sender_address``: a dead learner's weight sender, whose port
    the new one binds when rank 0 is on the same node (the servers reconnect to it)."""
    lrn = cfg.learner
    remote = ray.remote(num_cpus=lrn.cpus_per_rank, num_gpus=lrn.gpus_per_rank)(LearnerActor)
    actors = [remote.remote(cfg, rank, lrn.world_size, redis_url, cpu_cores[rank] if cpu_cores else None) for rank in range(lrn.world_size)]
    addr, port = ray.get(actors[0].rendezvous.remote())
    sender_port = 0
    if sender_address is not None and sender_address.removeprefix("tcp://").rsplit(":", 1)[0] == addr:
        sender_port = int(sender_address.rsplit(":", 1)[1])
    ray.get([a.setup.remote(addr, port, secret, sender_port) if rank == 0 else a.setup.remote(addr, port) for rank, a in enumerate(actors)],
            timeout=cfg.sync.timeout_s)
    return actors
