"""VPPO: policy updates focused on the tokens that depend on the image.

Huang et al., "Spotlight on Token Perception for Multimodal Reinforcement Learning"
(arXiv:2510.09285), as its reference code (VPPO-RL on EasyR1: ``verl/workers/actor/dp_actor.py``,
``verl/utils/perc_utils.py``) computes it. With ``y_t`` the sampled token of response ``i``,
``log p(y_t | image)`` the current policy's log-probability given the real image and
``log p~(y_t | image~)`` given the image with patches blackened (:func:`blacken_patches`):

* visual dependency (k3 estimator of ``KL(p || p~)`` on the sampled token, VPPO's
  ``low_var_kl``): ``d_t = clamp(log p~ - log p, -20, 20)``,
  ``S_t = clamp(exp(d_t) - d_t - 1, 0, 10)`` (:func:`visual_dependency`);
* token selection (``top_p_perception_tokens = p``): each response keeps the gradient on its
  ``ceil(L_i * p)`` trained tokens of highest ``S_t`` (:func:`select_perception_tokens`); the
  loss's denominator still counts all ``L_i`` trained tokens, as VPPO multiplies the mask into
  the per-token loss only;
* advantage shaping (``use_advantage_shaping``, ``advantage_scaling_min = b``): sequence score
  ``s_i = mean_t S_{i,t}``, ``n_i = clip((s_i - min s) / (max s - min s), 0, 1)`` over the
  batch, ``alpha_i = b + n_i (1 - b) / (mean n + 1e-8)``, ``A_{i,t} <- alpha_i A_{i,t}``
  (:func:`advantage_scale`): the factors average 1 and the least visual response keeps ``b``;
* entropy penalty (``use_entropy_penalty``, ``entropy_penalty_coef = c``): ``loss += c *
  mean_t(-log p(y_t))`` over the trained tokens (:func:`sampled_entropy`), the sampled-token
  estimate of the entropy, with its gradient: it lowers the entropy.

Where this differs from the reference code, on purpose: the min, max and mean of the shaping
are taken over the learner step's whole batch (VPPO: min/max over the per-device mini-batch
and the mean per micro-batch, whose composition in a token-packed learner is arbitrary), and
the blackening is seeded (VPPO: unseeded numpy).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from . import kl
from ._masked import masked_mean

PATCH_SIZE = 14
"""Side in pixels of the square cells :func:`blacken_patches` blackens (VPPO's ``patch_size``)."""
BLACKEN_PROB = 0.5
"""Probability that a cell is blackened (VPPO's ``black_prob``)."""
_SHAPING_EPS = 1e-8  # VPPO's epsilon in (1 - b) / (mu + eps)
_SHAPING_MIN_RANGE = 1e-6  # below this spread of scores, every factor is 1 (VPPO's guard)


def blacken_patches(image: Image.Image, seed: int | Sequence[int], patch_size: int = PATCH_SIZE, prob: float = BLACKEN_PROB) -> Image.Image:
    """The perception probe's image: each ``patch_size`` x ``patch_size`` cell of the grid
    from the top-left corner (edge cells clipped) set to black with probability ``prob``,
    drawn from ``numpy.random.default_rng(seed)`` (VPPO's ``random_patch_blackening``)."""
    pixels = np.array(image.convert("RGB"))
    rows, cols = math.ceil(pixels.shape[0] / patch_size), math.ceil(pixels.shape[1] / patch_size)
    black = np.random.default_rng(seed).random((rows, cols)) < prob
    for r, c in zip(*np.nonzero(black)):
        pixels[r * patch_size : (r + 1) * patch_size, c * patch_size : (c + 1) * patch_size] = 0
    return Image.fromarray(pixels)


def visual_dependency(logp: Tensor, masked_logp: Tensor) -> Tensor:
    """``S_t``: how much the sampled token's probability depends on the image. ``[B, T]`` ->
    ``[B, T]``, in nats, in [0, 10]; ``logp`` given the real image, ``masked_logp`` given the
    blackened one (both natural-log probabilities of the same tokens)."""
    return kl.k3(logp, masked_logp).clamp_min(0.0)


def select_perception_tokens(dependency: Tensor, mask: Tensor, fraction: float) -> Tensor:
    """1 on the ``ceil(L_i * fraction)`` trained tokens of highest dependency of each row
    (``L_i = mask[i].sum()``), 0 elsewhere; ties go to the earlier token. ``[B, T]`` -> ``[B, T]``
    (dtype of ``mask``). ``fraction`` in (0, 1]."""
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction={fraction} must be in (0, 1] (algorithm.top_p_perception_tokens)")
    valid = mask > 0
    keep = torch.ceil(valid.sum(dim=1) * fraction).long()  # [B]
    scores = dependency.masked_fill(~valid, float("-inf"))
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices
    ranks = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
    return ((ranks < keep[:, None]) & valid).to(mask.dtype)


def sequence_scores(dependency: Tensor, mask: Tensor) -> Tensor:
    """``s_i``: each row's mean dependency over its trained tokens. ``[B, T]`` -> ``[B]``."""
    return masked_mean(dependency, mask, dim=1)


def advantage_scale(dependency: Tensor, mask: Tensor, scaling_min: float) -> Tensor:
    """``alpha_i``, the factor of row ``i``'s advantages (module docstring). ``[B, T]`` -> ``[B]``.

    Rows without trained tokens get 1, and so does every row when fewer than two rows have
    tokens or their scores spread less than 1e-6 (nothing to rank them by)."""
    if not 0 <= scaling_min <= 1:
        raise ValueError(f"scaling_min={scaling_min} must be in [0, 1] (algorithm.advantage_scaling_min)")
    scores = sequence_scores(dependency, mask)
    valid = mask.sum(dim=1) > 0
    factor = torch.ones_like(scores)
    if int(valid.sum()) < 2:
        return factor
    low, high = scores[valid].min(), scores[valid].max()
    if float(high - low) <= _SHAPING_MIN_RANGE:
        return factor
    normalised = ((scores[valid] - low) / (high - low)).clamp(0.0, 1.0)
    factor[valid] = scaling_min + normalised * (1.0 - scaling_min) / (normalised.mean() + _SHAPING_EPS)
    return factor


def sampled_entropy(logp: Tensor, mask: Tensor) -> Tensor:
    """``mean_t(-log p(y_t))`` over trained tokens: the sampled-token entropy estimate the
    penalty scales (VPPO's ``entropy_loss``). ``[B, T]`` -> scalar, with gradient."""
    return masked_mean(-logp, mask)


def dependency_metrics(dependency: Tensor, mask: Tensor, selected: Tensor) -> dict[str, Tensor]:
    """``vppo/*`` statistics of one batch: the selected fraction of trained tokens, the mean
    dependency over all, selected and rejected trained tokens."""
    rejected = mask * (1 - selected)
    return {
        "vppo/selected_fraction": selected.sum() / mask.sum().clamp_min(1),
        "vppo/dependency_mean": masked_mean(dependency, mask),
        "vppo/dependency_mean_selected": masked_mean(dependency, selected),
        "vppo/dependency_mean_rejected": masked_mean(dependency, rejected),
    }
