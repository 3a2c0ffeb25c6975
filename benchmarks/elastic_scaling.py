"""Elastic scaling: a rollout pool resized 1 -> 4 -> 8 -> 2 servers while it produces.

The real :class:`~async_rl.rollout.pool.ServerPool` with :class:`~async_rl.rollout.fake_engine.FakeServer`
actors (a fixed token rate each, no vLLM), their real rollout workers and reward pools, one
embedded redis-server (AOF, ``appendfsync always``) and a learner stand-in that trains a
batch of ``B`` groups every ``--step-s`` seconds (commits them, publishes a version). This
process does what the driver does on ``async-rl scale``: :meth:`ServerPool.scale_to` (drains
the leaving servers with ``--grace-s``). Phases last ``--phase-s`` seconds each.

JSON keys:

- ``groups_per_s_by_phase``: groups appended to the stream per second, over each phase from
  ``--settle-s`` (15 s) after its change to its end; ``efficiency_by_phase``: that over
  (servers x one server's rate in the first phase). Target: >= 0.8 in every phase.
- ``scale_up_s`` / ``drain_s``: how long each change took (scale_to returned: the new servers
  produce; the leaving ones drained and stopped).
- ``lost_prompts`` / ``duplicated_prompts``: every claimed prompt index is trained, queued or
  returned exactly once (targets: 0 and 0).
- ``learner_wait_s_during_changes``: seconds the learner stand-in waited for a batch from the
  start of each change to ``--settle-s`` after it; ``learner_wait_s_total`` over the run. The
  learner is sized to need less than one server makes (``--step-s``), so any wait is a stall.

    python benchmarks/elastic_scaling.py --json benchmarks/results/elastic_scaling.json

Exits 1 if a target is missed.
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

EFFICIENCY_TARGET = 0.8
BATCH = 16
RUN = "elastic"


class Learner:
    """Trains ``B`` groups every ``step_s`` seconds: reads them (waiting when too few are
    queued), commits them, publishes a version; records every wait and the prompts trained."""

    def __init__(self, url: str, step_s: float):
        self.queue = ReplayQueue(url, RUN, max_depth=1_000_000)
        self.step_s = step_s
        self.stopped = threading.Event()
        self.waits: list[tuple[float, float]] = []
        """``(time.time() at the start, seconds)`` of each wait for groups."""
        self.prompts: list[int] = []

    def run(self) -> None:
        version = 0
        while not self.stopped.is_set():
            batch: list[Any] = []
            while len(batch) < BATCH and not self.stopped.is_set():
                t0 = time.time()
                entries = self.queue.get(BATCH - len(batch), timeout=0.2)
                if len(entries) < BATCH - len(batch):
                    self.waits.append((t0, time.time() - t0))
                batch += entries
            self.queue.commit(entry_id for entry_id, _ in batch)
            self.prompts += [group.prompt_id for _, group in batch]
            version += 1
            self.queue.publish_version(version)
            self.stopped.wait(self.step_s)

    def stop(self) -> tuple[list[tuple[float, float]], list[int]]:
        self.stopped.set()
        return self.waits, self.prompts


async def run_phases(pool: ServerPool, phases: list[int], args: argparse.Namespace, added: Any) -> list[dict[str, float]]:
    """Start with ``phases[0]`` servers, then scale through the rest; per phase: the change's
    time and window, and the groups added in the settled part of it."""
    out = []
    for k, servers in enumerate(phases):
        t0 = time.time()
        if k == 0:
            await pool.start()
        else:
            await pool.scale_to(servers, args.grace_s)
        changed = time.time()
        await asyncio.sleep(args.settle_s - (changed - t0) if changed - t0 < args.settle_s else 0.0)
        settled, groups0 = time.time(), added()
        await asyncio.sleep(max(1.0, args.phase_s - (settled - t0)))
        end = time.time()
        out.append({"servers": servers, "change_s": changed - t0, "start": t0, "settled": settled,
                    "groups_per_s": (added() - groups0) / (end - settled)})
        print(f"{servers:3d} servers: change {changed - t0:5.1f} s, {out[-1]['groups_per_s']:6.1f} groups/s", flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--phases", default="1,4,8,2", help="server counts, in order")
    parser.add_argument("--phase-s", type=float, default=40.0, help="length of each phase, seconds (from its change's start)")
    parser.add_argument("--settle-s", type=float, default=15.0, help="groups/s is measured from this long after a change")
    parser.add_argument("--grace-s", type=float, default=5.0, help="a leaving server's time to finish its groups in flight")
    add_fake_server_args(parser)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    phases = [int(s) for s in args.phases.split(",")]
    one_server = args.tokens_per_s / (args.n * args.max_tokens)  # groups/s
    step_s = BATCH / (0.8 * one_server)  # the learner needs 80% of one server's groups

    init_ray(num_cpus=os.cpu_count() or 1)
    rows = [PromptRow(i + 1, f"question {i}", str(i % 10)) for i in range(200_000)]
    settings = WorkerSettings(run_id=RUN, server_id="", n=args.n, sampling=Sampling(max_tokens=args.max_tokens, ignore_eos=True),
                              batch_size=BATCH, max_staleness=1000, max_inflight=args.max_inflight, shuffle=False)
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis") as url, ReplayQueue(url, RUN, max_depth=1_000_000) as queue:
        spec = WorkerHostSpec(url, RUN, max_depth=1_000_000, op_timeout_s=30.0, settings=settings, workers=1,
                              reward=RewardConfig(function="exact_match", num_workers=1), max_response_length=args.max_tokens)
        pool = ServerPool(ServerSpec({"tokens_per_s": args.tokens_per_s}, num_cpus=0, server_cls=FakeServer), phases[0],
                          workers=spec, rows=ray.put(rows), on_lost=queue.release_owner)
        client = connect(url, socket_timeout_s=30.0)
        learner = ray.remote(Learner).options(num_cpus=0, max_concurrency=2).remote(url, step_s)
        learning = learner.run.remote()

        async def go() -> list[dict[str, float]]:
            try:
                return await run_phases(pool, phases, args, lambda: client.xinfo_stream(queue.keys.rollouts)["entries-added"])
            finally:
                await pool.stop_workers(grace_s=args.grace_s)
                await pool.shutdown()

        points = asyncio.run(go())
        waits, trained = ray.get(learner.stop.remote())
        ray.get(learning)
        ray.kill(learner)
        stats = queue.stats()
        queued = [g.prompt_id for _, g in queue.get(1_000_000, timeout=1.0)]
        returned = [int(i) for i in client.lrange(queue.keys.returned, 0, -1)]
        client.close()
    ray.shutdown()

    claimed = trained + queued + returned
    base = points[0]["groups_per_s"] / points[0]["servers"]
    for p in points:
        p["efficiency"] = p["groups_per_s"] / (p["servers"] * base)
    changes = [(p["start"], p["settled"]) for p in points[1:]]
    result: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "phases": phases, "phase_s": args.phase_s, "settle_s": args.settle_s, "grace_s": args.grace_s,
        "ideal_groups_per_s_per_server": one_server, "learner_step_s": step_s, "batch": BATCH,
        "groups_per_s_by_phase": [round(p["groups_per_s"], 2) for p in points],
        "efficiency_by_phase": [round(p["efficiency"], 3) for p in points],
        "scale_up_s": [round(p["change_s"], 2) for prev, p in zip(points, points[1:], strict=False) if p["servers"] > prev["servers"]],
        "drain_s": [round(p["change_s"], 2) for prev, p in zip(points, points[1:], strict=False) if p["servers"] < prev["servers"]],
        "lost_prompts": stats["prompt_cursor"] - len(set(claimed)),
        "duplicated_prompts": len(claimed) - len(set(claimed)),
        "learner_wait_s_during_changes": round(sum(s for t, s in waits if any(a <= t <= b for a, b in changes)), 2),
        "learner_wait_s_total": round(sum(s for _, s in waits), 2),
        "groups_trained": len(trained), "inflight_after": stats["inflight"],
    }
    ok = (min(p["efficiency"] for p in points) >= EFFICIENCY_TARGET and result["lost_prompts"] == 0 and result["duplicated_prompts"] == 0)
    result["targets_met"] = ok
    report(result, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
