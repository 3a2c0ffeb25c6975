"""Starting or joining Ray: a run without ``ray.address`` gets a cluster of its own even when
another Ray cluster runs on this machine; a failed join says how to authenticate."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from ray_nodes import start_node, stop_nodes, wait_for_log


@pytest.fixture()
def other_cluster(tmp_path: Path) -> Iterator[str]:
    """A Ray head started with ``ray start`` (someone else's cluster); its GCS address."""
    head = start_node(["--head", "--port=0", "--num-cpus=1", "--include-dashboard=false"], tmp_path / "head.log")
    try:
        yield wait_for_log(tmp_path / "head.log", head, r"ray start --address='([^']+)'").group(1)
    finally:
        stop_nodes([head])


_OWN = """
import json, os, ray
from ray._private import ray_constants
from listening import tree_listeners
from async_rl.launch.ray_cluster import LOOPBACK, LOOPBACK_ENV, init_ray

init_ray(num_cpus=1)

@ray.remote(num_cpus=0)
def env():
    return {name: os.environ.get(name) for name in LOOPBACK_ENV}

print(json.dumps({"gcs": ray.get_runtime_context().gcs_address, "node": ray.util.get_node_ip_address(), "env": ray.get(env.remote()),
                  "multi_node": ray_constants.ENABLE_RAY_CLUSTER,
                  "open": [f"{x.name} {x.address}:{x.port}" for x in tree_listeners(os.getpid()) if x.address != LOOPBACK]}))
ray.shutdown()
"""


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.integration
def test_a_run_without_an_address_starts_its_own_cluster_beside_another(other_cluster: str) -> None:
    """... on loopback: Ray's daemons, the driver and the workers listen on 127.0.0.1 only, the
    workers get the loopback environment, and joining a cluster afterwards would still find its address."""
    from async_rl.launch.ray_cluster import LOOPBACK_ENV

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    for name in LOOPBACK_ENV:
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", _OWN], check=False, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    own = json.loads(done.stdout.strip().splitlines()[-1])
    assert own["gcs"] != other_cluster and own["gcs"].startswith("127.0.0.1:")
    assert own["node"] == "127.0.0.1" and own["env"] == LOOPBACK_ENV and own["multi_node"] is True
    assert own["open"] == []


def test_a_failed_join_names_token_authentication(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    from async_rl.launch import ray_cluster

    def refuse(**_: object) -> None:
        raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379")

    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with pytest.raises(ConnectionError, match=r"ray.address='10.0.0.1:6379'.*RAY_AUTH_MODE=token.*auth_token"):
        ray_cluster.init_ray("10.0.0.1:6379")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    with pytest.raises(ConnectionError) as err:
        ray_cluster.init_ray("10.0.0.1:6379")
    assert "RAY_AUTH_MODE" not in str(err.value)
