"""The learner's weight publisher: sending versions to the inference servers, their
acknowledgements, catch-up of lagging servers, and the version published for admission.

Every rank takes part in gathering the full parameters from the FSDP shards (collective);
rank 0 sends them with a :class:`WeightPublisher` while the learner goes on, and publishes a
version for admission only once every registered server acknowledged it (docs/architecture.md:
a version counts once its weights reached the servers).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn

from async_rl.config import LoraConfig
from async_rl.learner import collectives
from async_rl.learner.lora import adapter_named_parameters, adapter_spec, wire_name
from async_rl.learner.model import iter_full_parameters
from async_rl.sync.buckets import TensorSpec, tensor_specs
from async_rl.sync.control import AdapterSpec
from async_rl.sync.sender import PendingSend, SendResult


class WeightPublisher(Protocol):
    """What rank 0 sends weights with: :class:`async_rl.sync.sender.WeightSender`."""

    def begin(
        self, named_tensors: Iterable[tuple[str, Tensor]], version: int, *, specs: Sequence[TensorSpec],
        servers: Collection[str] | None = None, adapter: AdapterSpec | None = None,
    ) -> PendingSend:
        """Broadcast every ``(name, full tensor)`` (in ``specs`` order) as policy ``version``
        to ``servers`` (None: all registered); they load it while the learner goes on. With
        ``adapter``, the tensors are a LoRA adapter that replaces the servers' served one."""

    def complete(self, pending: PendingSend, wait: bool = True) -> SendResult | None:
        """Outcome of ``pending`` once every server acknowledged (None: not yet, ``wait=False``)."""

    def behind(self, version: int) -> list[str]:
        """Registered servers that do not hold ``version``."""

    @property
    def servers(self) -> dict[str, int | None]:
        """Registered servers and the version each holds."""

    @property
    def dropped(self) -> dict[str, int]:
        """Control messages dropped so far, by reason."""


@dataclass
class _Sending:
    """Rank 0's state of the weight updates."""

    sender: WeightPublisher
    announce: Callable[[int], None]
    """Publishes a version for admission (the queue's ``publish_version``)."""
    served: int
    """The version every server should hold (the last one sent to all of them)."""
    announced: int
    """The last version published for admission."""
    sent: int
    """The newest version this process sent (to all servers or in a catch-up)."""
    pending: PendingSend | None = None
    """The update the servers may still be loading."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Timings of the updates settled since the last :meth:`Publication.take_metrics` (``sync/*``)."""
    adapter_norm: float | None = None
    """L2 norm of the LoRA adapter last sent (all its A and B together); None for full weights."""


