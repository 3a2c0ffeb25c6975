"""A user's own advantage estimator and policy loss, named ``path/to/file.py:function`` in the
config: validated when the config loads (file, function, declaration, signature), computed
through the same entry points as the built-ins, their outputs' shapes checked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from async_rl.algos import advantages, losses
from async_rl.algos.options import ADVANTAGE_KEY, LossInfo, estimator_info, loss_info, user_algorithm
from async_rl.config import ConfigError, load_config
from user_algorithms import USER_ALGORITHMS



@pytest.fixture
def user_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_algos.py"
    path.write_text(USER_ALGORITHMS)
    return path


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(None, list(overrides))
    return str(err.value)


def test_a_user_estimator_and_loss_load_with_the_needs_they_declare(user_file: Path) -> None:
    cfg = load_config(None, [f"algorithm.advantage.name={user_file}:centred", f"algorithm.loss.name={user_file}:plain_pg"])
    assert estimator_info(cfg.algorithm.advantage.name).group and estimator_info(cfg.algorithm.advantage.name).options == ("eps",)
    assert loss_info(cfg.algorithm.loss.name) == LossInfo() and not cfg.algorithm.needs_critic
    # A declared group estimator is held to the rule of the built-in ones.
    assert f"algorithm.advantage.name='{user_file}:centred' compares samples of the same prompt and needs rollout.n > 1" in _error(
        f"algorithm.advantage.name={user_file}:centred", "rollout.n=1")


def test_what_cannot_be_used_is_refused_when_the_config_loads_naming_the_key(user_file: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.py"
    cases = {
        f"{missing}:centred": "FileNotFoundError: estimator file",
        f"{user_file}:absent": "AttributeError",
        f"{user_file}:not_a_function": "is int, not a function",
        f"{user_file}:two_arguments": "cannot be called as two_arguments(rewards, response_mask, group_index)",
        f"{user_file}:unknown_option": "declares options ['temperature'] that algorithm.advantage does not have",
    }
    for spec, expected in cases.items():
        msg = _error(f"algorithm.advantage.name={spec}")
        assert f"algorithm.advantage.name={spec!r}" in msg and expected in msg, msg
    msg = _error(f"algorithm.loss.name={user_file}:one_column")
    assert "algorithm.loss.name=" in msg and "cannot be called as one_column(logp, prox_logp, advantages, mask, options)" in msg


def test_the_user_functions_compute_through_the_built_ins_entry_points(user_file: Path) -> None:
    rewards, mask = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.ones(4, 3)
    group_index = torch.tensor([0, 0, 1, 1])
    adv, returns = advantages.compute_with_returns(f"{user_file}:centred", rewards=rewards, response_mask=mask,
                                                   group_index=group_index, eps=1e-6)
    assert adv.shape == (4, 3) and torch.equal(adv, returns)  # advantages alone: returns are the advantages
    assert adv[0, 0] > 0 > adv[1, 0] and adv[2, 0] == adv[3, 0] == 0
    logp = torch.full((4, 3), -1.0, requires_grad=True)
    loss, metrics = losses.compute(f"{user_file}:plain_pg", logp=logp, old_logp=logp.detach(), behav_logp=logp.detach(),
                                   advantages=adv, mask=mask)
    loss.backward()
    assert torch.isfinite(loss) and metrics["pg_clipfrac"] == 0.0 and logp.grad is not None and logp.grad.abs().sum() > 0
    assert user_algorithm(f"{user_file}:centred", ADVANTAGE_KEY).__globals__["CALLS"] == ["centred", "plain_pg"]  # one module, loaded once
    with pytest.raises(ValueError, match=r"returned \[\(4, 1\), \(4, 1\)\]|returned \(4, 1\): expected advantages \[B, T\] = \(4, 3\)"):
        advantages.compute(f"{user_file}:one_column", rewards=rewards, response_mask=mask)
