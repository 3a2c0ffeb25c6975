"""Same-GPU weight hand-off through CUDA IPC (``sync.backend: auto`` or ``ipc``).

A server whose workers all run on the learner rank 0's own GPU (a colocated one-GPU run)
reads each update straight from a buffer in the learner's GPU memory: no device-to-host
copy, no host-to-device copy, no collective (NCCL refuses two ranks on one GPU). The
sender packs every bucket into one device buffer (:class:`CudaIpcWriter`), exports it
once as a CUDA IPC handle (``UntypedStorage._share_cuda_``: plain bytes and integers,
sent in the sealed :class:`~async_rl.sync.control.Start`, never pickled), and reuses it
for every update that fits; a reader (:class:`CudaIpcReader`) opens a buffer once and
keeps it open while the sender names the same one.

The lifecycle is the host shared memory's (:mod:`async_rl.sync.ipc`): the buffer is
rewritten only by the next update, which starts after every reader acknowledged the last
one; a buffer a reader did not acknowledge is abandoned and a new one made. Abandoning
is safe on CUDA too: torch counts the readers of an exported block (its IPC reference
counter) and keeps a freed block out of the allocator until the last reader closed it
(``torch.cuda.ipc_collect`` then frees it). Anything that stops the hand-off (no CUDA,
another GPU, too little free memory, a handle that does not open) is
:class:`~async_rl.sync.ipc.IpcUnavailable`: that update, or that server from then on,
goes through host shared memory instead.

GPUs are named by UUID (:func:`gpu_identity`), not index: two processes with different
``CUDA_VISIBLE_DEVICES`` number the same GPU differently.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import torch

from async_rl.sync.buckets import Bucket
from async_rl.sync.ipc import IpcUnavailable, layout

FREE_MARGIN_BYTES = 1 << 30
"""GPU memory left free beside a new hand-off buffer (the learner's next step allocates
right after the update): a buffer that would leave less is refused for host memory."""


def gpu_identity(device: torch.device) -> str:
    """The UUID of ``device``'s GPU (``""`` for a CPU or any device without one)."""
    if device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


class CudaHandle(msgspec.Struct, frozen=True):
    """One exported CUDA allocation: the fields of ``UntypedStorage._share_cuda_`` (the
    block's IPC handle, the storage's place in it, torch's reader reference counter and
    the producer's event), in its order."""

    device: int
    handle: bytes
    size: int
    offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


class CudaSource(msgspec.Struct, tag=True, frozen=True):
    """Where an update's buckets are: the buffer ``handle`` on GPU ``gpu`` (UUID), bucket
    ``i`` at byte ``offsets[i]``."""

    gpu: str
    handle: CudaHandle
    offsets: tuple[int, ...]
    nbytes: int
    """Bytes of the whole update (the buffer may be larger)."""


class CudaIpcWriter:
    """The sender's device buffer: sized to the update, exported once, reused while it fits
    and is not abandoned."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.gpu = gpu_identity(device)
        self._data: torch.Tensor | None = None
        self._handle: CudaHandle | None = None

    def prepare(self, buckets: Sequence[Bucket]) -> CudaSource:
        """A buffer laid out for ``buckets``; raises :class:`IpcUnavailable` when this is not
        a GPU or the buffer would leave less than :data:`FREE_MARGIN_BYTES` free."""
        offsets, total = layout(buckets)
        if self._data is None or self._data.numel() < total:
            self.abandon()
            if self.device.type != "cuda":
                raise IpcUnavailable(f"CUDA IPC needs a GPU, the learner's tensors are on {self.device}")
            free, _ = torch.cuda.mem_get_info(self.device)
            if free < total + FREE_MARGIN_BYTES:
                raise IpcUnavailable(f"{self.device} has {free / 2**30:.1f} GiB free, a {total / 2**30:.1f} GiB hand-off buffer "
                                     f"would leave less than {FREE_MARGIN_BYTES / 2**30:.0f} GiB")
            try:
                data = torch.empty(max(total, 1), dtype=torch.uint8, device=self.device)
                handle = CudaHandle(*data.untyped_storage()._share_cuda_())  # type: ignore[attr-defined]
            except (RuntimeError, TypeError) as exc:  # OutOfMemoryError is a RuntimeError
                raise IpcUnavailable(f"cannot export a {total / 2**20:.0f} MiB buffer on {self.device}: {exc}") from None
            self._data, self._handle = data, handle
        return CudaSource(self.gpu, self._handle, offsets, total)  # type: ignore[arg-type]

    def bucket(self, source: CudaSource, i: int, nbytes: int) -> torch.Tensor:
        """The ``[nbytes]`` ``uint8`` view of bucket ``i`` of ``source``."""
        if self._data is None:
            raise RuntimeError("CudaIpcWriter.bucket before prepare")
        return self._data[source.offsets[i] : source.offsets[i] + nbytes]

    def finish(self) -> None:
        """Wait until every bucket is written: readers use another CUDA context, which
        sees the bytes only once this stream's copies are done."""
        torch.cuda.current_stream(self.device).synchronize()

    def abandon(self) -> None:
        """Stop using the current buffer; readers that still hold it keep it alive (torch's
        IPC reference counter), and it is freed by a later :func:`torch.cuda.ipc_collect`."""
        had = self._data is not None
        self._data, self._handle = None, None
        if had:
            torch.cuda.ipc_collect()

    close = abandon


class CudaIpcReader:
    """A receiving worker's open handle of the sender's buffer (kept while the sender names
    the same one, closed when it names another)."""

    def __init__(self) -> None:
        self._handle: bytes | None = None
        self._data: torch.Tensor | None = None

    def buckets(self, source: CudaSource, buckets: Sequence[Bucket]) -> list[torch.Tensor]:
        """Zero-copy device views of every bucket of ``source``; the reader must finish
        using them (synchronize its stream) before it acknowledges the update."""
        if self._data is None or self._handle != source.handle.handle:
            self.close()
            self._data = _open(source)
            self._handle = source.handle.handle
        if self._data.numel() < source.nbytes:
            raise IpcUnavailable(f"the sender's buffer holds {self._data.numel()} bytes, the update {source.nbytes}")
        data = self._data
        return [data[offset : offset + bucket.nbytes] for offset, bucket in zip(source.offsets, buckets, strict=True)]

    def close(self) -> None:
        """Drop the open buffer (torch closes the handle and tells the sender's counter)."""
        self._data, self._handle = None, None


def _open(source: CudaSource) -> torch.Tensor:
    """The sender's buffer, opened on this process's index of GPU ``source.gpu``."""
    if not torch.cuda.is_available():
        raise IpcUnavailable(f"CUDA IPC: this process sees no GPU (the sender's is {source.gpu})")
    index = next((i for i in range(torch.cuda.device_count()) if gpu_identity(torch.device("cuda", i)) == source.gpu), None)
    if index is None:
        raise IpcUnavailable(f"CUDA IPC: GPU {source.gpu} of the sender is not visible to this process")
    h = source.handle
    try:
        storage = torch.UntypedStorage._new_shared_cuda(  # type: ignore[attr-defined]
            index, h.handle, h.size, h.offset, h.ref_counter_handle, h.ref_counter_offset, h.event_handle, h.event_sync_required
        )
    except RuntimeError as exc:
        raise IpcUnavailable(f"CUDA IPC: cannot open the sender's buffer on GPU {source.gpu}: {exc}") from None
    return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index)).set_(storage)