class Publication:
    """Every rank's side of the weight updates of ``policy``.

    ``sender`` and ``announce`` are rank 0's (None elsewhere, or when no inference server
    is to be updated); ``counters`` are the learner's checkpointed counters
    (``sync_catch_up``, ``sync_failed``); ``version`` is the version the servers start from.
    With ``lora`` (a LoRA policy), only the adapter is gathered and sent, in PEFT's names
    (:func:`~async_rl.learner.lora.wire_name`): the servers keep their base weights.
    Construction is collective: every rank learns whether rank 0 publishes.
    """

    def __init__(self, rank: int, device: torch.device, policy: nn.Module, bucket_mb: int, counters: Counter[str],
                 sender: WeightPublisher | None, announce: Callable[[int], None] | None, version: int,
                 lora: LoraConfig | None = None) -> None:
        if sender is not None and announce is None:
            raise ValueError("a weight sender needs the queue's version announcement (rank 0)")
        self.rank, self.device, self.policy, self.bucket_bytes, self.counters = rank, device, policy, bucket_mb << 20, counters
        self.adapter = None if lora is None else adapter_spec(lora)
        self._rank0 = _Sending(sender, announce, version, version, version) if sender is not None and announce is not None else None
        # Every rank must know whether rank 0 publishes: the gathers are collective.
        self.active = bool(collectives.broadcast_bytes(b"1" if self._rank0 is not None else b"", device, rank))

    @property
    def loading(self) -> bool:
        """Rank 0: the last update may still be loading on the servers."""
        return self._rank0 is not None and self._rank0.pending is not None

    def publish(self, version: int, servers: list[str] | None = None) -> float:
        """Gather the full parameters bucket by bucket and send them as ``version``
        (collective); returns seconds. With ``servers`` only those get them (a catch-up);
        otherwise every server does. Acknowledgements are handled by :meth:`settle`."""
        if not self.active:
            return 0.0
        start = time.perf_counter()
        params = list(self.policy.named_parameters() if self.adapter is None else adapter_named_parameters(self.policy))
        buckets = iter_full_parameters(self.policy, self.bucket_bytes, named=params)
        try:
            if (state := self._rank0) is not None:
                self.settle(wait=True)
                if servers is None:
                    state.served = version
                state.sent = max(state.sent, version)
                named = (item for bucket in buckets for item in bucket)
                if self.adapter is not None:
                    named = self._adapter_for_the_wire(named, state)
                    params = [(wire_name(name), p) for name, p in params]
                state.pending = state.sender.begin(named, version, specs=tensor_specs(params), servers=servers, adapter=self.adapter)
        finally:
            for _ in buckets:  # every rank takes part in every gather, even if the send stopped early
                pass
        return time.perf_counter() - start

    @staticmethod
    def _adapter_for_the_wire(named: Iterable[tuple[str, Tensor]], state: _Sending) -> Iterator[tuple[str, Tensor]]:
        """The adapter's full tensors under their wire names; measures its norm on the way."""
        squares = 0.0
        for name, tensor in named:
            squares += float(tensor.detach().float().pow(2).sum())
            yield wire_name(name), tensor
        state.adapter_norm = squares ** 0.5

    def catch_up(self, version: int) -> None:
        """Send ``version``'s weights to servers that do not hold the served version: a
        restarted or newly added server, or one whose last update failed (collective:
        rank 0 decides)."""
        if not self.active:
            return
        self.settle(wait=False)
        behind = self._lagging()
        if collectives.broadcast_bytes("\n".join(behind).encode(), self.device, self.rank):
            self.counters["sync_catch_up"] += 1
            self.publish(version, servers=behind)

    def settle(self, wait: bool) -> None:
        """Act on the acknowledgements of the last update (rank 0): count a failure (the
        server keeps its weights; a later catch-up retries), then publish the served
        version for admission if every registered server holds it (a server that joined or
        failed is caught up first). With ``wait=False`` and acknowledgements still missing,
        nothing happens yet."""
        state = self._rank0
        if state is None or state.pending is None:
            return
        result = state.sender.complete(state.pending, wait)
        if result is None:
            return
        state.pending = None
        state.metrics = _sync_timings(result)
        if not result.ok and result.servers:
            self.counters["sync_failed"] += 1
        if state.served > state.announced and state.sender.servers and not self._lagging():
            state.announce(state.served)
            state.announced = state.served

    def take_metrics(self) -> dict[str, float]:
        """The ``sync/*`` timings of the updates settled since the last call, and the control
        messages the sender dropped so far (``sync/control_dropped/<reason>``, a count since the
        learner started; rank 0; {} elsewhere)."""
        if self._rank0 is None:
            return {}
        metrics, self._rank0.metrics = self._rank0.metrics, {}
        dropped = {f"sync/control_dropped/{reason}": float(n) for reason, n in self._rank0.sender.dropped.items()}
        norm = {} if self._rank0.adapter_norm is None else {"learner/lora_norm": self._rank0.adapter_norm}
        return {**metrics, **dropped, **norm}

    def _lagging(self) -> list[str]:
        """Rank 0: registered servers older than the served version (a catch-up sends the
        current weights, which may be newer: with ``sync.every > 1`` that is fine), or newer
        than any version this learner sent: weights of the line a restarted learner abandoned."""
        state = self._rank0
        if state is None:
            return []
        held = state.sender.servers
        return [sid for sid in state.sender.behind(state.served) if (v := held.get(sid)) is None or not state.served <= v <= state.sent]


def _sync_timings(result: SendResult) -> dict[str, float]:
    """``sync/*`` metrics of a settled update: the sender's whole update and its wait for the
    acknowledgements, and the slowest server's receive, load and pause (seconds); the bytes
    sent (the whole model, or a LoRA adapter)."""
    reports = list(result.servers.values())
    return {
        "sync/update_s": result.total_s, "sync/ack_wait_s": result.ack_s, "sync/update_bytes": float(result.bytes),
        "sync/receive_s": max((r.receive_s for r in reports), default=0.0),
        "sync/load_s": max((r.load_s for r in reports), default=0.0),
        "sync/pause_s": max((r.pause_s for r in reports), default=0.0),
    }
