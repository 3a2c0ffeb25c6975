"""A group's samples as environment episodes: tokens, masks, rewards and failures.

The server is a scripted ``generate`` that records what it was asked (the real server is in
``test_rollout_pool.py``); the tokenizer is the tiny assets' real one with its ChatML template.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from async_rl.config import EnvConfig
from async_rl.data.prompts import PromptRow
from async_rl.envs import EnvPool
from async_rl.envs.conversation import ChatEncoder
from async_rl.rollout.episodes import EpisodeSampler
from async_rl.rollout.types import Completion, Sampling

SAMPLES = Path(__file__).parents[1] / "envs" / "sample_envs.py"
"""The environments (``Countdown``, ``AddTool``, the faulty ones), loaded by the environment processes."""


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from async_rl.tiny.addition import make_splits
    from async_rl.tiny.text import N_TRAIN, N_VAL, TASK, _build_tokenizer

    train, _ = make_splits(TASK, 0, N_TRAIN, N_VAL)
    return _build_tokenizer(train, tmp_path_factory.mktemp("tokenizer"))


def _server(tokenizer, replies: list[str]):
    calls: list[tuple[list[int], Completion]] = []

    async def generate(prompt_token_ids: list[int], n: int, sampling: Sampling) -> list[Completion]:
        text = replies[min(len(calls), len(replies) - 1)]
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][: sampling.max_tokens - 1] + [tokenizer.eos_token_id]
        out = Completion(ids, [-0.25] * len(ids), [len(calls)] * len(ids), "stop", text)
        calls.append((list(prompt_token_ids), out))
        return [out]

    return generate, calls


def _run(tokenizer, body: Callable[[EpisodeSampler], Awaitable[Any]], cls: str = "Countdown", max_tokens: int = 200,
         max_prompt_length: int = 256, max_turn_tokens: int = 0, step_timeout_s: float = 30.0, **env) -> tuple[EpisodeSampler, Any]:
    """``body(sampler)`` with a sampler of ``cls`` in a real environment process."""
    cfg = EnvConfig(name=f"{SAMPLES}:{cls}", kwargs=env, max_turns=5, max_turn_tokens=max_turn_tokens,
                    step_timeout_s=step_timeout_s, num_workers=1)

    async def go() -> tuple[EpisodeSampler, Any]:
        async with EnvPool(cfg) as pool:
            sampler = EpisodeSampler(pool, cfg, ChatEncoder(tokenizer), Sampling(max_tokens=max_tokens), max_prompt_length)
            return sampler, await body(sampler)

    return asyncio.run(go())


ROW = PromptRow(1, "Count to 3", "3")


def test_an_episode_trains_exactly_the_tokens_the_server_generated(tokenizer):
    generate, calls = _server(tokenizer, ["1", "2", "3"])
    sampler, episode = _run(tokenizer, lambda s: s.episode(ROW, generate))
    tokens = episode.tokens
    assert episode.trajectory.actions == ["1", "2", "3"] and episode.trajectory.success
    # every turn was generated after the exact context so far
    assert [prompt for prompt, _ in calls] == [tokens.context()[: len(prompt)] for prompt, _ in calls]
    assert calls[0][0] == tokens.prompt_ids
    trained = [t for t, m in zip(tokens.token_ids, tokens.mask) if m]
    assert trained == [t for _, out in calls for t in out.token_ids]
    assert [v for v, m in zip(tokens.versions, tokens.mask) if m] == [v for _, out in calls for v in out.versions]
    assert tokenizer.decode(tokens.context()) == tokenizer.apply_chat_template(
        [{"role": "system", "content": "Say the number."}, {"role": "user", "content": "Count to 3"},
         {"role": "assistant", "content": "1"}, {"role": "user", "content": "try again"},
         {"role": "assistant", "content": "2"}, {"role": "user", "content": "try again"},
         {"role": "assistant", "content": "3"}], tokenize=False)
    assert sampler.counters.episodes == 1 and sampler.counters.turns == 3 and sampler.counters.successes == 1


def test_a_group_of_episodes_shares_its_prompt_and_masks_the_rest(tokenizer):
    generate, _ = _server(tokenizer, ["3"])
    _, (prompt, samples, failures) = _run(tokenizer, lambda s: s.group(ROW, 3, generate))
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
    assert len(samples) == 3 and all(s.reward == 1.0 and s.error is None and s.finish_reason == "stop" for s in samples)
    assert failures == [None, None, None]
    mask = samples[0].token_mask()
    assert mask[0] == 1 and 0 in mask and samples[0].reward_components == {"turns": 1.0, "success": 1.0}


def test_the_token_budget_ends_an_episode(tokenizer):
    generate, calls = _server(tokenizer, ["12"])  # never right: the budget of 10 tokens ends it
    _, (_, samples, _) = _run(tokenizer, lambda s: s.group(ROW, 1, generate), max_tokens=10)
    (sample,) = samples
    assert sample.num_tokens <= 10  # the observation that would overrun the budget is not kept
    assert sample.finish_reason == "length" and sample.reward == 0.0 and len(calls) < 5


def test_max_turn_tokens_bounds_each_turn_and_every_turn_fits_the_engine(tokenizer):
    generate, calls = _server(tokenizer, ["12345678901234567890"])  # 21 tokens, never right
    for budget, turn_tokens in ((200, 4), (60, 0)):
        calls.clear()
        _, (_, (sample,), _) = _run(tokenizer, lambda s: s.group(ROW, 1, generate), max_tokens=budget, max_turn_tokens=turn_tokens)
        first = len(calls[0][0])  # the engine's limit is the first prompt + the budget: no turn may ask past it
        assert all(len(prompt) + len(out.token_ids) <= first + budget for prompt, out in calls) and sample.num_tokens <= budget
        if turn_tokens:
            assert len(calls) == 5 and all(len(out.token_ids) == turn_tokens for _, out in calls)


def test_an_episode_whose_first_prompt_is_too_long_ends_before_generating(tokenizer):
    generate, calls = _server(tokenizer, ["3"])
    sampler, group = _run(tokenizer, lambda s: s.group(ROW, 2, generate), max_prompt_length=5)
    assert group is None and calls == []
    assert sampler.counters.overlong_prompts == 2 and sampler.counters.episodes == 2


def test_a_failing_environment_marks_its_sample_and_a_group_that_never_started_is_skipped(tokenizer):
    generate, _ = _server(tokenizer, ["3"])
    _, (_, samples, failures) = _run(tokenizer, lambda s: s.group(ROW, 2, generate), fail_at="step")
    assert all(s.error == "RuntimeError: crashed" and s.error_kind == "env_error" and s.finish_reason == "error" and s.reward == 0.0
               for s in samples)
    assert all(f.input == "3" and "sample_envs.py" in f.where and f.where.endswith("in step") for f in failures)
    sampler, group = _run(tokenizer, lambda s: s.group(ROW, 2, generate), fail_at="reset")
    assert group is None
    assert sampler.counters.errors == 2 and sampler.counters.turns == 0


def test_tool_calls_their_errors_step_time_and_reward_are_counted(tokenizer):
    replies = ['<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>', "<tool_call>{bad}</tool_call>", "3"]
    generate, calls = _server(tokenizer, replies)
    sampler, (_, (sample,), _) = _run(tokenizer, lambda s: s.group(ROW, 1, generate), cls="AddTool", max_tokens=400,
                                      max_prompt_length=4096)
    assert '"name": "add"' in tokenizer.decode(calls[0][0])  # the tool's schema is in the prompt
    assert sample.reward == 1.0 and sample.reward_components["turns"] == 3.0
    c = sampler.counters
    assert (c.tool_calls, c.tool_errors, c.turns, c.reward) == (2, 1, 3, 1.0) and c.step_s > 0.0


def test_episodes_lost_to_a_process_killed_by_a_blocking_method_are_played_again(tokenizer):
    """One episode's ``async`` step blocks its process's event loop for good: at the step timeout
    the process is killed and replaced; that episode's sample fails (``env_timeout``, naming the
    method and the fix), the others are played again from the start on the new process and
    train. The server's own loop (this test's) never stalls."""
    generate, calls = _server(tokenizer, ["block", "ok"])  # the first turn generated blocks; every later one is fine

    async def body(sampler: EpisodeSampler):
        last, worst = time.monotonic(), 0.0

        async def tick() -> None:
            nonlocal last, worst
            while True:
                await asyncio.sleep(0.01)
                worst, last = max(worst, time.monotonic() - last - 0.01), time.monotonic()

        ticker = asyncio.create_task(tick())
        group = await sampler.group(ROW, 3, generate)
        ticker.cancel()
        return group, worst

    sampler, (group, lag) = _run(tokenizer, body, cls="AsyncFaulty", step_timeout_s=1.0)
    failed = [(s, f) for s, f in zip(group.samples, group.failures) if f is not None]
    assert len(failed) == 1
    sample, failure = failed[0]
    assert sample.error_kind == "env_timeout" and sample.error == failure.signature and failure.input == "block"
    assert "AsyncFaulty.step blocked the event loop for" in failure.signature and "make it a plain def" in failure.signature
    assert all(s.error is None and s.reward == 1.0 for s in group.samples if s is not sample)
    c = sampler.counters
    assert (c.reruns, c.restarts, c.blocked, c.timeouts, c.errors, c.episodes) == (2, 1, 1, 1, 0, 3)
    # the blocking turn, then 2 replayed episodes' turns, and the turn each of them took before the kill, if it got that far
    assert 3 <= len(calls) <= 5 and lag < 0.25


def test_an_episode_lost_twice_fails_as_an_env_error_and_keeps_its_tokens(tokenizer):
    """Every turn crashes the environment process (``os._exit``): the episode is played again
    once, then fails naming the exit, with the tokens the model generated (the group is kept,
    so the learner can drop the sample and count why)."""
    generate, calls = _server(tokenizer, ["exit"])
    sampler, group = _run(tokenizer, lambda s: s.group(ROW, 1, generate), cls="Faulty")
    (sample,), (failure,) = group.samples, group.failures
    assert sample.error_kind == "env_error" and sample.error == "EnvLost: the environment process exited (exit code 3)"
    assert sample.num_tokens > 0 and failure.signature == sample.error and len(calls) == 2
    c = sampler.counters
    assert (c.reruns, c.errors, c.episodes) == (1, 1, 1)
