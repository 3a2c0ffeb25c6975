"""validate(): one greedy and ``n`` sampled answers per prompt, scored; ``n`` = 0 is greedy only."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

from async_rl.rollout.types import Completion
from async_rl.rollout.validation import ValPrompt, validate


class Answers:
    """A generate function that answers prompt ``[i]`` with ``str(i)`` greedily and ``"x"`` when
    sampled, and records each request's ``(n, temperature)``."""

    def __init__(self) -> None:
        self.requests: list[tuple[int, float]] = []

    async def __call__(self, prompt_ids, n, sampling, *images):
        self.requests.append((n, sampling.temperature))
        text = str(prompt_ids[0]) if sampling.temperature == 0 else "x"
        return [Completion(token_ids=[1, 2], logprobs=[0.0, 0.0], versions=[3, 4], finish_reason="stop", text=text) for _ in range(n)]


class Exact:
    """Scores a response correct when it equals the ground truth."""

    async def score(self, inputs):
        return [SimpleNamespace(correct=i["response"] == i["ground_truth"]) for i in inputs]


PROMPTS = [ValPrompt(prompt_ids=[i], answer=str(i) if i % 2 else "x") for i in range(4)]
"""Odd prompts: the greedy answer is right; even ones: every sampled answer is."""


def test_greedy_and_n_sampled_answers_are_scored():
    generate = Answers()
    result = asyncio.run(validate(generate, PROMPTS, Exact(), n=3, temperature=1.0, max_tokens=8))
    assert sorted(generate.requests) == [(1, 0.0)] * 4 + [(3, 1.0)] * 4
    assert (result.greedy_accuracy, result.mean_at_n, result.pass_at_n) == (0.5, 0.5, 0.5)
    assert (result.n, result.prompts, result.version, result.max_version) == (3, 4, 3, 4)


def test_n_zero_asks_only_the_greedy_answer():
    generate = Answers()
    result = asyncio.run(validate(generate, PROMPTS, Exact(), n=0, temperature=1.0, max_tokens=8))
    assert generate.requests == [(1, 0.0)] * 4
    assert result.greedy_accuracy == 0.5 and math.isnan(result.mean_at_n) and math.isnan(result.pass_at_n)
