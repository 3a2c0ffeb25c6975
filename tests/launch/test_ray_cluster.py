"""Starting or joining Ray: a run without ``ray.address`` gets a cluster of its own even when
another Ray cluster runs on this machine; a failed join says how to authenticate."""

from __future__ import annotations

import re
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
from async_rl.launch.ray_cluster import init_ray
import ray
init_ray(num_cpus=1)
print("GCS", ray.get_runtime_context().gcs_address)
ray.shutdown()
"""


@pytest.mark.integration
def test_a_run_without_an_address_starts_its_own_cluster_beside_another(other_cluster: str) -> None:
    done = subprocess.run([sys.executable, "-c", _OWN], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    own = re.search(r"GCS (\S+)", done.stdout)
    assert own and own.group(1) != other_cluster


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
