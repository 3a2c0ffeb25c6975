"""Policy losses with off-policy correction, KL-to-reference and entropy terms.

Shapes: ``B`` sequences, ``T`` response tokens; every per-token tensor is ``[B, T]`` and ``mask``
is 1 for trained tokens. Each sampled token has three log-probabilities: the current policy's
``logp`` (``pi_theta``, with gradient), the proximal policy's ``old_logp`` (``pi_prox``, recomputed
by the learner) and the sampler's ``behav_logp`` (``mu``, from vLLM).

A registered loss maps ``(logp, prox_logp, advantages, mask, options)`` to a per-token surrogate
(:class:`PolicyTerms`). :func:`compute` then applies the off-policy correction, which is the same
for every loss:

* the importance weight ``w`` (``is_level``): ``pi_train / mu`` per token, or its product over the
  sequence, truncated at ``is_cap`` and detached (truncated IS, Yao et al.,
  https://fengyao.notion.site/off-policy-rl);
* rejection (``mask_level``): tokens, or whole sequences, whose token ratio, summed log-ratio
  (sequence) or geometric-mean ratio falls outside ``[mask_lower, mask_upper]`` leave the mask
  (masked IS, https://richardli.xyz/rl-collapse; verl ``rollout_corr_helper``).

``pi_train`` is ``pi_prox`` for every loss except the bypass loss ``tis``, which has no recomputed
``pi_prox`` (``pi_prox := mu``) and corrects with the detached current policy instead, as verl's
bypass mode does. The per-token loss is ``w * surrogate``, aggregated over the surviving mask by
``agg_mode``; ``kl_coef * KL(pi_theta || pi_ref)`` and ``-entropy_coef * entropy`` are added when
their inputs are given.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from async_rl.plugins import Registry

from . import kl
from ._masked import masked_mean
from .options import AGG_MODES, LOSS_KEY, LossOptions, is_user_spec, loss_info, user_algorithm

# verl's SAFETY_BOUND: log-ratios are clamped to +-20 before exp so weights stay finite in float32.
_LOG_RATIO_BOUND = 20.0


@dataclass(frozen=True)
class PolicyTerms:
    """A loss's per-token surrogate and where it clipped; all ``[B, T]``."""

    loss: Tensor
    """Per-token loss before importance weighting and aggregation."""
    clipped: Tensor
    """Bool: the token's loss is the clipped branch (PPO clip / CISPO weight clip)."""
    clipped_lower: Tensor
    """Bool: the token's loss is the dual-clip bound (negative advantages only)."""


PolicyLoss = Callable[[Tensor, Tensor, Tensor, Tensor, LossOptions], PolicyTerms]

_REGISTRY: Registry[PolicyLoss] = Registry("policy loss")
register = _REGISTRY.register
"""Register a policy loss ``fn(logp, prox_logp, advantages, mask, options) -> PolicyTerms``;
how it anchors and weights is its :data:`~async_rl.algos.options.LOSSES` entry."""
names = _REGISTRY.names


