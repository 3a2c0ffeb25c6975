"""Pure tensor algorithms of the learner: advantage estimators, policy losses with off-policy
correction, a critic's value loss, KL estimators and KL controllers. No I/O, no distributed
code; of async_rl they use only :mod:`async_rl.plugins` (their registries).

:mod:`~async_rl.algos.options` holds their names, what each needs and the loss's options
without importing torch (the config reads it), so this package imports no submodule itself::

    from async_rl.algos import advantages, losses, kl
    adv = advantages.compute("grpo", rewards=r, group_index=g, response_mask=m)
    loss, metrics = losses.compute("decoupled_ppo", logp=..., old_logp=..., behav_logp=...,
                                   advantages=adv, mask=m, config={"is_cap": 2.0})
    value = kl.estimate("k3", logp, ref_logp)
"""
