"""Random LoRA adapters in PEFT's naming and the merged models that serve the same outputs
(the reference for every test that checks what a LoRA engine serves)."""

from __future__ import annotations

import copy

import torch

TARGETS = ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")
"""k_proj and up_proj are left out: their slices of vLLM's packed qkv_proj / gate_up_proj stay zero."""


def random_adapter(model: torch.nn.Module, seed: int, rank: int = 8, targets: tuple[str, ...] = TARGETS,
                   scale: float = 0.3) -> dict[str, torch.Tensor]:
    """PEFT-named A ``[r, in]`` and B ``[out, r]`` for every ``targets`` module of ``model``
    (B non-zero, unlike PEFT's initialisation)."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in targets:
            out_f, in_f = module.weight.shape
            out[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, in_f, generator=gen) * scale
            out[f"base_model.model.{name}.lora_B.weight"] = torch.randn(out_f, rank, generator=gen) * scale
    return out


def merged(model: torch.nn.Module, adapter: dict[str, torch.Tensor], alpha: float, rank: int = 8) -> torch.nn.Module:
    """A copy of ``model`` with ``W + (alpha / r) B A`` in every adapted module."""
    out = copy.deepcopy(model)
    modules = dict(out.named_modules())
    with torch.no_grad():
        for key, a in adapter.items():
            if key.endswith(".lora_A.weight"):
                name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
                modules[name].weight += (alpha / rank) * (adapter[key.replace("lora_A", "lora_B")] @ a)
    return out