def compute(
    name: str,
    *,
    logp: Tensor,
    old_logp: Tensor | None,
    behav_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: Mapping[str, Any] | object | None = None,
    ref_logp: Tensor | None = None,
    entropy: Tensor | None = None,
    token_weight: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Scalar loss and float metrics for policy loss ``name`` (one of :func:`names`).

    Args:
        logp: ``[B, T]`` current policy log-probabilities (carries the gradient).
        old_logp: ``[B, T]`` proximal policy log-probabilities; may be None for the bypass loss ``tis``.
        behav_logp: ``[B, T]`` behaviour (sampler) log-probabilities.
        advantages: ``[B, T]`` per-token advantages.
        mask: ``[B, T]`` 1 for trained tokens.
        config: a dict or an object with :class:`LossOptions` names; missing names take defaults.
        ref_logp: ``[B, T]`` reference policy log-probabilities; when given, ``kl_loss`` is logged
            and ``kl_coef * kl_loss`` added. Required when ``kl_coef != 0``.
        entropy: ``[B, T]`` per-token entropy of ``pi_theta`` with gradient (e.g.
            :func:`entropy_from_logits`); when given, ``entropy`` is logged and
            ``entropy_coef * entropy`` subtracted. Required when ``entropy_coef != 0``.
        token_weight: ``[B, T]`` factor of each token's policy-gradient term (VPPO's perception
            token selection: 0 takes a token out of the gradient); the aggregation's
            denominators still count every trained token, as VPPO's.

    Returns:
        ``(loss, metrics)``; metrics: ``pg_loss``, ``pg_clipfrac``, ``pg_clipfrac_lower``,
        ``ppo_kl``, ``is_weight_mean``, ``is_weight_max``, ``is_ess``, ``masked_fraction``,
        ``is_clipped_fraction`` (share of the valid tokens whose weight was truncated at
        ``is_cap``), ``behav_kl``, plus ``kl_loss`` / ``entropy`` when those inputs are given.
    """
    options = LossOptions.from_any(config)
    user = is_user_spec(name)
    fn = user_algorithm(name, LOSS_KEY) if user else _REGISTRY.get(name)
    info = loss_info(name)
    mask = mask.to(logp.dtype)
    if info.bypass:
        prox_logp, train_logp = behav_logp, logp.detach()
    elif old_logp is None:
        raise ValueError(f"policy loss {name!r} needs old_logp (the proximal policy)")
    else:
        prox_logp = train_logp = old_logp
    behav_log_ratio = (train_logp - behav_logp).detach()
    level = "token" if info.behaviour_weight and options.is_level == "none" else options.is_level
    uncapped = importance_weight(behav_log_ratio, mask, level, None)
    weight = uncapped if options.is_cap is None else uncapped.clamp_max(options.is_cap)
    keep = mask * rejection_mask(behav_log_ratio, mask, options.mask_level, options.mask_lower, options.mask_upper)

    terms = fn(logp, prox_logp, advantages, keep, options)
    if user:
        terms = _user_terms(name, terms, tuple(logp.shape))
    pg_loss = aggregate(terms.loss * weight * (1.0 if token_weight is None else token_weight), keep, options.agg_mode)
    metrics = {
        "pg_loss": pg_loss,
        "pg_clipfrac": masked_mean(terms.clipped.to(keep.dtype), keep),
        "pg_clipfrac_lower": masked_mean(terms.clipped_lower.to(keep.dtype), keep),
        "ppo_kl": masked_mean(prox_logp - logp, keep),
        **_correction_metrics(weight, mask, keep),
        "is_clipped_fraction": masked_mean((uncapped > weight).to(mask.dtype), mask),
        "behav_kl": masked_mean(kl.estimate("k3", behav_logp, train_logp), mask),
    }
    loss = pg_loss
    if ref_logp is not None:
        metrics["kl_loss"] = aggregate(kl.estimate(options.kl_kind, logp, ref_logp), keep, options.agg_mode)
        loss = loss + options.kl_coef * metrics["kl_loss"]
    elif options.kl_coef != 0:
        raise ValueError("kl_coef != 0 needs ref_logp")
    if entropy is not None:
        metrics["entropy"] = aggregate(entropy, keep, options.agg_mode)
        loss = loss - options.entropy_coef * metrics["entropy"]
    elif options.entropy_coef != 0:
        raise ValueError("entropy_coef != 0 needs entropy")
    return loss, {key: float(value.detach()) for key, value in metrics.items()}


def _user_terms(name: str, terms: Any, shape: tuple[int, ...]) -> PolicyTerms:
    """A user loss's per-token loss (nothing clipped) or :class:`PolicyTerms`, checked to be ``[B, T]``."""
    if isinstance(terms, Tensor):
        none = torch.zeros(shape, dtype=torch.bool, device=terms.device)
        terms = PolicyTerms(terms, none, none)
    if not isinstance(terms, PolicyTerms) or tuple(terms.loss.shape) != shape:
        got = tuple(terms.loss.shape) if isinstance(terms, PolicyTerms) else type(terms).__name__
        raise ValueError(f"{LOSS_KEY}={name!r} returned {got}: expected the per-token loss [B, T] = {shape} (a tensor or PolicyTerms)")
    return terms


def _correction_metrics(weight: Tensor, mask: Tensor, keep: Tensor) -> dict[str, Tensor]:
    """Weight mean/max and ESS over the valid tokens, and the rejected fraction of them.

    ``is_ess = 1 / mean(w~^2)`` with ``w~ = w / mean(w)``, i.e. ``mean(w)^2 / mean(w^2)`` (verl
    ``rollout_is_eff_sample_size``): 1 for equal weights, towards 0 as a few tokens dominate.
    """
    weight = weight.detach()
    weight_mean = masked_mean(weight, mask)
    return {
        "is_weight_mean": weight_mean,
        "is_weight_max": torch.where(mask > 0, weight, torch.zeros_like(weight)).max(),
        "is_ess": weight_mean.square() / masked_mean(weight.square(), mask).clamp_min(torch.finfo(weight.dtype).tiny),
        "masked_fraction": 1 - keep.sum() / mask.sum().clamp_min(1),
    }


