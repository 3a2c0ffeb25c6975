"""The PPO-with-critic math (value loss, explained variance, GAE, KL in the reward, KL controllers)
against reference derivations written element by element in plain Python floats (the formulas of
verl's ``compute_value_loss``, ``compute_gae_advantage_return``, ``kl_penalty``,
``apply_kl_penalty`` and ``AdaptiveKLController``; verl is not a dependency)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from async_rl.algos import advantages, kl, losses
from async_rl.algos.options import AGG_MODES

TOL = 1e-5


def _random_batch(seed: int, b: int = 5, t: int = 9) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(b, t, generator=g) > 0.25).double()
    mask[0] = 0  # an empty row
    mask[1, 0] = 1
    return {
        "values": torch.randn(b, t, generator=g, dtype=torch.float64),
        "old_values": torch.randn(b, t, generator=g, dtype=torch.float64),
        "returns": torch.randn(b, t, generator=g, dtype=torch.float64),
        "rewards": torch.randn(b, t, generator=g, dtype=torch.float64),
        "logp": -torch.rand(b, t, generator=g, dtype=torch.float64) * 3,
        "ref_logp": -torch.rand(b, t, generator=g, dtype=torch.float64) * 3,
        "mask": mask,
    }


def _ref_agg(loss: list[list[float]], mask: list[list[float]], mode: str) -> float:
    rows = [(sum(l * m for l, m in zip(lr, mr)), sum(mr), len(mr)) for lr, mr in zip(loss, mask)]
    if mode == "token-mean":
        return sum(s for s, _, _ in rows) / max(sum(n for _, n, _ in rows), 1)
    kept = [(s, n, t) for s, n, t in rows if n > 0]
    per = {"seq-mean-token-sum": [s for s, _, _ in kept], "seq-mean-token-mean": [s / n for s, n, _ in kept],
           "seq-mean-token-sum-norm": [s / t for s, _, t in kept]}[mode]
    return sum(per) / max(len(per), 1)


def _ref_value_loss(v, v_old, ret, mask, clip, mode):
    loss, clipped_count, n = [], 0.0, 0.0
    for vr, vor, rr, mr in zip(v, v_old, ret, mask):
        row = []
        for x, xo, r, m in zip(vr, vor, rr, mr):
            x_clip = min(max(x, xo - clip), xo + clip)
            a, c = (x - r) ** 2, (x_clip - r) ** 2
            row.append(max(a, c))
            clipped_count += m * (c > a)
            n += m
        loss.append(row)
    return 0.5 * _ref_agg(loss, mask, mode), clipped_count / max(n, 1)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_value_loss_matches_the_reference(mode: str, seed: int) -> None:
    d = _random_batch(seed)
    values = d["values"].clone().requires_grad_(True)
    loss, metrics = losses.value_loss(values, d["old_values"], d["returns"], d["mask"], 0.5, mode)
    expected, clipfrac = _ref_value_loss(*(d[k].tolist() for k in ("values", "old_values", "returns", "mask")), 0.5, mode)
    assert loss.item() == pytest.approx(expected, abs=TOL)
    assert metrics["vf_clipfrac"].item() == pytest.approx(clipfrac, abs=TOL)
    assert 0 < clipfrac < 1  # both branches are exercised
    loss.backward()
    assert values.grad is not None and torch.all(values.grad[d["mask"] == 0] == 0)


def test_value_loss_gradient_is_zero_where_the_clipped_term_wins() -> None:
    old = torch.tensor([[0.0, 0.0]])
    values = torch.tensor([[1.0, 0.1]], requires_grad=True)  # first token moved past the clip range
    returns = torch.tensor([[-1.0, 1.0]])
    loss, metrics = losses.value_loss(values, old, returns, torch.ones(1, 2), 0.2)
    loss.backward()
    # token 0: (1 - -1)^2 = 4 > (0.2 - -1)^2 = 1.44, unclipped wins: grad 0.5 * 2 * 2 / 2 = 1
    # token 1: inside the clip range, both terms are (0.1 - 1)^2: grad 0.5 * 2 * -0.9 / 2
    assert values.grad[0].tolist() == pytest.approx([1.0, -0.45])
    old2 = torch.tensor([[0.0]])
    v2 = torch.tensor([[0.5]], requires_grad=True)
    loss2, m2 = losses.value_loss(v2, old2, torch.tensor([[1.0]]), torch.ones(1, 1), 0.2)
    loss2.backward()  # clipped (0.2 - 1)^2 = 0.64 > (0.5 - 1)^2 = 0.25: the clipped term, no gradient
    assert v2.grad.item() == 0 and m2["vf_clipfrac"].item() == 1 and loss2.item() == pytest.approx(0.32)


def test_value_loss_without_clipping_and_bad_arguments() -> None:
    d = _random_batch(3)
    loss, metrics = losses.value_loss(d["values"], d["old_values"], d["returns"], d["mask"], None)
    m = d["mask"]
    assert loss.item() == pytest.approx(0.5 * ((d["values"] - d["returns"]).square() * m).sum().item() / m.sum().item())
    assert metrics["vf_clipfrac"].item() == 0
    with pytest.raises(ValueError, match="cliprange must be > 0"):
        losses.value_loss(d["values"], d["old_values"], d["returns"], m, 0.0)
    with pytest.raises(ValueError, match="unknown agg_mode 'mean'"):
        losses.value_loss(d["values"], d["old_values"], d["returns"], m, 0.2, "mean")


def _ref_var(xs: list[float]) -> float:
    mean = sum(xs) / len(xs)
    return sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)


def test_explained_variance() -> None:
    d = _random_batch(4)
    pairs = [(v, r) for vr, rr, mr in zip(d["values"].tolist(), d["returns"].tolist(), d["mask"].tolist())
             for v, r, m in zip(vr, rr, mr) if m]
    expected = 1 - _ref_var([r - v for v, r in pairs]) / _ref_var([r for _, r in pairs])
    assert losses.explained_variance(d["values"], d["returns"], d["mask"]).item() == pytest.approx(expected, abs=TOL)
    ret, mask = d["returns"], d["mask"]
    assert losses.explained_variance(ret, ret, mask).item() == pytest.approx(1.0)
    mean = (ret * mask).sum() / mask.sum()
    assert losses.explained_variance(torch.full_like(ret, mean.item()), ret, mask).item() == pytest.approx(0.0, abs=1e-9)
    assert losses.explained_variance(ret, torch.ones_like(ret), mask).item() == 0  # Var(R) = 0
    one = torch.zeros_like(mask)
    one[1, 0] = 1
    assert losses.explained_variance(ret, ret + 1, one).item() == 0  # one token


def _ref_gae(rewards, values, mask, gamma, lam):
    b, t = len(rewards), len(rewards[0])
    adv = [[0.0] * t for _ in range(b)]
    for i in range(b):
        next_value, last = 0.0, 0.0
        for j in reversed(range(t)):
            delta = rewards[i][j] * mask[i][j] + gamma * next_value - values[i][j]
            if mask[i][j]:
                last = delta + gamma * lam * last
                next_value = values[i][j]
            adv[i][j] = last
    returns = [[a + v for a, v in zip(ar, vr)] for ar, vr in zip(adv, values)]
    flat = [a for ar, mr in zip(adv, mask) for a, m in zip(ar, mr) if m]
    mean, var = sum(flat) / len(flat), _ref_var(flat)
    whitened = [[(a - mean) / math.sqrt(var + 1e-8) * m for a, m in zip(ar, mr)] for ar, mr in zip(adv, mask)]
    return whitened, returns


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_gae_matches_the_reference(gamma: float, lam: float) -> None:
    d = _random_batch(5)
    adv, ret = advantages.compute_with_returns(
        "gae", rewards=d["rewards"], response_mask=d["mask"], values=d["values"], gamma=gamma, lam=lam)
    ref_adv, ref_ret = _ref_gae(d["rewards"].tolist(), d["values"].tolist(), d["mask"].tolist(), gamma, lam)
    assert torch.allclose(adv, torch.tensor(ref_adv, dtype=adv.dtype), atol=TOL)
    assert torch.allclose(ret, torch.tensor(ref_ret, dtype=ret.dtype), atol=TOL)


def _ref_kl(kind: str, lp: float, rlp: float) -> float:
    if kind == "k1":
        return lp - rlp
    if kind == "k2":
        return 0.5 * (lp - rlp) ** 2
    log_r = min(max(rlp - lp, -20.0), 20.0)
    return min(max(math.exp(log_r) - log_r - 1, -10.0), 10.0)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_estimators_and_penalty_match_the_reference(kind: str) -> None:
    d = _random_batch(6)
    token_kl = kl.estimate(kind, d["logp"], d["ref_logp"])
    ref = [[_ref_kl(kind, a, b) for a, b in zip(ar, br)] for ar, br in zip(d["logp"].tolist(), d["ref_logp"].tolist())]
    assert torch.allclose(token_kl, torch.tensor(ref, dtype=token_kl.dtype), atol=TOL)

    rewards, current = kl.penalize_rewards(d["rewards"], token_kl, d["mask"], 0.05)
    mask = d["mask"].tolist()
    ref_rewards = [[(s - 0.05 * k) * m for s, k, m in zip(sr, kr, mr)] for sr, kr, mr in zip(d["rewards"].tolist(), ref, mask)]
    ref_current = sum(sum(k * m for k, m in zip(kr, mr)) / max(sum(mr), 1) for kr, mr in zip(ref, mask)) / len(mask)
    assert torch.allclose(rewards, torch.tensor(ref_rewards, dtype=rewards.dtype), atol=TOL)
    assert current.item() == pytest.approx(ref_current, abs=TOL)


def test_adaptive_kl_controller_follows_ziegler_et_al() -> None:
    ctrl = kl.AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10000)
    expected = 0.2
    rng = random.Random(0)
    for _ in range(50):
        current, n = rng.uniform(0.0, 15.0), rng.randint(1, 512)
        ctrl.update(current, n)
        expected *= 1 + min(max(current / 6.0 - 1, -0.2), 0.2) * n / 10000
        assert ctrl.value == pytest.approx(expected, rel=1e-12)
    high = kl.AdaptiveKLController(0.1, 0.01, 100)
    high.update(1.0, 100)  # KL 100x the target: the error is capped at +20%
    assert high.value == pytest.approx(0.12)
    low = kl.AdaptiveKLController(0.1, 0.01, 100)
    low.update(0.0, 50)
    assert low.value == pytest.approx(0.1 * (1 - 0.2 * 0.5))
    restored = kl.AdaptiveKLController(0.1, 0.01, 100)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.value == ctrl.value


def test_fixed_kl_controller_and_invalid_adaptive_settings() -> None:
    ctrl = kl.FixedKLController(0.05)
    ctrl.update(100.0, 512)
    assert ctrl.value == 0.05 and ctrl.state_dict() == {"value": 0.05}
    for bad in ({"init_kl_coef": 0.0}, {"target_kl": -1.0}, {"horizon": 0}, {"target_kl": float("nan")}):
        args = {"init_kl_coef": 0.1, "target_kl": 6.0, "horizon": 10000} | bad
        name = next(iter(bad))
        with pytest.raises(ValueError, match=f"{name} must be a finite number > 0"):
            kl.AdaptiveKLController(**args)
