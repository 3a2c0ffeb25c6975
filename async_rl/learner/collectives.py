"""Every collective of the learner's own process group, with its tensors on the group's device.

NCCL accepts only CUDA tensors; gloo accepts CPU ones (and CPU copies of CUDA ones), so a
tensor left on the CPU crashes a GPU learner that every CPU test passes. The learner calls
these functions, never ``torch.distributed`` directly, with the device the group runs on
(``DistInfo.device``):

* normally a tensor found elsewhere is moved there (and the result moved back), at the cost
  of a copy, and counted in :data:`moved`;
* in strict mode (``ASYNC_RL_STRICT_DEVICES=1``, or :func:`strict_devices` in tests) it
  raises :class:`CollectiveDeviceError` naming the collective, so a test on CPU can declare
  the group's device as ``cuda`` and prove that every tensor is put there.

FSDP2's own collectives (parameter all-gathers, gradient reduce-scatters, the gradient-norm
reduction of DTensors) use the device mesh and are not routed here.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

_strict = os.environ.get("ASYNC_RL_STRICT_DEVICES") == "1"

moved: Counter[str] = Counter()
"""Collectives (by ``what``) whose tensor had to be moved to the group's device: each is a
device bug that costs a copy (and would fail in strict mode)."""


class CollectiveDeviceError(RuntimeError):
    """A tensor handed to a learner collective is not on the group's device (strict mode)."""


@contextlib.contextmanager
def strict_devices(enabled: bool = True) -> Iterator[None]:
    """Within the block, a tensor on the wrong device raises instead of being moved."""
    global _strict
    previous, _strict = _strict, enabled
    try:
        yield
    finally:
        _strict = previous


def tensor_device(tensor: Tensor) -> torch.device:
    """Where ``tensor`` lives (one function, so a CPU test can simulate a CUDA placement)."""
    return tensor.device


def _on_device(tensor: Tensor, device: torch.device, what: str) -> Tensor:
    """``tensor`` on ``device``: itself when it is there already."""
    have = tensor_device(tensor)
    if have.type == device.type:
        return tensor
    if _strict:
        raise CollectiveDeviceError(f"{what}: tensor on {have.type}, but the learner's process group runs on {device.type} "
                                    f"(NCCL takes CUDA tensors only); create it with device=DistInfo.device")
    moved[what] += 1
    return tensor.to(device)


def all_reduce(tensor: Tensor, device: torch.device, what: str) -> Tensor:
    """Sum ``tensor`` over the ranks; returns the sum (``tensor`` itself when it was on
    ``device``, which is then reduced in place)."""
    placed = _on_device(tensor, device, what)
    dist.all_reduce(placed)
    if placed is not tensor:
        tensor.copy_(placed)
    return tensor


def broadcast(tensor: Tensor, device: torch.device, src: int, what: str) -> Tensor:
    """Rank ``src``'s ``tensor`` on every rank (in place, like :func:`all_reduce`)."""
    placed = _on_device(tensor, device, what)
    dist.broadcast(placed, src)
    if placed is not tensor:
        tensor.copy_(placed)
    return tensor


def barrier() -> None:
    """Wait for every rank (NCCL barriers run on the device :func:`init_distributed` set)."""
    dist.barrier()


def broadcast_bytes(payload: bytes, device: torch.device, rank: int) -> bytes:
    """Rank 0's ``payload`` on every rank (``payload`` is ignored elsewhere): its length, then
    the bytes as a uint8 tensor (skipped when empty), both on ``device``."""
    length = broadcast(torch.tensor([len(payload) if rank == 0 else 0], dtype=torch.long, device=device), device, 0, "payload length")
    size = int(length)
    if size == 0:
        return b""
    if rank == 0:
        broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device), device, 0, "payload")
        return payload
    return broadcast(torch.empty(size, dtype=torch.uint8, device=device), device, 0, "payload").cpu().numpy().tobytes()
