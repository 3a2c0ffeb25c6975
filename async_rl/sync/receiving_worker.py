"""The receiving half of weight sync, apart from any engine: :class:`ReceivingWorker`.

A worker (a vLLM worker through :class:`~async_rl.sync.vllm_receiver.WeightReceiverExtension`,
or a plain ``torch.nn.Module`` through :class:`~async_rl.sync.module_receiver.ModuleReceiver`)
is driven by :class:`~async_rl.sync.server.WeightUpdateServer` through ``collective_rpc``
calls of the methods below. It stages a whole update before anything touches the model:
from the weight group in a background thread (so generation continues while buckets
flow; staged on CPU), or as views of the sender's host shared memory or CUDA IPC buffer
(already all there). Only :meth:`wsync_load`, after every worker of the engine staged the
update, applies it, through the subclass's :meth:`_wsync_apply`. A sender that dies or
stalls mid-update therefore leaves the old weights serving.

This module imports no engine: the receiving protocol runs (and is tested) wherever torch
and ZeroMQ do, e.g. on the GPU machine that has no vLLM.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Literal

import torch

from async_rl.sync.control import Announce, ErrorKind, Start, decode
from async_rl.sync.cuda_ipc import CudaIpcReader, CudaSource, gpu_identity
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
    """One flat ``uint8`` tensor per bucket, ``[bucket.nbytes]``: staged on CPU, or views of
    the sender's host shared memory or (``on_gpu``) CUDA IPC buffer."""
    on_gpu: bool = False
    state: ReceiveState = "receiving"
    error: str | None = None
    error_kind: ErrorKind | None = None
    receive_s: float = 0.0


def decode_announce(data: bytes) -> Announce:
    """The :class:`Announce` encoded in ``data`` (``TypeError`` for any other message)."""
    ann = decode(data)
    if not isinstance(ann, Announce):
        raise TypeError(f"expected an Announce, got {type(ann)}")
    return ann


class ReceivingWorker:
    """Methods of one receiving worker, all called through ``collective_rpc``. ``self.device``
    is the worker's device; a subclass applies a staged update (:meth:`_wsync_apply`) and may
    refuse updates it cannot take (:meth:`wsync_check`)."""

    _wsync_staging: _Staging | None = None
    _wsync_group: WeightGroup | None = None
    _wsync_shm: ShmReader | None = None
    _wsync_cuda: CudaIpcReader | None = None

    def wsync_worker_index(self) -> int:
        """Index of this worker inside its engine (its rank offset in the weight group)."""
        return 0

    def wsync_gpu(self) -> str:
        """UUID of this worker's GPU ("" without one): the sender hands updates to a server
        whose workers are all on its own GPU through CUDA IPC."""
        return gpu_identity(torch.device(self.device))  # type: ignore[attr-defined]

    def wsync_check(self, announce: bytes) -> str | None:
        """Why this worker cannot take the update ``announce`` (an encoded :class:`Announce`),
        or None when it can. The server asks before it answers Ready, so a refused update is
        declined before any tensor is sent. Here: adapters are refused (no LoRA to serve)."""
        if decode_announce(announce).adapter is None:
            return None
        return "a LoRA adapter was sent to a receiver that serves none: send full weights"

    def wsync_begin(self, announce: bytes, start: bytes) -> None:
        """Start receiving the update (encoded :class:`Announce` and :class:`Start`) in
        a background thread; returns at once. Drops any unfinished previous update."""
        ann, st = decode_announce(announce), decode(start)
        if not isinstance(st, Start):
            raise TypeError(f"expected a Start, got {type(st)}")
        self._wsync_drop_staging()
        staging = _Staging(ann, time.monotonic())
        self._wsync_staging = staging
        if st.handoff is not None:  # same host or GPU: the buckets are in the sender's memory already
            try:
                staging.bufs = self._wsync_map(st.handoff, ann)  # views: loaded from there, no copy
                staging.on_gpu = isinstance(st.handoff, CudaSource)
                staging.state = "received"
            except Exception as e:  # reported through wsync_status
                staging.error, staging.state = f"{type(e).__name__}: {e}", "failed"
                if isinstance(e, IpcUnavailable):
                    staging.error_kind = "ipc_unavailable"
            staging.receive_s = time.monotonic() - staging.started
            return
        if st.rendezvous is None:
            raise ValueError(f"update {ann.update_id}: Start names neither a rendezvous nor a hand-off")
        staging.thread = threading.Thread(
            target=self._wsync_receive,
            args=(staging, st.rendezvous, st.rank_offset + self.wsync_worker_index(), st.timeout_s),
            name=f"wsync-recv-{ann.update_id}",
            daemon=True,
        )
        staging.thread.start()

    def wsync_status(self, update_id: int) -> tuple[ReceiveState, str | None, float, ErrorKind | None]:
        """``(state, error, receive_s, error_kind)`` of ``update_id`` on this worker; non-blocking."""
        s = self._wsync_staging
        if s is None or s.announce.update_id != update_id:
            return "failed", f"update {update_id} is not being received here", 0.0, None
        return s.state, s.error, s.receive_s, s.error_kind

    def wsync_load(self, update_id: int) -> float:
        """Apply the fully staged ``update_id`` to the model in place; returns seconds. An
        update read from CUDA IPC is finished on this worker's stream before this returns:
        the sender rewrites the buffer once every reader acknowledged."""
        s = self._wsync_staging
        if s is None or s.announce.update_id != update_id or s.state != "received":
            raise RuntimeError(f"update {update_id} is not fully received on this worker")
        t0 = time.monotonic()
        try:
            self._wsync_apply(s.announce, s.bufs)
            if s.on_gpu:
                torch.cuda.current_stream(s.bufs[0].device if s.bufs else None).synchronize()
        finally:
            self._wsync_staging = None
        return time.monotonic() - t0

    def wsync_discard(self, update_id: int) -> None:
        """Drop ``update_id``'s staged buckets (the model keeps its weights)."""
        s = self._wsync_staging
        if s is not None and s.announce.update_id == update_id:
            self._wsync_drop_staging()

    # -- for subclasses ----------------------------------------------------------

    def _wsync_apply(self, announce: Announce, bufs: list[torch.Tensor]) -> None:
        """Put the staged update (one flat ``uint8`` tensor per bucket of ``announce``) into
        the model; raising leaves the model's weights undefined (the server restarts). Every
        receiver defines it (vLLM's worker extension, :class:`ModuleReceiver`)."""
        raise NotImplementedError(f"{type(self).__name__} receives updates but defines no _wsync_apply to load them")

    # -- internals -----------------------------------------------------------------

    def _wsync_map(self, source: object, ann: Announce) -> list[torch.Tensor]:
        """Views of every bucket in the sender's host shared memory or CUDA IPC buffer."""
        if isinstance(source, CudaSource):
            if self._wsync_cuda is None:
                self._wsync_cuda = CudaIpcReader()
            return self._wsync_cuda.buckets(source, ann.buckets)
        if self._wsync_shm is None:
            self._wsync_shm = ShmReader()
        return self._wsync_shm.buckets(source, ann.buckets)  # type: ignore[arg-type]

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
        device = torch.device(self.device)  # type: ignore[attr-defined]
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
