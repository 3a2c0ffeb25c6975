"""Starting or joining the Ray cluster the run's actors live in.

Ray starts its worker processes with ``nice 15``, so every actor (inference servers and
their vLLM processes, learner ranks) would lose the CPU to anything at normal priority:
the driver, Redis, Ray's own daemons. On a small CPU machine that cost the rollout pool
about a quarter of vLLM's throughput. A cluster we start ourselves runs its workers at
normal priority; ``deploy/ray_node.sh`` does the same for clusters started by hand.

Ray's GCS keeps the events of the last 100,000 tasks (about 3.4 KB each: 340 MB); a run
makes about one task per weight update, so the GCS grew 3 MB per 1,000 updates for days.
A cluster started here (or by ``deploy/ray_node.sh``) keeps the last 1,000.

**One rule for where a run listens** (docs/security.md, "Ports"): a run without
``ray.address`` starts its own cluster, which is the single-node case, and everything it
starts listens on loopback. Ray's node address is ``127.0.0.1``, so its daemons, the driver and
every worker bind it, and the run's own sockets follow it: the learner binds its process
group's store, the weight group's store and the ZeroMQ control socket on the address
``ray.util.get_node_ip_address()`` names. The actors' environment puts gloo's and NCCL's
sockets and vLLM's on loopback too (:data:`LOOPBACK_ENV`). A run that joins a cluster binds
each node's cluster address instead (the one ``ray start --node-ip-address`` gave it).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

WORKER_NICENESS = 0
"""Niceness of Ray worker processes in a cluster started here (Ray's default is 15)."""

TASK_EVENTS_KEPT = 1000
"""Tasks whose events the GCS keeps for ``ray list tasks`` (Ray's default is 100,000)."""

LOOPBACK = "127.0.0.1"
"""The node address of a cluster started here: what everything of a single-node run binds."""

LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "VLLM_HOST_IP": LOOPBACK}
"""Environment of the actors of a cluster started here (a variable set in the driver's own
environment wins): gloo's pair sockets (learner group, weight group, vLLM's groups) and NCCL's
bootstrap sockets on the loopback interface, and the address vLLM names itself by
(its internal sockets) on loopback."""

log = logging.getLogger(__name__)


def init_ray(address: str | None = None, num_cpus: int | None = None, **kwargs) -> None:
    """``ray.init`` for async-rl: join ``address`` if given, else start a local cluster on
    loopback (the module's docstring).

    Args:
        address: an existing cluster (``ray.address``); its nodes set their own niceness and address.
        num_cpus: CPUs of a local cluster (ignored when joining).
        kwargs: passed to ``ray.init`` (``log_to_driver`` etc.).
    """
    import ray

    kwargs.setdefault("include_dashboard", False)
    kwargs.setdefault("log_to_driver", False)
    if address is None:
        env = {name: value for name, value in LOOPBACK_ENV.items() if name not in os.environ}
        # "local": a cluster of our own even when another runs on this machine (plain ray.init()
        # would join the one /tmp/ray/ray_current_cluster names and refuse our settings).
        with _single_machine():
            ray.init(address="local", num_cpus=num_cpus, _node_ip_address=LOOPBACK, runtime_env={"env_vars": env},
                     _system_config={"worker_niceness": WORKER_NICENESS, "task_events_max_num_task_in_gcs": TASK_EVENTS_KEPT}, **kwargs)
        if (node := ray.util.get_node_ip_address()) != LOOPBACK:
            log.warning("Ray took %s, not %s, as the address of the cluster it started: its daemons and the run's sockets "
                        "listen on it (docs/security.md)", node, LOOPBACK)
        return
    try:
        ray.init(address=address, **kwargs)
    except ConnectionError as exc:
        raise ConnectionError(f"cannot join the Ray cluster at ray.address={address!r}: {exc}{_auth_hint()}") from exc


@contextlib.contextmanager
def _single_machine() -> Iterator[None]:
    """While Ray starts a cluster: let it take loopback as the node's address.

    Ray 2.60 replaces a loopback ``_node_ip_address`` by the address other nodes would reach,
    unless multi-node clusters are off, as they are by default on macOS and Windows
    (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``, read once when ``ray`` is imported). Turned off here
    for the start only: joining a cluster later in this process must find its real address.
    """
    from ray._private import ray_constants

    enabled = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = enabled


def _auth_hint() -> str:
    """What to try when joining failed and token authentication may be the reason."""
    if os.environ.get("RAY_AUTH_MODE") == "token":
        return ""
    # Ray reads RAY_AUTH_MODE when it is imported, so it must be set before the process starts.
    return (". Clusters started with `ray start` may use token authentication (Ray 2.60): run with RAY_AUTH_MODE=token "
            "and the head node's token in ~/.ray/auth_token (or RAY_AUTH_TOKEN), as every `ray start --address` needs too "
            "(deploy/ray_node.sh, docs/training.md#a-ray-cluster)")
