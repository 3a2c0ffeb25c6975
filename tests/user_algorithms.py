"""A user's own estimator and loss, as the source of a file the tests write and name in the config
(``path/to/file.py:function``, docs/algorithms.md)."""

USER_ALGORITHMS = '''
import torch

from async_rl.algos.options import estimator, policy_loss

CALLS = []


@estimator(group=True, options=("eps",))
def centred(rewards, response_mask, group_index, eps):
    """Reward minus its group's mean, over the group's spread plus eps, on every response token."""
    CALLS.append("centred")
    groups = int(group_index.max()) + 1
    count = torch.zeros(groups).index_add_(0, group_index, torch.ones_like(rewards))
    mean = torch.zeros(groups).index_add_(0, group_index, rewards) / count
    score = (rewards - mean[group_index]) / (rewards.std() + eps)
    return score[:, None] * response_mask


@policy_loss()
def plain_pg(logp, prox_logp, advantages, mask, options):
    """The unclipped surrogate -A * pi_theta / pi_prox, per token."""
    CALLS.append("plain_pg")
    return -advantages * torch.exp(logp - prox_logp.detach())


def one_column(rewards, response_mask, group_index):
    return rewards[:, None]


def two_arguments(rewards, response_mask):
    return rewards


@estimator(group=False, options=("temperature",))
def unknown_option(rewards, response_mask, group_index, temperature):
    return rewards


not_a_function = 3
'''
