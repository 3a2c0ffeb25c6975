"""The learning checks over step metrics as the driver receives them: each rule raises on its
condition only, is said once, again only after it cleared and came back, and names its keys."""

from __future__ import annotations

import pytest

from async_rl.config import load_config
from async_rl.launch.learning_checks import (
    CLEAR_SHARE,
    CRITIC_STEPS,
    RAISE_SHARE,
    WINDOW_STEPS,
    BudgetTruncation,
    CriticNotLearning,
    LearningChecks,
    NoLearningSignal,
    WeightsClipped,
    rules_for,
)


def _run(checks: LearningChecks, steps: list[dict[str, float]], start: int = 1) -> list[tuple[int, str]]:
    """Feed ``steps`` (versions from ``start``); the (version, line) of every warning said."""
    said = []
    for version, metrics in enumerate(steps, start):
        said.extend((version, line) for line in checks.observe({"version": float(version), **metrics}))
    return said


def test_the_critic_check_counts_steps_after_warmup_and_names_the_lr():
    checks = LearningChecks([CriticNotLearning(lr=1e-6, warmup_steps=5)])
    bad = {"critic/explained_variance": -0.1}
    said = _run(checks, [bad] * (5 + CRITIC_STEPS))
    # the 5 warm-up steps do not count: the 50th step after them raises it, once
    assert [v for v, _ in said] == [5 + CRITIC_STEPS]
    assert said[0][1].startswith("warn/critic_not_learning: ") and "learner.critic.optim.lr (now 1e-06" in said[0][1]
    assert "learner.critic.warmup_steps (now 5)" in said[0][1] and checks.flags() == {"warn/critic_not_learning": 1.0}
    # still bad: not said again; one step above 0 clears it, and 50 more bad steps say it again
    assert _run(checks, [bad] * 10, start=56) == []
    assert _run(checks, [{"critic/explained_variance": 0.2}], start=66) == [] and checks.flags()["warn/critic_not_learning"] == 0.0
    again = _run(checks, [bad] * CRITIC_STEPS, start=67)
    assert [v for v, _ in again] == [66 + CRITIC_STEPS]


def test_a_critic_that_learns_or_goes_unmeasured_is_not_named():
    checks = LearningChecks([CriticNotLearning(lr=1e-4, warmup_steps=0)])
    learning = [{"critic/explained_variance": -0.5 if v % 10 == 0 else 0.3} for v in range(200)]
    assert _run(checks, learning) == []
    assert _run(checks, [{}] * 200) == [] and checks.flags() == {"warn/critic_not_learning": 0.0}


def test_windowed_rules_wait_for_a_full_window_and_clear_with_hysteresis():
    checks = LearningChecks([BudgetTruncation(max_response_length=16, max_turns=3, max_turn_tokens=8)])
    said = _run(checks, [{"batch/truncated_fraction": 1.0}] * WINDOW_STEPS)
    assert [v for v, _ in said] == [WINDOW_STEPS]  # not before the window is full
    # hovering between the two levels keeps it raised, and says nothing more
    middle = (RAISE_SHARE + CLEAR_SHARE) / 2
    assert _run(checks, [{"batch/truncated_fraction": middle}] * WINDOW_STEPS, start=21) == []
    assert checks.flags() == {"warn/token_budget": 1.0}
    assert _run(checks, [{"batch/truncated_fraction": 0.0}] * WINDOW_STEPS, start=41) == []
    assert checks.flags() == {"warn/token_budget": 0.0}
    # back above half: said again
    back = _run(checks, [{"batch/truncated_fraction": 0.9}] * WINDOW_STEPS, start=61)
    assert len(back) == 1 and checks.flags() == {"warn/token_budget": 1.0}


def test_half_the_samples_truncated_is_not_most():
    checks = LearningChecks([BudgetTruncation(max_response_length=16, max_turns=None)])
    assert _run(checks, [{"batch/truncated_fraction": RAISE_SHARE}] * 3 * WINDOW_STEPS) == []


def test_the_budget_message_names_the_keys_of_single_and_multi_turn_runs():
    single, multi = BudgetTruncation(16, None), BudgetTruncation(16, 3, 0)
    for rule in (single, multi):
        for _ in range(WINDOW_STEPS):
            rule.observe({"batch/truncated_fraction": 0.75})
    assert "rollout.max_response_length=16" in single.message() and "75%" in single.message() and "max_turns" not in single.message()
    assert "before rollout.env.max_turns=3" in multi.message() and "rollout.env.max_turn_tokens (now unbounded)" in multi.message()


def test_clipped_weights_take_the_larger_of_truncated_and_rejected_and_skip_steps_without_an_update():
    checks = LearningChecks([WeightsClipped(is_cap=2.0, max_staleness=8, sync_every=1)])
    rejected = {"actor/is_clipped_fraction": 0.1, "actor/masked_fraction": 0.8}
    said = _run(checks, [rejected, {}] * WINDOW_STEPS)  # a step without actor metrics neither counts nor clears
    assert [v for v, _ in said] == [2 * WINDOW_STEPS - 1]
    line = said[0][1]
    assert "algorithm.loss.is_cap=2.0" in line and "algorithm.max_staleness (now 8)" in line and "sync.every=1" in line
    fine = LearningChecks([WeightsClipped(is_cap=2.0, max_staleness=2, sync_every=1)])
    assert _run(fine, [{"actor/is_clipped_fraction": 0.05, "actor/masked_fraction": 0.0}] * 3 * WINDOW_STEPS) == []


def test_no_signal_needs_every_group_equal_in_most_steps():
    checks = LearningChecks([NoLearningSignal(n=8, reward="rollout.reward.function=exact_match", estimator="grpo")])
    almost = {"batch/equal_reward_groups": 15 / 16, "batch/reward_mean": 0.1}
    assert _run(checks, [almost] * 3 * WINDOW_STEPS) == []  # one group in 16 still teaches
    said = _run(checks, [{"batch/equal_reward_groups": 1.0, "batch/reward_mean": 0.0}] * WINDOW_STEPS, start=61)
    assert len(said) == 1
    line = said[0][1]
    assert line.startswith("warn/no_learning_signal: ") and "rollout.n" in line and "8 samples" in line
    assert "rollout.reward.function=exact_match" in line and "batch/reward_mean 0.00" in line


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        ([], ["token_budget", "is_weights_clipped", "no_learning_signal"]),
        (["algorithm.advantage.name=gae"], ["token_budget", "is_weights_clipped", "critic_not_learning"]),
        (["rollout.env.name=addition_feedback", "rollout.env.max_turns=3"], ["token_budget", "is_weights_clipped", "no_learning_signal"]),
    ],
)
def test_the_rules_of_a_run_follow_its_config(overrides, names):
    rules = rules_for(load_config(None, overrides))
    assert [r.name for r in rules] == names
    budget = rules[0]
    assert isinstance(budget, BudgetTruncation) and budget.max_turns == (3 if overrides[:1] == ["rollout.env.name=addition_feedback"] else None)
    if "no_learning_signal" in names:
        assert ("rollout.env.name=addition_feedback" in rules[-1].reward) == (budget.max_turns is not None)
