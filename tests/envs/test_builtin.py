"""The built-in environments, played by a scripted model through the real episode runner and environment process."""

from __future__ import annotations

import asyncio
import time

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


def test_the_slow_tool_waits_its_drawn_latency_and_episodes_wait_side_by_side():
    """addition_slow_feedback in a real environment process: each step sleeps its draw (here a
    constant 0.3 s: median = p99), and 16 episodes of 3 steps wait together, not one after another."""
    kwargs = {"latency_median_s": 0.3, "latency_p99_s": 0.3}

    async def episode(pool):
        said = iter(["40", "45", "41"])

        async def act(messages):
            return next(said)

        env = pool.open()
        try:
            return await run_episode(env, act, max_turns=3, row=ROW)
        finally:
            env.close()

    async def go():
        async with EnvPool(EnvConfig(name="addition_slow_feedback", kwargs=kwargs, num_workers=1)) as pool:
            t0 = time.monotonic()
            one = await episode(pool)
            alone = time.monotonic() - t0
            t0 = time.monotonic()
            many = await asyncio.gather(*(episode(pool) for _ in range(16)))
            return one, alone, many, time.monotonic() - t0

    one, alone, many, together = asyncio.run(go())
    assert one.states == ["What is 12+30?", "Higher.", "Lower."] and not one.success
    assert [info["tool_wait_s"] for info in one.infos] == pytest.approx([0.3] * 3)
    assert alone >= 0.9 and one.step_s >= 0.9
    assert all(t.step_s >= 0.9 for t in many) and together < 0.9 * 4, together


def test_the_slow_tool_latency_is_lognormal_with_its_median_and_p99():
    env = make_environment(load_environment("addition_slow_feedback"), {"latency_seed": 7})
    env.reset(ROW)
    draws = sorted(env.latency_s() for _ in range(20000))
    assert draws[10000] == pytest.approx(0.3, rel=0.05) and draws[19800] == pytest.approx(3.0, rel=0.12)
    seeded = [make_environment(load_environment("addition_slow_feedback"), {"latency_seed": 7}) for _ in range(3)]
    seeded[0].reset(ROW), seeded[1].reset(ROW), seeded[2].reset({"problem": "What is 1+2?", "answer": "3"})
    first = [env.latency_s() for env in seeded]
    assert first[0] == first[1] != first[2], "a seed makes an episode's waits a function of its problem"
    with pytest.raises(ValueError, match="latency_median_s <= latency_p99_s"):
        make_environment(load_environment("addition_slow_feedback"), {"latency_median_s": 2.0, "latency_p99_s": 1.0})
