"""A served model's servers and actor killed under load (rollout/served.py,
launch/served_models.py), on a real vLLM engine under Ray of the module's own. Not timed
(tests/lanes.py): a tail test, run by whichever lane reaches it first; the served model's
other checks share the server pool's Ray in tests/rollout/test_rollout_pool.py."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import ray

from async_rl.config import load_config
from async_rl.launch.ray_cluster import init_ray
from async_rl.rollout.types import Sampling, served_model_actor
from run_helpers import until

pytestmark = [pytest.mark.integration, pytest.mark.ray, pytest.mark.vllm, pytest.mark.assets, pytest.mark.slow]


@pytest.fixture(scope="module")
def judge(tiny_assets):
    """``models.judge`` as the driver runs it (:class:`ServedModels`): the tiny model on a
    server of its own (no CPU reserved). Yields the models, their console lines, the loop and the config."""
    from async_rl.launch.served_models import ServedModels

    cfg = load_config(None, [f"learner.model_path={tiny_assets.model_dir}", f"models.judge.model_path={tiny_assets.model_dir}",
                             "models.judge.cpus_per_server=0", "models.judge.vllm.max_model_len=256", "trainer.run_name=served-healing"])
    init_ray(num_cpus=2)
    loop = asyncio.new_event_loop()
    said: list[str] = []
    models = ServedModels(cfg, said.append)
    try:
        loop.run_until_complete(asyncio.wait_for(models.start(None), 300))
        yield models, said, loop, cfg
    finally:
        loop.run_until_complete(models.shutdown())
        loop.close()
        ray.shutdown()


def test_a_killed_served_server_is_replaced_and_every_request_answered_once(judge):
    """A served model's server SIGKILLed while requests run on it, at default settings: every
    request gets exactly one answer (those in flight retried on the replacement), the server
    is replaced and the driver's console says so once; a second server added live serves
    too; the model's actor killed is restarted under its name by the driver's health check,
    its servers with it."""
    models, said, loop, cfg = judge
    actor = models.actors["judge"]
    before = ray.get(actor.stats.remote())
    pid = ray.get(actor.health.remote())[0].pid
    sampling = Sampling(temperature=1.0, max_tokens=240, ignore_eos=True)

    async def go():
        calls = [actor.generate.remote([1, 2, 3, i], 2, sampling) for i in range(8)]
        await until(lambda: ray.get(actor.health.remote())[0].running_requests > 0, "requests running", 60, lambda: "")
        os.kill(pid, signal.SIGKILL)
        answers = await asyncio.wait_for(asyncio.gather(*calls), 240)
        await models.watch_once()
        return answers

    answers = loop.run_until_complete(go())
    assert all(len(a) == 2 and all(len(c.token_ids) == 240 for c in a) for a in answers)
    after = ray.get(actor.stats.remote())
    assert after["models/judge/answered"] - before["models/judge/answered"] == 8
    assert after["models/judge/failed"] == before["models/judge/failed"]
    assert after["models/judge/retries"] > before["models/judge/retries"] and after["models/judge/restarts"] == before["models/judge/restarts"] + 1
    assert [line for line in said if "judge-0 died" in line and line.startswith("models.judge: ")] != [], said
    assert [s["server_id"] for s in models.servers()] == ["judge-0"] and models.servers()[0]["pid"] != pid
    assert loop.run_until_complete(models.scale("judge", 2, 10.0)) == ["models.judge: judge-1 added"]
    outs = ray.get([actor.generate.remote([4, 5, 6], 1, sampling) for _ in range(4)])
    assert all(len(o[0].token_ids) == 240 for o in outs) and models.num_servers("judge") == 2
    assert loop.run_until_complete(models.scale("judge", 1, 10.0)) == ["models.judge: judge-1 drained and stopped"]

    ray.kill(actor, no_restart=True)  # the model's actor itself dies: found by the next check, restarted under its name
    assert loop.run_until_complete(asyncio.wait_for(models.watch_once(), 300)) is True  # a new server listed: servers.json rewritten
    assert any("its actor died" in line for line in said) and models.actor_restarts == 1, said
    new = ray.get_actor(served_model_actor(cfg.trainer.run_name, "judge"))
    (c,) = ray.get(new.generate.remote([7, 8, 9], 1, Sampling(temperature=1.0, max_tokens=8)))
    assert len(c.token_ids) >= 1 and [s["server_id"] for s in models.servers()] == ["judge-0"]
