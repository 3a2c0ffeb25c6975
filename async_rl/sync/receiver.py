"""vLLM worker side of weight sync: :class:`WeightReceiverExtension`.

Enable with ``LLM(..., worker_extension_cls="async_rl.sync.receiver.WeightReceiverExtension")``
(or ``AsyncEngineArgs(worker_extension_cls=...)``); vLLM mixes the class into every
worker, and :mod:`async_rl.sync.server` drives it with ``collective_rpc``. The receive
runs in a background thread, so generation continues while buckets flow; every bucket
is staged (on CPU) and the model is only touched by :meth:`wsync_load`, after every
worker of the engine staged the whole update. A sender that dies or stalls mid-update
therefore leaves the old weights serving.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Literal

import torch
from vllm.config import set_current_vllm_config
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

from async_rl.heap import release_freed_heap
from async_rl.sync import lora
from async_rl.sync.buckets import unpack_bucket
from async_rl.sync.control import Announce, ErrorKind, Start, decode
from async_rl.sync.group import Rendezvous, WeightGroup, connect_store
from async_rl.sync.ipc import IpcUnavailable, ShmReader

ReceiveState = Literal["receiving", "received", "failed"]


@dataclass
class _Staging:
    """One update being received by one worker."""

    announce: Announce
    started: float
    thread: threading.Thread | None = None
    bufs: list[torch.Tensor] = field(default_factory=list)
    """One flat CPU ``uint8`` tensor per bucket, ``[bucket.nbytes]``."""
    state: ReceiveState = "receiving"
    error: str | None = None
    error_kind: ErrorKind | None = None
    receive_s: float = 0.0


class WeightReceiverExtension:
    """Methods mixed into each vLLM worker (``self`` is the worker: ``vllm_config``,
    ``device``, ``model_runner`` come from it). All are called via ``collective_rpc``."""

    _wsync_staging: _Staging | None = None
    _wsync_group: WeightGroup | None = None
    _wsync_shm: ShmReader | None = None

    def wsync_worker_index(self) -> int:
        """Index of this worker inside its engine (TP x PP rank)."""
        return self.vllm_config.parallel_config.rank  # type: ignore[attr-defined]

    def wsync_check(self, announce: bytes) -> str | None:
        """Why this worker cannot take the update ``announce`` (an encoded :class:`Announce`),
        or None when it can. The server asks before it answers Ready, so a refused update is
        declined before any tensor is sent (the sender leaves this server out of the
        broadcast instead of waiting for it) and what is served stays: an adapter the engine
        cannot serve (:func:`~async_rl.sync.lora.check_adapter`), an adapter sent to an engine
        without LoRA, full weights sent to an engine that serves an adapter."""
        ann = decode(announce)
        if not isinstance(ann, Announce):
            raise TypeError(f"expected an Announce, got {type(ann)}")
        serves_lora = getattr(self.model_runner, "lora_manager", None) is not None  # type: ignore[attr-defined]
        if ann.adapter is None:
            return ("full weights were sent to an engine that serves a LoRA adapter (enable_lora): "
                    "send the adapter only") if serves_lora else None
        try:
            lora.check_adapter(lora.lora_manager(self), ann.adapter, ann.specs)
        except lora.AdapterRefused as e:
            return str(e)
        return None

    def wsync_begin(self, announce: bytes, start: bytes) -> None:
        """Start receiving the update (encoded :class:`Announce` and :class:`Start`) in
        a background thread; returns at once. Drops any unfinished previous update."""
        ann, st = decode(announce), decode(start)
        if not isinstance(ann, Announce) or not isinstance(st, Start):
            raise TypeError(f"expected Announce and Start, got {type(ann)}, {type(st)}")
        self._wsync_drop_staging()
        staging = _Staging(ann, time.monotonic())
        if st.shm is not None:  # same host: the buckets are in the sender's shared memory already
            self._wsync_staging = staging
            try:
                if self._wsync_shm is None:
                    self._wsync_shm = ShmReader()
                staging.bufs = self._wsync_shm.buckets(st.shm, ann.buckets)  # views: loaded from there, no copy
                staging.state = "received"
            except Exception as e:  # reported through wsync_status
                staging.error, staging.state = f"{type(e).__name__}: {e}", "failed"
                if isinstance(e, IpcUnavailable):
                    staging.error_kind = "ipc_unavailable"
            staging.receive_s = time.monotonic() - staging.started
            return
        if st.rendezvous is None:
            raise ValueError(f"update {ann.update_id}: Start names neither a rendezvous nor shared memory")
        staging.thread = threading.Thread(
            target=self._wsync_receive,
            args=(staging, st.rendezvous, st.rank_offset + self.wsync_worker_index(), st.timeout_s),
            name=f"wsync-recv-{ann.update_id}",
            daemon=True,
        )
        self._wsync_staging = staging
        staging.thread.start()

    def wsync_status(self, update_id: int) -> tuple[ReceiveState, str | None, float, ErrorKind | None]:
        """``(state, error, receive_s, error_kind)`` of ``update_id`` on this worker; non-blocking."""
        s = self._wsync_staging
        if s is None or s.announce.update_id != update_id:
            return "failed", f"update {update_id} is not being received here", 0.0, None
        return s.state, s.error, s.receive_s, s.error_kind

    def wsync_lora_init(self, rank: int) -> None:
        """Serve a zero LoRA adapter of ``rank`` as the policy (version 0: the base model);
        call once, after the engine started (its warm-up removes every adapter)."""
        lora.install_zero_adapter(lora.lora_manager(self), rank)

    def wsync_load(self, update_id: int) -> float:
        """Load the fully staged ``update_id`` into the model in place; returns seconds.

        Uses vLLM's layer-wise reload, so weights may arrive in any checkpoint layout
        (separate q/k/v are fused by ``load_weights``) and post-load processing runs. An
        adapter update (``Announce.adapter``) replaces the served LoRA adapter instead.
        """
        s = self._wsync_staging
        if s is None or s.announce.update_id != update_id or s.state != "received":
            raise RuntimeError(f"update {update_id} is not fully received on this worker")
        t0 = time.monotonic()
        specs = s.announce.specs
        if s.announce.adapter is not None:
            named = (pair for bucket, buf in zip(s.announce.buckets, s.bufs, strict=True) for pair in unpack_bucket(bucket, specs, buf))
            lora.install_adapter(lora.lora_manager(self), s.announce.adapter, named)
            self._wsync_staging = None
            return time.monotonic() - t0
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            initialize_layerwise_reload(model)
            for bucket, buf in zip(s.announce.buckets, s.bufs, strict=True):
                model.load_weights(unpack_bucket(bucket, specs, buf))
            finalize_layerwise_reload(model, self.vllm_config.model_config)  # type: ignore[attr-defined]
        self._wsync_staging = None
        # The reload freed and reallocated every weight (and the CPU backend's packed copies)
        # between generation's allocations: without this a vLLM worker of the tiny quickstart
        # model grew 70-90 MB per 1,000 updates (benchmarks/soak.py); about 5 ms on its heap.
        release_freed_heap()
        return time.monotonic() - t0

    def wsync_discard(self, update_id: int) -> None:
        """Drop ``update_id``'s staged buckets (the model keeps its weights)."""
        s = self._wsync_staging
        if s is not None and s.announce.update_id == update_id:
            self._wsync_drop_staging()

    # -- internals -----------------------------------------------------------------

    def _wsync_drop_staging(self) -> None:
        s, self._wsync_staging = self._wsync_staging, None
        if s is not None and s.thread is not None and s.thread.is_alive():
            # Aborting the group unblocks the thread's pending broadcast.
            self._wsync_close_group()
            s.thread.join(timeout=5.0)

    def _wsync_close_group(self) -> None:
        g, self._wsync_group = self._wsync_group, None
        if g is not None:
            g.close()

    def _wsync_join(self, rv: Rendezvous, rank: int, timeout_s: float) -> WeightGroup:
        g = self._wsync_group
        if g is not None and g.rendezvous == rv and g.rank == rank:
            return g
        self._wsync_close_group()
        g = WeightGroup.join(rv, rank, connect_store(rv, timeout_s), timeout_s)
        self._wsync_group = g
        return g

    def _wsync_receive(self, s: _Staging, rv: Rendezvous, rank: int, timeout_s: float) -> None:
        deadline = s.started + timeout_s
        device: torch.device = self.device  # type: ignore[attr-defined]
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # the current device is per thread
            group = self._wsync_join(rv, rank, deadline - time.monotonic())
            on_cpu = group.device.type == "cpu"
            recv = None if on_cpu else torch.empty(
                max(b.nbytes for b in s.announce.buckets), dtype=torch.uint8, device=group.device
            )
            for bucket in s.announce.buckets:
                # Staging lives on CPU: a full extra copy of the model must not take
                # accelerator memory; only one bucket does.
                stage = torch.empty(bucket.nbytes, dtype=torch.uint8, pin_memory=not on_cpu)
                target = stage if recv is None else recv[: bucket.nbytes]
                group.broadcast(target, deadline - time.monotonic())
                if recv is not None:
                    stage.copy_(target)
                s.bufs.append(stage)
            s.receive_s = time.monotonic() - s.started
            s.state = "received"
        except Exception as e:  # reported through wsync_status, never raised in a thread
            s.bufs.clear()
            s.error = f"{type(e).__name__}: {e}"
            s.state = "failed"
            self._wsync_close_group()
