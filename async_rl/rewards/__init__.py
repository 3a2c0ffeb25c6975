"""Reward functions with EasyR1's batch interface.

A reward function takes ``list[dict]`` (keys ``response``, ``response_length``,
``ground_truth``) and returns ``list[dict]`` with the key ``overall`` (the scalar reward)
and any named components (floats).
"""

from async_rl.rewards.registry import RewardFunction, builtin_names, load_reward_function

__all__ = ["RewardFunction", "builtin_names", "load_reward_function"]
