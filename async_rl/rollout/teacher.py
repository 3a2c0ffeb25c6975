"""The teacher of on-policy distillation (``algorithm.distill``): a served model's
log-probability of each token of the student's own samples.

For a group, the rollout worker sends each sample's prompt + response tokens to the
teacher's :class:`~async_rl.rollout.served.ServedModel` actor (all at once: one prefill
each, batched by the teacher's engine) and keeps the log-probs of the response tokens, and
with ``algorithm.distill.top_k`` the teacher's likeliest tokens at each position. They
travel with the sample (``Sample.teacher_logprobs``, ``teacher_top_ids``) to the learner
(:mod:`async_rl.algos.distill`). A teacher that gives no answer for a sample fails that
sample only (``teacher_error``: not trained, reported).
"""

from __future__ import annotations

import asyncio

from async_rl.records import Failure
from async_rl.rollout.served_client import ServedModelClient
from async_rl.rollout.types import Completion, ScoredTokens


class Teacher:
    """Asks the teacher's actor (``client``) to score samples, with its ``top_k`` likeliest
    tokens at each position (``algorithm.distill.top_k``; 0: the sampled tokens only)."""

    def __init__(self, client: ServedModelClient, top_k: int = 0):
        self.client = client
        self.top_k = top_k
        self.errors = 0
        """Samples the teacher gave no log-probs for."""

    async def logprobs(self, prompt_ids: list[int], completions: list[Completion]) -> list[ScoredTokens | Failure]:
        """Per completion, the teacher's scores of its response tokens (given ``prompt_ids``
        and the tokens before each), or the :class:`Failure` of one it gave none for."""
        return list(await asyncio.gather(*(self._one(prompt_ids, c) for c in completions)))

    async def _one(self, prompt_ids: list[int], completion: Completion) -> ScoredTokens | Failure:
        try:
            scored = await self.client.prompt_logprobs(prompt_ids + completion.token_ids, self.top_k)
            response = scored.tail(len(prompt_ids) - 1)  # position p's scores are entry p - 1
            if len(response.logprobs) != len(completion.token_ids):
                raise ValueError(f"the teacher scored {len(response.logprobs)} response tokens of {len(completion.token_ids)}")
            return response
        except Exception as exc:  # noqa: BLE001 - isolated to this sample, as a reward function's error
            self.errors += 1
            return Failure("teacher_error", f"{type(exc).__name__}: {exc}"[:500], input=completion.text[:200])
