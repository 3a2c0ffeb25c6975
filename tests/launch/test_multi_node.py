"""The multi-node layout on one host, as a new user would set it up (docs/training.md#a-ray-cluster):
a Ray head and a second raylet of one CPU each, started with `ray start` and token
authentication, an external redis-server, and `async-rl train` with `ray.address` and
`queue.redis_url`. The inference server and the learner rank land on different raylets."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from ray_nodes import start_node, stop_nodes, wait_for_log
from run_helpers import step_versions, train_cli, write_config

from async_rl.queue import EmbeddedRedis

pytestmark = pytest.mark.integration


@pytest.fixture()
def two_raylets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Address of a two-node Ray cluster on this host (one CPU a node), token-authenticated."""
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", secrets.token_hex(32))  # no ~/.ray/auth_token needed
    monkeypatch.setenv("RAY_worker_niceness", "0")
    procs = []
    try:
        procs.append(start_node(["--head", "--port=0", "--num-cpus=1", "--include-dashboard=false"], tmp_path / "head.log"))
        address = wait_for_log(tmp_path / "head.log", procs[0], r"ray start --address='([^']+)'").group(1)
        procs.append(start_node([f"--address={address}", "--num-cpus=1"], tmp_path / "node.log"))
        wait_for_log(tmp_path / "node.log", procs[1], r"Ray runtime started")
        yield address
    finally:
        stop_nodes(procs)


_ACTOR_NODES = """
import json, sys, ray
from ray._private import state
ray.init(address=sys.argv[1], log_to_driver=False)
print(json.dumps([[a["ActorClassName"], a["Address"]["NodeID"]] for a in state.actors().values()]))
"""


def _actor_nodes(address: str) -> dict[str, set[str]]:
    """Node ids of the cluster's actors, by class name (dead ones included), from the GCS."""
    out = subprocess.run([sys.executable, "-c", _ACTOR_NODES, address], capture_output=True, text=True, timeout=120, check=True).stdout
    nodes: dict[str, set[str]] = {}
    for name, node in json.loads(out.strip().splitlines()[-1]):
        nodes.setdefault(name, set()).add(node)
    return nodes


def test_quickstart_trains_on_two_raylets_with_an_external_redis(tiny_assets, tmp_path: Path, two_raylets: str) -> None:
    with EmbeddedRedis(tmp_path / "redis") as redis_url:
        config = write_config(tiny_assets, tmp_path, steps=2, ray={"address": two_raylets}, queue={"redis_url": redis_url},
                              trainer={"val_every": 0})
        done = train_cli(config, timeout_s=900)
        assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert step_versions(tmp_path / "run")[-1] == 2
    password = urlsplit(redis_url).password
    leaked = [p for p in (tmp_path / "run").rglob("*") if p.is_file() and password.encode() in p.read_bytes()]
    assert password and leaked == [], leaked  # not in resolved_config.yaml, W&B's config or any log
    nodes = _actor_nodes(two_raylets)
    server, learner = nodes.get("InferenceServer", set()), nodes.get("LearnerActor", set())
    assert len(server) == 1 and len(learner) == 1 and server != learner, nodes
