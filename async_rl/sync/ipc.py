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

Segments: ``/dev/shm/asyncrl-{pid}-{pid namespace}-{16 random hex}``, created exclusively with
mode 0600 (a name someone already holds is skipped for a fresh one, never opened) and their
pages reserved with ``posix_fallocate`` before anything is written. Every failure to create,
reserve or map one is :class:`IpcUnavailable`: that update goes over the broadcast group.
:func:`sweep_segments` removes this user's segments whose owner died without unlinking them.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import stat
from collections.abc import Sequence
from functools import cache
from multiprocessing import resource_tracker, shared_memory

import msgspec
import torch

from async_rl.sync.buckets import Bucket

SHM_DIR = "/dev/shm"
SHM_PREFIX = "asyncrl-"
_NAME_TRIES = 4
"""Fresh names drawn before giving up: a name already taken means a squatter, not chance."""
_SEGMENT = re.compile(rf"{SHM_PREFIX}(?P<pid>\d+)-(?P<ns>\d+)-[0-9a-f]{{16}}")


class IpcUnavailable(RuntimeError):
    """Shared memory cannot carry the update here (no ``/dev/shm``, too little free, or a
    segment that cannot be created, reserved or mapped): it goes over the broadcast group."""


class ShmSource(msgspec.Struct, tag=True, frozen=True):
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


@cache
def _pid_namespace() -> int:
    """Inode of this process's pid namespace (0: unknown). Part of a segment's name, so a
    sweep judges only the pids it can see: containers that share ``/dev/shm`` may not share pids."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _create(size: int) -> shared_memory.SharedMemory:
    """A new segment of ``size`` bytes (mode 0600, owned by this process), every page reserved:
    a write to a page a full tmpfs cannot supply is SIGBUS, a failed reservation is an error."""
    for _ in range(_NAME_TRIES):
        name = f"{SHM_PREFIX}{os.getpid()}-{_pid_namespace()}-{secrets.token_hex(8)}"
        path = os.path.join(SHM_DIR, name)
        try:  # O_EXCL: never open (or follow a link planted at) a name someone else made
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            continue
        except OSError as exc:
            raise IpcUnavailable(f"cannot create a segment in {SHM_DIR}: {exc}") from None
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
            return shared_memory.SharedMemory(name=name, create=False)
        except OSError as exc:
            _unlink(path)
            raise IpcUnavailable(f"cannot reserve and map {size / 2**20:.0f} MiB in {path}: {exc}") from None
    raise IpcUnavailable(f"{_NAME_TRIES} fresh random segment names in {SHM_DIR} were all taken")


def sweep_segments() -> list[str]:
    """Remove this user's segments (in this pid namespace) whose owner process is gone: a
    learner killed together with its resource tracker leaves them behind. A live owner's, or
    one whose owner cannot be judged, is kept. Returns a line per removed segment."""
    namespace = _pid_namespace()
    try:
        entries = list(os.scandir(SHM_DIR)) if namespace else []
    except OSError:
        return []
    done = []
    for entry in entries:
        match = _SEGMENT.fullmatch(entry.name)
        if match is None or int(match["ns"]) != namespace or _alive(int(match["pid"])):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:  # removed meanwhile
            continue
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and _unlink(entry.path):
            done.append(f"removed {entry.path} ({st.st_size / 2**20:.0f} MiB): its owner, process {match['pid']}, is gone")
    return done


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (in this pid namespace)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process has the pid: alive
        pass
    return True


def _unlink(path: str) -> bool:
    """Remove ``path``; False if it could not be (gone already, or not ours)."""
    try:
        os.unlink(path)
    except OSError:
        return False
    return True


def layout(buckets: Sequence[Bucket]) -> tuple[tuple[int, ...], int]:
    """Byte offset of each bucket in one buffer holding them all, and the buffer's size."""
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
        cannot hold it or a segment cannot be made. Free space is checked first (reserving
        what is not there would briefly fill the tmpfs other processes write to as well)."""
        offsets, total = layout(buckets)
        if self._shm is None or self._shm.size < total:
            self.abandon()
            try:
                free = shutil.disk_usage(SHM_DIR).free
            except OSError as exc:
                raise IpcUnavailable(f"{SHM_DIR} is not usable: {exc}") from None
            if free < total:
                raise IpcUnavailable(f"{SHM_DIR} has {free / 2**20:.0f} MiB free, the update needs {total / 2**20:.0f} MiB")
            self._shm = _create(max(total, 1))
            self._data = torch.frombuffer(self._shm.buf, dtype=torch.uint8)
        return ShmSource(self._shm.name, offsets, total)

    def bucket(self, source: ShmSource, i: int, nbytes: int) -> torch.Tensor:
        """The ``[nbytes]`` ``uint8`` view of bucket ``i`` of ``source``."""
        if self._data is None:
            raise RuntimeError("ShmWriter.bucket before prepare")
        return self._data[source.offsets[i] : source.offsets[i] + nbytes]

    def finish(self) -> None:
        """Every bucket is written once the pack returned (host memory): nothing to wait for."""

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
            # the sender's segment when this process exits: it is not ours to remove (unless
            # this process is the sender, whose registration it is).
            if not source.name.lstrip("/").startswith(f"{SHM_PREFIX}{os.getpid()}-"):
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
