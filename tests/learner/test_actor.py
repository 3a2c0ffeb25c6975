"""The learner as Ray actors: two ranks train from the queue, rank 0 exposes the weight sender."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import ray
from learner_helpers import learner_config, make_groups

from async_rl.launch.ray_cluster import init_ray
from async_rl.learner.actor import start_learners
from async_rl.sync.auth import RunSecret
from async_rl.learner.checkpoint import list_checkpoints
from async_rl.queue import ReplayQueue

pytestmark = [pytest.mark.redis, pytest.mark.ray, pytest.mark.dist, pytest.mark.slow]  # its two LearnerActor ranks form a process group


@pytest.mark.integration
def test_two_rank_actors_train_checkpoint_and_commit(tiny_model: Path, redis_url: str, tmp_path: Path) -> None:
    run = f"actor-{uuid.uuid4().hex[:8]}"
    with ReplayQueue(redis_url, run) as q:
        for group in make_groups(8, seed=11, run=run):
            q.put(group)
    cfg = learner_config(tiny_model, tmp_path, run, "learner.world_size=2", "trainer.total_steps=2", "learner.cpus_per_rank=0.5")
    init_ray(num_cpus=2)
    try:
        actors = start_learners(cfg, redis_url, RunSecret.generate())
        assert ray.get(actors[0].sync_address.remote()).startswith("tcp://")
        assert ray.get(actors[1].sync_address.remote()) is None
        results = ray.get([a.run.remote() for a in actors], timeout=180)
        ray.get([a.close.remote() for a in actors], timeout=60)
    finally:
        ray.shutdown()
    assert [r["version"] for r in results] == [2, 2]
    assert results[0]["steps"][0]["actor/pg_loss"] == results[1]["steps"][0]["actor/pg_loss"]
    assert results[0]["steps"][1]["time/sync"] > 0  # gathered for the sender every step (no servers registered)
    assert [c.name for c in list_checkpoints(tmp_path)] == ["step_00000002"]
    with ReplayQueue(redis_url, run) as q:
        assert q.stats()["pending"] == 0 and q.stats()["depth"] == 0
