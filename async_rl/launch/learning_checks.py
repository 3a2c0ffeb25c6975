"""Say when learning cannot work: rules over the metrics of each learner step.

A run can go on for hours, every process healthy, and learn nothing: a critic whose learning
rate is too low for the model, episodes that spend their whole token budget on the first turn,
samples too far off the policy for the importance weights to use, or groups whose samples all
score the same. Each :class:`Rule` watches one such condition in the per-step metrics that
reach the driver; :class:`LearningChecks` says a rule on the driver's console when it becomes
active (naming the config keys to change and how) and keeps ``warn/<name>`` at 1 while it is,
0 otherwise, in every metrics sink (``metrics.jsonl``, W&B, Prometheus). A rule clears only
well below the level that raised it (hysteresis): a condition is said once, and again only
after it cleared and came back.

Pure logic: the driver feeds it dicts of floats (:meth:`LearningChecks.observe`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from async_rl.algos.options import estimator_info
from async_rl.config import Config

WARN_PREFIX = "warn/"
"""Metric key prefix of the checks' flags: ``warn/<rule name>``."""
CRITIC_STEPS = 50
"""Consecutive learner steps after the critic's warm-up (``learner.critic.warmup_steps``) with
``critic/explained_variance`` <= 0 before the critic is said not to learn: long enough that a
critic still fitting its first returns is not named (the quickstart's at lr 1e-4 reaches
0.47-0.51), short against a run whose critic's learning rate is too low, which stays below 0
throughout (the default 1e-6 on the tiny model: at most -0.08 over 200 steps)."""
WINDOW_STEPS = 20
"""Learner steps a windowed rule looks back over (a rule says nothing before it has seen this
many): 320 groups at the quickstart's batch of 16, so one unlucky batch decides nothing."""
RAISE_SHARE = 0.5
"""A windowed rule becomes active when its value averaged over the window exceeds this: most
samples, tokens or steps."""
CLEAR_SHARE = 0.25
"""A windowed rule that is active clears only once its window's average falls to this or below;
between the two levels it keeps its state, so a condition hovering near 50 % is said once."""


@dataclass
class Window:
    """The last :data:`WINDOW_STEPS` values of a per-step share (in ``[0, 1]``), with hysteresis."""

    values: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW_STEPS))
    active: bool = False

    def add(self, value: float) -> bool:
        """Take one step's value; whether the condition holds now."""
        self.values.append(value)
        if len(self.values) == WINDOW_STEPS:
            share = self.share
            self.active = share > RAISE_SHARE or (self.active and share > CLEAR_SHARE)
        return self.active

    @property
    def share(self) -> float:
        """The mean of the values in the window (0 before any)."""
        return sum(self.values) / len(self.values) if self.values else 0.0


class Rule(Protocol):
    """One condition under which the run cannot learn (or hardly)."""

    name: str
    """``warn/<name>`` is its metric."""

    def observe(self, metrics: Mapping[str, float]) -> bool | None:
        """Take one step's metrics; whether the condition holds now, or None when the step
        says nothing about it (its metrics are absent: the rule keeps its state)."""

    def message(self) -> str:
        """What is wrong, the numbers that show it, and the keys to change."""


@dataclass
class CriticNotLearning:
    """The critic's explained variance stayed <= 0 for :data:`CRITIC_STEPS` steps after its
    warm-up: its values explain none of the returns, and GAE's advantages are noise."""

    lr: float
    """``learner.critic.optim.lr``."""
    warmup_steps: int
    """``learner.critic.warmup_steps``: steps that train the critic alone (not counted)."""
    name: str = "critic_not_learning"
    streak: int = 0
    last: float = 0.0

    def observe(self, metrics: Mapping[str, float]) -> bool | None:
        if "critic/explained_variance" not in metrics or metrics.get("version", 0.0) <= self.warmup_steps:
            return None
        self.last = metrics["critic/explained_variance"]
        self.streak = self.streak + 1 if self.last <= 0 else 0
        return self.streak >= CRITIC_STEPS

    def message(self) -> str:
        return (f"the critic is not learning: its explained variance (critic/explained_variance) has been <= 0 for {self.streak} "
                f"steps after its warm-up (last {self.last:.2f}), so the GAE advantages are noise. Raise "
                f"learner.critic.optim.lr (now {self.lr:g}; the default 1e-6 is for large models, the tiny quickstart model "
                f"learns at 1e-4) and let it fit before the policy moves with learner.critic.warmup_steps (now {self.warmup_steps})")


@dataclass
class BudgetTruncation:
    """Most samples of the window ended on the token budget (``batch/truncated_fraction``):
    in a multi-turn run, episodes that ran out of ``rollout.max_response_length`` before
    ``rollout.env.max_turns`` (their later turns never happen); in a single-turn run, responses
    cut unfinished."""

    max_response_length: int
    max_turns: int | None
    """``rollout.env.max_turns`` in a multi-turn run, else None."""
    max_turn_tokens: int | None = None
    """``rollout.env.max_turn_tokens`` (0 or None: a turn may take the whole budget left)."""
    name: str = "token_budget"
    window: Window = field(default_factory=Window)

    def observe(self, metrics: Mapping[str, float]) -> bool | None:
        if "batch/truncated_fraction" not in metrics:
            return None
        return self.window.add(metrics["batch/truncated_fraction"])

    def message(self) -> str:
        share = f"{self.window.share:.0%}"
        if self.max_turns is None:
            return (f"most responses are cut at the token budget: {share} of the samples of the last {WINDOW_STEPS} steps stopped "
                    f"at rollout.max_response_length={self.max_response_length} tokens (batch/truncated_fraction), unfinished, "
                    "and are rewarded as such. Raise rollout.max_response_length, or ask for shorter answers (data.format_prompt)")
        per_turn = f"bound each turn with rollout.env.max_turn_tokens (now {self.max_turn_tokens or 'unbounded'}), "
        return (f"most episodes end on the token budget before rollout.env.max_turns={self.max_turns}: {share} of the episodes of "
                f"the last {WINDOW_STEPS} steps ran out of rollout.max_response_length={self.max_response_length} tokens (the budget "
                f"of a whole episode, feedback and template tokens included; batch/truncated_fraction), so their later turns are "
                f"never played or trained. Raise rollout.max_response_length, {per_turn}or lower rollout.env.max_turns")


