"""Starting or joining the Ray cluster the run's actors live in.

Ray starts its worker processes with ``nice 15``, so every actor (inference servers and
their vLLM processes, learner ranks) would lose the CPU to anything at normal priority:
the driver, Redis, Ray's own daemons. On a small CPU machine that cost the rollout pool
about a quarter of vLLM's throughput. A cluster we start ourselves runs its workers at
normal priority; ``deploy/ray_node.sh`` does the same for clusters started by hand.

Ray's GCS keeps the events of the last 100,000 tasks (about 3.4 KB each: 340 MB); a run
makes about one task per weight update, so the GCS grew 3 MB per 1,000 updates for days.
A cluster started here (or by ``deploy/ray_node.sh``) keeps the last 1,000.
"""

from __future__ import annotations

import os

WORKER_NICENESS = 0
"""Niceness of Ray worker processes in a cluster started here (Ray's default is 15)."""

TASK_EVENTS_KEPT = 1000
"""Tasks whose events the GCS keeps for ``ray list tasks`` (Ray's default is 100,000)."""


def init_ray(address: str | None = None, num_cpus: int | None = None, **kwargs) -> None:
    """``ray.init`` for async-rl: join ``address`` if given, else start a local cluster.

    Args:
        address: an existing cluster (``ray.address``); its nodes set their own niceness.
        num_cpus: CPUs of a local cluster (ignored when joining).
        kwargs: passed to ``ray.init`` (``log_to_driver`` etc.).
    """
    import ray

    kwargs.setdefault("include_dashboard", False)
    kwargs.setdefault("log_to_driver", False)
    if address is None:
        # "local": a cluster of our own even when another runs on this machine (plain ray.init()
        # would join the one /tmp/ray/ray_current_cluster names and refuse our settings).
        ray.init(address="local", num_cpus=num_cpus, _system_config={"worker_niceness": WORKER_NICENESS, "task_events_max_num_task_in_gcs": TASK_EVENTS_KEPT}, **kwargs)
        return
    try:
        ray.init(address=address, **kwargs)
    except ConnectionError as exc:
        raise ConnectionError(f"cannot join the Ray cluster at ray.address={address!r}: {exc}{_auth_hint()}") from exc


def _auth_hint() -> str:
    """What to try when joining failed and token authentication may be the reason."""
    if os.environ.get("RAY_AUTH_MODE") == "token":
        return ""
    # Ray reads RAY_AUTH_MODE when it is imported, so it must be set before the process starts.
    return (". Clusters started with `ray start` may use token authentication (Ray 2.60): run with RAY_AUTH_MODE=token "
            "and the head node's token in ~/.ray/auth_token (or RAY_AUTH_TOKEN), as every `ray start --address` needs too "
            "(deploy/ray_node.sh, docs/training.md#a-ray-cluster)")
