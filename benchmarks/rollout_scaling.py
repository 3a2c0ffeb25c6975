"""Rollout scaling: groups/s into the replay queue with 1..32 servers, and the driver's share.

Each point starts ``S`` :class:`~async_rl.rollout.fake_engine.FakeServer` actors (a fixed
token rate each, no vLLM) through the real :class:`~async_rl.rollout.pool.ServerPool`; every
server runs its real rollout workers and reward pool in its own process and writes to one
embedded redis-server (AOF, ``appendfsync always``, as a run has it). A consumer actor stands
in for an infinitely fast learner: it reads batches of ``B`` groups, commits them and
publishes a version per batch. Every group is admitted as in a run (the admission script
runs per group), but with ``--max-staleness`` 1000 the bound never holds the servers back:
this measures the data path, not the staleness rule (whose in-flight limit,
``(eta + 1) x B`` groups, a run sizes to its servers). This process is
the driver: during the measured window it does what ``async-rl train`` does (polls the queue
stats and the rollout counters once a second).

Measured per point, over ``--seconds`` after a warm-up:

- ``groups_per_s``: groups appended to the stream (``XINFO STREAM`` entries-added);
- ``efficiency``: ``groups_per_s / (S x groups_per_s at S = 1)``;
- ``driver_cpu_ms_per_group`` and ``driver_cpu_ms_per_s``: this process's CPU time (all its
  threads, Ray's included) per group and per second. It does not grow with the groups: a
  few ms a second of Ray's own threads and the polls, so per group it is highest at S = 1;
- ``redis_cpu_ms_per_group`` and ``redis_limit_groups_per_s`` (``1000 / redis_cpu_ms_per_group``):
  redis-server's own CPU time (``INFO cpu``), i.e. how far Redis is from being the limit.

With ``--reward-ms`` the reward function sleeps that long per call (one call per group),
with ``--reward-workers`` processes per server: the slow-reward rows should match the fast
ones when the workers cover the calls.

    python benchmarks/rollout_scaling.py --json benchmarks/results/rollout_scaling.json

Targets: efficiency at the largest S >= 0.8, driver CPU <= 1 ms per group there, and the slow
reward's groups/s >= 0.9 x the fast one's at every S it was run; exits 1 if missed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import ray

from async_rl.config import RewardConfig
from async_rl.data.prompts import PromptRow
from async_rl.launch.ray_cluster import init_ray
from async_rl.queue import EmbeddedRedis, ReplayQueue
from async_rl.queue.client import connect
from async_rl.rollout.fake_engine import FakeServer
from async_rl.rollout.host import WorkerHostSpec
from async_rl.rollout.pool import ServerPool, ServerSpec
from async_rl.rollout.types import Sampling
from async_rl.rollout.worker import WorkerSettings

sys.path.insert(0, str(Path(__file__).parent))
from _fake_servers import add_fake_server_args  # noqa: E402
from _report import report  # noqa: E402

EFFICIENCY_TARGET, DRIVER_CPU_TARGET_MS, SLOW_REWARD_TARGET = 0.8, 1.0, 0.9
BATCH = 16

SLOW_REWARD = """import time

def compute_score(items, delay_s):
    time.sleep(delay_s)
    return [{"overall": float(i["response"][:1] == i["ground_truth"])} for i in items]
