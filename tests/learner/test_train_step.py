"""Train step on one rank in the test process: loss goes down, decoupled PPO == PPO on-policy,
bad groups are dropped with reasons and never reach the weights."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
import torch
from learner_helpers import learner_config, make_groups, prepare_groups

from async_rl.learner.batching import Batch, prepare
from async_rl.learner.model import DistInfo, load_sharded
from async_rl.learner.screening import Limits, screen
from async_rl.learner.train_step import Trainer, lr_factor
from async_rl.records import RolloutGroup, Sample
from user_algorithms import USER_ALGORITHMS


def _trainer(model_dir: Path, info: DistInfo, tmp_path: Path, *overrides: str) -> Trainer:
    cfg = learner_config(model_dir, tmp_path, "unit", *overrides)
    policy = load_sharded(str(model_dir), cfg.learner, info.device, trainable=True)
    reference = load_sharded(str(model_dir), cfg.learner, info.device, trainable=False) if cfg.algorithm.needs_reference else None
    critic = load_sharded(str(model_dir), cfg.learner, info.device, trainable=True, value_model=True) if cfg.algorithm.needs_critic else None
    return Trainer(policy, reference, cfg.learner, cfg.algorithm, info, cfg.trainer.total_steps, cfg.trainer.seed, critic=critic)


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in trainer.policy.state_dict().items()}


def _on_policy(groups: list[RolloutGroup], trainer: Trainer, batch: Batch) -> list[RolloutGroup]:
    """``groups`` with behaviour log-probs replaced by the current policy's, computed exactly as
    the trainer recomputes proximal log-probs (same micro-batches, so bit-identical)."""
    logp = trainer._all_rows_logp(trainer.policy, batch)
    out, row = [], 0
    for group in groups:
        samples = []
        for sample in group.samples:
            n = sample.num_tokens
            samples.append(Sample.from_lists(list(sample.token_array()), logp[row, :n].tolist(), 0, sample.reward))
            row += 1
        out.append(RolloutGroup.from_lists("t", group.group_id, group.prompt_id, list(group.prompt_array()), samples, "s", 0.0))
    return out


@pytest.mark.slow
@pytest.mark.dist
def test_loss_decreases_on_a_fixed_batch(tiny_model: Path, one_rank: DistInfo, tmp_path: Path) -> None:
    # pi_prox := mu (fixed), so the clipped surrogate is comparable across steps.
    trainer = _trainer(tiny_model, one_rank, tmp_path, "algorithm.recompute_proximal=false", "algorithm.loss.name=ppo",
                       "algorithm.loss.clip_high=10.0", "learner.ppo_mini_batches=2")
    batch = prepare_groups(make_groups(4, seed=1), 64, 512).batch
    losses = [trainer.step(batch, step).metrics["actor/pg_loss"] for step in range(4)]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


@pytest.mark.slow
@pytest.mark.dist
def test_decoupled_ppo_equals_ppo_on_policy(tiny_model: Path, one_rank: DistInfo, tmp_path: Path) -> None:
    results = []
    for loss in ("ppo", "decoupled_ppo"):
        trainer = _trainer(tiny_model, one_rank, tmp_path, f"algorithm.loss.name={loss}", "learner.ppo_mini_batches=2", "learner.ppo_epochs=2")
        groups = make_groups(4, seed=2)
        groups = _on_policy(groups, trainer, prepare_groups(groups, 64, 512).batch)
        metrics = trainer.step(prepare_groups(groups, 64, 512).batch, 0).metrics
        results.append((_params(trainer), metrics))
    (ppo, m_ppo), (dec, m_dec) = results
    assert m_dec["actor/is_weight_mean"] == 1.0 and m_dec["actor/is_clipped_fraction"] == 0.0  # on-policy: nothing to cut
    equal = sum(len({s.reward for s in g.samples}) == 1 for g in groups) / len(groups)
    assert m_dec["batch/equal_reward_groups"] == pytest.approx(equal)
    assert m_ppo["actor/updates"] == m_dec["actor/updates"] == 4
    for name in ppo:
        torch.testing.assert_close(dec[name], ppo[name], rtol=0, atol=0)




@pytest.mark.dist
def test_a_user_defined_estimator_and_loss_train_three_steps(tiny_model: Path, one_rank: DistInfo, tmp_path: Path) -> None:
    """``algorithm.advantage.name`` and ``algorithm.loss.name`` as ``path/to/file.py:function``
    (docs/algorithms.md): the trainer calls the user's functions at every step and the weights
    move, with no edit of the package."""
    from async_rl.algos.options import ADVANTAGE_KEY, user_algorithm

    algos = tmp_path / "my_algos.py"
    algos.write_text(USER_ALGORITHMS)
    trainer = _trainer(tiny_model, one_rank, tmp_path, f"algorithm.advantage.name={algos}:centred", f"algorithm.loss.name={algos}:plain_pg")
    batch = prepare_groups(make_groups(4, seed=5), 64, 512).batch
    before = _params(trainer)
    metrics = [trainer.step(batch, step).metrics for step in range(3)]
    assert all(m["actor/pg_clipfrac"] == 0.0 and m["actor/grad_norm"] > 0 for m in metrics), metrics  # the unclipped user loss
    calls = user_algorithm(f"{algos}:centred", ADVANTAGE_KEY).__globals__["CALLS"]
    assert calls.count("centred") == 3 and calls.count("plain_pg") >= 3, calls
    after = _params(trainer)
    assert any(not torch.equal(before[name], after[name]) for name in before)


@pytest.mark.dist
def test_bad_groups_are_dropped_with_reasons(tiny_model: Path, one_rank: DistInfo, tmp_path: Path) -> None:
    good = make_groups(2, seed=3)
    ok = Sample.from_lists([5, 6], [-1.0, -1.0], 0, 1.0)
    def group(*samples: Sample) -> RolloutGroup:
        return RolloutGroup.from_lists("t", "bad", 9, [3, 4], [ok, *samples], "s", 0.0)
    bad = [
        group(Sample.from_lists([7], [-1.0], 0, float("nan"))),
        group(Sample.from_lists([7], [float("nan")], 0, 1.0)),
        group(Sample.from_lists([7], [-1.0], 0, 0.0, error="reward crashed")),
        group(Sample.from_lists([], [], 0, 1.0)),
        group(Sample.from_lists([9999], [-1.0], 0, 1.0)),
        group(Sample.from_lists(list(range(2, 80)), [-1.0] * 78, 0, 1.0)),
    ]
    prepared = prepare_groups(good + bad, 64, 512)
    # a token outside the vocabulary condemns its whole group (malformed: dead-lettered when read);
    # a failed reward only its sample (algorithm.failed_samples=drop_sample)
    assert dict(prepared.dropped) == {"nonfinite_reward": 2, "nonfinite_logprob": 2, "reward_error": 1,
                                      "empty_response": 1, "bad_token": 2, "too_long": 1}
    assert len(prepared.kept) == 5 and prepared.batch.size == 8 + 3
    trainer = _trainer(tiny_model, one_rank, tmp_path)
    before = _params(trainer)
    metrics = trainer.step(prepared.batch, 0).metrics
    after = _params(trainer)
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    assert prepare_groups(bad[:2], 64, 512).batch is None


def test_lr_schedule_warmup_then_cosine(tmp_path: Path) -> None:
    optim = learner_config("m", tmp_path, "r", "learner.optim.warmup_steps=2", "learner.optim.scheduler=cosine",
                           "learner.optim.min_lr_ratio=0.1").learner.optim
    factors = [lr_factor(s, optim, total_steps=6) for s in range(7)]
    assert factors[:3] == [0.5, 1.0, 1.0]
    assert factors[-1] == pytest.approx(0.1)
    assert all(b <= a for a, b in zip(factors[2:], factors[3:]))


@pytest.mark.dist
def test_kl_in_reward_penalises_the_rewards_and_adapts_its_coefficient(tiny_model: Path, one_rank: DistInfo, tmp_path: Path) -> None:
    kl_settings = ("algorithm.kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.kl_coef=0.5",
                   "algorithm.kl_ctrl.target_kl=0.001", "algorithm.kl_ctrl.horizon=100", "learner.ppo_mini_batches=2")
    trainer = _trainer(tiny_model, one_rank, tmp_path, "algorithm.loss.name=ppo", *kl_settings)
    plain = _trainer(tiny_model, one_rank, tmp_path, "algorithm.loss.name=ppo", "learner.ppo_mini_batches=2")
    batch = prepare_groups(make_groups(4, seed=8), 64, 512).batch
    # step 0: pi_prox (recomputed) is the reference itself, so the KL is 0 and the step is the plain one
    first = trainer.step(batch, 0).metrics
    assert first["reward/kl"] == pytest.approx(0.0, abs=1e-6) and first["reward/kl_coef"] == 0.5
    assert first["batch/advantage_mean"] == pytest.approx(plain.step(batch, 0).metrics["batch/advantage_mean"], abs=1e-6)
    after_first = 0.5 * (1 - 0.2 * batch.size / 100)  # KL 0 is below the target: the coefficient shrinks by the capped 20%
    assert trainer.kl_ctrl is not None and trainer.kl_ctrl.value == pytest.approx(after_first)
    # step 1: the policy moved, so the estimator sees outcome - beta * sum_t KL_t
    ref_logp = trainer._all_rows_logp(trainer.reference, batch)
    old_logp = trainer._all_rows_logp(trainer.policy, batch)
    second = trainer.step(batch, 1).metrics
    mask = batch.response_mask
    per_sequence = ((old_logp - ref_logp) * mask).sum(-1) / mask.sum(-1).clamp_min(1)
    assert second["reward/kl"] == pytest.approx(float(per_sequence.mean()), abs=1e-6) and second["reward/kl"] != 0
    assert second["reward/kl_coef"] == pytest.approx(after_first)
    error = min(max(second["reward/kl"] / 0.001 - 1, -0.2), 0.2)
    assert trainer.kl_ctrl.value == pytest.approx(after_first * (1 + error * batch.size / 100))
    with pytest.raises(ValueError, match="reference model is needed exactly when"):
        cfg = learner_config(tiny_model, tmp_path, "unit", *kl_settings)
        Trainer(plain.policy, None, cfg.learner, cfg.algorithm, one_rank, cfg.trainer.total_steps, cfg.trainer.seed)


@pytest.mark.dist
def test_the_critic_learns_the_returns_and_holds_the_policy_during_its_warm_up(tiny_model: Path, one_rank: DistInfo, tmp_path: Path) -> None:
    trainer = _trainer(tiny_model, one_rank, tmp_path, "algorithm.advantage.name=gae", "algorithm.advantage.lam=0.95",
                       "learner.critic.optim.lr=1e-3", "learner.critic.warmup_steps=3", "learner.critic.ppo_mini_batches=2",
                       "learner.critic.ppo_epochs=2")
    batch = prepare_groups(make_groups(4, seed=10), 64, 512).batch
    before = _params(trainer)
    steps = [trainer.step(batch, step).metrics for step in range(4)]
    for m in steps[:3]:  # warm-up: 4 critic updates a step, the policy untouched
        assert m["critic/updates"] == 4 and m["actor/updates"] == 0
    assert steps[3]["actor/updates"] == 1 and steps[3]["critic/updates"] == 4
    warm = steps[2]
    assert warm["critic/vf_loss"] < steps[0]["critic/vf_loss"]  # the same returns' targets are learnt
    assert warm["critic/explained_variance"] > steps[0]["critic/explained_variance"]
    assert 0 <= warm["critic/vf_clipfrac"] <= 1 and steps[0]["critic/lr"] == 1e-3
    after = _params(trainer)
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the policy moved at step 3 only
    with pytest.raises(ValueError, match="a critic is needed exactly when"):
        cfg = learner_config(tiny_model, tmp_path, "unit", "algorithm.advantage.name=gae")
        Trainer(trainer.policy, None, cfg.learner, cfg.algorithm, one_rank, cfg.trainer.total_steps, cfg.trainer.seed)


@pytest.mark.redis
@pytest.mark.ray
@pytest.mark.vllm
@pytest.mark.assets
@pytest.mark.slow
@pytest.mark.integration
def test_a_stale_run_corrects_with_the_recomputed_proximal_policy(tiny_assets, tmp_path: Path) -> None:
    """One small cell of benchmarks/staleness_ablation.py (decoupled_ppo, eta = 4, the window
    filled before each step), end to end: not a learning target, the correction at work.

    The suite shares no running stack (each end-to-end test runs its own ``async-rl train``);
    this one shares the session's tiny assets. Two mini-batches per step make the learner
    recompute ``pi_prox`` (one update would take it from the loss pass). Steps train on groups
    exactly min(version, 4) versions old. On the stale ones the weight ``min(pi_prox / mu, 2)``
    differs from 1 (it is 1 everywhere if ``pi_prox`` were ``mu``) and stays under the cap, and
    ``pi_prox`` is far closer to the current policy (``ppo_kl``, one mini-batch apart) than to
    ``mu`` (``behav_kl``, up to four versions apart), on the mean over the stale steps."""
    from run_helpers import train_cli, write_config

    steps = 7
    config = write_config(tiny_assets, tmp_path, steps=steps, algorithm={"max_staleness": 4, "loss": {"name": "decoupled_ppo"}},
                          learner={"fill_staleness_window": True, "ppo_mini_batches": 2, "optim": {"lr": 5e-4}},
                          trainer={"val_every": 0, "save_every": steps})
    proc = train_cli(config, "logging.wandb.enable=false", "logging.plots=false")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in records if "perf/tokens_per_s" in r]
    assert [(r["staleness/mean"], r["staleness/max"]) for r in rows] == [(min(v, 4), min(v, 4)) for v in range(steps)]
    assert rows[0]["actor/updates"] == 2
    stale = [r for r in rows if r["staleness/mean"] >= 2]
    for r in stale:
        assert r["actor/is_weight_max"] <= 2.0 and r["actor/is_weight_mean"] != 1.0 and r["actor/behav_kl"] > 0, r
    # Over the stale steps, not per step: a step's ppo_kl is a signed mean over ~80 tokens (k1),
    # and at staleness 3 every weight was below 1 in some runs (the policy left mu's tokens).
    assert max(r["actor/is_weight_max"] for r in stale) > 1.0, stale
    assert statistics.fmean(abs(r["actor/ppo_kl"]) for r in stale) < 0.5 * statistics.fmean(r["actor/behav_kl"] for r in stale), stale
    # the weights move away from 1 as the samples age: the correction grows with staleness
    # (against the staleness-1 step: at staleness 0 behav_kl is 0, which any positive value beats)
    assert statistics.fmean(r["actor/behav_kl"] for r in stale) > rows[1]["actor/behav_kl"], rows  # 1.8-19x measured


def _with_teacher(groups: list[RolloutGroup], shift) -> list[RolloutGroup]:
    """``groups`` whose samples carry teacher log-probs: the behaviour log-prob of each token
    plus ``shift(group index, sample index)`` nats."""
    out = []
    for g, group in enumerate(groups):
        samples = [Sample.from_lists(list(s.token_array()), list(s.logprob_array()), 0, s.reward,
                                     teacher_logprobs=[x + shift(g, k) for x in s.logprob_array()])
                   for k, s in enumerate(group.samples)]
        out.append(RolloutGroup.from_lists("t", group.group_id, group.prompt_id, list(group.prompt_array()), samples, "s", 0.0))
    return out


@pytest.mark.slow
@pytest.mark.dist
def test_distillation_moves_the_student_towards_the_teacher(tiny_model: Path, one_rank: DistInfo, tmp_path: Path) -> None:
    """``algorithm.distill`` with no task reward: a teacher that agrees with the sampler gives
    no signal (no parameter moves); one that finds the first sample of each group likelier and
    the others less likely (by 1 nat a token) raises the student's log-probs of the first and
    lowers the others', and the step reports the reverse KL it sees."""
    distill = ("models.teacher.model_path=/m", "algorithm.distill.teacher=teacher", "learner.optim.weight_decay=0.0")
    trainer = _trainer(tiny_model, one_rank, tmp_path, *distill)
    groups = make_groups(4, seed=5)
    groups = _on_policy(groups, trainer, prepare_groups(groups, 64, 512).batch)
    before = _params(trainer)
    metrics = trainer.step(prepare_groups(_with_teacher(groups, lambda g, k: 0.0), 64, 512).batch, 0).metrics
    assert metrics["distill/reverse_kl"] == 0.0 and metrics["batch/advantage_abs_max"] == 0.0
    for name, value in _params(trainer).items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)

    taught = prepare_groups(_with_teacher(groups, lambda g, k: 1.0 if k == 0 else -1.0), 64, 512).batch
    first = torch.tensor([k == 0 for g in groups for k in range(len(g.samples))])
    start = trainer._all_rows_logp(trainer.policy, taught)
    metrics = trainer.step(taught, 1).metrics
    for step in range(2, 4):
        trainer.step(taught, step)
    moved = ((trainer._all_rows_logp(trainer.policy, taught) - start) * taught.response_mask).sum(-1) / taught.response_mask.sum(-1)
    assert metrics["distill/reverse_kl"] == pytest.approx(-(first.float() * 2 - 1).mul(taught.response_mask.sum(-1)).sum().item()
                                                          / taught.response_mask.sum().item(), abs=1e-5)
    assert moved[first].min() > 0 > moved[~first].max(), moved


