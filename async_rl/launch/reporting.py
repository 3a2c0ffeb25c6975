"""What the driver tells: each learner step's metrics with the rollout side's (counters read
from Redis, the generation rate), the servers' failure reports relayed to the console and the
run's files, a heartbeat while no step comes, the diagnosis of a stalled run, and
``servers.json``."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections import deque
from typing import Any

from async_rl.launch.failures import FailureLog
from async_rl.launch.learning_checks import LearningChecks, rules_for
from async_rl.launch.run_context import RunContext
from async_rl.launch.stall import Snapshot, blame
from async_rl.queue.admission import admission_limit
from async_rl.rollout.host import COUNTERS

log = logging.getLogger(__name__)

RATE_WINDOW_S = 10.0
"""Generation tokens/s is measured over about this many seconds (groups land in bursts), seconds."""
FAILURE_POLL_S = 1.0
"""How often the driver reads the servers' failure reports from the queue, seconds."""
HEARTBEAT_S = 30.0
"""While no learner step has come for this long, the console shows what the rollout side is
doing (and the counters go to every metrics sink) once per this many seconds."""


class Reporter:
    def __init__(self, run: RunContext):
        self.run = run
        self.failures = FailureLog(run.run_dir, run.cfg.algorithm.failed_samples)
        self.checks = LearningChecks(rules_for(run.cfg))
        """Conditions under which the run cannot learn, said on the console (:mod:`~async_rl.launch.learning_checks`)."""
        self._generated = RateMeter(RATE_WINDOW_S)
        self._control_dropped: dict[str, float] = {}
        """The weight sender's ``sync/control_dropped/*`` counts at the last step."""
        self._failure_cursor = "0"

    async def open(self) -> None:
        """Start after the failure reports already in the queue (a resumed run's are on file)."""
        self._failure_cursor = await self.run.redis(self.run.queue.last_failure_id)

    async def log_step(self, metrics: dict[str, float]) -> None:
        """One learner step's metrics, with the rollout side's, to every sink; what the step
        shows that the user must act on, to the console."""
        run = self.run
        metrics.update(await self.rollout_now())
        metrics.update(await run.models.stats())
        metrics["learner/restarts"] = float(run.learner_restarts)
        self._say_control_drops(metrics)
        for line in self.checks.observe(metrics):  # a learning check that just became active
            run.say(line)
        metrics.update(self.checks.flags())
        run.tracker.log(metrics)
        run.last_step = time.monotonic()

    def _say_control_drops(self, metrics: dict[str, float]) -> None:
        """Name on the console the control messages the weight sender dropped since the last
        step (the counts are the sender's since it started: a restarted learner counts anew)."""
        prefix = "sync/control_dropped/"
        counts = {k.removeprefix(prefix): v for k, v in metrics.items() if k.startswith(prefix)}
        new = {r: n - self._control_dropped.get(r, 0.0) if n >= self._control_dropped.get(r, 0.0) else n for r, n in counts.items()}
        self._control_dropped = counts
        if any(new.values()):
            self.run.say(f"the weight sender dropped control messages ({', '.join(f'{r} {n:.0f}' for r, n in new.items() if n)}) at "
                         f"{self.run.learners.sender_address}: something other than this run's servers reaches it; training goes on "
                         "(docs/security.md)")

    async def queue_now(self) -> tuple[dict[str, float], dict[str, Any]]:
        """The rollout workers' counters and the queue's stats (:meth:`ReplayQueue.stats`)."""
        queue = self.run.queue
        return await self.run.redis(lambda: (queue.rollout_stats(), queue.stats()))

    async def rollout_now(self) -> dict[str, float]:
        """The rollout side's metrics now (counters from Redis, generation rate)."""
        rollout, stats = await self.queue_now()
        return self.rollout_metrics(rollout, stats, self._generated.rate(rollout.get("tokens_generated", 0.0), time.monotonic()))

    async def relay_failures(self) -> None:
        """About once a second: the servers' failure reports to the console and the run's
        files; while no step comes, a heartbeat every :data:`HEARTBEAT_S` seconds."""
        last_beat = time.monotonic()
        while True:
            await asyncio.sleep(FAILURE_POLL_S)
            try:
                await self.relay_once()
                now = time.monotonic()
                if now - self.run.last_step >= HEARTBEAT_S and now - last_beat >= HEARTBEAT_S:
                    last_beat = now
                    await self._heartbeat(now - self.run.last_step)
            except Exception as exc:  # noqa: BLE001 - diagnostics must never end the run (Redis away: the watcher decides)
                if not self.run.outages.waiting_for_disk:  # a Redis waiting for disk space was said already
                    log.warning("failure reports not read: %s: %s", type(exc).__name__, exc)

    async def relay_once(self) -> None:
        self._failure_cursor, reports, bad = await self.run.redis(self.run.queue.read_failures, self._failure_cursor)
        self.failures.undecodable += bad
        for line in self.failures.ingest(reports, time.monotonic()):
            self.run.say(line)

    async def _heartbeat(self, waited_s: float) -> None:
        """Log the rollout side's counters to every sink, and say on the console what each side is doing."""
        metrics = {"version": float(self.run.version), **(await self.rollout_now())}
        self.run.tracker.log(metrics, heartbeat=True)
        dropped = ", ".join(f"{k.removeprefix('queue/dropped/')} {v:.0f}" for k, v in metrics.items() if k.startswith("queue/dropped/") and v)
        errors = ", ".join(f"{label} {metrics[key]:.0f}" for label, key in (
            ("reward errors", "rollout/reward_errors"), ("of them timeouts", "rollout/reward_timeouts"), ("environment errors", "env/errors"),
            ("environment timeouts", "env/timeouts"))
            if metrics.get(key))
        self.run.say(f"no learner step for {waited_s:.0f} s: {metrics.get('rollout/groups_put', 0):.0f} groups generated, "
                     f"{metrics.get('rollout/tokens_per_s', 0):.0f} tokens/s; dropped: {dropped or 'none'}; "
                     f"{errors or 'no reward or environment errors'}. {await self.diagnose()}")

    async def snapshot(self, healths: list[Any], stats: dict[str, Any] | None = None) -> Snapshot:
        """The run's state for :mod:`~async_rl.launch.stall` (``healths``: a :meth:`ServerPool.health`
        just taken; ``stats``: the queue's, read now if not given)."""
        run, cfg = self.run, self.run.cfg
        stats = await run.redis(run.queue.stats) if stats is None else stats
        return Snapshot(run.version, stats["version"], stats["groups_started"], cfg.algorithm.max_staleness, cfg.learner.batch_size,
                        stats["depth"], stats["inflight"], [h if isinstance(h, str) else (h.server_id, h.version) for h in healths],
                        run.workers_started)

    async def diagnose(self) -> str:
        """What each side of a stalled run waits for, in one paragraph, and the component to blame."""
        run, cfg = self.run, self.run.cfg
        stats = await run.redis(run.queue.stats)
        healths = await run.pool.health()
        limit = admission_limit(stats["version"], cfg.algorithm.max_staleness, cfg.learner.batch_size)
        admission = (f"admission closed: groups_started={stats['groups_started']} >= (published version {stats['version']} + "
                     f"max_staleness {cfg.algorithm.max_staleness} + 1) x batch {cfg.learner.batch_size} = {limit}"
                     if stats["groups_started"] >= limit else f"admission open ({stats['groups_started']}/{limit} started)")
        servers = "; ".join(
            h if isinstance(h, str) else f"{h.server_id} holds version {h.version}, {h.running_requests} requests running"
            for h in healths
        )
        return (f"learner at version {run.version} waits for {cfg.learner.batch_size} groups (queue depth {stats['depth']}, "
                f"pending {stats['pending']}); rollout: {admission}, {stats['inflight']} groups in flight, "
                f"{stats['returned_prompts']} returned prompts waiting; servers: {servers}. "
                f"Waiting on {blame(await self.snapshot(healths, stats))}")

    def rollout_metrics(self, rollout: dict[str, float], stats: dict[str, Any], tokens_per_s: float) -> dict[str, float]:
        """Console and tracker metrics of the rollout side: the workers' counters (``rollout``,
        from Redis, cumulative over the run) and the queue's state (``stats``)."""
        run, pool = self.run, self.run.pool
        out = {
            "rollout/tokens_per_s": tokens_per_s,
            "queue/depth": float(stats["depth"]),
            "queue/pending": float(stats["pending"]),
            "queue/dropped_stale": float(stats["dropped_stale"]),
            "queue/dead_lettered": float(stats["dead_lettered"]),
            "queue/oldest_age_s": float(stats["oldest_age_s"]),
            "queue/returned_prompts": float(stats["returned_prompts"]),
            "rollout/servers": float(pool.num_servers),
            "rollout/server_restarts": float(pool.restarts),
            "queue/redis_restarts": float(run.outages.redis_restarts),
            "rollout/engine_deaths": float(pool.engine_deaths),
            "recoveries/version_republished": float(run.recoveries["version_republished"]),
            "recoveries/engine_hangs": float(pool.engine_hangs),
            "recoveries/learner_hangs": float(run.recoveries["learner_hangs"]),
            "recoveries/disk_full": float(run.recoveries["disk_full"]),
            "rollout/failure_reports_undecodable": float(self.failures.undecodable),
        }
        out.update({f"rollout/{name}": rollout.get(name, 0.0) for name in COUNTERS})
        if episodes := rollout.get("env_episodes", 0.0):
            out["env/turns_mean"] = rollout.get("env_turns", 0.0) / episodes
            for name in ("errors", "timeouts", "blocked", "restarts", "reruns"):
                out[f"env/{name}"] = rollout.get(f"env_{name}", 0.0)
            out["env/overlong_prompts"] = rollout.get("env_overlong_prompts", 0.0)
            out["env/success_rate"] = rollout.get("env_successes", 0.0) / episodes
            out["env/reward_mean"] = rollout.get("env_reward", 0.0) / episodes
            out["env/step_s_mean"] = rollout.get("env_step_s", 0.0) / max(rollout.get("env_turns", 0.0), 1.0)
            out["env/tool_calls"] = rollout.get("env_tool_calls", 0.0)
            out["env/tool_errors"] = rollout.get("env_tool_errors", 0.0)
        out.update({f"queue/dropped/{reason}": float(count) for reason, count in stats["dropped"].items()})
        return out

    def write_servers(self) -> None:
        """(Re)write ``servers.json``: the driver's Prometheus URL, the id, pid, vLLM engine
        process ids, OpenAI API URL and vLLM metrics URL of every started server, each
        learner rank's pid, the weight sender's control address and the served models' servers
        (``models``: the model's name, server id, pids and OpenAI API URL)."""
        run = self.run
        servers = [{"server_id": h.server_id, "pid": h.pid, "engine_pids": h.engine_pids, "openai_url": h.openai_url,
                    "metrics_url": vllm_metrics_url(h.openai_url)}
                   for h in run.pool.started if h is not None]
        prometheus = run.tracker.prometheus if run.tracker is not None else None
        learners = [{"rank": rank, "pid": pid} for rank, pid in enumerate(run.learners.pids)]
        doc = {"prometheus_url": prometheus.url if prometheus is not None else None, "servers": servers, "learners": learners,
               "weight_sync_address": run.learners.sender_address, "models": run.models.servers()}
        path = run.run_dir / "servers.json"
        tmp = path.with_name(f".{path.name}.tmp")  # renamed into place: a reader never sees half a file
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp, path)


class RateMeter:
    """Rate of a cumulative counter over a trailing window of at least ``window_s`` seconds."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()

    def rate(self, value: float, now: float) -> float:
        """Per second, from the oldest sample still in the window to (``now``, ``value``); 0 at first."""
        self._samples.append((now, value))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        t0, v0 = self._samples[0]
        return (value - v0) / (now - t0) if now > t0 else 0.0


def vllm_metrics_url(openai_url: str | None) -> str | None:
    """vLLM's own Prometheus endpoint on a server's OpenAI API port (``.../v1`` -> ``.../metrics``)."""
    return None if openai_url is None else openai_url.removesuffix("/v1") + "/metrics"
