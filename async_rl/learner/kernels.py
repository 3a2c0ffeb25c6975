"""Fused kernels for the learner's model, each behind a switch of ``learner.kernels`` that
falls back cleanly where it cannot run; every choice is logged.

* Liger kernels (``liger``): Triton RMSNorm, SwiGLU MLP and RoPE, patched into the model
  instance. GPU only; ``auto`` uses them when ``liger_kernel`` is installed.
* ``compile``: ``torch.compile`` of each decoder layer (the first step pays the compilation).
"""

from __future__ import annotations

import importlib.util
import logging

import torch
from torch import nn

from async_rl.config import KernelsConfig

log = logging.getLogger(__name__)


def liger_problem(kernels: KernelsConfig, device_type: str, installed: bool) -> str | None:
    """Why ``liger: on`` cannot run on ``device_type`` (``cuda`` or ``cpu``), or None."""
    if kernels.liger == "on" and (device_type != "cuda" or not installed):
        return ("learner.kernels.liger=on needs a GPU learner and the liger_kernel package "
                f"(device {device_type}, liger_kernel {'installed' if installed else 'not installed'}); use auto or off")
    return None


def use_liger(kernels: KernelsConfig, device: torch.device) -> bool:
    """Whether Liger kernels apply: ``on`` raises where they cannot run, ``auto`` falls back."""
    installed = importlib.util.find_spec("liger_kernel") is not None
    why = liger_problem(kernels, device.type, installed)
    if why is not None:
        raise RuntimeError(why)
    return kernels.liger == "on" or (kernels.liger == "auto" and installed and device.type == "cuda")


def apply(model: nn.Module, layers: nn.ModuleList, kernels: KernelsConfig, device: torch.device) -> None:
    """Patch ``model`` (before sharding) with the kernels ``kernels`` asks for and ``device`` allows."""
    if use_liger(kernels, device):
        from liger_kernel.transformers import _apply_liger_kernel_to_instance

        try:
            _apply_liger_kernel_to_instance(model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                            fused_linear_cross_entropy=False)
        except Exception as exc:  # an unsupported architecture: the model stays as it is
            if kernels.liger == "on":
                raise
            log.warning("learner kernels: Liger kernels not applied to %s (%s); using the model's own", type(model).__name__, exc)
        else:
            log.info("learner kernels: Liger RMSNorm, SwiGLU and RoPE")
    else:
        log.info("learner kernels: no Liger kernels (learner.kernels.liger=%s, device %s)", kernels.liger, device.type)
    if kernels.compile:
        for layer in layers:
            layer.compile()
        log.info("learner kernels: torch.compile of %d decoder layers", len(layers))
