"""The dedicated weight-broadcast process group (sender = rank 0, vLLM workers = 1..N).

Built directly from a ``TCPStore`` + ``PrefixStore`` and a backend class, so it never
touches (nor needs) ``torch.distributed``'s default group: the learner's FSDP group and
vLLM's own TP group live beside it untouched. One code path for both backends: gloo
moves CPU tensors, NCCL moves CUDA tensors on the current device.

The sender hosts one ``TCPStore`` from the first update that needs a group on; each group
"epoch" uses its own key prefix, so a new group (after a membership change or a failure)
needs no new port. The prefix holds 128 random bits and travels only inside the sealed
``Start`` message: a process that reaches the store without the run's secret cannot name a
key of the group (the rank-0 address, the NCCL id) to read or overwrite it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Literal

import msgspec
import torch
import torch.distributed as dist

from async_rl.netbind import master_store

Backend = Literal["gloo", "nccl"]


class GroupError(RuntimeError):
    """A collective of the weight group failed (peer gone, bad state)."""


class GroupTimeout(GroupError, TimeoutError):
    """Rendezvous or a collective of the weight group did not finish in time."""


class Rendezvous(msgspec.Struct, frozen=True):
    """Everything a member needs to join one epoch of the weight group."""

    host: str
    port: int
    epoch: int
    """A new epoch is a new group (for logs: :attr:`key_prefix` names its keys)."""
    world_size: int
    backend: Backend
    key_prefix: str
    """The group's keys in the store: ``wsync/<epoch>/<32 random hex>`` (:func:`new_key_prefix`)."""


def new_key_prefix(epoch: int) -> str:
    """An unguessable store prefix for ``epoch`` (128 random bits)."""
    return f"wsync/{epoch}/{secrets.token_hex(16)}"


def resolve_backend(backend: Literal["auto", "gloo", "nccl"]) -> Backend:
    """``auto`` is NCCL when this (sending) process sees a CUDA device, else gloo."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    return backend


def group_device(backend: Backend) -> torch.device:
    """Device whose tensors the backend moves (NCCL: this process's current GPU)."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def host_store(host: str, timeout_s: float) -> dist.TCPStore:
    """Start the sender's store on a free port of ``host``, listening on that address only
    (read the port from ``.port``)."""
    return master_store(host, 0, timeout_s)


def connect_store(rv: Rendezvous, timeout_s: float) -> dist.TCPStore:
    """Client connection to the sender's store; fails after ``timeout_s`` seconds."""
    return dist.TCPStore(rv.host, rv.port, None, False, timeout=timedelta(seconds=timeout_s))


@contextlib.contextmanager
def _nccl_errors_do_not_kill() -> Iterator[None]:
    # ProcessGroupNCCL reads this at construction; its default (3) makes the watchdog
    # tear the whole process down on a timed-out collective, which would kill a vLLM
    # worker that should instead report the failure and keep serving.
    old = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
        else:
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = old


class WeightGroup:
    """This process's membership of one epoch of the weight group."""

    def __init__(self, pg: dist.ProcessGroup, rv: Rendezvous, rank: int, create_s: float):
        self.pg = pg
        self.rendezvous = rv
        self.rank = rank
        self.device = group_device(rv.backend)
        self.create_s = create_s
        """Seconds spent in rendezvous + group construction."""

    @classmethod
    def join(
        cls, rv: Rendezvous, rank: int, store: dist.Store, timeout_s: float
    ) -> WeightGroup:
        """Join epoch ``rv.epoch`` as ``rank``; blocks until all ``rv.world_size`` ranks
        joined, raising :class:`GroupTimeout` after ``timeout_s`` seconds."""
        t0 = time.monotonic()
        timeout = timedelta(seconds=timeout_s)
        store.set_timeout(timeout)
        prefixed = dist.PrefixStore(rv.key_prefix, store)
        try:
            if rv.backend == "gloo":
                pg = dist.ProcessGroupGloo(prefixed, rank, rv.world_size, timeout)
            else:
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                with _nccl_errors_do_not_kill():
                    pg = dist.ProcessGroupNCCL(prefixed, rank, rv.world_size, opts)
                # NCCL connects lazily; do it now so rendezvous cost and failures land
                # here, inside the timeout, not in the first bucket.
                pg.eager_connect_single_device(group_device("nccl"))
        except RuntimeError as e:
            if time.monotonic() - t0 >= timeout_s * 0.99:
                raise GroupTimeout(f"weight group rendezvous timed out: {e}") from e
            raise GroupError(f"weight group rendezvous failed: {e}") from e
        return cls(pg, rv, rank, time.monotonic() - t0)

    def broadcast(self, tensor: torch.Tensor, timeout_s: float) -> None:
        """Broadcast ``tensor`` (on :attr:`device`) from rank 0 in place; wait at most
        ``timeout_s`` seconds (host-blocking on both backends)."""
        self.wait(self.start_broadcast(tensor, timeout_s), timeout_s)

    def start_broadcast(self, tensor: torch.Tensor, timeout_s: float) -> dist.Work:
        """Start broadcasting ``tensor`` from rank 0 and return at once; finish with
        :meth:`wait`. ``tensor`` must not change until then (the transfer reads it
        meanwhile: gloo on its own threads, NCCL on its stream)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = timedelta(seconds=max(timeout_s, 1e-3))
        try:
            return self.pg.broadcast([tensor], opts)
        except RuntimeError as e:
            raise GroupError(f"broadcast failed: {e}") from e

    def wait(self, work: dist.Work, timeout_s: float) -> None:
        """Wait at most ``timeout_s`` seconds for a started collective."""
        t0 = time.monotonic()
        try:
            work.wait(timedelta(seconds=max(timeout_s, 1e-3)))
        except RuntimeError as e:
            if time.monotonic() - t0 >= timeout_s * 0.99 or "timed out" in str(e).lower():
                raise GroupTimeout(f"broadcast timed out after {timeout_s:.1f} s: {e}") from e
            raise GroupError(f"broadcast failed: {e}") from e

    def close(self) -> None:
        """Abort the group (unblocks pending collectives); safe after a failure."""
        with contextlib.suppress(RuntimeError):
            self.pg.abort()
