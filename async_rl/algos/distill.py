"""On-policy distillation: the per-token reverse KL to a teacher as the advantage, or the
forward KL over the teacher's top-k at each position as a loss term.

The student samples a response; a teacher scores the same tokens (its log-probability of
each, given the prompt and the tokens before it). The per-token reverse KL estimate
``log mu(y_t) - log p_teacher(y_t)`` (``mu``: the sampler, the policy that drew ``y_t``) is
minimised by policy gradient with the advantage ``log p_teacher(y_t) - log mu(y_t)``: tokens
the teacher finds likelier than the student are reinforced, the others pushed down. It is a
dense signal (one per token, not one per response), which is why distillation needs far
fewer samples than RL from a scalar reward (Agarwal et al. 2024, GKD; Thinking Machines,
"On-Policy Distillation", 2025). The advantage is a constant of the loss, so the policy loss's
off-policy correction (``algorithm.loss``) applies to it as to any other.

With ``algorithm.distill.top_k`` the teacher also gives its k likeliest tokens at each
position of the student's sample, and the student is trained towards that distribution
directly: :func:`top_k_forward_kl` per position, ``sum_j p_T(j) (log p_T(j) - log pi(j))``
over the teacher's top k (GKD's on-policy distillation with the forward KL, Agarwal et al.
2024). A sampled token tells the student one log-ratio a position, with the sign of a noisy
estimate; the top-k tells it where the teacher's mass is, so its gradient has no sampling
noise (on the tiny addition task the sampled estimator's gradient norm was 7-11 against
GRPO's 1-3, its mean advantage about -0.6: most of the step pushed sampled tokens down).
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


def top_k_forward_kl(student_top_logp: Tensor, teacher_top_logp: Tensor, mask: Tensor) -> Tensor:
    """Per token, the forward KL from the teacher's top-k to the student:
    ``sum_j exp(t_j) (t_j - s_j)`` over the teacher's k likeliest tokens ``j`` (the teacher's
    mass outside them is left out), 0 off the mask.

    Shapes: ``student_top_logp`` (differentiable) and ``teacher_top_logp`` ``[N, T, K]``,
    ``mask`` ``[N, T]`` -> ``[N, T]``; natural log. Its gradient in the student's logits at a
    position is ``sum_j p_T(j) (pi - onehot_j)``: towards the teacher's distribution.
    """
    if student_top_logp.shape != teacher_top_logp.shape or student_top_logp.dim() != 3 or student_top_logp.shape[:2] != mask.shape:
        raise ValueError(f"the top-k forward KL needs [N, T, K] log-probs of one shape and an [N, T] mask, got "
                         f"{tuple(student_top_logp.shape)}, {tuple(teacher_top_logp.shape)}, {tuple(mask.shape)}")
    teacher = teacher_top_logp.detach()
    return (teacher.exp() * (teacher - student_top_logp)).sum(-1) * mask