@pytest.mark.slow
@pytest.mark.dist
def test_top_k_distillation_moves_the_student_towards_the_teachers_distribution(tiny_model: Path, one_rank: DistInfo,
                                                                                tmp_path: Path) -> None:
    """``algorithm.distill.top_k``: a teacher whose top 2 at every position are token 7
    (p 0.9) and token 8 (p 0.05). With no task reward the advantage is 0 (the sampled-token
    term is off); the loss's forward KL over the top 2 falls step by step and the student's
    log-prob of token 7 rises at every response position. A sample without the top-k is not
    trained (``teacher_error``)."""
    trainer = _trainer(tiny_model, one_rank, tmp_path, "models.teacher.model_path=/m", "algorithm.distill.teacher=teacher",
                       "algorithm.distill.top_k=2")
    groups = []
    for group in make_groups(4, seed=6):
        samples = [Sample.from_lists(list(s.token_array()), list(s.logprob_array()), s.token_versions(), s.reward,
                                     teacher_logprobs=list(s.logprob_array()),
                                     teacher_top=([[7, 8]] * s.num_tokens, [[math.log(0.9), math.log(0.05)]] * s.num_tokens))
                   for s in group.samples]
        groups.append(RolloutGroup.from_lists("t", group.group_id, group.prompt_id, list(group.prompt_array()), samples, "s", 0.0))
    limits = Limits(64, 512, needs_teacher=True, teacher_top_k=2)
    batch = prepare([screen(g, limits) for g in groups]).batch
    assert batch is not None and batch.teacher_top_ids.shape == (*batch.response_mask.shape, 2)
    assert prepare([screen(g, limits) for g in make_groups(1, seed=7)]).dropped["teacher_error"] == 4  # no teacher at all

    def token_7() -> torch.Tensor:
        with torch.no_grad():
            return trainer._logprobs(trainer.policy, batch, with_top=True)[2][..., 0][batch.response_mask.bool()]

    start = token_7()
    steps = [trainer.step(batch, s).metrics for s in range(3)]
    assert all(m["batch/advantage_abs_max"] == 0.0 for m in steps)
    kls = [m["actor/distill_top_k_kl"] for m in steps]
    assert kls[2] < kls[1] < kls[0], kls
    assert (token_7() > start).all()
