"""A weight-sync receiver that loads into a plain ``torch.nn.Module``: :class:`ModuleReceiver`.

The same receiving protocol as a vLLM server's workers (:class:`~async_rl.sync.receiving_worker.ReceivingWorker`,
driven by the same :class:`~async_rl.sync.server.WeightUpdateServer`), with the engine
replaced by one in-process worker (:class:`LocalEngine`) whose load copies each tensor into
the module's parameter or buffer of the same name. It runs where vLLM cannot (the GPU
machine, where the one-GPU hand-off is measured into a transformers model) and makes the
protocol testable without an engine.
"""

from __future__ import annotations

from typing import Any

import torch

from async_rl.sync.buckets import unpack_bucket
from async_rl.sync.control import Announce
from async_rl.sync.receiving_worker import ReceivingWorker


class ModuleReceiver(ReceivingWorker):
    """Receives full weights into ``module`` (on ``module``'s device)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._targets = dict(module.named_parameters()) | dict(module.named_buffers())
        first = next(iter(self._targets.values()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self.loads = 0
        """Updates applied so far."""

    def _wsync_apply(self, announce: Announce, bufs: list[torch.Tensor]) -> None:
        """Copy every tensor of the update into the module's tensor of that name; a name
        the module lacks or a shape that differs is an error (raised before any copy)."""
        named = [pair for bucket, buf in zip(announce.buckets, bufs, strict=True) for pair in unpack_bucket(bucket, announce.specs, buf)]
        for name, tensor in named:
            target = self._targets.get(name)
            if target is None:
                raise KeyError(f"the update names {name!r}, which the module does not have")
            if target.shape != tensor.shape:
                raise ValueError(f"{name!r}: the update's shape {tuple(tensor.shape)} differs from the module's {tuple(target.shape)}")
        with torch.no_grad():
            for name, tensor in named:
                self._targets[name].copy_(tensor)
        self.loads += 1


class LocalEngine:
    """The one-worker engine :class:`~async_rl.sync.server.WeightUpdateServer` drives:
    ``collective_rpc`` calls ``worker``'s method in this process (the offline-engine shape:
    plain methods, nothing to pause)."""

    def __init__(self, worker: ReceivingWorker) -> None:
        self.worker = worker

    def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = ()) -> list[Any]:
        """``[worker.method(*args)]``; ``timeout`` is the caller's bound, unused in-process."""
        return [getattr(self.worker, method)(*args)]

    def reset_prefix_cache(self) -> bool:
        """No cache to reset."""
        return True
