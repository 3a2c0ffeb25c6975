"""On-policy distillation's advantage (``algos/distill.py``): the teacher's per-token log-ratio
to the sampler, weighted with the reward's advantage, zero off the mask, shapes checked."""

from __future__ import annotations

import pytest
import torch

from async_rl.algos.distill import distill_advantages, reverse_kl


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
