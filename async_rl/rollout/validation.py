"""Validation through the inference servers: greedy accuracy, mean@n and pass@n (of single
responses scored by the reward function, or of environment episodes' success).

It runs on the same servers as the rollouts (their current weights), concurrently with
generation, and reports the policy version the servers held.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any

from async_rl.data.prompts import PromptRow
from async_rl.rewards.scoring import RewardScorer
from async_rl.rollout.episodes import EpisodeSampler
from async_rl.rollout.types import GenerateFn, Sampling


@dataclass(frozen=True)
class ValPrompt:
    """One validation prompt: chat-formatted token ids, the reference answer and, for a
    vision-language prompt, its images (PIL, in prompt order)."""

    prompt_ids: list[int]
    answer: str
    images: list[Any] | None = None


@dataclass
class ValidationResult:
    """Scores on the validation prompts."""

    version: int
    """Lowest policy version among the validation tokens (the servers' weights)."""
    max_version: int
    """Highest one: weight updates that arrived while validation ran (each request runs on the weights of its time)."""
    greedy_accuracy: float
    """Fraction of prompts whose greedy answer is correct."""
    mean_at_n: float
    """Mean correctness over ``n`` sampled answers per prompt (nan when ``n`` = 0)."""
    pass_at_n: float
    """Fraction of prompts with at least one correct answer among ``n`` samples (nan when ``n`` = 0)."""
    n: int
    prompts: int
    seconds: float


async def validate(
    generate: GenerateFn,
    prompts: list[ValPrompt],
    scorer: RewardScorer,
    *,
    n: int,
    temperature: float,
    max_tokens: int,
    concurrency: int = 32,
) -> ValidationResult:
    """Greedy and ``n``-sample evaluation of ``prompts`` (``n`` = 0: greedy only)."""
    t0 = time.monotonic()
    limit = asyncio.Semaphore(concurrency)
    greedy = Sampling(temperature=0.0, max_tokens=max_tokens)
    sampled = Sampling(temperature=temperature, max_tokens=max_tokens)

    async def one(prompt: ValPrompt) -> tuple[bool, list[bool], list[int]]:
        async with limit:
            extra = (prompt.images,) if prompt.images else ()
            requests = [generate(prompt.prompt_ids, 1, greedy, *extra)] + ([generate(prompt.prompt_ids, n, sampled, *extra)] if n else [])
            completions = [c for batch in await asyncio.gather(*requests) for c in batch]
        scores = await scorer.score(
            [{"response": c.text, "response_length": len(c.token_ids), "ground_truth": prompt.answer} for c in completions]
        )
        return scores[0].correct, [s.correct for s in scores[1:]], [v for c in completions for v in c.versions]

    return _summary(await asyncio.gather(*(one(p) for p in prompts)), n, t0)


async def validate_episodes(
    generate: GenerateFn,
    rows: list[PromptRow],
    greedy: EpisodeSampler,
    sampled: EpisodeSampler,
    *,
    n: int,
    concurrency: int = 32,
) -> ValidationResult:
    """Environment episodes of the validation rows: one greedy (``greedy``'s sampling) and
    ``n`` sampled each. An episode succeeds when it ended without an environment error and
    ``info["success"]`` (or, without it, an episode reward of at least 1) says so."""
    t0 = time.monotonic()
    limit = asyncio.Semaphore(concurrency)

    async def one(row: PromptRow) -> tuple[bool, list[bool], list[int]]:
        async with limit:
            episodes = await asyncio.gather(greedy.episode(row, generate), *(sampled.episode(row, generate) for _ in range(n)))
        wins = [e.trajectory.failure is None and e.trajectory.success for e in episodes]
        return wins[0], wins[1:], [v for e in episodes if e.tokens is not None for v, m in zip(e.tokens.versions, e.tokens.mask) if m]

    return _summary(await asyncio.gather(*(one(r) for r in rows)), n, t0)


def _summary(results: list[tuple[bool, list[bool], list[int]]], n: int, t0: float) -> ValidationResult:
    """Per prompt ``(greedy correct, n sampled correct, versions of the generated tokens)`` -> the result."""
    count = max(len(results), 1)
    versions = [v for r in results for v in r[2]]
    return ValidationResult(
        version=min(versions, default=0),
        max_version=max(versions, default=0),
        greedy_accuracy=sum(r[0] for r in results) / count,
        mean_at_n=sum(sum(r[1]) / n for r in results) / count if n else math.nan,
        pass_at_n=sum(any(r[1]) for r in results) / count if n else math.nan,
        n=n,
        prompts=len(results),
        seconds=time.monotonic() - t0,
    )
