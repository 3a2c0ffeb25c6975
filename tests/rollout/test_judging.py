"""Judge rewards' own logic (``rollout/judging.py``): the verdict reader, the weighted sum and
where each failure stays. The judge's answers come from a stand-in client here (the served
judge itself, on a real engine, is tests/rollout/test_rollout_pool.py's); the reward
functions run in real reward pools."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from async_rl.config import ConfigError, load_config
from async_rl.rewards import RewardPool, RewardScorer
from async_rl.rewards.builtin import judge_yes_no
from async_rl.rollout.judging import Judge, JudgedScorer, judge_reward_configs
from async_rl.rollout.types import Completion, ServedModelError


def test_judge_yes_no_reads_the_first_word_and_refuses_the_rest():
    items = [{"judge": "Yes."}, {"judge": " no, it is 12"}, {"judge": "**YES**"}]
    assert [s["overall"] for s in judge_yes_no(items)] == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="starts with neither yes nor no"):
        judge_yes_no([{"judge": "maybe"}])


class _Answers:
    """Stands in for the judge's actor: answers by the response the prompt quotes."""

    def __init__(self):
        self.prompts: list[str] = []

    async def generate(self, prompt_token_ids, n, sampling):
        text = bytes(prompt_token_ids).decode()
        self.prompts.append(text)
        if "response=boom" in text:
            raise ServedModelError("models.judge: a generate request failed on 3 server(s)")
        verdict = "maybe" if "response=odd" in text else "yes" if "response=good" in text else "no"
        return [Completion([1], [0.0], [0], "stop", verdict)]

    async def classify(self, token_ids):  # a reward model: the probability of its last label
        text = bytes(token_ids).decode()
        self.prompts.append(text)
        if "response=boom" in text:
            raise ServedModelError("models.judge: a classify request failed on 3 server(s)")
        return [0.25, 0.75] if "response=good" in text else [0.9, 0.1]


@pytest.fixture()
def judged(tmp_path: Path):
    """``judged(*overrides)``: a JudgedScorer over two started reward pools and :class:`_Answers`."""
    pools = []

    def make(*overrides: str) -> tuple[JudgedScorer, _Answers]:
        cfg = load_config(None, ["models.judge.model_path=/m", "rollout.reward.judge.model=judge",
                                 "rollout.reward.judge.template=q={{ prompt }} response={{ response }} truth={{ ground_truth }}",
                                 "rollout.reward.num_workers=1", "rollout.max_response_length=8", *overrides])
        rule_cfg, verdict_cfg = judge_reward_configs(cfg.rollout.reward)
        scorers = []
        for pool_cfg in (rule_cfg, verdict_cfg):
            pool = RewardPool(pool_cfg)
            pool.start()
            pools.append(pool)
            scorers.append(RewardScorer(pool, pool_cfg, 8))
        answers = _Answers()
        judge = Judge(cfg.rollout.reward.judge, answers, lambda text: list(text.encode()))
        return JudgedScorer(*scorers, judge, cfg.rollout.reward, 8), answers

    yield make
    for pool in pools:
        pool.close()


def _items(*responses: str, truth: str = "good") -> list[dict]:
    return [{"prompt": "2+2?", "response": r, "response_length": 4, "ground_truth": truth} for r in responses]


def test_the_reward_is_the_weighted_sum_and_each_failure_stays_with_its_sample(judged):
    scorer, answers = judged("rollout.reward.weight=2.0", "rollout.reward.judge.weight=0.5")
    scores = asyncio.run(scorer.score(_items("good", "bad", "boom", "odd")))
    good, bad, boom, odd = scores
    assert (good.reward, good.components["rule"], good.components["judge"]) == (2.5, 1.0, 1.0)  # exact match 1 x 2 + yes x 0.5
    assert (bad.reward, bad.components["judge"], bad.failure) == (0.0, 0.0, None)
    assert boom.failure.kind == "judge_error" and "failed on 3 server(s)" in boom.failure.signature and boom.reward == 0.0
    assert odd.failure.kind == "reward_error" and "neither yes nor no" in odd.failure.signature
    assert answers.prompts[0] == "q=2+2? response=good truth=good"  # the template over prompt, response, ground truth
    counters = scorer.counters
    assert (counters.scored, counters.errors, scorer.judge.errors) == (4, 2, 1)


def test_a_judge_alone_skips_the_rule_and_the_overlong_penalty_applies_once(judged):
    scorer, _ = judged("rollout.reward.weight=0", "rollout.reward.overlong_penalty.enable=true",
                       "rollout.reward.overlong_penalty.buffer_length=4")
    items = _items("good", "bad", truth="other")
    items[0]["response_length"] = 8  # at the budget: the full penalty, once
    good, bad = asyncio.run(scorer.score(items))
    assert good.reward == 1.0 - 1.0 and good.components["overlong_penalty"] == -1.0 and good.components["rule"] == 0.0
    assert bad.reward == 0.0 and scorer.rule.counters.scored == 0  # the rule function was not called


def test_a_reward_models_probability_is_the_judge_score_read_by_no_function(tmp_path: Path):
    cfg = load_config(None, ["models.judge.model_path=/m", "models.judge.task=classify", "rollout.reward.judge.model=judge",
                             "rollout.reward.judge.template=response={{ response }}", "rollout.reward.judge.weight=2.0",
                             "rollout.reward.num_workers=1", "rollout.max_response_length=8"])
    pool = RewardPool(cfg.rollout.reward)
    pool.start()
    try:
        judge = Judge(cfg.rollout.reward.judge, _Answers(), lambda text: list(text.encode()), classify=True)
        scorer = JudgedScorer(RewardScorer(pool, cfg.rollout.reward, 8), None, judge, cfg.rollout.reward, 8)
        good, bad, boom = asyncio.run(scorer.score(_items("good", "bad", "boom")))
    finally:
        pool.close()
    assert (good.reward, good.components["judge"], good.components["rule"]) == (1.0 + 2 * 0.75, 0.75, 1.0)
    assert (bad.reward, bad.components["judge"]) == (2 * 0.1, 0.1)
    assert boom.failure.kind == "judge_error" and "classify request failed" in boom.failure.signature
    with pytest.raises(ValueError, match="needs the scorer of its function"):
        JudgedScorer(scorer.rule, None, Judge(cfg.rollout.reward.judge, _Answers(), list), cfg.rollout.reward, 8)


def test_judge_config_rules():
    with pytest.raises(ConfigError, match="must name a served model"):
        load_config(None, ["rollout.reward.judge.model=judge"])
    with pytest.raises(ConfigError, match="scores episodes itself"):
        load_config(None, ["models.judge.model_path=/m", "rollout.reward.judge.model=judge", "rollout.env.name=addition_feedback"])
    with pytest.raises(ConfigError, match="both 0"):
        load_config(None, ["models.judge.model_path=/m", "rollout.reward.judge.model=judge", "rollout.reward.weight=0",
                           "rollout.reward.judge.weight=0"])
    rm = ["models.rm.model_path=/m", "models.rm.task=classify"]
    with pytest.raises(ConfigError, match="no function reads"):
        load_config(None, [*rm, "rollout.reward.judge.model=rm", "rollout.reward.judge.function=f.py:read"])
    with pytest.raises(ConfigError, match="has no log-probs of tokens"):
        load_config(None, [*rm, "algorithm.distill.teacher=rm"])
    with pytest.raises(ConfigError, match=r"it takes two tokens, \[no, yes\], and models.rm.task=classify"):
        load_config(None, ["models.rm.model_path=/m", "models.rm.classifier_from_tokens=['no','yes']"])
