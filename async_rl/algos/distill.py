"""On-policy distillation: the per-token reverse KL to a teacher as the advantage.

The student samples a response; a teacher scores the same tokens (its log-probability of
each, given the prompt and the tokens before it). The per-token reverse KL estimate
``log mu(y_t) - log p_teacher(y_t)`` (``mu``: the sampler, the policy that drew ``y_t``) is
minimised by policy gradient with the advantage ``log p_teacher(y_t) - log mu(y_t)``: tokens
the teacher finds likelier than the student are reinforced, the others pushed down. It is a
dense signal (one per token, not one per response), which is why distillation needs far
fewer samples than RL from a scalar reward (Agarwal et al. 2024, GKD; Thinking Machines,
"On-Policy Distillation", 2025). The advantage is a constant of the loss, so the policy loss's
off-policy correction (``algorithm.loss``) applies to it as to any other.
"""

from __future__ import annotations

from torch import Tensor

from ._masked import masked_mean


def distill_advantages(reward_advantages: Tensor, teacher_logp: Tensor, behav_logp: Tensor, mask: Tensor,
                       coef: float, reward_coef: float) -> Tensor:
    """``(reward_coef * reward_advantages + coef * (teacher_logp - behav_logp)) * mask``.

    Shapes: every tensor ``[N, T]`` (response tokens, right-padded; ``mask`` 1 on trained
    tokens) -> ``[N, T]``, 0 off the mask. Log-probabilities in nats; no gradient flows.
    """
    shapes = {t.shape for t in (reward_advantages, teacher_logp, behav_logp, mask)}
    if len(shapes) != 1 or reward_advantages.dim() != 2:
        raise ValueError(f"distillation needs four [N, T] tensors of one shape, got {[tuple(t.shape) for t in (reward_advantages, teacher_logp, behav_logp, mask)]}")
    return ((reward_coef * reward_advantages + coef * (teacher_logp - behav_logp)) * mask).detach()


def reverse_kl(teacher_logp: Tensor, behav_logp: Tensor, mask: Tensor) -> float:
    """The mean per-token reverse KL estimate ``log mu - log p_teacher`` over the trained
    tokens (nats per token; ``[N, T]`` inputs): what distillation drives down."""
    return float(masked_mean(behav_logp - teacher_logp, mask))