@dataclass
class WeightsClipped:
    """On most trained tokens of the window the importance weight was cut: truncated at
    ``algorithm.loss.is_cap`` (``actor/is_clipped_fraction``) or rejected by the
    ``algorithm.loss.mask_*`` bounds (``actor/masked_fraction``), whichever is larger. The
    samples are too far off the policy for the correction to use them."""

    is_cap: float | None
    max_staleness: int
    sync_every: int
    name: str = "is_weights_clipped"
    window: Window = field(default_factory=Window)

    def observe(self, metrics: Mapping[str, float]) -> bool | None:
        shares = [metrics[k] for k in ("actor/is_clipped_fraction", "actor/masked_fraction") if k in metrics]
        if not shares:  # no policy update this step (the critic's warm-up)
            return None
        return self.window.add(max(shares))

    def message(self) -> str:
        return (f"importance weights are cut on most tokens: on {self.window.share:.0%} of the trained tokens of the last "
                f"{WINDOW_STEPS} steps the weight pi_prox/mu was truncated at algorithm.loss.is_cap={self.is_cap} or rejected by "
                "algorithm.loss.mask_lower/mask_upper (actor/is_clipped_fraction, actor/masked_fraction; actor/behav_kl is the "
                f"distance). The samples are too far off the policy to learn from: lower algorithm.max_staleness (now "
                f"{self.max_staleness}), publish weights more often (sync.every={self.sync_every}), or lower learner.optim.lr; "
                "if the distance is there at staleness 0, the servers' and the learner's log-probs differ (rollout.temperature, dtypes)")


@dataclass
class NoLearningSignal:
    """In most steps of the window every group's samples got the same reward
    (``batch/equal_reward_groups`` = 1): a group estimator's advantages are all 0 and the
    policy does not move. Only for group estimators (``grpo``, ``rloo``, ...)."""

    n: int
    """``rollout.n``."""
    reward: str
    """Where the rewards come from, as keys: ``rollout.reward.function=...``, or the environment's."""
    estimator: str
    name: str = "no_learning_signal"
    window: Window = field(default_factory=Window)
    reward_mean: float = 0.0

    def observe(self, metrics: Mapping[str, float]) -> bool | None:
        if "batch/equal_reward_groups" not in metrics:
            return None
        self.reward_mean = metrics.get("batch/reward_mean", self.reward_mean)
        return self.window.add(float(metrics["batch/equal_reward_groups"] >= 1.0))

    def message(self) -> str:
        return (f"no learning signal: in {self.window.share:.0%} of the last {WINDOW_STEPS} steps every group's {self.n} samples got "
                f"the same reward (batch/equal_reward_groups = 1), so the {self.estimator} advantages are all 0 and the policy does "
                f"not move (batch/reward_mean {self.reward_mean:.2f}). The task is too hard or too easy for the model, or the reward "
                f"gives one value: raise rollout.n so a group's samples can differ, train on data the model solves sometimes "
                f"(data.train_files), or give partial credit in the reward ({self.reward})")


def rules_for(cfg: Config) -> list[Rule]:
    """The rules that apply to ``cfg``'s run (the critic's with ``gae``, the signal's with a group estimator)."""
    r, alg = cfg.rollout, cfg.algorithm
    env = r.env if r.env.name is not None else None
    rules: list[Rule] = [
        BudgetTruncation(r.max_response_length, env.max_turns if env else None, env.max_turn_tokens if env else None),
        WeightsClipped(alg.loss.is_cap, alg.max_staleness, cfg.sync.every),
    ]
    if alg.needs_critic:
        rules.append(CriticNotLearning(cfg.learner.critic.optim.lr, cfg.learner.critic.warmup_steps))
    if estimator_info(alg.advantage.name).group:
        reward = (f"rollout.env.name={env.name}, rollout.env.reward={env.reward}" if env else f"rollout.reward.function={r.reward.function}")
        rules.append(NoLearningSignal(r.n, reward, alg.advantage.name))
    return rules


class LearningChecks:
    """Runs :class:`Rule` s over each step's metrics; see the module docstring."""

    def __init__(self, rules: list[Rule]):
        self.rules = rules
        self.active = {rule.name: False for rule in rules}

    def observe(self, metrics: Mapping[str, float]) -> list[str]:
        """Take one learner step's metrics; the warnings to say now (rules that just became
        active), each as ``warn/<name>: <message>``."""
        said = []
        for rule in self.rules:
            now = rule.observe(metrics)
            if now is None:
                continue
            if now and not self.active[rule.name]:
                said.append(f"{WARN_PREFIX}{rule.name}: {rule.message()}")
            self.active[rule.name] = now
        return said

    def flags(self) -> dict[str, float]:
        """``warn/<name>``: 1.0 while the rule is active, else 0.0 (for every metrics sink)."""
        return {f"{WARN_PREFIX}{name}": float(on) for name, on in self.active.items()}
