"""Judge rewards (``rollout.reward.judge``): a served model grades each response.

For every sample of a group, the rollout worker renders the judge's template over the row's
prompt, the response and the ground truth, wraps it in the judge's chat template, and asks
the judge's :class:`~async_rl.rollout.served.ServedModel` actor for a greedy answer (all
samples at once: the judge's engine batches them). A reward function of the judge's own
(``judge.function``, in a guarded pool like ``rollout.reward.function``) reads each answer
(the input's ``judge`` field) into a score, and the sample's reward is
``rollout.reward.weight x rule + judge.weight x judge``.

A reward model (``models.<name>.task: classify``) judges without words: it scores the same
rendered, chat-formatted text, and its probability (of its last label) is the judge's score,
read by no function.

Failures stay with their sample, as for reward functions: a judge that gives no answer
(every server tried, or its actor gone for longer than a request may take) fails the sample
with ``judge_error``; an answer its function cannot read fails it with ``reward_error``.
Neither is trained, both are counted and reported to the driver's console.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from async_rl.config import JudgeConfig, OverlongPenaltyConfig, RewardConfig
from async_rl.records import Failure
from async_rl.rewards import RewardScorer
from async_rl.rewards.scoring import RewardCounters, Score, apply_overlong
from async_rl.rollout.served_client import ServedModelClient
from async_rl.rollout.types import Sampling


class Judge:
    """Renders the judge's prompts and asks the judge.

    Args:
        cfg: ``rollout.reward.judge``.
        client: the judge model's actor.
        encode: the judge's chat formatting: text -> token ids
            (:meth:`~async_rl.data.prompts.PromptFormatter.token_ids` of its tokenizer).
        classify: the judge is a reward model (``task: classify``): its verdict is the
            probability of its last label, not an answer.
    """

    def __init__(self, cfg: JudgeConfig, client: ServedModelClient, encode: Any, classify: bool = False):
        from jinja2 import StrictUndefined
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.cfg = cfg
        self.client = client
        self.encode = encode
        self.classify = classify
        # Sandboxed, as data.format_prompt: a template reaches no Python internals.
        self.template = ImmutableSandboxedEnvironment(undefined=StrictUndefined).from_string(cfg.template)
        self.sampling = Sampling(temperature=0.0, max_tokens=cfg.max_tokens)
        self.errors = 0
        """Samples the judge gave no answer for."""

    async def verdicts(self, inputs: list[dict[str, Any]]) -> list[str | float | Failure]:
        """The judge's answer to each input (``prompt``, ``response``, ``ground_truth``; a reward
        model's: its probability), or the :class:`Failure` of an input it gave none for; all asked at once."""
        return list(await asyncio.gather(*(self._verdict(item) for item in inputs)))

    async def _verdict(self, item: dict[str, Any]) -> str | float | Failure:
        try:
            text = self.template.render(prompt=item.get("prompt", ""), response=item["response"], ground_truth=item["ground_truth"])
            if self.classify:
                return (await self.client.classify(self.encode(text)))[-1]
            (answer,) = await self.client.generate(self.encode(text), 1, self.sampling)
            return answer.text
        except Exception as exc:  # noqa: BLE001 - isolated to this sample, as a reward function's error
            self.errors += 1
            signature = f"{type(exc).__name__}: {exc}"[:500]
            return Failure("judge_error", signature, input=str(item.get("response", ""))[:200])


class JudgedScorer:
    """The reward with a judge, with :class:`~async_rl.rewards.RewardScorer`'s interface:
    ``rollout.reward.weight x`` the rule function's score ``+ judge.weight x`` the judge's,
    its components ``rule`` and ``judge`` beside the rule function's own. A sample fails when
    either part fails. The rule function is not called when its weight is 0; DAPO's overlong
    penalty applies once, to the sum.

    Args:
        rule: the rule function's scorer (``rollout.reward``, its overlong penalty off).
        verdicts: the scorer of the judge's function (``judge.function`` over the answers);
            None for a reward model's judge (its probability is the score).
        judge: the judge.
        cfg: ``rollout.reward`` (weights, overlong penalty).
        max_response_length: ``L_max`` in tokens, for the overlong penalty.
    """

    def __init__(self, rule: RewardScorer, verdicts: RewardScorer | None, judge: Judge, cfg: RewardConfig, max_response_length: int):
        if cfg.judge is None:
            raise ValueError("a judged scorer needs rollout.reward.judge")
        if verdicts is None and not judge.classify:
            raise ValueError("a judge that answers in words needs the scorer of its function (judge.function)")
        self.rule = rule
        self.verdicts = verdicts
        self.judge = judge
        self.cfg = cfg
        self.judge_weight = cfg.judge.weight
        self.max_response_length = max_response_length
        self.scored = 0
        """Samples scored (successfully or not)."""

    @property
    def counters(self) -> RewardCounters:
        """The rule's and the judge function's counts together; judge failures count as errors."""
        a, b = self.rule.counters, self.verdicts.counters if self.verdicts is not None else RewardCounters()
        return RewardCounters(scored=self.scored, errors=a.errors + b.errors + self.judge.errors,
                              timeouts=a.timeouts + b.timeouts, distinct_errors=a.distinct_errors + b.distinct_errors,
                              groups_filtered=a.groups_filtered)

    def keep_group(self, rewards: list[float]) -> bool:
        """DAPO dynamic sampling (counted with the rule's scorer)."""
        return self.rule.keep_group(rewards)

    async def score(self, inputs: list[dict[str, Any]]) -> list[Score]:
        """Each sample's weighted reward; never raises for a failing part (the sample carries it)."""
        rule_weight = self.cfg.weight
        self.scored += len(inputs)
        rule_task = asyncio.ensure_future(self.rule.score(inputs)) if rule_weight > 0 else None
        try:
            answers = await self.judge.verdicts(inputs)
            answered = [i for i, a in enumerate(answers) if isinstance(a, str)]  # words for the judge's function to read
            read = await self.verdicts.score([{**inputs[i], "judge": answers[i]} for i in answered]) if answered and self.verdicts else []
            rules = await rule_task if rule_task is not None else [Score(0.0) for _ in inputs]
        finally:
            if rule_task is not None and not rule_task.done():
                rule_task.cancel()
        judged: list[Score | Failure] = [Score(a) if isinstance(a, float) else a for a in answers]  # type: ignore[misc]
        for i, s in zip(answered, read, strict=True):
            judged[i] = s
        out = []
        for item, rule, judge in zip(inputs, rules, judged, strict=True):
            failure = judge if isinstance(judge, Failure) else judge.failure or rule.failure
            if failure is not None:
                out.append(Score(0.0, {}, failure))
                continue
            score = Score(rule_weight * rule.reward + self.judge_weight * judge.reward,
                          {**rule.components, "rule": rule.reward, "judge": judge.reward})
            apply_overlong(score, int(item["response_length"]), self.cfg.overlong_penalty, self.max_response_length)
            out.append(score)
        return out


def judge_reward_configs(cfg: RewardConfig) -> tuple[RewardConfig, RewardConfig]:
    """The two pools' configs of a judged reward: the rule function's and the judge function's
    (same type, timeout and pool sizes), both without the overlong penalty (the judged scorer
    applies it once, to the sum)."""
    if cfg.judge is None:
        raise ValueError("rollout.reward.judge is not set")
    off = OverlongPenaltyConfig()
    return (dataclasses.replace(cfg, overlong_penalty=off),
            dataclasses.replace(cfg, function=cfg.judge.function, kwargs=dict(cfg.judge.kwargs), overlong_penalty=off))
