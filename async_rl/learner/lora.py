"""LoRA adapters on the policy, added through transformers' PEFT integration (``add_adapter``).

The Hugging Face class and every module path stay as they are (``decoder_layers``, the
``LogProbHead``, the attention kernels and the critic work unchanged); only parameter names
change: a targeted ``q_proj.weight`` becomes ``q_proj.base_layer.weight`` (frozen, never sent
or saved) beside the new ``q_proj.lora_A.default.weight`` ``[r, in]`` and
``q_proj.lora_B.default.weight`` ``[out, r]`` (float32, the only trainable parameters). PEFT
starts ``B`` at zero, so version 0 is the base model plus a zero adapter, which is what the
servers start serving.

The reference policy of a LoRA run is the same model with its adapters disabled
(:func:`adapters_disabled`): no second model.
"""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import peft
import torch
from peft.utils.error import NoMatchingPeftModuleError
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from async_rl.bounds import bound_problems
from async_rl.config import LORA_KEY, LORA_UNSERVABLE, ConfigError, LoraConfig
from async_rl.learner import vision
from async_rl.sync.control import AdapterSpec

log = logging.getLogger(__name__)

ADAPTER_NAME = "default"
"""PEFT's name of the one adapter (``add_adapter``'s default); it is part of every LoRA parameter's name."""
_LORA_PARAM = re.compile(rf"^(?P<module>.+)\.lora_(?P<which>[AB])\.{ADAPTER_NAME}\.weight$")
"""A LoRA parameter's name: the adapted module's path, ``A`` or ``B``."""


def peft_config(lora: LoraConfig) -> peft.LoraConfig:
    """PEFT's configuration of ``lora``: a causal LM's adapter without bias terms."""
    alpha: Any = lora.alpha  # PEFT annotates lora_alpha as int but scales by alpha / r in float
    return peft.LoraConfig(r=lora.rank, lora_alpha=alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules),
                           task_type="CAUSAL_LM", bias="none")


def apply_lora(model: nn.Module, lora: LoraConfig) -> None:
    """Add the adapter to ``model`` (a Hugging Face causal LM, before ``fully_shard``: on shards
    PEFT would size ``B`` by the shard's rows) and freeze everything else.

    The adapter's parameters are float32 whatever the base's dtype (PEFT gives them the base
    layer's): they are the master weights the optimizer updates. FSDP2 accepts the frozen
    base beside them in one unit (it requires one dtype among trainable parameters only).
    Raises :class:`ConfigError` naming the key when ``lora`` breaks a rule of its section.
    """
    problems = bound_problems(lora, f"{LORA_KEY}.") + lora.problems()
    if problems:
        raise ConfigError("invalid LoRA config:\n  " + "\n  ".join(problems))
    model.requires_grad_(False)
    model.add_adapter(peft_config(lora))  # type: ignore[operator]
    adapter = adapter_named_parameters(model)
    for _, param in adapter:
        param.data = param.data.float()
        param.requires_grad_(True)
    log.info("learner LoRA: rank %d, alpha %g, dropout %g on %s: %d trainable parameters of %d", lora.rank, lora.alpha, lora.dropout,
             ",".join(lora.target_modules), sum(p.numel() for _, p in adapter), sum(p.numel() for p in model.parameters()))


def adapter_named_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of every LoRA ``A`` and ``B`` of ``model``, in module order (names
    as ``named_parameters`` gives them; sharded under FSDP2)."""
    return [(name, param) for name, param in model.named_parameters() if _LORA_PARAM.match(name)]


def wire_name(name: str) -> str:
    """The name a LoRA parameter is sent (and exported) under: PEFT's file format,
    ``base_model.model.<module>.lora_{A,B}.weight`` (``.default`` dropped), which vLLM parses.
    Raises ``ValueError`` for a name that is not one of the adapter's parameters."""
    match = _LORA_PARAM.match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a LoRA parameter ('<module>.lora_A.{ADAPTER_NAME}.weight' or lora_B)")
    return f"base_model.model.{match['module']}.lora_{match['which']}.weight"


def adapter_spec(lora: LoraConfig) -> AdapterSpec:
    """What an adapter update announces to the servers: its rank, alpha and targets."""
    return AdapterSpec(r=lora.rank, alpha=lora.alpha, target_modules=tuple(lora.target_modules))


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Within the block ``model`` computes as its base model (every adapter layer returns its
    base layer's output): the reference policy of a LoRA run. Only flags change, so FSDP2 is
    unaffected; the adapters are enabled again however the block ends.

    PEFT also clears ``requires_grad`` of the adapters it disables. They are trainable again
    at once: FSDP2 reads ``requires_grad`` at its lazy initialisation (the first forward,
    which may be this one) to fix the dtypes gradients are reduced and kept in."""
    trainable = [param for _, param in adapter_named_parameters(model) if param.requires_grad]
    model.disable_adapters()  # type: ignore[operator]
    try:
        for param in trainable:
            param.requires_grad_(True)
        yield
    finally:
        model.enable_adapters()  # type: ignore[operator]


def unsupported_model(model_config: Mapping[str, Any]) -> str | None:
    """Why LoRA cannot train the model of ``model_config`` (its ``config.json`` as a dict) yet,
    or None: a vision-language model (its targets would need limiting to the language model)."""
    if vision.is_vision_language(model_config):
        return f"{LORA_KEY} is not supported for a vision-language model (model_type {model_config.get('model_type')!r}) yet; train it without {LORA_KEY}"
    return None


def target_problems(model_config: Mapping[str, Any], lora: LoraConfig) -> list[str]:
    """What is wrong with ``lora``'s targets for the model of ``model_config`` (its
    ``config.json`` as a dict), without loading weights: PEFT matches each target on the model
    built on the meta device. Refuses a vision-language model (not supported with LoRA yet),
    ``lm_head``/``embed_tokens``, and a name that matches no module, listing the valid ones.
    Empty when the targets are fine."""
    key = f"{LORA_KEY}.target_modules"
    why = unsupported_model(model_config)
    if why is not None:
        return [why]
    problems = lora.problems()
    if problems:
        return problems
    config = AutoConfig.for_model(**model_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    valid = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                    if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in LORA_UNSERVABLE})
    problems = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Already found a `peft_config`")  # the probes are several adapters on purpose
        for i, target in enumerate(lora.target_modules):
            try:  # one adapter per target: PEFT fails only when none of a config's targets matches
                peft.inject_adapter_in_model(peft.LoraConfig(r=lora.rank, target_modules=[target]), model, adapter_name=f"probe{i}")
            except NoMatchingPeftModuleError:
                problems.append(f"{key}: {target!r} matches no module of this model")
            except ValueError:  # a module PEFT cannot adapt (a whole block such as mlp)
                problems.append(f"{key}: {target!r} names a module that is not a Linear layer")
    if problems:
        problems.append(f"{key}: valid module names of this model: {', '.join(valid)}")
    return problems
