"""Reward functions with EasyR1's interface, run in a guarded process pool.

A batch reward function takes ``list[dict]`` (keys ``response``, ``response_length``,
``ground_truth``) plus ``**rollout.reward.kwargs`` and returns ``list[dict]`` with the key
``overall`` (the scalar reward) and any named components (floats); a sequential one takes
and returns one dict. :class:`RewardPool` runs it in worker processes,
:class:`RewardScorer` turns its outputs into rewards.
"""

from async_rl.rewards.pool import RewardCallError, RewardError, RewardPool, RewardTimeout, RewardWorkerDied
from async_rl.rewards.registry import REWARDS, RewardFunction, builtin_names, load_reward_function
from async_rl.rewards.scoring import (
    RewardCounters,
    RewardOutputError,
    RewardScorer,
    RewardStartupError,
    Score,
    check_reward_function,
    score_output,
)

from async_rl.rewards import builtin as _builtin  # noqa: E402,F401 - registers the built-in reward functions

__all__ = [
    "REWARDS",
    "RewardCallError",
    "RewardCounters",
    "RewardError",
    "RewardFunction",
    "RewardOutputError",
    "RewardPool",
    "RewardScorer",
    "RewardStartupError",
    "RewardTimeout",
    "RewardWorkerDied",
    "Score",
    "builtin_names",
    "check_reward_function",
    "load_reward_function",
    "score_output",
]