"""


class Consumer:
    """An infinitely fast learner: reads ``B`` groups, commits them, publishes a version."""

    def __init__(self, url: str, run: str):
        self.queue = ReplayQueue(url, run, max_depth=1_000_000)
        self.stopped = threading.Event()
        self.consumed = 0

    def run(self) -> int:
        version = 0
        while not self.stopped.is_set():
            entries = self.queue.get(BATCH, timeout=0.2)
            self.queue.commit(entry_id for entry_id, _ in entries)
            self.consumed += len(entries)
            if self.consumed // BATCH > version:
                version = self.consumed // BATCH
                self.queue.publish_version(version)
        return self.consumed

    def stop(self) -> None:
        self.stopped.set()


def _redis_cpu_s(client: Any) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def _role(proc: psutil.Process) -> str:
    cmd = " ".join(proc.cmdline())
    if proc.pid == os.getpid():
        return "driver"
    for role, marker in (("servers", "ray::FakeServer"), ("consumer", "ray::Consumer"), ("rewards", "multiprocessing.spawn"),
                         ("redis", "redis-server")):
        if marker in cmd:
            return role
    return "ray_daemons_and_idle_workers"


def cpu_by_role() -> dict[int, tuple[str, float]]:
    """CPU seconds so far of every process on the machine, with its role in the benchmark."""
    out = {}
    for proc in psutil.process_iter():
        try:
            with proc.oneshot():
                times = proc.cpu_times()
                out[proc.pid] = (_role(proc), times.user + times.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def measure(url: str, servers: int, args: argparse.Namespace, reward: RewardConfig, tag: str) -> dict[str, float]:
    run = f"scaling-{tag}-{servers}"
    rows = [PromptRow(i + 1, f"question {i}", str(i % 10)) for i in range(100_000)]
    settings = WorkerSettings(run_id=run, server_id="", n=args.n, sampling=Sampling(max_tokens=args.max_tokens, ignore_eos=True),
                              batch_size=BATCH, max_staleness=args.max_staleness, max_inflight=args.max_inflight, shuffle=False)
    spec = WorkerHostSpec(url, run, max_depth=100_000, op_timeout_s=30.0, settings=settings, workers=1, reward=reward,
                          max_response_length=args.max_tokens)
    pool = ServerPool(ServerSpec({"tokens_per_s": args.tokens_per_s}, num_cpus=0, server_cls=FakeServer), servers,
                      workers=spec, rows=ray.put(rows))
    client = connect(url, socket_timeout_s=30.0)
    with ReplayQueue(url, run) as queue:
        consumer = ray.remote(Consumer).options(num_cpus=0, max_concurrency=2).remote(url, run)
        consuming = consumer.run.remote()

        async def window() -> dict[str, float]:
            await pool.start()
            await asyncio.sleep(args.warmup)
            added0, redis0 = client.xinfo_stream(queue.keys.rollouts)["entries-added"], _redis_cpu_s(client)
            roles0 = cpu_by_role()
            cpu0, t0 = time.process_time(), time.monotonic()
            while time.monotonic() - t0 < args.seconds:  # the driver's own work: one poll a second
                await asyncio.sleep(1.0)
                queue.stats()
                queue.rollout_stats()
            seconds, cpu = time.monotonic() - t0, time.process_time() - cpu0
            groups = client.xinfo_stream(queue.keys.rollouts)["entries-added"] - added0
            redis_cpu = _redis_cpu_s(client) - redis0
            spent: dict[str, float] = {}
            for pid, (role, cpu_s) in cpu_by_role().items():
                spent[role] = spent.get(role, 0.0) + cpu_s - (roles0[pid][1] if pid in roles0 else 0.0)
            await pool.stop_workers(grace_s=5.0)
            await pool.shutdown()
            return {"servers": servers, "groups_per_s": groups / seconds, "driver_cpu_ms_per_group": 1000 * cpu / max(groups, 1),
                    "driver_cpu_ms_per_s": 1000 * cpu / seconds,
                    "redis_cpu_ms_per_group": 1000 * redis_cpu / max(groups, 1),
                    "redis_limit_groups_per_s": groups / max(redis_cpu, 1e-9),
                    "cpu_cores_used": {role: round(cpu_s / seconds, 3) for role, cpu_s in sorted(spent.items())}}

        try:
            point = asyncio.run(window())
        finally:
            ray.get(consumer.stop.remote())
            ray.get(consuming)
            ray.kill(consumer)
            client.close()
    print(f"[{tag}] {servers:3d} servers: {point['groups_per_s']:8.1f} groups/s, driver {point['driver_cpu_ms_per_group']:.3f} ms/group, "
          f"redis {point['redis_cpu_ms_per_group']:.3f} ms/group; cores used: {point['cpu_cores_used']}", flush=True)
    return point


def sweep(url: str, servers: list[int], args: argparse.Namespace, reward: RewardConfig, tag: str) -> list[dict[str, float]]:
    points = [measure(url, s, args, reward, tag) for s in servers]
    one = points[0]["groups_per_s"] / points[0]["servers"]
    for p in points:
        p["efficiency"] = p["groups_per_s"] / (p["servers"] * one)
    return points


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", default="1,2,4,8,16,32", help="comma-separated server counts (the first is the baseline)")
    parser.add_argument("--slow-servers", default="1,8,32", help="server counts run again with the slow reward ('' for none)")
    parser.add_argument("--seconds", type=float, default=15.0, help="measured window per point")
    parser.add_argument("--warmup", type=float, default=4.0, help="seconds after the servers started, before measuring")
    add_fake_server_args(parser)
    parser.add_argument("--max-staleness", type=int, default=1000,
                        help="eta: high, so admission (still checked per group) never holds the servers back")
    parser.add_argument("--reward-ms", type=float, default=100.0, help="the slow reward function's time per call")
    parser.add_argument("--reward-workers", type=int, default=2, help="reward processes per server for the slow reward")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    servers = [int(s) for s in args.servers.split(",")]
    slow_servers = [int(s) for s in args.slow_servers.split(",") if s]

    init_ray(num_cpus=os.cpu_count() or 1)
    result: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "tokens_per_s_per_server": args.tokens_per_s, "n": args.n, "max_tokens": args.max_tokens, "batch": BATCH,
        "ideal_groups_per_s_per_server": args.tokens_per_s / (args.n * args.max_tokens),
    }
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis") as url:
        fast = sweep(url, servers, args, RewardConfig(function="exact_match", num_workers=1), "fast")
        slow: list[dict[str, float]] = []
        if slow_servers:
            path = Path(tmp) / "slow_reward.py"
            path.write_text(SLOW_REWARD)
            reward = RewardConfig(function=f"{path}:compute_score", num_workers=args.reward_workers, kwargs={"delay_s": args.reward_ms / 1000})
            slow = [measure(url, s, args, reward, "slow") for s in slow_servers]
    ray.shutdown()

    by_servers = {p["servers"]: p for p in fast}
    last = fast[-1]
    slow_ratios = [p["groups_per_s"] / by_servers[p["servers"]]["groups_per_s"] for p in slow if p["servers"] in by_servers]
    result.update({
        "points": fast,
        "slow_reward_ms": args.reward_ms, "slow_reward_workers_per_server": args.reward_workers, "slow_reward_points": slow,
        "groups_per_s_1": fast[0]["groups_per_s"], f"groups_per_s_{last['servers']}": last["groups_per_s"],
        f"efficiency_{last['servers']}": last["efficiency"],
        f"driver_cpu_ms_per_group_{last['servers']}": last["driver_cpu_ms_per_group"],
        "driver_cpu_ms_per_s_max": max(p["driver_cpu_ms_per_s"] for p in fast + slow),
        "redis_limit_groups_per_s_min": min(p["redis_limit_groups_per_s"] for p in fast),
        "slow_reward_ratio_min": min(slow_ratios) if slow_ratios else None,
    })
    ok = (last["efficiency"] >= EFFICIENCY_TARGET and last["driver_cpu_ms_per_group"] <= DRIVER_CPU_TARGET_MS
          and (not slow_ratios or min(slow_ratios) >= SLOW_REWARD_TARGET))
    result["targets_met"] = ok
    print()
    print(f"{'servers':>8} {'groups/s':>10} {'efficiency':>10} {'driver ms/group':>16} {'redis ms/group':>15} {'redis limit/s':>14}")
    for p in fast:
        print(f"{p['servers']:>8} {p['groups_per_s']:>10.1f} {p['efficiency']:>10.2f} {p['driver_cpu_ms_per_group']:>16.3f} "
              f"{p['redis_cpu_ms_per_group']:>15.3f} {p['redis_limit_groups_per_s']:>14.0f}")
    print()
    report(result, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
