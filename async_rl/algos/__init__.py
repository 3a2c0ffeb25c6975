"""Pure tensor algorithms of the learner: advantage estimators, policy losses with off-policy
correction, a critic's value loss, KL estimators and KL controllers. No I/O, no distributed
code, no dependency on other async_rl modules.

    from async_rl.algos import advantages, losses, kl
    adv = advantages.compute("grpo", rewards=r, group_index=g, response_mask=m)
    loss, metrics = losses.compute("decoupled_ppo", logp=..., old_logp=..., behav_logp=...,
                                   advantages=adv, mask=m, config={"is_cap": 2.0})
    value = kl.estimate("k3", logp, ref_logp)
"""

from . import advantages, kl, losses

__all__ = ["advantages", "kl", "losses"]