def _level_log_ratio(log_ratio: Tensor, mask: Tensor, level: str) -> Tensor:
    """Log-ratio at ``level``: per token, summed over the sequence, or its per-sequence mean (geometric).

    Shapes: ``[B, T]`` -> ``[B, T]`` (sequence levels broadcast over the sequence's tokens).
    """
    if level == "token":
        return log_ratio
    total = (log_ratio * mask).sum(-1, keepdim=True)
    if level == "sequence":
        return total.expand_as(log_ratio)
    if level == "geometric":
        return (total / mask.sum(-1, keepdim=True).clamp_min(1)).expand_as(log_ratio)
    raise ValueError(f"unknown level {level!r}")


def importance_weight(log_ratio: Tensor, mask: Tensor, level: str, cap: float | None) -> Tensor:
    """Detached truncated importance weight ``min(exp(log_ratio at level), cap)``.

    Shapes: ``log_ratio`` (``log pi_train - log mu``), ``mask`` ``[B, T]`` -> ``[B, T]``.
    ``level``: "token", "sequence" (product of the token ratios) or "none" (all ones).
    Sources: TIS, Yao et al. (https://fengyao.notion.site/off-policy-rl); verl
    ``compute_rollout_correction_weights`` (log-ratio clamped to +-20 before exp).
    """
    if level == "none":
        return torch.ones_like(log_ratio)
    bounded = _level_log_ratio(log_ratio.detach(), mask, level).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    weight = torch.exp(bounded)
    return weight if cap is None else weight.clamp_max(cap)


def rejection_mask(log_ratio: Tensor, mask: Tensor, level: str, lower: float, upper: float) -> Tensor:
    """1 where the ratio at ``level`` lies in ``[lower, upper]``, else 0 (masked importance sampling).

    Shapes: ``log_ratio`` (``log pi_train - log mu``), ``mask`` ``[B, T]`` -> ``[B, T]`` float.
    ``level``: "token", "sequence" (``sum_t log ratio``), "geometric" (``mean_t log ratio``) or
    "none" (all ones). Compared in log space, so long sequences cannot overflow.
    Sources: masked importance sampling (MIS), Liu, Yao et al., "When Speed Kills Stability"
    (https://richardli.xyz/rl-collapse); verl ``rollout_corr_helper.compute_rollout_rejection_mask``.
    """
    if level == "none":
        return torch.ones_like(log_ratio)
    level_log_ratio = _level_log_ratio(log_ratio.detach(), mask, level)
    log_lower = math.log(lower) if lower > 0 else -math.inf
    inside = (level_log_ratio >= log_lower) & (level_log_ratio <= math.log(upper))
    return inside.to(log_ratio.dtype)


def _sequence_reduce(mode: str, loss_mat: Tensor, mask: Tensor) -> Tensor:
    """Per-sequence loss ``[B]`` for the "seq-mean-*" aggregation modes."""
    token_sum = (loss_mat * mask).sum(-1)
    if mode == "seq-mean-token-sum":
        return token_sum
    if mode == "seq-mean-token-mean":
        return token_sum / mask.sum(-1).clamp_min(1)
    if mode == "seq-mean-token-sum-norm":
        return token_sum / mask.shape[-1]
    raise ValueError(f"unknown agg_mode {mode!r}; valid modes: {AGG_MODES}")


