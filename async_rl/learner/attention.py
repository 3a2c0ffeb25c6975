"""Attention over packed rows: samples concatenated in one row attend only within themselves.

Three implementations, chosen by ``learner.kernels.attention`` (:func:`choose`):

* ``flash_attention_2``: flash-attn's varlen kernel (GPU, when ``flash_attn`` is installed),
  given the cumulative sample boundaries;
* ``flex_attention``: PyTorch's flex attention (GPU); transformers builds its block mask from
  the restarting ``position_ids``;
* ``sdpa``: :func:`packed_sdpa`, registered with transformers under :data:`PACKED_SDPA`: one
  causal ``scaled_dot_product_attention`` per sample, so no ``[S, S]`` mask or score matrix of
  the whole row is ever built (the CPU path, and a GPU fallback).

Shapes: a packed row of ``S`` tokens holds samples ``[bounds[i], bounds[i + 1])``.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from async_rl.config import KernelsConfig

log = logging.getLogger(__name__)

PACKED_SDPA = "async_rl_packed_sdpa"
"""The name :func:`packed_sdpa` is registered under in transformers' attention interface."""


def packed_sdpa(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                scaling: float | None = None, dropout: float = 0.0, packed_bounds: Sequence[int] | None = None,
                **_: object) -> tuple[Tensor, None]:
    """Causal attention of each sample of a packed row on its own.

    ``query`` ``[1, heads, S, d]``, ``key``/``value`` ``[1, kv_heads, S, d]``; returns
    ``[1, S, heads, d]`` as transformers expects. ``packed_bounds`` (``len = samples + 1``,
    from 0 to ``S``) comes from :func:`attention_kwargs`; without it the row is one sample.
    """
    if attention_mask is not None:
        raise ValueError("packed attention takes no attention mask: samples are delimited by packed_bounds")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves ``groups`` query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    bounds = list(packed_bounds) if packed_bounds is not None else [0, query.shape[2]]
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    # split, not a slice per sample: a slice's backward writes its gradient into a zeroed
    # tensor of the whole row, which made the backward quadratic in the samples per row.
    parts = [
        F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, dropout_p=dropout if module.training else 0.0)
        for q, k, v in zip(query.split(lengths, dim=2), key.split(lengths, dim=2), value.split(lengths, dim=2), strict=True)
    ]
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make :data:`PACKED_SDPA` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_SDPA, packed_sdpa)


def problem(kernels: KernelsConfig, device_type: str, flash_installed: bool) -> str | None:
    """Why ``kernels.attention`` cannot run on ``device_type`` (``cuda`` or ``cpu``), or None."""
    want = kernels.attention
    if want in ("flash_attention_2", "flex_attention") and device_type != "cuda":
        return f"learner.kernels.attention={want!r} needs a GPU learner; use 'sdpa' (or 'auto') on the CPU"
    if want == "flash_attention_2" and not flash_installed:
        return "learner.kernels.attention='flash_attention_2' needs the flash_attn package; use 'auto' or 'flex_attention'"
    return None


def choose(kernels: KernelsConfig, device: torch.device) -> str:
    """The transformers attention implementation for ``kernels.attention`` on ``device``
    (``auto``: flash-attn varlen, else flex attention on GPU; :data:`PACKED_SDPA` on CPU).
    A named kernel that cannot run here raises ``RuntimeError`` saying why (:func:`problem`)."""
    cuda = device.type == "cuda"
    has_flash = importlib.util.find_spec("flash_attn") is not None
    why = problem(kernels, device.type, has_flash)
    if why is not None:
        raise RuntimeError(why)
    want = kernels.attention
    if want == "auto":
        want = ("flash_attention_2" if has_flash else "flex_attention") if cuda else "sdpa"
    register()
    name = PACKED_SDPA if want == "sdpa" else want
    log.info("learner attention: %s (learner.kernels.attention=%s, device %s)", name, kernels.attention, device.type)
    return name


def attention_kwargs(implementation: str, bounds: Sequence[int], device: torch.device) -> dict[str, object]:
    """Forward keyword arguments telling ``implementation`` where the samples of a packed row
    start and end (flex attention reads the restarting ``position_ids`` instead)."""
    if implementation == PACKED_SDPA:
        return {"packed_bounds": tuple(bounds)}
    if implementation.startswith("flash_attention"):
        cu = torch.tensor(bounds, dtype=torch.int32, device=device)
        longest = max(b - a for a, b in zip(bounds, bounds[1:]))
        return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
    return {}
