"""Masked reductions over ``[B, T]`` tensors (``mask`` is 1 for trained tokens, 0 for padding)."""

from __future__ import annotations

import torch
from torch import Tensor


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``values`` over entries where ``mask`` is 1; 0 where nothing is selected.

    Shapes: ``values`` and ``mask`` ``[B, T]``; result a scalar (``dim=None``) or reduced over ``dim``.
    """
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp_min(1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp_min(1)


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / sqrt(var + eps)`` with batch mean and unbiased variance under ``mask``.

    Shapes: ``values``, ``mask`` ``[B, T]`` -> ``[B, T]``. Same as verl's ``masked_whiten``
    (``verl/utils/torch_functional.py``: Bessel-corrected variance, ``rsqrt(var + 1e-8)``); with a
    single selected entry the variance is taken as 0 instead of raising.
    """
    mean = masked_mean(values, mask)
    count = mask.sum()
    var = ((values - mean) ** 2 * mask).sum() / (count - 1).clamp_min(1)
    return (values - mean) * torch.rsqrt(var + eps)
