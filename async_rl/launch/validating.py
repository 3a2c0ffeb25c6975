"""Validation during a run: every ``trainer.val_every`` steps, before the first step (the
starting weights alone; ``trainer.val_before_train``) and at the end, on server 0, one at a
time beside training; text prompts scored by the reward function, or environment episodes
(their success rate)."""

from __future__ import annotations

import asyncio

from async_rl.envs.conversation import ChatEncoder
from async_rl.launch.inputs import RunInputs
from async_rl.launch.run_context import RunContext
from async_rl.rollout.episodes import EpisodeSampler
from async_rl.rollout.types import Sampling
from async_rl.rollout.validation import ValidationResult, validate, validate_episodes


class Validator:
    def __init__(self, run: RunContext, inputs: RunInputs):
        self.run = run
        self.inputs = inputs
        self.results: list[ValidationResult] = []
        self._task: asyncio.Task | None = None

    def maybe_start(self, force: bool = False, final: bool = False) -> None:
        """Start a validation if one is due (``force``: now; ``final``: the last, unless the
        periodic one already measured these weights) and none is running."""
        run = self.run
        every = run.cfg.trainer.val_every
        if not self.inputs.val_prompts or every == 0 or (self._task is not None and not self._task.done()):
            return
        if final and self.results and self.results[-1].version == run.version:
            return
        if force or run.version % every == 0:
            self._task = asyncio.create_task(self._validate(final))

    @property
    def running(self) -> asyncio.Task | None:
        """The validation task started last (it may have ended), or None."""
        return self._task

    async def wait(self) -> None:
        """Until the validation started last has ended (its error, if any, raised)."""
        if self._task is not None:
            await self._task

    async def _validate(self, final: bool) -> None:
        cfg, r, inputs = self.run.cfg, self.run.cfg.rollout, self.inputs
        generate = self.run.pool.generate_fn(0)()
        if inputs.envs is not None:  # success rate of environment episodes
            encoder = ChatEncoder(inputs.formatter.tokenizer)
            greedy, sampled = (EpisodeSampler(inputs.envs, r.env, encoder, Sampling(temperature=t, max_tokens=r.max_response_length),
                                              cfg.data.max_prompt_length) for t in (0.0, r.temperature))
            result = await validate_episodes(generate, inputs.val_rows, greedy, sampled, n=cfg.trainer.val_n)
        else:
            result = await validate(generate, inputs.val_prompts, inputs.scorer(cfg),
                                    n=cfg.trainer.val_n, temperature=r.temperature, max_tokens=r.max_response_length)
        self.results.append(result)
        sampled_scores = {"val/mean_at_n": result.mean_at_n, "val/pass_at_n": result.pass_at_n} if result.n else {}  # none at val_n = 0
        self.run.tracker.log({
            "version": float(result.version), "val/greedy_accuracy": result.greedy_accuracy, **sampled_scores,
            "val/seconds": result.seconds, "val/final": float(final), "val/max_version": float(result.max_version),
        })