def aggregate(loss_mat: Tensor, mask: Tensor, mode: str) -> Tensor:
    """Scalar from a per-token loss ``[B, T]`` under ``mask`` ``[B, T]``.

    "token-mean": ``sum(L m) / sum(m)``. "seq-mean-token-sum": mean over sequences of
    ``sum_t L m``. "seq-mean-token-mean": mean over sequences of ``sum_t L m / sum_t m``.
    "seq-mean-token-sum-norm": mean over sequences of ``sum_t L m / T`` (Dr. GRPO's constant
    normaliser, arXiv:2503.20783; verl's variant sums over sequences instead of averaging).
    Sequence means run over sequences with at least one trained token; an empty mask gives 0.
    Source: verl ``core_algos.agg_loss``.
    """
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    per_sequence = _sequence_reduce(mode, loss_mat, mask)
    return per_sequence.sum() / (mask.sum(-1) > 0).sum().clamp_min(1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Per-token entropy ``logsumexp(z) - sum softmax(z) z``: ``[B, T, V]`` -> ``[B, T]``, with gradient.

    Source: verl ``verl/utils/torch_functional.entropy_from_logits``.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


def _clipped_surrogate(log_ratio: Tensor, advantages: Tensor, options: LossOptions) -> PolicyTerms:
    """PPO's pessimistic clipped surrogate on ``ratio = exp(log_ratio)``, with clip-higher and dual-clip.

    ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``; for ``A < 0`` and ``clip_c`` set, also
    ``min(., -A clip_c)``. Shapes ``[B, T]``. Source: verl ``compute_policy_loss_vanilla``.
    """
    ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - options.clip_low, 1 + options.clip_high)
    loss = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    if options.clip_c is None:
        return PolicyTerms(loss, is_clipped, torch.zeros_like(is_clipped))
    bound = -advantages * options.clip_c
    negative = advantages < 0
    is_clipped_lower = negative & (loss > bound)
    return PolicyTerms(torch.where(negative, torch.minimum(loss, bound), loss), is_clipped, is_clipped_lower)


@register("ppo")
def ppo(logp: Tensor, prox_logp: Tensor, advantages: Tensor, mask: Tensor, options: LossOptions) -> PolicyTerms:
    """PPO clip on ``r = pi_theta / pi_prox`` with separate ``clip_low`` / ``clip_high`` and optional dual-clip.

    Options: ``clip_low``, ``clip_high``, ``clip_c``. Shapes ``[B, T]``.
    Sources: Schulman et al. (arXiv:1707.06347); clip-higher, DAPO (arXiv:2503.14476); dual-clip,
    Ye et al. (arXiv:1912.09729); verl ``compute_policy_loss_vanilla``.
    """
    del mask  # token-level: no sequence reduction
    return _clipped_surrogate(logp - prox_logp, advantages, options)


@register("decoupled_ppo")
def decoupled_ppo(
    logp: Tensor, prox_logp: Tensor, advantages: Tensor, mask: Tensor, options: LossOptions
) -> PolicyTerms:
    """Decoupled PPO: PPO clip on ``pi_theta / pi_prox``, times the detached weight ``min(pi_prox / mu, is_cap)``.

    The weight is applied by :func:`compute` (at ``is_level``, "token" when that is "none").
    AReaL drops tokens whose weight exceeds the cap instead of truncating; that is
    ``mask_level="token"`` with ``mask_upper=is_cap`` here. Options: as ``ppo``, plus ``is_cap``.
    Shapes ``[B, T]``. Sources: Fu et al., AReaL (arXiv:2505.24298), Hilton et al. (arXiv:2110.00641);
    AReaL ``areal/utils/functional.py::ppo_actor_loss_fn``.
    """
    return ppo(logp, prox_logp, advantages, mask, options)


@register("tis")
def tis(logp: Tensor, prox_logp: Tensor, advantages: Tensor, mask: Tensor, options: LossOptions) -> PolicyTerms:
    """Bypass mode: ``pi_prox := mu``, PPO clip on ``pi_theta / mu`` (no recompute of ``pi_prox``).

    The clipped ratio truncates the importance ratio itself, so ``is_level`` stays "none" unless a
    second weight ``sg(pi_theta) / mu`` is wanted; rejection (``mask_level``) compares
    ``sg(pi_theta) / mu``. Options: as ``ppo``. Shapes ``[B, T]``.
    Sources: Yao et al., TIS (https://fengyao.notion.site/off-policy-rl); verl
    ``compute_policy_loss_bypass_mode`` (loss_type "ppo_clip").
    """
    return ppo(logp, prox_logp, advantages, mask, options)


