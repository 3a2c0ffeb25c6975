"""The built-in environments, played by a scripted model through the real episode runner and environment process."""

from __future__ import annotations

import asyncio

import pytest

from async_rl.config import EnvConfig
from async_rl.envs import EnvPool, load_environment, make_environment, run_episode
from async_rl.envs.builtin import NOT_A_NUMBER

ROW = {"problem": "What is 12+30?", "answer": "42"}


def _play(replies: list[str], max_turns: int = 4, **kwargs):
    said = iter(replies)

    async def act(messages):
        return next(said)

    async def go():
        async with EnvPool(EnvConfig(name="addition_feedback", kwargs=kwargs, num_workers=1)) as pool:
            env = pool.open()
            try:
                return await run_episode(env, act, max_turns=max_turns, row=ROW)
            finally:
                env.close()

    return asyncio.run(go())


def test_addition_feedback_says_higher_or_lower_and_rewards_an_early_win():
    t = _play(["40", "45", "42"])
    assert t.states == ["What is 12+30?", "Higher.", "Lower."] and t.done and t.success
    assert t.rewards == [0.0, 0.0, 0.5] and t.total_reward("sum") == 0.5
    assert _play(["42"]).total_reward("sum") == 1.0


def test_addition_feedback_asks_for_a_number_and_the_turn_limit_is_a_loss():
    t = _play(["forty-two", "41"], max_turns=2)
    assert t.states[1] == NOT_A_NUMBER and not t.done and not t.success and t.total_reward("sum") == 0.0


def test_addition_feedback_rejects_a_row_without_an_integer_answer():
    env = make_environment(load_environment("addition_feedback"), {})
    with pytest.raises(ValueError, match="integer 'answer'"):
        env.reset({"problem": "What is x?", "answer": "x"})
