"""vLLM worker side of weight sync: :class:`WeightReceiverExtension`.

Enable with ``LLM(..., worker_extension_cls="async_rl.sync.vllm_receiver.WeightReceiverExtension")``
(or ``AsyncEngineArgs(worker_extension_cls=...)``); vLLM mixes the class into every
worker, and :mod:`async_rl.sync.server` drives it with ``collective_rpc``. Receiving and
staging an update is :class:`~async_rl.sync.receiving_worker.ReceivingWorker`'s (no vLLM there);
this class adds what is vLLM's: the worker's rank, which updates the engine can take (a
LoRA adapter or full weights) and the load itself.
"""

from __future__ import annotations

import itertools

import torch
from vllm.config import set_current_vllm_config
from vllm.model_executor.model_loader.reload import (
    finalize_layerwise_reload,
    initialize_layerwise_reload,
)

from async_rl.heap import release_freed_heap
from async_rl.sync import lora
from async_rl.sync.buckets import unpack_bucket
from async_rl.sync.control import Announce
from async_rl.sync.receiving_worker import ReceivingWorker, decode_announce


RELOADS_PER_TRIM = 8
"""A full reload returns the freed heap (:func:`~async_rl.heap.release_freed_heap`) once in this many."""
_RELOADS = itertools.count()
"""This vLLM worker process's full reloads so far (the first one trims)."""


class WeightReceiverExtension(ReceivingWorker):
    """Methods mixed into each vLLM worker (``self`` is the worker: ``vllm_config``,
    ``device``, ``model_runner`` come from it). All are called via ``collective_rpc``."""

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
        ann = decode_announce(announce)
        serves_lora = getattr(self.model_runner, "lora_manager", None) is not None  # type: ignore[attr-defined]
        if ann.adapter is None:
            return ("full weights were sent to an engine that serves a LoRA adapter (enable_lora): "
                    "send the adapter only") if serves_lora else None
        try:
            lora.check_adapter(lora.lora_manager(self), ann.adapter, ann.specs)
        except lora.AdapterRefused as e:
            return str(e)
        return None

    def wsync_lora_init(self, rank: int) -> None:
        """Serve a zero LoRA adapter of ``rank`` as the policy (version 0: the base model);
        call once, after the engine started (its warm-up removes every adapter)."""
        lora.install_zero_adapter(lora.lora_manager(self), rank)

    def _wsync_apply(self, announce: Announce, bufs: list[torch.Tensor]) -> None:
        """Load the staged update into the model in place.

        Uses vLLM's layer-wise reload, so weights may arrive in any checkpoint layout
        (separate q/k/v are fused by ``load_weights``) and post-load processing runs. An
        adapter update (``Announce.adapter``) replaces the served LoRA adapter instead.
        """
        specs = announce.specs
        if announce.adapter is not None:
            named = (pair for bucket, buf in zip(announce.buckets, bufs, strict=True) for pair in unpack_bucket(bucket, specs, buf))
            lora.install_adapter(lora.lora_manager(self), announce.adapter, named)
            return
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        with set_current_vllm_config(self.vllm_config):  # type: ignore[attr-defined]
            initialize_layerwise_reload(model)
            for bucket, buf in zip(announce.buckets, bufs, strict=True):
                model.load_weights(unpack_bucket(bucket, specs, buf))
            finalize_layerwise_reload(model, self.vllm_config.model_config)  # type: ignore[attr-defined]
        # The reload freed and reallocated every weight (and the CPU backend's packed copies)
        # between generation's allocations: never trimmed, a vLLM worker of the tiny quickstart
        # model grew 70-90 MB per 1,000 updates (benchmarks/soak.py). Trimmed after every load,
        # the next load faulted the handed-back pages in again: 118 MB loads took 20-40 ms longer
        # (benchmarks/weight_sync.py). So one load in RELOADS_PER_TRIM trims.
        if next(_RELOADS) % RELOADS_PER_TRIM == 0:
            release_freed_heap()
