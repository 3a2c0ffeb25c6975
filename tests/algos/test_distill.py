"""On-policy distillation (``algos/distill.py``): the advantage (the teacher's per-token
log-ratio to the sampler, weighted with the reward's advantage) and the top-k forward KL, zero
off the mask, shapes checked."""

from __future__ import annotations

import pytest
import torch

from async_rl.algos.distill import distill_advantages, reverse_kl, top_k_forward_kl


def test_the_advantage_is_the_teachers_log_ratio_plus_the_weighted_reward_advantage():
    reward_adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
    teacher = torch.tensor([[-1.0, -0.5, -2.0], [-3.0, -1.0, 0.0]])
    behav = torch.tensor([[-2.0, -0.5, -1.0], [-1.0, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = distill_advantages(reward_adv, teacher, behav, mask, coef=2.0, reward_coef=0.5)
    assert adv.tolist() == [[2.5, 0.5, -1.5], [-4.5, -0.5, 0.0]]
    assert distill_advantages(reward_adv, teacher, behav, mask, coef=1.0, reward_coef=0.0).tolist() == [[1.0, 0.0, -1.0], [-2.0, 0.0, 0.0]]
    assert reverse_kl(teacher, behav, mask) == pytest.approx((-1.0 + 0.0 + 1.0 + 2.0 + 0.0) / 5)
    with pytest.raises(ValueError, match="four \\[N, T\\] tensors of one shape"):
        distill_advantages(reward_adv, teacher[:, :2], behav, mask, 1.0, 0.0)


def test_the_top_k_forward_kl_is_the_teachers_cross_entropy_less_its_entropy_with_its_gradient():
    """Per position ``sum_j p_T(j) (log p_T(j) - log pi(j))`` over the teacher's top k; its
    gradient in the student's logits is ``sum_j p_T(j) (pi - onehot_j)``; 0 off the mask."""
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 6, requires_grad=True)
    student = torch.log_softmax(logits, -1)
    ids = torch.tensor([[[0, 1], [2, 3], [4, 5]], [[1, 0], [5, 5], [3, 2]]])
    teacher = torch.log(torch.tensor([[[0.6, 0.3], [0.5, 0.1], [0.9, 0.05]], [[0.7, 0.2], [0.4, 0.4], [0.5, 0.5]]]))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    kl = top_k_forward_kl(student.gather(-1, ids), teacher, mask)
    expected = (teacher.exp() * (teacher - student.detach().gather(-1, ids))).sum(-1) * mask
    torch.testing.assert_close(kl.detach(), expected)
    assert kl[0, 2] == 0
    kl[1, 0].backward()
    target = torch.zeros(6).index_add_(0, ids[1, 0], teacher[1, 0].exp())
    torch.testing.assert_close(logits.grad[1, 0], target.sum() * student[1, 0].detach().exp() - target)
    with pytest.raises(ValueError, match=r"\[N, T, K\]"):
        top_k_forward_kl(student.gather(-1, ids), teacher[..., :1], mask)
