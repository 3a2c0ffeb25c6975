"""Past one cluster (issue 47): N simulated inference servers on the real queue, and which part
of the control plane saturates first.

    python benchmarks/scale_sim.py --json benchmarks/results/scale_sim.json --plot
    python benchmarks/scale_sim.py --servers 32 --seconds 20              # a quick look

**Real**: redis-server (AOF, ``appendfsync always``, as a run has it), the admission script,
tickets, puts, the learner's reads, staleness screen and acks
(:class:`~async_rl.queue.ReplayQueue`), the worker loop each server process runs
(:class:`~async_rl.rollout.worker.RolloutWorker`, one Redis connection per server), each
server's counters added to Redis every :data:`~async_rl.rollout.host.STATS_PERIOD_S` as its
host does, and Ray for the driver's per-server calls: a health check of every server each
:data:`~async_rl.launch.supervision.HEALTH_PERIOD_S` and an engine-death watch held open
per server, as :class:`~async_rl.rollout.pool.ServerPool` has them.

**Simulated**: the accelerators (:class:`Accelerator`: ``tokens_per_s`` a server, requests in
arrival order, a sleep per request, as :class:`~async_rl.rollout.fake_engine.FakeServer`),
many servers per process (:class:`SimHost` actors, one per core, so 1,024 fit on 2 cores),
the reward (an instant rule in process), the weight update (each server pauses generation
``--update-pause-s`` when a version is published) and the learner's compute (none: the
stand-in reads ``B`` groups, acks them and publishes the next version at once, so the
servers, not the learner, set the pace).

Responses carry ``1 / --token-scale`` (64) of the tokens they stand for (generation time
counts them all): on 2 cores the harness cannot also build 100 MB/s of token payloads (at 1/16
its hosts took 1.4 of the 2 cores at 1,024 servers, and their delays showed in the heal and
scale times; at 1/64, 1.2). Redis's cost per byte is measured apart (:func:`byte_cost`: big
groups put and read back, medians of three) and added to its per-group cost at the full
payload (``redis_cores_at_full_payload``).

Per N: groups/s delivered (stream entries added) against offered (the accelerators' rate,
less the update pauses), driver CPU (this process, Ray's threads included), Redis CPU and
commands/s, admission latency p50/p99 (every ``admit`` call of every server), queue depth,
the time to heal a killed server (its engine dies: tickets left open, the driver's watch
ends them and starts a replacement; until the replacement's first group) and to scale by
+10 % and -10 % (until every added server put a group / every removed one stopped), each
the median of ``--repeats`` events (one event's time depends on where in the learner's step
it falls: slots open when a version is published), and after a graceful stop and a drained
queue: prompts lost and duplicated (both must be 0).

Targets (issue 47, fixed before the first run): at 1,024 servers delivered >= 0.95 x offered
at the 1,024-GPU load, driver < 10 % of a core, Redis < 50 % of a core (payload included),
0 lost, 0 duplicated; heal and scale times at 1,024 at most 2 x those at 32. Exit 1 if missed.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil
import ray

from async_rl.config import RolloutConfig
from async_rl.data.prompts import PromptRow
from async_rl.launch.ray_cluster import init_ray
from async_rl.launch.supervision import HEALTH_PERIOD_S
from async_rl.queue import EmbeddedRedis, ReplayQueue
from async_rl.queue.client import QueueUnavailableError
from async_rl.queue.keys import RunKeys
from async_rl.queue.replay import Staleness
from async_rl.records import RolloutGroup, Sample
from async_rl.rewards.scoring import RewardCounters, Score
from async_rl.rollout.host import STATS_PERIOD_S
from async_rl.rollout.types import Completion, Sampling
from async_rl.rollout.worker import RolloutWorker, WorkerCounters, WorkerSettings

sys.path.insert(0, str(Path(__file__).parent))
from _report import new_plot, report, save_plot  # noqa: E402

RUN = "scale-sim"
PROMPT_TOKENS = 256
TARGET_DELIVERED, TARGET_DRIVER_CORES, TARGET_REDIS_CORES, TARGET_HEAL_RATIO = 0.95, 0.10, 0.50, 2.0


@dataclass(frozen=True)
class Load:
    """What one simulated server does, and what it stands for (issue 47's item 2).

    Defaults: a 7B policy in bf16, one server per GPU (tensor parallel 1), 12,500 output
    tokens/s per server (the upper end of vLLM's published single-H100 figures for an 8B model
    at high concurrency: a harder load on the control plane than the usual), GRPO groups of
    16, responses of reasoning length: lognormal, median 3,000 tokens, sigma 0.8, capped at
    16,384 (mean about 4,100, a tail to the cap)."""

    tokens_per_s: float = 12_500.0
    n: int = 16
    median_tokens: float = 3_000.0
    sigma: float = 0.8
    max_tokens: int = 16_384
    update_pause_s: float = 1.0
    """Generation paused per weight update, s (a 7B bf16 update, 15 GB, over NCCL at 400 Gb/s
    takes about 0.3 s plus the engines' reload)."""

    def draw(self, rng: random.Random) -> int:
        """One response length, tokens."""
        return max(1, min(self.max_tokens, round(rng.lognormvariate(math.log(self.median_tokens), self.sigma))))

    def mean_tokens(self) -> float:
        """Mean response length under the cap (200,000 draws, seeded: the same every run)."""
        rng = random.Random(0)
        return statistics.fmean(self.draw(rng) for _ in range(200_000))

    def groups_per_s(self) -> float:
        """One server's rate with no pause, groups/s."""
        return self.tokens_per_s / (self.n * self.mean_tokens())


def offered_groups_per_s(load: Load, servers: int, batch: int) -> float:
    """What ``servers`` simulated accelerators can produce, groups/s, less the update pauses:
    a step every ``batch`` groups pauses generation ``update_pause_s``."""
    ideal = servers * load.groups_per_s()
    step_s = batch / ideal
    return ideal * step_s / (step_s + load.update_pause_s)


def real_run_loads(load: Load, gpus: tuple[int, ...] = (64, 256, 1024)) -> list[dict[str, Any]]:
    """The offered load of a 7B GRPO run on each GPU count (every GPU generating: a run that
    trains on some of them offers less), groups/s and payload MB/s into Redis (8 bytes a token:
    int32 id and float32 log-prob)."""
    per_gpu = load.groups_per_s()
    return [{"gpus": g, "servers": g, "groups_per_s": g * per_gpu, "payload_mb_per_s": g * load.tokens_per_s * 8 / 1e6} for g in gpus]


@dataclass(frozen=True)
class WeightPath:
    """The weight update at scale, on paper (issue 47's item 4). Sizes are Qwen2.5's in bf16.
    Measured: CUDA IPC within a GPU, 43 GB/s (0.99 GB in 23 ms, H100, GPU_DEVICE_NOTES.md).
    Assumed (stated, not measured here): 400 Gb/s per GPU between nodes (NDR InfiniBand, one
    NIC a GPU), 8 GPUs a node, NCCL's pipelined broadcast (bytes / link rate, plus a chunk per
    hop: 1 MiB at the link rate and 10 us), a communicator's creation growing with its ranks
    (5 ms a rank), and a server's reload into vLLM at 10 GB/s (layer by layer, from staging)."""

    link_gb_per_s: float = 50.0
    ipc_gb_per_s: float = 43.0
    gpus_per_node: int = 8
    hop_s: float = 10e-6 + (1 << 20) / 50e9
    init_s_per_rank: float = 5e-3
    load_gb_per_s: float = 10.0

    def table(self, gpus: tuple[int, ...] = (64, 256, 1024)) -> list[dict[str, Any]]:
        """Per model and GPU count: the broadcast today (one group of the learner and every
        server's workers; a member change rebuilds it) and as a tree (the learner broadcasts
        to one relay a node; each relay hands its node's GPUs the buckets over CUDA IPC while
        the next bucket is on the wire, the slower of the two setting the pace), seconds."""
        rows = []
        for model, gb, tp in (("7B", 7.62 * 2, 1), ("70B", 70.6 * 2, 8)):
            for g in gpus:
                ranks, nodes = g + 1, max(1, g // self.gpus_per_node)
                rows.append({"model": model, "gpus": g, "servers": g // tp, "tp": tp, "ranks": ranks, "gb": gb,
                             "flat_broadcast_s": gb / self.link_gb_per_s + ranks * self.hop_s,
                             "tree_broadcast_s": gb / min(self.link_gb_per_s, self.ipc_gb_per_s) + (nodes + 1) * self.hop_s,
                             "reload_s": gb / tp / self.load_gb_per_s,
                             "flat_group_rebuild_s": ranks * self.init_s_per_rank,
                             "tree_group_rebuild_s": (nodes + 1) * self.init_s_per_rank})
        return rows


# -- the simulated servers --------------------------------------------------------------------


class Accelerator:
    """A saturated accelerator: ``tokens_per_s`` tokens a second in all, requests in arrival
    order; a weight update pauses it ``update_pause_s``. A dead one never answers."""

    def __init__(self, load: Load, token_scale: int, seed: int):
        self.load, self.token_scale = load, token_scale
        self.rng = random.Random(seed)
        self.free_at = 0.0
        self.version = 0
        self.updates: list[tuple[float, int]] = [(0.0, 0)]
        """(monotonic time, version) of each update: a request's tokens carry the version
        current when its own generation began (its turn in the queue), not when it was queued."""
        self.dead = asyncio.Event()

    def update(self, version: int) -> None:
        """A new version was published: generation stops for the update, then serves it."""
        self.free_at = max(time.monotonic(), self.free_at) + self.load.update_pause_s
        self.version = version
        self.updates = [*self.updates[-15:], (self.free_at, version)]

    async def generate(self, prompt_ids: list[int], n: int, sampling: Sampling) -> list[Completion]:
        lengths = [self.load.draw(self.rng) for _ in range(n)]
        now = time.monotonic()
        begins = max(now, self.free_at)
        self.free_at = begins + sum(lengths) / self.load.tokens_per_s
        await asyncio.sleep(self.free_at - now)
        if self.dead.is_set():
            await asyncio.Event().wait()  # a dead engine's request never returns
        version = max((v for t, v in self.updates if t <= begins), default=self.updates[0][1])
        out = []
        for length in lengths:
            carried = max(1, length // self.token_scale)
            out.append(Completion(TOKENS[:carried], LOGPROBS[:carried], [version] * carried, "stop"))
        return out


TOKENS = [random.Random(1).randrange(32_000) for _ in range(Load().max_tokens)]
LOGPROBS = [-1.0] * Load().max_tokens


class InstantScorer:
    """A rule reward in process (the sim has no reward pool): alternate 0 and 1 within a group,
    so every group is trainable."""

    def __init__(self) -> None:
        self.counters = RewardCounters()

    async def score(self, inputs: list[dict[str, Any]]) -> list[Score]:
        self.counters.scored += len(inputs)
        return [Score(float(i % 2)) for i in range(len(inputs))]

    def keep_group(self, rewards: list[float]) -> bool:
        return True


class TimedQueue:
    """The server's :class:`ReplayQueue`, its ``admit`` calls timed (seconds, into ``into``)."""

    def __init__(self, queue: ReplayQueue, into: list[float]):
        self._queue, self._into = queue, into

    def admit(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self._queue.admit(*args, **kwargs)
        finally:
            self._into.append(time.perf_counter() - t0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)


class DeadQueue:
    """What a killed process reaches: nothing (its open tickets stay open in Redis)."""

    def __getattr__(self, name: str) -> Any:
        def unreachable(*args: Any, **kwargs: Any) -> Any:
            raise QueueUnavailableError("the process was killed")
        return unreachable


@dataclass(frozen=True)
class HostSpec:
    redis_url: str
    load: Load
    token_scale: int
    batch: int
    max_staleness: int
    max_inflight: int
    rows: int
    grace_s: float = 30.0


class SimServer:
    """One simulated server process: its accelerator, its worker loop on the real queue, its
    counters flushed to Redis every :data:`STATS_PERIOD_S`."""

    def __init__(self, spec: HostSpec, index: int, start_no: int, rows: list[PromptRow], latencies: list[float]):
        self.index, self.start_no = index, start_no
        self.owner = f"server-{index}#{start_no}"
        self.accelerator = Accelerator(spec.load, spec.token_scale, seed=index * 1000 + start_no)
        self.queue = ReplayQueue(spec.redis_url, RUN, max_depth=1_000_000)
        settings = WorkerSettings(run_id=RUN, server_id=f"server-{index}", n=spec.load.n,
                                  sampling=Sampling(1.0, 1.0, -1, spec.load.max_tokens), batch_size=spec.batch,
                                  max_staleness=spec.max_staleness, max_inflight=spec.max_inflight,
                                  max_prompt_length=PROMPT_TOKENS, owner=self.owner)
        self.worker = RolloutWorker(settings, TimedQueue(self.queue, latencies), rows, lambda _: TOKENS[:PROMPT_TOKENS],
                                    InstantScorer(), lambda: self.accelerator.generate)  # type: ignore[arg-type]
        self.stop = asyncio.Event()
        self.first_put_at: float | None = None
        self._flushed = WorkerCounters()
        self.task = asyncio.create_task(self.worker.run(self.stop))
        self.flusher = asyncio.create_task(self._flush_every())

    async def _flush_every(self) -> None:
        while True:
            await asyncio.sleep(STATS_PERIOD_S)
            now = self.worker.counters
            if self.first_put_at is None and now.groups_put:
                self.first_put_at = time.time()
            deltas = {k: float(v - getattr(self._flushed, k)) for k, v in asdict(now).items() if v != getattr(self._flushed, k)}
            if deltas:
                await asyncio.to_thread(self.queue.add_rollout_stats, deltas)
                self._flushed = WorkerCounters(**asdict(now))

    def kill(self) -> None:
        """The engine died and took the process: nothing more reaches Redis from it."""
        self.worker.queue = DeadQueue()  # type: ignore[assignment]
        self.accelerator.dead.set()
        self.task.cancel()
        self.flusher.cancel()

    async def close(self, grace_s: float) -> None:
        """Stop admitting, let groups in flight finish for ``grace_s``, then cancel them (each
        ends its ticket, its prompt returned): a server removed or the run stopping."""
        self.stop.set()
        _, late = await asyncio.wait({self.task}, timeout=grace_s)
        for task in late:
            task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.flusher.cancel()
        await asyncio.gather(self.flusher, return_exceptions=True)
        self.queue.close()


@ray.remote(num_cpus=0, max_concurrency=100_000)
class SimHost:
    """Many simulated servers in one process (an asyncio actor). Its concurrency is unbounded
    (Ray's default for an async actor is 1,000 calls at once): each server's engine-death
    watch is a call held open, and with 512 of them the health checks would queue behind
    them (a run's servers are actors of their own)."""

    def __init__(self, spec: HostSpec):
        self.spec = spec
        self.rows = [PromptRow(i + 1, f"p{i}", "1") for i in range(spec.rows)]
        self.servers: dict[int, SimServer] = {}
        self.latencies: list[float] = []
        self.died: dict[tuple[int, int], asyncio.Event] = {}
        self.version_watch: asyncio.Task | None = None

    async def add(self, indices: list[int]) -> None:
        if self.version_watch is None:  # on the actor's loop
            # A thread per server at least: each waits in its own (XREAD BLOCK, up to 1 s), as in
            # a server process of its own; a smaller pool queues the others' calls behind them.
            asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(4096))
            self.version_watch = asyncio.create_task(self._watch_versions())
        for i in indices:
            self._start(i, 0)

    def _start(self, i: int, start_no: int) -> None:
        self.servers[i] = SimServer(self.spec, i, start_no, self.rows, self.latencies)
        self.died[(i, start_no)] = asyncio.Event()

    async def _watch_versions(self) -> None:
        """The weight updates: a published version pauses every accelerator (the harness's
        own poll, 20 a second; a run's servers learn of it through the weight sync)."""
        queue = ReplayQueue(self.spec.redis_url, RUN, max_depth=1_000_000)
        seen = 0
        while True:
            await asyncio.sleep(0.05)
            version = int(await asyncio.to_thread(lambda: queue.client.hget(queue.keys.counters, "version") or 0))
            if version > seen:
                seen = version
                for server in self.servers.values():
                    server.accelerator.update(version)

    async def health(self, i: int) -> dict[str, Any]:
        server = self.servers.get(i)
        if server is None or server.accelerator.dead.is_set():
            raise RuntimeError(f"server-{i} is dead")
        return {"version": server.accelerator.version, "groups_put": server.worker.counters.groups_put}

    async def engine_died(self, i: int, start_no: int) -> str:
        await self.died[(i, start_no)].wait()
        return "killed"

    async def kill(self, i: int) -> float:
        killed_at = time.time()
        server = self.servers[i]
        server.kill()
        # A dead process's calls reached Redis before it died or never: its task ends (a claim
        # in flight in its thread returns first) before the driver hears of the death and
        # ends its tickets. Without this wait, a thread's late admission could open a ticket
        # after release_owner ran (one was left open at 512 servers on 2026-12-06).
        await asyncio.gather(server.task, return_exceptions=True)
        self.died[(i, server.start_no)].set()
        return killed_at

    async def restart(self, i: int) -> int:
        start_no = self.servers[i].start_no + 1
        self._start(i, start_no)
        return start_no

    async def first_put(self, indices: list[int]) -> list[float | None]:
        return [self.servers[i].first_put_at if i in self.servers else None for i in indices]

    async def remove(self, indices: list[int]) -> float:
        await asyncio.gather(*(self.servers.pop(i).close(self.spec.grace_s) for i in indices))
        return time.time()

    async def take_latencies(self) -> list[float]:
        out, self.latencies[:] = list(self.latencies), []
        return out

    async def stop(self) -> None:
        await asyncio.gather(*(s.close(self.spec.grace_s) for s in self.servers.values()))
        self.servers.clear()
        if self.version_watch is not None:
            self.version_watch.cancel()

    def pid(self) -> int:
        return os.getpid()


@ray.remote(num_cpus=0, max_concurrency=2)
class LearnerStandIn:
    """The learner without compute: reads ``batch`` groups under the staleness rule, acks
    them and publishes the next version (the servers then pause for the update)."""

    def __init__(self, url: str, batch: int, max_staleness: int):
        self.queue = ReplayQueue(url, RUN, max_depth=1_000_000)
        self.batch, self.max_staleness = batch, max_staleness
        self.stopped = threading.Event()
        self.draining = False
        self.prompts: list[int] = []
        self.version = 0

    def run(self) -> int:
        got: list[tuple[str, RolloutGroup]] = []
        while not self.stopped.is_set():
            got += self.queue.get(self.batch - len(got), Staleness(self.version, self.max_staleness), timeout=0.5)
            if len(got) >= self.batch or (self.draining and got):
                self.queue.commit(entry_id for entry_id, _ in got)
                self.prompts += [group.prompt_id for _, group in got]
                got = []
                if not self.draining:
                    self.version += 1
                    self.queue.publish_version(self.version)
        return self.version

    def drain(self) -> None:
        """Ack what comes from now on without waiting for full batches or publishing."""
        self.draining = True

    def stop(self) -> list[int]:
        self.stopped.set()
        return self.prompts

    def pid(self) -> int:
        return os.getpid()


# -- the driver's side ------------------------------------------------------------------------


class Driver:
    """What ``async-rl train``'s driver does per server, at a run's periods: a health check of
    every server each :data:`HEALTH_PERIOD_S` (one Ray call each), an engine-death watch per
    server (a Ray call held open; on its answer the dead server's tickets are ended and a
    replacement started), the queue's stats each second and the rollout counters with the
    health check."""

    def __init__(self, queue: ReplayQueue, hosts: list[Any]):
        self.queue, self.hosts = queue, hosts
        self.placed: dict[int, Any] = {}
        self.watches: dict[int, asyncio.Task] = {}
        self.depths: list[int] = []
        self.health_sweeps_s: list[float] = []
        self.unhealthy = 0
        self.healed = 0

    def host_of(self, i: int) -> Any:
        return self.hosts[i % len(self.hosts)]

    async def add(self, indices: list[int]) -> None:
        by_host: dict[int, list[int]] = {}
        for i in indices:
            by_host.setdefault(i % len(self.hosts), []).append(i)
        for i in indices:
            self.placed[i] = self.host_of(i)
        await asyncio.to_thread(self.queue.set_producers, len(self.placed))  # before they admit, as the pool does
        await asyncio.gather(*(self.hosts[h].add.remote(ix) for h, ix in by_host.items()))
        for i in indices:
            self.watches[i] = asyncio.create_task(self._watch(i, 0))

    async def remove(self, indices: list[int]) -> float:
        for i in indices:
            self.watches.pop(i).cancel()
            self.placed.pop(i)
        await asyncio.to_thread(self.queue.set_producers, len(self.placed))
        by_host: dict[int, list[int]] = {}
        for i in indices:
            by_host.setdefault(i % len(self.hosts), []).append(i)
        return max(await asyncio.gather(*(self.hosts[h].remove.remote(ix) for h, ix in by_host.items())))

    async def _watch(self, i: int, start_no: int) -> None:
        await self.host_of(i).engine_died.remote(i, start_no)
        await asyncio.to_thread(self.queue.release_owner, f"server-{i}#{start_no}")
        new = await self.host_of(i).restart.remote(i)
        self.healed += 1
        self.watches[i] = asyncio.create_task(self._watch(i, new))

    async def loop(self, stop: asyncio.Event) -> None:
        next_health = time.monotonic() + HEALTH_PERIOD_S
        while not stop.is_set():
            await asyncio.sleep(1.0)
            self.depths.append((await asyncio.to_thread(self.queue.stats))["depth"])
            if time.monotonic() >= next_health:
                next_health += HEALTH_PERIOD_S
                t0 = time.monotonic()
                await asyncio.to_thread(self.queue.rollout_stats)
                healths = await asyncio.gather(*(asyncio.wait_for(h.health.remote(i), 30.0) for i, h in list(self.placed.items())),
                                               return_exceptions=True)
                self.unhealthy += sum(isinstance(h, BaseException) for h in healths)
                self.health_sweeps_s.append(time.monotonic() - t0)


def redis_counters(client: Any) -> tuple[float, int]:
    """redis-server's CPU seconds so far and commands processed."""
    cpu, stats = client.info("cpu"), client.info("stats")
    return float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]), int(stats["total_commands_processed"])


def command_stats(client: Any) -> dict[str, tuple[int, float]]:
    """Per Redis command (those scripts call included): calls and CPU microseconds so far."""
    return {name.removeprefix("cmdstat_"): (int(v["calls"]), float(v["usec"])) for name, v in client.info("commandstats").items()}


def command_deltas(before: dict[str, tuple[int, float]], after: dict[str, tuple[int, float]], groups: int) -> dict[str, dict[str, float]]:
    """Per command run in the window: calls a group, and its share of the CPU Redis spent in
    commands (the rest of Redis's CPU is its event loop, the AOF's fsync and the replies)."""
    calls = {name: n - before.get(name, (0, 0.0))[0] for name, (n, _) in after.items()}
    usec = {name: u - before.get(name, (0, 0.0))[1] for name, (_, u) in after.items()}
    total = max(sum(usec.values()), 1e-9)
    return {name: {"per_group": calls[name] / max(groups, 1), "cpu_share": usec[name] / total}
            for name in sorted(usec, key=lambda n: -usec[n]) if calls[name] > 0}


def entries_added(client: Any) -> int:
    """Groups appended to the run's stream so far."""
    return int(client.xinfo_stream(RunKeys(RUN).rollouts)["entries-added"])


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def wait_first_puts(driver: Driver, indices: list[int], since: float, timeout_s: float = 300.0) -> float:
    """Seconds from ``since`` (``time.time()``) until every server of ``indices`` put a group
    in its current start (its counters flush once a second: up to 1 s late)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        by_host: dict[int, list[int]] = {}
        for i in indices:
            by_host.setdefault(i % len(driver.hosts), []).append(i)
        puts = [t for h, ix in by_host.items() for t in await driver.hosts[h].first_put.remote(ix)]
        if all(t is not None and t >= since for t in puts):
            return max(puts) - since  # type: ignore[type-var]
        await asyncio.sleep(0.2)
    raise TimeoutError(f"servers {indices[:5]}... put no group within {timeout_s:g} s")


async def measure(servers: int, args: argparse.Namespace, load: Load) -> dict[str, Any]:
    """One point: ``servers`` simulated servers through warm-up, a measured window, a heal, a
    scale-up and a scale-down, then a graceful stop and the prompt accounting."""
    batch = servers if args.batch is None else args.batch
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(data_dir=tmp, appendfsync="always") as url:
        queue = ReplayQueue(url, RUN, max_depth=1_000_000)
        client = queue.client
        rows = max(100_000, servers * 200)
        inflight = args.max_inflight
        spec = HostSpec(url, load, args.token_scale, batch, args.max_staleness, inflight, rows)
        hosts = [SimHost.remote(spec) for _ in range(args.hosts)]
        learner = LearnerStandIn.remote(url, batch, args.max_staleness)
        pids = {"hosts": ray.get([h.pid.remote() for h in hosts]), "learner": ray.get(learner.pid.remote())}
        learning = learner.run.remote()
        driver = Driver(queue, hosts)
        t_start = time.monotonic()
        await driver.add(list(range(servers)))
        started_s = time.monotonic() - t_start
        stop = asyncio.Event()
        loop = asyncio.create_task(driver.loop(stop))
        await asyncio.sleep(args.warmup)

        for h in hosts:
            await h.take_latencies.remote()
        driver.depths.clear()
        procs = {name: [psutil.Process(p) for p in (ps if isinstance(ps, list) else [ps])] for name, ps in pids.items()}
        cpu0 = {name: sum(p.cpu_times().user + p.cpu_times().system for p in ps) for name, ps in procs.items()}
        me = psutil.Process()
        driver0, (redis0, cmds0), added0, t0 = me.cpu_times(), redis_counters(client), entries_added(client), time.monotonic()
        by_command0 = command_stats(client)
        await asyncio.sleep(args.seconds)
        driver1, (redis1, cmds1), added1, t1 = me.cpu_times(), redis_counters(client), entries_added(client), time.monotonic()
        by_command1 = command_stats(client)
        cpu1 = {name: sum(p.cpu_times().user + p.cpu_times().system for p in ps) for name, ps in procs.items()}
        window = t1 - t0
        groups = added1 - added0
        latencies = [x for h in hosts for x in await h.take_latencies.remote()]
        driver_s = (driver1.user + driver1.system) - (driver0.user + driver0.system)
        point: dict[str, Any] = {
            "servers": servers, "batch": batch, "max_inflight": inflight, "start_s": started_s,
            "offered_groups_per_s": offered_groups_per_s(load, servers, batch),
            "groups_per_s": groups / window,
            "driver_cores": driver_s / window, "driver_cpu_ms_per_group": 1000 * driver_s / max(groups, 1),
            "redis_cores": (redis1 - redis0) / window, "redis_cpu_ms_per_group": 1000 * (redis1 - redis0) / max(groups, 1),
            "redis_commands_per_s": (cmds1 - cmds0) / window, "redis_commands_per_group": (cmds1 - cmds0) / max(groups, 1),
            "admission_calls": len(latencies),
            "admission_p50_ms": 1000 * percentile(latencies, 0.5), "admission_p99_ms": 1000 * percentile(latencies, 0.99),
            "queue_depth_mean": statistics.fmean(driver.depths) if driver.depths else 0.0,
            "queue_depth_max": max(driver.depths, default=0),
            "health_sweep_s": max(driver.health_sweeps_s, default=float("nan")),
            "cores": {name: (cpu1[name] - cpu0[name]) / window for name in procs},
            "redis_commands": command_deltas(by_command0, by_command1, groups),
        }
        point["delivered_fraction"] = point["groups_per_s"] / point["offered_groups_per_s"]

        # Heal, --repeats times: server r's engine dies; the driver's watch ends its tickets
        # and starts a replacement (servers 0, 1, 2...: the same accelerators at every N).
        heals = []
        for r in range(args.repeats):
            killed_at = await driver.host_of(r).kill.remote(r)
            heals.append(await wait_first_puts(driver, [r], killed_at))
        # Scale +10 %, then -10 % (the added servers go), --repeats times (fresh indices each).
        step = max(1, math.ceil(0.1 * servers))
        ups, downs = [], []
        for r in range(args.repeats):
            added = list(range(servers + r * step, servers + (r + 1) * step))
            since = time.time()
            await driver.add(added)
            ups.append(await wait_first_puts(driver, added, since))
            since = time.time()
            downs.append(await driver.remove(added) - since)
        point.update(heal_s=statistics.median(heals), scale_up_s=statistics.median(ups), scale_down_s=statistics.median(downs),
                     heals_s=heals, scale_ups_s=ups, scale_downs_s=downs)

        # A graceful stop, the queue drained, then every claimed prompt accounted for.
        stop.set()
        await loop
        for task in driver.watches.values():
            task.cancel()
        await asyncio.gather(*(h.stop.remote() for h in hosts))
        await asyncio.to_thread(ray.get, learner.drain.remote())
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            stats = queue.stats()
            if stats["depth"] == 0 and stats["pending"] == 0 and stats["inflight"] == 0:
                break
            await asyncio.sleep(0.5)
        consumed = await asyncio.to_thread(ray.get, learner.stop.remote())
        await asyncio.to_thread(ray.get, learning)
        stats = queue.stats()
        dropped = sum(stats["dropped"].values())
        point.update(
            groups_consumed=len(consumed), prompts_claimed=stats["prompt_cursor"], prompts_returned=stats["returned_prompts"],
            groups_dropped=dropped, tickets_open=stats["inflight"], healed=driver.healed, unhealthy_checks=driver.unhealthy,
            duplicated=len(consumed) - len(set(consumed)),
            lost=stats["prompt_cursor"] - len(set(consumed)) - stats["returned_prompts"] - dropped - stats["inflight"],
        )
        for actor in (*hosts, learner):
            ray.kill(actor)
        queue.close()
        return point


def byte_cost(token_scale: int, load: Load, groups: int = 200, rounds: int = 3) -> dict[str, Any]:
    """Redis's CPU per MB of group payload: ``groups`` groups of the full payload and of the
    carried one (1 / ``token_scale``) put and read back on a fresh redis-server (AOF always);
    the difference per MB added is what the sim leaves out. Each size is measured ``rounds``
    times, alternating, and the medians taken: one round's figure varies up to 2.5x with the
    disk's fsync cost (a fresh machine's first writes are the slowest)."""
    rng = random.Random(3)

    def group(i: int, scale: int) -> RolloutGroup:
        samples = []
        for _ in range(load.n):
            carried = max(1, load.draw(rng) // scale)
            samples.append(Sample.from_lists(TOKENS[:carried], LOGPROBS[:carried], 0, 1.0))
        return RolloutGroup.from_lists(RUN, f"{RUN}:{i}", i, TOKENS[:PROMPT_TOKENS], samples, "server-0", 1.0)

    def one(built: list[RolloutGroup]) -> float:
        """Redis CPU ms a group, ``built`` put and read back."""
        with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(data_dir=tmp, appendfsync="always") as url:
            queue = ReplayQueue(url, RUN, max_depth=1_000_000)
            cpu0, _ = redis_counters(queue.client)
            for g in built:
                queue.put(g)
            read = 0
            while read < len(built):
                entries = queue.get(len(built) - read, timeout=1.0)
                queue.commit(e for e, _ in entries)
                read += len(entries)
            cpu1, _ = redis_counters(queue.client)
            queue.close()
        return 1000 * (cpu1 - cpu0) / len(built)

    built = {name: [group(i, scale) for i in range(groups)] for name, scale in (("full", 1), ("carried", token_scale))}
    out: dict[str, Any] = {f"{name}_mb_per_group": sum(len(s.token_ids) * 2 for g in gs for s in g.samples) / 1e6 / groups
                           for name, gs in built.items()}
    runs: dict[str, list[float]] = {name: [] for name in built}
    for _ in range(rounds):
        for name, gs in built.items():
            runs[name].append(one(gs))
    for name, ms in runs.items():
        out[f"{name}_redis_cpu_ms_per_group"] = statistics.median(ms)
        out[f"{name}_redis_cpu_ms_per_group_rounds"] = ms
    extra_mb = out["full_mb_per_group"] - out["carried_mb_per_group"]
    out["redis_cpu_ms_per_mb"] = (out["full_redis_cpu_ms_per_group"] - out["carried_redis_cpu_ms_per_group"]) / max(extra_mb, 1e-9)
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    fig, ax = new_plot()
    xs = [p["servers"] for p in result["points"]]
    ax.plot(xs, [p["delivered_fraction"] for p in result["points"]], "o-", label="delivered / offered")
    ax.plot(xs, [p["driver_cores"] for p in result["points"]], "s-", label="driver, cores")
    ax.plot(xs, [p["redis_cores_at_full_payload"] for p in result["points"]], "^-", label="Redis at full payload, cores")
    ax.axhline(TARGET_DELIVERED, color="grey", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    save_plot(fig, ax, path, "simulated servers", "fraction / cores", "scale_sim: the control plane against N servers")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="32,128,512,1024", help="comma-separated N")
    parser.add_argument("--hosts", type=int, default=2, help="SimHost processes (one per core)")
    parser.add_argument("--batch", type=int, default=None, help="groups per learner step (default: N, one a server)")
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--max-inflight", type=int, default=RolloutConfig().max_inflight,
                        help="groups in flight per server (rollout.max_inflight; default its default)")
    parser.add_argument("--token-scale", type=int, default=64,
                        help="a response carries 1/this of its tokens (Redis's cost at the full payload is added from byte_cost)")
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds before the measured window")
    parser.add_argument("--seconds", type=float, default=60.0, help="measured window, seconds")
    parser.add_argument("--repeats", type=int, default=5, help="heals and scale steps at each N (their medians compared)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", action="store_true", help="write a PNG beside --json")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    load = Load()
    costs = byte_cost(args.token_scale, load)  # before Ray starts: its start-up would share the cores
    init_ray(num_cpus=os.cpu_count(), log_to_driver=False)
    result: dict[str, Any] = {
        "machine": f"{os.uname().machine}, {os.cpu_count()} cores", "load": asdict(load),
        "mean_response_tokens": load.mean_tokens(), "groups_per_s_per_server": load.groups_per_s(),
        "token_scale": args.token_scale, "hosts": args.hosts, "max_staleness": args.max_staleness,
        "max_inflight": args.max_inflight, "warmup_s": args.warmup, "window_s": args.seconds, "repeats": args.repeats,
        "health_period_s": HEALTH_PERIOD_S, "stats_period_s": STATS_PERIOD_S, "byte_cost": costs,
        "real_runs": real_run_loads(load), "weight_path": {"assumptions": asdict(WeightPath()), "rows": WeightPath().table()},
        "points": [],
    }
    for n in (int(x) for x in args.servers.split(",")):
        point = asyncio.run(measure(n, args, load))
        full_mb_per_s = point["groups_per_s"] * costs["full_mb_per_group"]
        carried_mb_per_s = point["groups_per_s"] * costs["carried_mb_per_group"]
        point["redis_cores_at_full_payload"] = point["redis_cores"] + (full_mb_per_s - carried_mb_per_s) * costs["redis_cpu_ms_per_mb"] / 1000
        result["points"].append(point)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in point.items() if k not in ("cores", "redis_commands")), flush=True)
    top, bottom = result["points"][-1], result["points"][0]
    result["targets"] = {
        "delivered_fraction": [top["delivered_fraction"], TARGET_DELIVERED], "driver_cores": [top["driver_cores"], TARGET_DRIVER_CORES],
        "redis_cores_at_full_payload": [top["redis_cores_at_full_payload"], TARGET_REDIS_CORES],
        "lost": sum(p["lost"] for p in result["points"]), "duplicated": sum(p["duplicated"] for p in result["points"]),
        "heal_ratio": top["heal_s"] / bottom["heal_s"], "scale_up_ratio": top["scale_up_s"] / bottom["scale_up_s"],
        "scale_down_ratio": top["scale_down_s"] / max(bottom["scale_down_s"], 1e-3),
    }
    t = result["targets"]
    met = (top["delivered_fraction"] >= TARGET_DELIVERED and top["driver_cores"] < TARGET_DRIVER_CORES
           and top["redis_cores_at_full_payload"] < TARGET_REDIS_CORES and t["lost"] == 0 and t["duplicated"] == 0
           and max(t["heal_ratio"], t["scale_up_ratio"], t["scale_down_ratio"]) <= TARGET_HEAL_RATIO)
    result["targets_met"] = met
    report({k: v for k, v in result.items() if k != "load"}, args.json)
    if args.plot and args.json is not None:
        plot(result, args.json.with_suffix(".png"))
    ray.shutdown()
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
