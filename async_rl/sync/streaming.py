"""Putting one update's buckets on their way: into each hand-off buffer (host shared memory,
a CUDA IPC buffer) and onto the broadcast group, pipelined (:func:`stream_buckets`, called by
:class:`~async_rl.sync.sender.WeightSender` and measured alone by ``benchmarks/learner_throughput.py``)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from async_rl.sync.buckets import Bucket, TensorSpec, bucket_in_place, iter_bucket_tensors, pack_bucket
from async_rl.sync.cuda_ipc import CudaIpcWriter, CudaSource
from async_rl.sync.group import WeightGroup
from async_rl.sync.ipc import ShmSource, ShmWriter


def stream_buckets(
    group: WeightGroup | None,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    specs: Sequence[TensorSpec],
    buckets: Sequence[Bucket],
    deadline: float,
    handoffs: Sequence[tuple[ShmWriter | CudaIpcWriter, ShmSource | CudaSource]] = (),
) -> int:
    """Put every bucket in each hand-off buffer (``handoffs``: host shared memory, a CUDA
    IPC buffer) and/or broadcast it on ``group`` (as rank 0) by ``deadline``
    (``time.monotonic()``); returns the bytes of the update. The caller finishes the
    hand-off buffers (:meth:`~async_rl.sync.ipc.ShmWriter.finish`) before naming them.

    Pipelined: bucket *i+1* is gathered and packed while bucket *i* is on the wire, into
    one of two staging buffers (a one-tensor bucket goes from its own memory, unstaged; a
    CPU group broadcasts the host shared-memory copy). Every tensor of a bucket stays
    referenced until its broadcast finished.
    """
    staging: list[torch.Tensor | None] = [None, None]
    previous: tuple[dist.Work, torch.Tensor, list[torch.Tensor]] | None = None  # work, its bytes, their tensors
    nbytes = 0
    for i, (bucket, tensors) in enumerate(iter_bucket_tensors(named_tensors, specs, buckets)):
        nbytes += bucket.nbytes
        copies = [pack_bucket(bucket, specs, tensors, writer.bucket(source, i, bucket.nbytes)) for writer, source in handoffs]
        if group is None:
            continue
        shared = next((c for c in copies if c.is_cpu), None)
        data = shared if shared is not None and group.device.type == "cpu" else bucket_in_place(bucket, specs, tensors, group.device)
        if data is None:  # slot i % 2 was last used by broadcast i - 2, finished below at i - 1
            buf = staging[i % 2]
            if buf is None or buf.numel() < bucket.nbytes:
                buf = staging[i % 2] = torch.empty(bucket.nbytes, dtype=torch.uint8, device=group.device)
            data = pack_bucket(bucket, specs, tensors, buf)
        work = group.start_broadcast(data, deadline - time.monotonic())
        if previous is not None:
            group.wait(previous[0], deadline - time.monotonic())
        previous = (work, data, tensors)
    if previous is not None and group is not None:
        group.wait(previous[0], deadline - time.monotonic())
    return nbytes
