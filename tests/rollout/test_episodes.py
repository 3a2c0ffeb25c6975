"""A group's samples as environment episodes: tokens, masks, rewards and failures.

The server is a scripted ``generate`` that records what it was asked (the real server is in
``test_rollout_pool.py``); the tokenizer is the tiny assets' real one with its ChatML template.
"""

from __future__ import annotations

import asyncio

import pytest

from async_rl.config import EnvConfig
from async_rl.data.prompts import PromptRow
from async_rl.envs import BaseEnvironment, EnvironmentConfig
from async_rl.envs.conversation import ChatEncoder
from async_rl.envs.tools import ToolEnvironment
from async_rl.rollout.episodes import EpisodeSampler
from async_rl.rollout.types import Completion, Sampling


class Countdown(BaseEnvironment):
    """Done when the model says the row's answer; a reward of 1 then."""

    def __init__(self, config: EnvironmentConfig):
        super().__init__(config)
        self.fail_at = config.get("fail_at")

    def reset(self, row: dict) -> str:
        if self.fail_at == "reset":
            raise RuntimeError("no level")
        self.answer = row["answer"]
        return row["problem"]

    def step(self, action: str):
        if self.fail_at == "step":
            raise RuntimeError("crashed")
        return "try again", float(action == self.answer), action == self.answer, {}

    def get_prompt_prefix(self) -> str:
        return "Say the number."


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


def _sampler(tokenizer, max_tokens: int = 200, max_prompt_length: int = 256, max_turn_tokens: int = 0, **env) -> EpisodeSampler:
    cfg = EnvConfig(name="test", kwargs=env, max_turns=5, max_turn_tokens=max_turn_tokens)
    return EpisodeSampler(Countdown, cfg, ChatEncoder(tokenizer), Sampling(max_tokens=max_tokens), max_prompt_length)


ROW = PromptRow(1, "Count to 3", "3")


def test_an_episode_trains_exactly_the_tokens_the_server_generated(tokenizer):
    generate, calls = _server(tokenizer, ["1", "2", "3"])
    sampler = _sampler(tokenizer)
    episode = asyncio.run(sampler.episode(ROW, generate))
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
    prompt, samples = asyncio.run(_sampler(tokenizer).group(ROW, 3, generate))
    assert tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
    assert len(samples) == 3 and all(s.reward == 1.0 and s.error is None and s.finish_reason == "stop" for s in samples)
    mask = samples[0].token_mask()
    assert mask[0] == 1 and 0 in mask and samples[0].reward_components == {"turns": 1.0, "success": 1.0}


def test_the_token_budget_ends_an_episode(tokenizer):
    generate, calls = _server(tokenizer, ["12"])  # never right: the budget of 10 tokens ends it
    _, samples = asyncio.run(_sampler(tokenizer, max_tokens=10).group(ROW, 1, generate))
    (sample,) = samples
    assert sample.num_tokens <= 10  # the observation that would overrun the budget is not kept
    assert sample.finish_reason == "length" and sample.reward == 0.0 and len(calls) < 5


def test_max_turn_tokens_bounds_each_turn_and_every_turn_fits_the_engine(tokenizer):
    generate, calls = _server(tokenizer, ["12345678901234567890"])  # 21 tokens, never right
    for budget, turn_tokens in ((200, 4), (60, 0)):
        calls.clear()
        _, (sample,) = asyncio.run(_sampler(tokenizer, max_tokens=budget, max_turn_tokens=turn_tokens).group(ROW, 1, generate))
        first = len(calls[0][0])  # the engine's limit is the first prompt + the budget: no turn may ask past it
        assert all(len(prompt) + len(out.token_ids) <= first + budget for prompt, out in calls) and sample.num_tokens <= budget
        if turn_tokens:
            assert len(calls) == 5 and all(len(out.token_ids) == turn_tokens for _, out in calls)


def test_an_episode_whose_first_prompt_is_too_long_ends_before_generating(tokenizer):
    generate, calls = _server(tokenizer, ["3"])
    sampler = _sampler(tokenizer, max_prompt_length=5)
    assert asyncio.run(sampler.group(ROW, 2, generate)) is None and calls == []
    assert sampler.counters.overlong_prompts == 2 and sampler.counters.episodes == 2


def test_a_failing_environment_marks_its_sample_and_a_group_that_never_started_is_skipped(tokenizer):
    generate, _ = _server(tokenizer, ["3"])
    _, samples = asyncio.run(_sampler(tokenizer, fail_at="step").group(ROW, 2, generate))
    assert all(s.error == "Countdown.step: RuntimeError: crashed" and s.finish_reason == "error" and s.reward == 0.0 for s in samples)
    sampler = _sampler(tokenizer, fail_at="reset")
    assert asyncio.run(sampler.group(ROW, 2, generate)) is None
    assert sampler.counters.errors == 2 and sampler.counters.turns == 0


class AddTool(ToolEnvironment):
    """The answer after a calculator call; the tools reach the first prompt."""

    def get_tools(self):
        def add(a: int, b: int) -> int:
            """Add.

            Args:
                a: first
                b: second
            """
            return a + b

        return [add]

    def reset(self, row: dict) -> str:
        self.answer_text = row["answer"]
        return row["problem"]

    def answer(self, text: str):
        return "", float(text == self.answer_text), True, {}


def test_tool_calls_their_errors_step_time_and_reward_are_counted(tokenizer):
    replies = ['<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>', "<tool_call>{bad}</tool_call>", "3"]
    generate, calls = _server(tokenizer, replies)
    sampler = EpisodeSampler(AddTool, EnvConfig(name="t", max_turns=5), ChatEncoder(tokenizer), Sampling(max_tokens=400), 4096)
    _, (sample,) = asyncio.run(sampler.group(ROW, 1, generate))
    assert '"name": "add"' in tokenizer.decode(calls[0][0])  # the tool's schema is in the prompt
    assert sample.reward == 1.0 and sample.reward_components["turns"] == 3.0
    c = sampler.counters
    assert (c.tool_calls, c.tool_errors, c.turns, c.reward) == (2, 1, 3, 1.0) and c.step_s > 0.0
