"""Same-host weight hand-off through POSIX shared memory (``sync.backend: auto`` or ``ipc``).

For a server on the learner's own machine the sender packs every bucket of an update into
one shared-memory segment (``/dev/shm``) and tells the server its name; the server's
workers map it and load their weights straight from it. No collective, no process group
(so a learner and a server may share one GPU, which NCCL refuses), and the one copy is the
sender's pack.

Ownership: the sender (:class:`ShmWriter`) creates, reuses and unlinks segments; a reader
(:class:`ShmReader`) only maps them. A segment is rewritten only by the next update, which
starts after every reader of the previous one acknowledged (the sender completes an
update before it begins the next); a segment whose readers did not all acknowledge is
abandoned to them (unlinked, so it is freed when the last mapping closes) and a fresh one
is made. On CPU the segment is the servers' staging memory; on GPU the learner's bytes are
copied to it once (device to host) and the server's load copies them up.
"""

from __future__ import annotations

import itertools
import os
import shutil
import socket
from collections.abc import Sequence
from functools import cache
from multiprocessing import resource_tracker, shared_memory

import msgspec
import torch

from async_rl.sync.buckets import Bucket

SHM_DIR = "/dev/shm"
SHM_PREFIX = "asyncrl-"
_names = itertools.count()


class IpcUnavailable(RuntimeError):
    """Shared memory cannot hold the update here (no ``/dev/shm``, or too little free)."""


class ShmSource(msgspec.Struct, frozen=True):
    """Where an update's buckets are: segment ``name``, bucket ``i`` at byte ``offsets[i]``."""

    name: str
    offsets: tuple[int, ...]
    nbytes: int
    """Bytes of the whole update (the segment may be larger)."""


@cache
def host_identity() -> str:
    """This machine as sender and servers compare it: ``hostname/boot id`` (processes with
    the same identity share ``/dev/shm``; a container with a private one fails its first
    open, and the sender then uses the collective for that server)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def _layout(buckets: Sequence[Bucket]) -> tuple[tuple[int, ...], int]:
    offsets, total = [], 0
    for bucket in buckets:
        offsets.append(total)
        total += bucket.nbytes
    return tuple(offsets), total


class ShmWriter:
    """The sender's segment: sized to the update, reused while it fits and is not abandoned."""

    def __init__(self) -> None:
        self._shm: shared_memory.SharedMemory | None = None
        self._data: torch.Tensor | None = None

    def prepare(self, buckets: Sequence[Bucket]) -> ShmSource:
        """A segment laid out for ``buckets``; raises :class:`IpcUnavailable` if ``/dev/shm``
        cannot hold it (checked before writing: a write past a full tmpfs is SIGBUS)."""
        offsets, total = _layout(buckets)
        if self._shm is None or self._shm.size < total:
            self.abandon()
            try:
                free = shutil.disk_usage(SHM_DIR).free
            except OSError as exc:
                raise IpcUnavailable(f"{SHM_DIR} is not usable: {exc}") from None
            if free < total:
                raise IpcUnavailable(f"{SHM_DIR} has {free / 2**20:.0f} MiB free, the update needs {total / 2**20:.0f} MiB")
            name = f"{SHM_PREFIX}{os.getpid()}-{next(_names)}"
            self._shm = shared_memory.SharedMemory(name=name, create=True, size=max(total, 1))
            self._data = torch.frombuffer(self._shm.buf, dtype=torch.uint8)
        return ShmSource(self._shm.name, offsets, total)

    def bucket(self, source: ShmSource, i: int, nbytes: int) -> torch.Tensor:
        """The ``[nbytes]`` ``uint8`` view of bucket ``i`` of ``source``."""
        if self._data is None:
            raise RuntimeError("ShmWriter.bucket before prepare")
        return self._data[source.offsets[i] : source.offsets[i] + nbytes]

    def abandon(self) -> None:
        """Stop using the current segment (unlinked: readers that still map it keep it)."""
        shm, self._shm, self._data = self._shm, None, None
        if shm is not None:
            shm.unlink()
            _close(shm)

    close = abandon


class ShmReader:
    """A server worker's mapping of the sender's segment (kept while the name stays the same)."""

    def __init__(self) -> None:
        self._shm: shared_memory.SharedMemory | None = None
        self._data: torch.Tensor | None = None

    def buckets(self, source: ShmSource, buckets: Sequence[Bucket]) -> list[torch.Tensor]:
        """Zero-copy ``uint8`` views of every bucket of ``source``."""
        if self._shm is None or self._shm.name != source.name.lstrip("/"):
            self.close()
            try:
                shm = shared_memory.SharedMemory(name=source.name, create=False)
            except OSError as exc:
                raise IpcUnavailable(f"cannot map shared memory {source.name!r} of the sender: {exc}") from None
            # Python < 3.13 registers every attach with the resource tracker, which would unlink
            # the sender's segment when this process exits: it is not ours to remove.
            resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
            self._shm, self._data = shm, torch.frombuffer(shm.buf, dtype=torch.uint8)
        if self._shm.size < source.nbytes:
            raise IpcUnavailable(f"shared memory {source.name!r} holds {self._shm.size} bytes, the update {source.nbytes}")
        data = self._data
        return [data[offset : offset + bucket.nbytes] for offset, bucket in zip(source.offsets, buckets, strict=True)]

    def close(self) -> None:
        shm, self._shm, self._data = self._shm, None, None
        if shm is not None:
            _close(shm)


def _close(shm: shared_memory.SharedMemory) -> None:
    try:
        shm.close()
    except BufferError:  # a view is still alive somewhere: the mapping goes with it
        pass
