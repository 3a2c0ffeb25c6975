"""The served LoRA adapter inside a vLLM worker: checked, built from received tensors, swapped in.

A LoRA run serves one adapter, the policy, under one fixed id (:data:`POLICY_LORA_ID`); every
request names it (``LoRARequest(POLICY_LORA_NAME, POLICY_LORA_ID, ...)``). An update replaces
that adapter's weights in the worker's LoRA manager, so requests in flight go on with the new
adapter after the resume, exactly as they go on with new full weights (and their tokens'
version tags stay true). The adapter is built from the tensors in memory
(``LoRAModel.from_lora_tensors``): no directory, nothing pickled through the engine core. Its
id never leaves the manager's caches (``max_loras=max_cpu_loras=1``, pinned), so vLLM never
tries to load it from the request's path, which names nothing on disk.

Version 0 is a zero adapter (:func:`install_zero_adapter`, at the server's start): PEFT
initialises ``B`` to zero, so the learner's version 0 is the base model too, and a request
started before the first update already carries the adapter it will decode with later.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from vllm.lora.lora_model import LoRAModel
from vllm.lora.peft_helper import PEFTHelper
from vllm.lora.request import LoRARequest
from vllm.lora.utils import parse_fine_tuned_lora_name

from async_rl.sync.buckets import TensorSpec
from async_rl.sync.control import AdapterSpec

POLICY_LORA_ID = 1
"""vLLM's integer id of the served policy adapter (ids start at 1)."""
POLICY_LORA_NAME = "async-rl-policy"


def policy_lora_request(version: int, name: str = POLICY_LORA_NAME) -> LoRARequest:
    """What every generation request of a LoRA server names: the policy adapter, whatever
    version it holds. The path names nothing on disk (the adapter never leaves the pinned
    cache, so vLLM never loads from it); it carries the version only so that prefix-cache
    keys, which hash it, differ between versions. ``name``: what the OpenAI-compatible API's
    answers call it (the API's model name); the id alone selects the adapter."""
    return LoRARequest(name, POLICY_LORA_ID, f"async-rl://policy/v{version}")


class AdapterRefused(ValueError):
    """The announced adapter cannot be served by this engine (the old one keeps serving)."""


def lora_manager(worker: Any) -> Any:
    """The worker's LoRA manager (``LRUCacheWorkerLoRAManager``); raises :class:`AdapterRefused`
    when the engine was started without ``enable_lora``."""
    manager = getattr(worker.model_runner, "lora_manager", None)
    if manager is None:
        raise AdapterRefused("a LoRA adapter was sent to a vLLM engine started without enable_lora")
    return manager


def _servable_names(manager: Any) -> set[str]:
    """Last parts of the module names the engine serves LoRA on (``q_proj``, ``gate_proj``, ...:
    a packed ``qkv_proj`` counts as its parts), as vLLM's own directory loader checks them."""
    adapters = manager._adapter_manager
    names: set[str] = set()
    for module in adapters.supported_lora_modules:
        names.update(adapters.packed_modules_mapping.get(module, [module]))
    return names


def check_adapter(manager: Any, adapter: AdapterSpec, specs: Iterable[TensorSpec]) -> None:
    """Refuse, before any tensor arrives, an adapter this engine would serve wrongly: a rank
    above ``max_lora_rank``, a tensor that is not a LoRA ``A``/``B`` of a servable module (vLLM
    would drop it silently: served != trained), or shapes that do not match the rank."""
    max_rank = manager.lora_config.max_lora_rank
    if adapter.r > max_rank:
        raise AdapterRefused(f"LoRA rank {adapter.r} > the engine's max_lora_rank {max_rank}")
    servable = _servable_names(manager)
    for spec in specs:
        if not spec.name.endswith((".lora_A.weight", ".lora_B.weight")):
            raise AdapterRefused(f"{spec.name}: not a LoRA A or B weight (PEFT's '<module>.lora_A.weight')")
        module, is_a = parse_fine_tuned_lora_name(spec.name)
        if module.rsplit(".", 1)[-1] not in servable:
            raise AdapterRefused(f"{spec.name}: vLLM serves no LoRA on {module!r} (servable: {', '.join(sorted(servable))})")
        rank = spec.shape[0] if is_a else spec.shape[-1]
        if len(spec.shape) != 2 or rank != adapter.r:
            raise AdapterRefused(f"{spec.name}: shape {list(spec.shape)} is not a rank-{adapter.r} LoRA {'A [r, in]' if is_a else 'B [out, r]'}")


def install_adapter(manager: Any, adapter: AdapterSpec, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Build the adapter from ``tensors`` and make it the served policy adapter.

    The tensors are cloned: vLLM scales ``B`` in place when it activates an adapter, and on the
    shared-memory path they are views of the sender's segment, which other servers read too."""
    adapters = manager._adapter_manager
    model = adapters.model
    helper = PEFTHelper.from_dict({"r": adapter.r, "lora_alpha": adapter.alpha, "target_modules": list(adapter.target_modules),
                                   "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(
        POLICY_LORA_ID, {name: t.clone() for name, t in tensors}, helper, device="cpu", dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size, weights_mapper=None if mapper is None else mapper.get_rename_mapper(),
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    _swap(adapters, lora)


def install_zero_adapter(manager: Any, rank: int) -> None:
    """Serve a zero adapter of ``rank`` on every servable module: version 0, the base model."""
    adapters = manager._adapter_manager
    _swap(adapters, adapters.create_dummy_lora(POLICY_LORA_ID, rank, manager.embedding_modules))


def _swap(adapters: Any, lora: LoRAModel) -> None:
    adapters.remove_adapter(POLICY_LORA_ID)  # deactivates it first; nothing when absent
    adapters.add_adapter(lora)  # packs q/k/v and gate/up, a missing projection as zero
    adapters.activate_adapter(POLICY_LORA_ID)
    adapters.pin_adapter(POLICY_LORA_ID)
