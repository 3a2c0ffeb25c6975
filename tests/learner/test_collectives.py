"""Every learner collective gets its tensors on the group's device: a learner step on the CPU,
with the group's device declared ``cuda`` (simulated, see ``simulated_cuda``) and the
collectives strict, runs every path that reduces or broadcasts a tensor."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
from learner_helpers import learner_config, make_groups, prepare_groups
from simulated_cuda import simulated_cuda

from async_rl.learner import collectives
from async_rl.learner.model import DistInfo, load_sharded
from async_rl.learner.train_step import Trainer


@pytest.mark.dist
def test_strict_mode_names_a_tensor_left_on_the_cpu(one_rank: DistInfo) -> None:
    with simulated_cuda() as cuda:
        with pytest.raises(collectives.CollectiveDeviceError, match="metrics: tensor on cpu.*runs on cuda"):
            collectives.all_reduce(torch.ones(2), cuda, "metrics")
        assert collectives.all_reduce(torch.ones(2, device=cuda), cuda, "metrics").tolist() == [1.0, 1.0]


@pytest.mark.dist
def test_outside_strict_mode_a_stray_tensor_is_moved_and_counted(one_rank: DistInfo) -> None:
    before = collectives.moved["probe"]
    with simulated_cuda() as cuda, collectives.strict_devices(False):
        stray = torch.ones(2)
        assert collectives.all_reduce(stray, cuda, "probe") is stray and stray.tolist() == [1.0, 1.0]
    assert collectives.moved["probe"] == before + 1


def _combinations() -> list[tuple[str, ...]]:
    """Every loss x a group estimator and REINFORCE++ x one or several updates per step x KL
    on or off (entropy loss with the KL), trimmed to the pairs that exercise different paths."""
    out = []
    for loss in ("ppo", "decoupled_ppo", "tis", "gspo", "cispo"):
        for updates in (("learner.ppo_mini_batches=1",), ("learner.ppo_mini_batches=2", "learner.ppo_epochs=2")):
            for kl in ((), ("algorithm.loss.kl_coef=0.1", "algorithm.loss.entropy_coef=0.01")):
                recompute = ("algorithm.recompute_proximal=false",) if loss == "tis" else ()
                advantage = "algorithm.advantage.name=reinforce_pp" if kl else "algorithm.advantage.name=grpo"
                out.append((f"algorithm.loss.name={loss}", advantage, *recompute, *updates, *kl))
    kl_in_reward = ("algorithm.kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive")
    out.append(("algorithm.loss.name=decoupled_ppo", "algorithm.advantage.name=grpo", "learner.ppo_mini_batches=2", *kl_in_reward))
    out.append(("algorithm.loss.name=ppo", "algorithm.advantage.name=rloo", "learner.ppo_mini_batches=1", *kl_in_reward))
    critic = ("algorithm.advantage.name=gae", "learner.critic.ppo_mini_batches=2", "learner.critic.ppo_epochs=2")
    out.append(("algorithm.loss.name=decoupled_ppo", "learner.ppo_mini_batches=2", *critic))
    return out


@pytest.mark.dist
@pytest.mark.parametrize("overrides", _combinations(), ids=lambda o: "-".join(x.split("=")[1] for x in o))
def test_a_learner_step_puts_every_collective_tensor_on_the_device(
    tiny_model: Path, one_rank: DistInfo, tmp_path: Path, overrides: tuple[str, ...]
) -> None:
    cfg = learner_config(tiny_model, tmp_path, "strict", *overrides)
    policy = load_sharded(str(tiny_model), cfg.learner, one_rank.device, trainable=True)
    reference = load_sharded(str(tiny_model), cfg.learner, one_rank.device, trainable=False) if cfg.algorithm.needs_reference else None
    critic = load_sharded(str(tiny_model), cfg.learner, one_rank.device, trainable=True, value_model=True) if cfg.algorithm.needs_critic else None
    batch = prepare_groups(make_groups(4, seed=5), 64, 512).batch
    with simulated_cuda() as cuda:
        info = dataclasses.replace(one_rank, device=cuda)
        trainer = Trainer(policy, reference, cfg.learner, cfg.algorithm, info, cfg.trainer.total_steps, cfg.trainer.seed, critic=critic)
        result = trainer.step(batch, 0)
        assert collectives.broadcast_bytes(b"stop", info.device, info.rank) == b"stop"  # the feed's messages, the publisher's names
    assert result.optimizer_steps >= 1


def test_no_learner_module_calls_a_collective_directly() -> None:
    """The simulated-CUDA step proves the paths it runs; this covers every other line."""
    package = Path(collectives.__file__).parent
    direct = re.compile(r"\bdist\.(all_reduce|broadcast|barrier|all_gather\w*|reduce_scatter\w*|gather|scatter|send|recv|reduce)\(")
    offenders = [f"{path.name}:{n}" for path in sorted(package.glob("*.py")) if path.name != "collectives.py"
                 for n, line in enumerate(path.read_text().splitlines(), 1) if direct.search(line)]
    assert offenders == [], f"call learner.collectives instead of torch.distributed at {offenders}"