@register("gspo")
def gspo(logp: Tensor, prox_logp: Tensor, advantages: Tensor, mask: Tensor, options: LossOptions) -> PolicyTerms:
    """GSPO: clip on the sequence ratio ``s_i = exp(mean_t log(pi_theta / pi_prox))``, token-level
    straight-through form ``s_i,t = sg(s_i) pi_theta / sg(pi_theta)``.

    Options: ``clip_low``, ``clip_high`` (the paper uses ~3e-4 / 4e-4), ``clip_c``. The paper's
    objective aggregates with ``agg_mode="seq-mean-token-mean"``. Shapes ``[B, T]``.
    Sources: Zheng et al., GSPO (arXiv:2507.18071); verl ``compute_policy_loss_gspo``.
    """
    sequence_log_ratio = _level_log_ratio(logp - prox_logp, mask, "geometric")
    return _clipped_surrogate(logp - logp.detach() + sequence_log_ratio.detach(), advantages, options)


@register("cispo")
def cispo(logp: Tensor, prox_logp: Tensor, advantages: Tensor, mask: Tensor, options: LossOptions) -> PolicyTerms:
    """CISPO: ``-sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log pi_theta`` with ``r = pi_theta / pi_prox``.

    Every token keeps a gradient; clipping only bounds its weight (MiniMax-M1 leaves the lower
    side open: set ``clip_low`` near 1). ``clip_c`` does not apply. Shapes ``[B, T]``.
    Sources: MiniMax-M1 (arXiv:2506.13585); verl ``compute_policy_loss_cispo``.
    """
    del mask  # token-level: no sequence reduction
    ratio = torch.exp((logp - prox_logp).detach().clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))
    weight = ratio.clamp(1 - options.clip_low, 1 + options.clip_high)
    return PolicyTerms(-weight * advantages * logp, weight != ratio, torch.zeros_like(ratio, dtype=torch.bool))


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, cliprange: float | None, agg_mode: str = "token-mean"
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss of a critic: ``0.5 * agg(max((v - R)^2, (clip(v, v_old +- c) - R)^2))``.

    Shapes: ``values`` (current critic, with gradient), ``old_values`` (the critic that computed
    the returns), ``returns`` (targets, e.g. GAE's ``A + V``) and ``mask`` all ``[B, T]``.
    ``cliprange`` ``c`` is absolute (value units); ``None`` turns clipping off. ``agg_mode`` as in
    :func:`aggregate`. Metrics (detached scalars): ``vf_loss``, ``vf_clipfrac`` (share of trained
    tokens where the clipped term is the larger), ``explained_variance``, ``value_mean``,
    ``return_mean``. Source: verl ``core_algos.compute_value_loss`` (PPO2's clipped value loss).
    """
    if agg_mode not in AGG_MODES:
        raise ValueError(f"unknown agg_mode {agg_mode!r}; valid modes: {AGG_MODES}")
    if cliprange is not None and not cliprange > 0:
        raise ValueError(f"cliprange must be > 0 or None, got {cliprange!r}")
    mask = mask.to(values.dtype)
    unclipped = (values - returns).square()
    if cliprange is None:
        clipped = unclipped
    else:
        # clamp to [v_old - c, v_old + c] rather than v_old + clamp(v - v_old): inside the range it
        # is v itself, so rounding never counts a token as clipped
        clipped = (torch.clamp(values, old_values - cliprange, old_values + cliprange) - returns).square()
    loss = 0.5 * aggregate(torch.maximum(unclipped, clipped), mask, agg_mode)
    with torch.no_grad():
        metrics = {
            "vf_loss": loss.detach(),
            "vf_clipfrac": masked_mean((clipped > unclipped).to(values.dtype), mask),
            "explained_variance": explained_variance(values, returns, mask),
            "value_mean": masked_mean(values, mask),
            "return_mean": masked_mean(returns, mask),
        }
    return loss, metrics


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """``1 - Var(R - v) / Var(R)`` over trained tokens (unbiased variances): 1 for a perfect critic,
    0 for one that predicts the mean, negative for worse. ``[B, T]`` -> scalar; 0 when ``Var(R)``
    is 0 or fewer than two tokens are trained. Source: verl ``critic/vf_explained_var``."""
    mask = mask.to(returns.dtype)
    denom = (mask.sum() - 1).clamp_min(1)

    def var(x: Tensor) -> Tensor:
        return ((x - masked_mean(x, mask)).square() * mask).sum() / denom

    var_returns = var(returns)  # 0 with fewer than two trained tokens
    ratio = var(returns - values) / var_returns.clamp_min(torch.finfo(returns.dtype).tiny)
    return torch.where(var_returns > 0, 1 - ratio, torch.zeros_like(ratio))  # no host sync
