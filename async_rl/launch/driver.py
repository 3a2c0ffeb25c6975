"""``async-rl train``: start every process, drive the learner, validate, log, and shut down.

The driver (this process) owns the run's lifecycle. It starts, in order: the embedded
redis-server (unless ``queue.redis_url``), Ray, the learner ranks (their rank 0 hosts the
weight sender) and the inference servers (registered with that sender), each running its
rollout workers in its own process (:mod:`async_rl.rollout.host`): generated groups go
from the server straight to Redis, never through this process. It then calls the learner
one step at a time with a bounded wait, so it can log progress (rollout counters read from
Redis), start validation and react to Ctrl-C / SIGTERM. Shutdown (normal end or signal)
runs in reverse: workers stop, the learner writes a final checkpoint and commits its queue
entries, servers and learner actors stop, Ray stops, the embedded Redis stops.

Every Redis call runs in a thread (:meth:`_Run._redis`): with Redis away one retries for
``queue.timeout_s``, and the event loop must stay free to take a signal meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import signal
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import ray

from async_rl.config import Config, save_resolved
from async_rl.data.images import load_image
from async_rl.data.prompts import ImageFields, PromptFormatter, read_prompt_rows, write_rejected
from async_rl.envs import EnvPool, EnvStartupError
from async_rl.envs.conversation import ChatEncoder
from async_rl.launch import disk
from async_rl.launch.cores import SupportCores, cpu_layout, set_process_cores, support_cores
from async_rl.launch.failures import FailureLog
from async_rl.launch.learning_checks import LearningChecks, rules_for
from async_rl.launch.plan import Plan, StartupError, startable_plan
from async_rl.launch.prometheus import server_states
from async_rl.launch.ray_cluster import init_ray
from async_rl.launch.reaper import reap_on_exit
from async_rl.launch.run_state import RunStateError, claim_run, driver_owner, make_private, set_aside
from async_rl.launch.stall import VERSION_WATCHDOG_S, Snapshot, blame, provable_version
from async_rl.launch.tracking import Tracker
from async_rl.learner.actor import start_learners
from async_rl.learner.memory import servers_gpu_share
from async_rl.queue import EmbeddedRedis, QueueUnavailableError, RedisExit, ReplayQueue
from async_rl.queue.embedded import MIN_FREE_BYTES, NO_SPACE, SPACE_WAIT_S
from async_rl.queue.admission import admission_limit
from async_rl.queue.ownership import LEASE_RENEW_S, LEASE_RETRY_S, LeaseLostError, RunInUseError, RunOwnership
from async_rl.queue.requests import Requests, ScaleReply
from async_rl.rewards.pool import RewardPool
from async_rl.rewards.scoring import RewardScorer, RewardStartupError, check_reward_function
from async_rl.rollout.engine_args import engine_kwargs, on_gpu, openai_api_settings
from async_rl.rollout.host import COUNTERS, WorkerHostSpec
from async_rl.rollout.pool import ServerPool, ServerSpec
from async_rl.rollout.episodes import EpisodeSampler
from async_rl.rollout.types import Sampling
from async_rl.rollout.validation import ValidationResult, ValPrompt, validate, validate_episodes
from async_rl.sync.auth import RunSecret, SyncEndpoint

log = logging.getLogger(__name__)
T = TypeVar("T")

LEARNER_WAIT_S = 2.0
"""Longest one learner call waits for a batch before control returns to the driver, seconds."""
WORKER_GRACE_S = 10.0
"""How long stopping workers may finish their groups in flight before they are cancelled, seconds."""
HEALTH_PERIOD_S = 10.0
"""Period of the server health check and of the stall check, seconds."""
RATE_WINDOW_S = 10.0
"""Generation tokens/s is measured over about this many seconds (groups land in bursts), seconds."""
FAILURE_POLL_S = 1.0
"""How often the driver reads the servers' failure reports from the queue, seconds."""
REQUEST_POLL_S = 1.0
"""How often the driver looks for a request to the run (``async-rl scale``), seconds."""
LEARNER_SLOW_FACTOR = 3.0
"""A learner call may take this many times the slowest call so far before its silent ranks count as hung."""
LEARNER_FIRST_CALL_FACTOR = 10.0
"""The first learner call of a learner group may take this many times ``trainer.learner_hang_timeout_s``."""
HEARTBEAT_S = 30.0
"""While no learner step has come for this long, the console shows what the rollout side is
doing (and the counters go to every metrics sink) once per this many seconds."""


class RunFailed(RuntimeError):
    """The run started but could not go on (stalled, nothing trainable, the learner died)."""


def _cause(exc: BaseException) -> str:
    """The original error of a Ray task failure, as ``Type: message``."""
    cause = getattr(exc, "cause", None) or exc
    return f"{type(cause).__name__}: {cause}"


@dataclass
class RunResult:
    """What a finished (or interrupted) run reports."""

    version: int
    run_dir: Path
    interrupted: bool
    validations: list[ValidationResult] = field(default_factory=list)
    train_wall_s: float = 0.0
    """Seconds from the rollout workers' start to the learner's last step (start-up excluded)."""
    server_busy_s: list[float] = field(default_factory=list)
    """Per server, seconds with requests running during the run."""


def train(cfg: Config, plan: Plan | None = None) -> RunResult:
    """Run training as configured (``plan``: :func:`~async_rl.launch.plan.startable_plan` of
    ``cfg`` when the caller made it); raises :class:`StartupError` for problems found before starting."""
    plan = plan if plan is not None else startable_plan(cfg)
    return asyncio.run(_Run(cfg, plan.disk).main())


class _Run:
    def __init__(self, cfg: Config, disk_need: disk.DiskNeed | None = None):
        self.cfg = cfg
        self.run_dir = Path(cfg.trainer.output_dir)
        self.disk_need = disk_need
        """What the run writes into its directory (None: unknown, the model's config.json is not here)."""
        self.stop = asyncio.Event()
        self.interrupted = False
        self.version = 0
        self.validations: list[ValidationResult] = []
        self._validating: asyncio.Task | None = None
        self.train_wall_s = 0.0
        self.server_busy_s: list[float] = []
        self.failure: str | None = None
        """Why the run stopped early (exit status 1), or None."""
        self.failures = FailureLog(self.run_dir, cfg.algorithm.failed_samples)
        self.checks = LearningChecks(rules_for(cfg))
        """Conditions under which the run cannot learn, said on the console (:mod:`~async_rl.launch.learning_checks`)."""
        self._last_step = time.monotonic()
        """When the learner's last step was logged (or the rollout workers started)."""
        self._first_call_s: float | None = None
        """The current learner group's first call (it loads and warms the model), seconds (None: not finished)."""
        self._slowest_call_s: float | None = None
        """The slowest of the current learner group's later calls (None: none finished), seconds."""
        self._restarting = False
        """A learner group is being restarted (its ledger reconciled)."""
        self._disk_low = False
        """The run's disk has less room than it needs (said once until it clears)."""
        self._disk_full_since: float | None = None
        """When the embedded Redis stopped for want of disk space (its restart waits for it), or None."""
        self._redis_back_at = -math.inf
        """When the embedded Redis last came back after exiting (monotonic seconds)."""
        self.recoveries: Counter[str] = Counter()
        """What the driver recovered from without a restart (``recoveries/*``)."""
        self._generated = RateMeter(RATE_WINDOW_S)
        self.redis_restarts = 0
        """Times the embedded Redis was restarted after it exited on its own."""
        self.learner_restarts = 0
        """Times the learner group was restarted from its checkpoint after a rank died."""
        self._sender_address: str | None = None
        self._control_dropped: dict[str, float] = {}
        """The weight sender's ``sync/control_dropped/*`` counts at the last step."""
        self._secret = RunSecret.generate()
        """Seals the weight-sync control messages; reaches the learner and the servers as an actor argument only."""
        """The learner's weight sender (rank 0), which the servers register with."""
        self._learner_pids: list[int] = []

    # -- lifecycle ------------------------------------------------------------------

    async def main(self) -> RunResult:
        cfg = self.cfg
        # What this process and its children (redis-server, a local Ray and its workers) write
        # is this user's only: prompts, responses, weights, the Redis password.
        os.umask(0o077)
        set_aside(cfg)  # trainer.resume=fresh: the previous run's files go to previous-<run id>/ first
        make_private(self.run_dir)
        save_resolved(cfg, self.run_dir)
        loop = asyncio.get_running_loop()
        self._install_signal_handlers()
        try:
            async with contextlib.AsyncExitStack() as stack:
                await self._start(stack)
                await self._train()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            # W&B's service process writes its files with modes of its own (0644): unreachable
            # inside the 0700 directory, closed too before the directory is ever opened up.
            make_private(self.run_dir)
        if self.failure is not None:
            raise RunFailed(self.failure)
        return RunResult(self.version, self.run_dir, self.interrupted, self.validations, self.train_wall_s, self.server_busy_s)

    def _install_signal_handlers(self) -> None:
        # Called again right after ray.init: Ray installs its own C++ SIGTERM handler,
        # which would otherwise run too and abort the process at exit.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: int) -> None:
        if not self.stop.is_set():
            log.warning("%s: stopping generation, writing a final checkpoint, shutting down", signal.Signals(sig).name)
            self.interrupted = True
            self.stop.set()

    async def _start(self, stack: contextlib.AsyncExitStack) -> None:
        cfg = self.cfg
        layout = cpu_layout(cfg)
        all_cores = os.sched_getaffinity(0)
        # Once the servers started, what runs beside them goes to their cores (the start uses every core).
        self._support = stack.enter_context(SupportCores(support_cores(layout))) if layout else None
        self._redis_pid: int | None = None
        """The embedded Redis's process (None: an external one), which runs on every core."""
        stack.enter_context(reap_on_exit())  # before any process starts: each ends with this one, even on SIGKILL
        from transformers import AutoTokenizer

        # What can fail on the user's files fails here, before Redis, Ray and vLLM start.
        self.formatter = PromptFormatter(AutoTokenizer.from_pretrained(cfg.learner.model_path), cfg.data.system_prompt, cfg.data.format_prompt)
        self.rows = self._read_rows(cfg.data.train_files)
        val_rows = self._read_rows(cfg.data.val_files) if cfg.data.val_files else []
        self.val_rows = val_rows
        bounds = ImageFields.from_config(cfg.data).bounds
        self.val_prompts = [
            ValPrompt(self.formatter.token_ids(r.prompt, len(r.images)), r.answer, [load_image(ref, bounds) for ref in r.images] or None)
            for r in val_rows
        ]
        self.envs: EnvPool | None = None
        if cfg.rollout.env.name is not None:
            self.envs = EnvPool(replace(cfg.rollout.env, num_workers=1))  # validation episodes only
            try:
                await self.envs.start()
            except EnvStartupError as exc:
                raise StartupError(str(exc)) from None
            stack.callback(self.envs.close)
            if any(r.images for r in (*self.rows, *val_rows)):
                raise StartupError(f"rollout.env.name={cfg.rollout.env.name!r}: multi-turn environments take text prompts only; "
                                   f"the dataset has rows with images ({cfg.data.image_key!r}): train them without rollout.env")
        self.rewards = stack.enter_context(RewardPool(cfg.rollout.reward))
        try:
            await check_reward_function(self._scorer(), [r.answer for r in (val_rows or self.rows)])
        except RewardStartupError as exc:
            raise StartupError(str(exc)) from None

        if cfg.queue.redis_url:
            redis_url = cfg.queue.redis_url
        else:
            embedded = EmbeddedRedis(self.run_dir / "redis")
            redis_url = await asyncio.to_thread(stack.enter_context, embedded)  # replaying a long AOF takes a while
            # Redis answers every admission, put and read. On the rollout cores, which vLLM
            # keeps busy, it waited seconds for the CPU and held generation and the learner
            # back with it (20 steps: 30-190 s instead of 8 s); it is light, so it runs anywhere.
            redis_cores = all_cores if layout else None
            self._redis_pid = embedded.pid
            loop = asyncio.get_running_loop()
            embedded.watch(lambda event: _call_soon(loop, self._on_redis_exit, event, redis_cores))
        await self._claim_run(stack, redis_url, embedded=not cfg.queue.redis_url)
        self.queue = stack.enter_context(await self._redis(lambda: ReplayQueue(redis_url, cfg.trainer.run_name, cfg.queue.max_depth,
                                                                               op_timeout_s=cfg.queue.timeout_s)))
        self._failure_cursor = await self._redis(self.queue.last_failure_id)  # a resumed run's older failure reports are on file already

        try:
            init_ray(cfg.ray.address, cfg.ray.num_cpus, configure_logging=False)
        except ConnectionError as exc:
            raise StartupError(str(exc)) from None
        stack.callback(ray.shutdown)
        self._install_signal_handlers()
        self._redis_url, self._rank_cores = redis_url, layout.ranks if layout else None

        env = {"VLLM_CPU_KVCACHE_SPACE": str(max(1, round(cfg.rollout.vllm.kv_cache_space_gb)))} if not on_gpu() else {}
        spec = ServerSpec(engine_kwargs(cfg), cfg.rollout.cpus_per_server, cfg.rollout.gpus_per_server, env,
                          openai_api=openai_api_settings(cfg), hang_timeout_s=cfg.rollout.engine_hang_timeout_s)
        self.pool = ServerPool(spec, cfg.rollout.num_servers, on_start=self._on_server_start,
                               env_per_server=[{"VLLM_CPU_OMP_THREADS_BIND": cores} for cores in layout.servers] if layout else None,
                               workers=WorkerHostSpec.from_config(cfg, redis_url), rows=ray.put(self.rows), on_lost=self.queue.release_owner,
                               report=self._say)
        stack.push_async_callback(self.pool.shutdown)
        self._sync_known: asyncio.Future[SyncEndpoint | None] = asyncio.get_running_loop().create_future()
        """The weight sender's endpoint, once the learner started and the driver is ready for the servers."""
        self._servers_starting: asyncio.Task | None = None
        if servers_gpu_share(cfg.rollout, cfg.learner) == 0:
            # The engines build while the learner starts. Not on a GPU they share: vLLM would
            # size its KV cache by the memory the learner is still taking.
            self._servers_starting = asyncio.create_task(self.pool.start(workers=False, sync=self._sync_known))
            stack.push_async_callback(_cancel, self._servers_starting)  # a start that fails on the way kills them
        # After trainer.resume=fresh moved the old state aside, the learner starts from the base model.
        await self._start_learners(replace(cfg, trainer=replace(cfg.trainer, resume="off")) if cfg.trainer.resume == "fresh" else cfg)
        stack.callback(self._kill_learners)
        try:
            self.tracker = Tracker(cfg, self.run_dir, cfg.trainer.total_steps, resumed=self.version > 0)
        except OSError as exc:  # the Prometheus port is taken
            raise StartupError(str(exc)) from None
        stack.callback(self.tracker.close)
        if self.tracker.prometheus is not None:
            log.info("Prometheus metrics at %s", self.tracker.prometheus.url)
            if cfg.logging.console:
                self.tracker.console.print(f"Prometheus metrics: {self.tracker.prometheus.url}", highlight=False)
        self._write_servers()
        self._sync_known.set_result(self._sync_endpoint())

    def _on_redis_exit(self, event: RedisExit, cores: set[int] | None) -> None:
        """The embedded Redis exited on its own: restarted on its AOF (clients retry), waiting
        for disk space first when its disk is full, or the run ends."""
        if event.error is not None:
            self._fail(f"{event.describe()} (its data and redis.log are in {self.run_dir / 'redis'})")
            return
        if event.disk_full is not None:
            self._disk_full_since = time.monotonic()
            self.recoveries["disk_full"] += 1
            self._say(event.describe())
            return
        if self._disk_full_since is not None:
            self._say(f"disk space is back after {time.monotonic() - self._disk_full_since:.0f} s")
            self._disk_full_since = None
        self._redis_back_at = time.monotonic()
        self.redis_restarts = event.restarts
        self._redis_pid = event.new_pid
        if cores and event.new_pid is not None:
            with contextlib.suppress(OSError):  # it may have died again; the watcher restarts it
                set_process_cores(event.new_pid, cores)
        self._say(event.describe())

    async def _claim_run(self, stack: contextlib.AsyncExitStack, redis_url: str, embedded: bool) -> None:
        """Bind the output directory and the run name's queue to one run id
        (:func:`~async_rl.launch.run_state.claim_run`) and hold the run name's lease until the end."""
        ownership = stack.enter_context(RunOwnership(redis_url, self.cfg.trainer.run_name, op_timeout_s=self.cfg.queue.timeout_s))
        try:
            await asyncio.to_thread(claim_run, ownership, self.cfg, embedded=embedded, owner=driver_owner())
        except (RunStateError, RunInUseError) as exc:
            raise StartupError(str(exc)) from None
        stack.callback(ownership.release)  # after everything that writes to the queue has stopped
        done = threading.Event()
        holder = threading.Thread(target=self._hold_lease, args=(ownership, done, asyncio.get_running_loop()),
                                  name="run-lease", daemon=True)
        holder.start()
        # At the end: stop renewing, and give a renewal in progress a moment to finish before the
        # release (a late renewal would hold the lease for another TTL); never wait on a dead Redis.
        stack.callback(holder.join, 5.0)
        stack.callback(done.set)

    def _hold_lease(self, ownership: RunOwnership, done: threading.Event, loop: asyncio.AbstractEventLoop) -> None:
        """Renew the run name's lease every few seconds until ``done``; end the run if another
        driver took it. A thread of its own: neither a busy event loop nor a thread pool whose
        workers all wait (on Redis, on a server's start) may delay it past the lease's TTL, or
        the run would look dead to ``async-rl scale`` and to a second driver."""
        wait_s = LEASE_RENEW_S
        while not done.wait(wait_s):
            try:
                ownership.renew()
                wait_s = LEASE_RENEW_S
            except LeaseLostError as exc:
                loop.call_soon_threadsafe(self._fail, str(exc))
                return
            except QueueUnavailableError as exc:  # Redis away: the queue's own calls decide the run's fate
                # Retried soon: a Redis away past the TTL (a full disk, a restart) dropped the
                # lease, and until it is renewed `async-rl scale` finds no driver (LEASE_BACK_S).
                if self._disk_full_since is None:  # a Redis waiting for disk space was said already
                    log.warning("the run's lease was not renewed: %s", exc)
                wait_s = LEASE_RETRY_S

    def _scorer(self) -> RewardScorer:
        return RewardScorer(self.rewards, self.cfg.rollout.reward, self.cfg.rollout.max_response_length)

    def _read_rows(self, path: str) -> list:
        rows, rejected = read_prompt_rows(path, self.cfg.data.prompt_key, self.cfg.data.answer_key, ImageFields.from_config(self.cfg.data))
        if rejected:
            write_rejected(rejected, self.run_dir / "rejected_rows.jsonl")
            log.warning("%s: %d malformed rows skipped (first: %s); see %s", path, len(rejected), rejected[0].reason, self.run_dir / "rejected_rows.jsonl")
        if not rows:
            raise StartupError(f"{path} has no usable rows ({len(rejected)} rejected)")
        return rows

    async def _start_learners(self, cfg: Config, live: bool = False) -> None:
        """Start the learner ranks, which load the latest checkpoint (or the model), and
        reconcile the ledger at their version. ``live``: a restart while the rollout workers
        run (their open tickets stay; the new weight sender takes the old one's port)."""
        previous = self._sender_address if live else None
        self.learners = await asyncio.to_thread(start_learners, cfg, self._redis_url, self._secret, self._rank_cores, previous)
        starts = await asyncio.gather(*(a.run.remote(0) for a in self.learners))
        self.version = starts[0]["version"]  # > 0 after a resume
        self._sender_address = await self.learners[0].sync_address.remote()
        self._learner_pids = await asyncio.gather(*(a.pid.remote() for a in self.learners))
        started = await self.learners[0].started_from.remote()
        for line in started["swept"]:  # a checkpoint save was killed in an earlier run
            log.warning("checkpoints: %s", line)
        if started["checkpoint"] is not None:
            log.info("the learner resumed from %s (version %d)", started["checkpoint"], self.version)
        if started["resharded"] is not None:  # learner.world_size changed since the checkpoint
            log.info("%s", started["resharded"])
        # The learner resumed (its checkpoint's entries are committed): rebuild the ledger from
        # what is really there, so slots and prompts of groups lost with a killed run come back.
        found = await self._redis(lambda: self.queue.reconcile(self.version, cfg.learner.batch_size, live=live))
        if found.returned or found.groups_started != found.groups_started_before:
            log.info("ledger reconciled at version %d: %d prompts returned (claimed, never enqueued), %d groups queued, "
                     "groups_started %d -> %d", self.version, found.returned, found.queued, found.groups_started_before, found.groups_started)

    def _sync_endpoint(self) -> SyncEndpoint | None:
        """Where the servers register for weight updates (None: the learner has no sender)."""
        return None if self._sender_address is None else SyncEndpoint(self._sender_address, self._secret)

    async def _restart_learners(self, why: str) -> bool:
        """A learner rank died: restart the whole group from the last checkpoint, as a resume
        does, while the servers keep generating within the staleness bound; False (the run
        ends) once ``trainer.max_restarts`` restarts are spent or the restart failed."""
        limit = self.cfg.trainer.max_restarts
        if self.learner_restarts >= limit:
            self._fail(f"{why}; not restarted: trainer.max_restarts={limit} restarts spent")
            return False
        self.learner_restarts += 1
        before = self.version
        self._say(f"{why}; restarting the learner from its last checkpoint (restart {self.learner_restarts} of "
                  f"trainer.max_restarts={limit})")
        self._kill_learners(graceful=False)
        self._first_call_s = self._slowest_call_s = None  # the new group loads and warms its model again
        self._restarting = True  # the watchdog publishes no version while the ledger is rebuilt
        try:  # the same load path as a resume: the newest checkpoint of this run, on learner.world_size ranks
            await self._start_learners(replace(self.cfg, trainer=replace(self.cfg.trainer, resume="auto")), live=True)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            self._fail(f"{why}; the learner's restart failed: {_cause(exc)}")
            return False
        finally:
            self._restarting = False
        if self.pool.spec.sync != (sync := self._sync_endpoint()):  # rank 0 landed on another node: servers must re-register
            self._say(f"the weight sender moved to {self._sender_address}: replacing the servers")
            self.pool.spec.sync = sync
            for i in self.pool.indices:
                await self.pool.restart(i, self.pool.handle(i))
        self._write_servers()
        redone = f"steps {self.version + 1}-{before} are redone" if before > self.version else "no step is redone"
        self._say(f"learner restarted at version {self.version} (it was at {before}); {redone}")
        return True

    def _kill_learners(self, graceful: bool = True) -> None:
        """Close (``graceful``: checkpoint-free, leave the process group) and kill every learner rank."""
        for rank, actor in enumerate(self.learners):
            if graceful:
                try:
                    ray.get(actor.close.remote(), timeout=30)
                except ray.exceptions.RayError as exc:  # it died, its close raised or hung: it is killed below either way
                    log.warning("learner rank %d did not close cleanly (%s); killing it", rank, _cause(exc))
            ray.kill(actor, no_restart=True)

    async def _on_server_start(self, index: int, handle: Any) -> None:
        await self._await_current_weights(index, handle)
        self._write_servers()

    def _write_servers(self) -> None:
        """(Re)write ``servers.json``: the driver's Prometheus URL, the id, pid, vLLM engine
        process ids, OpenAI API URL and vLLM metrics URL of every started server, each
        learner rank's pid and the weight sender's control address."""
        servers = [{"server_id": h.server_id, "pid": h.pid, "engine_pids": h.engine_pids, "openai_url": h.openai_url,
                    "metrics_url": vllm_metrics_url(h.openai_url)}
                   for h in self.pool.started if h is not None]
        prometheus = self.tracker.prometheus
        learners = [{"rank": rank, "pid": pid} for rank, pid in enumerate(self._learner_pids)]
        doc = {"prometheus_url": prometheus.url if prometheus is not None else None, "servers": servers, "learners": learners,
               "weight_sync_address": self._sender_address}
        (self.run_dir / "servers.json").write_text(json.dumps(doc, indent=1) + "\n")

    async def _await_current_weights(self, index: int, handle: Any) -> None:
        """A (re)started or added server serves only once it holds the learner's version of the
        moment it registered, or a later one (the learner's catch-up or next update sends it;
        from then on it gets every update). Not the version of each moment: the learner may
        step faster than a new engine loads, and a server chasing it would never start."""
        target, timeout_s = self.version, self.cfg.sync.timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                while (await handle.health.remote()).version < target:
                    await asyncio.sleep(0.5)
        except TimeoutError:
            raise TimeoutError(f"server-{index} did not receive version {target} within sync.timeout_s={timeout_s:g}") from None

    # -- the run --------------------------------------------------------------------

    async def _train(self) -> None:
        learner = asyncio.create_task(self._drive_learner())
        watcher: asyncio.Task | None = None
        relay: asyncio.Task | None = None
        requests: asyncio.Task | None = None
        try:
            try:
                await (self._servers_starting or self.pool.start(workers=False, sync=self._sync_known))
            except (ray.exceptions.RayError, asyncio.TimeoutError) as exc:  # e.g. a server's node cannot reach queue.redis_url
                self._fail(f"the inference servers did not start: {_cause(exc)}")
                return
            if self._support is not None:
                self._support.place(keep={self._redis_pid} if self._redis_pid is not None else ())
            if self.cfg.logging.console and any(self.pool.openai_urls()):
                self.tracker.console.print(f"OpenAI-compatible API: {' '.join(u or '-' for u in self.pool.openai_urls())} "
                                           f"(servers listed in {self.run_dir / 'servers.json'})", highlight=False)
            watcher = asyncio.create_task(self._watch())
            relay = asyncio.create_task(self._relay_failures())
            # The first validation measures the starting weights alone: the rollout workers
            # (and so the learner's first updates) start after it (verl's val_before_train).
            self._maybe_validate(force=True)
            if self._validating is not None:
                await _until(self._validating, self.stop)
            if self.stop.is_set():
                return
            await self.pool.start_workers()
            requests = asyncio.create_task(self._serve_requests())
            started = self._last_step = time.monotonic()
            r = self.cfg.rollout
            self._say(f"rollout workers started: {r.num_servers} server(s) x {r.workers_per_server} worker(s); "
                      f"the learner steps on every {self.cfg.learner.batch_size} groups of {r.n}")
            await learner
            self.train_wall_s = time.monotonic() - started
        finally:
            self.stop.set()
            for task in (watcher, requests):
                if task is not None:
                    task.cancel()
            if requests is not None:
                await asyncio.gather(requests, return_exceptions=True)  # a scale in progress ends before the workers stop
            if not learner.done():
                await learner
            # Workers end their tickets (prompts in flight go back to the queue) before the
            # learner's final commit is read back and before Redis stops.
            await self._stop_workers()
            if relay is not None:
                relay.cancel()
                await asyncio.gather(relay, return_exceptions=True)
                await self._relay_once()  # what the workers reported as they stopped
            with contextlib.suppress(Exception):  # the summary's counters; the queue may be gone after a failure
                self.tracker.latest.update(self._rollout_metrics(*await self._queue_now(), 0.0))
        self.server_busy_s = [h.busy_s for h in await self.pool.health() if not isinstance(h, str)]
        if self._validating is not None:
            await self._validating
        if self.failure is None:
            self._maybe_validate(force=True, final=True)
        if self._validating is not None:
            await self._validating

    async def _stop_workers(self) -> None:
        await self.pool.stop_workers(WORKER_GRACE_S)
        try:
            open_tickets = (await self._redis(self.queue.stats))["inflight"]
        except QueueUnavailableError as exc:  # the stop goes on: the next start reconciles the ledger
            log.error("open admission tickets not checked: %s", exc)
            return
        if open_tickets:  # each group ends its ticket: a bug if not
            log.error("%d admission tickets are still open after the workers stopped; the next start returns their prompts", open_tickets)

    async def _drive_learner(self) -> None:
        total = self.cfg.trainer.total_steps
        while self.version < total and not self.stop.is_set():
            try:
                call_start = time.monotonic()
                results = await _all_ranks([a.run.remote(1, LEARNER_WAIT_S) for a in self.learners], self._learner_bound_s(),
                                           self._queue_back_at)
                took = time.monotonic() - call_start
                if self._first_call_s is None:
                    self._first_call_s = took
                else:
                    self._slowest_call_s = max(self._slowest_call_s or 0.0, took)
            except _RankDied as exc:
                self.recoveries["learner_hangs"] += isinstance(exc, _RankHung)
                if await self._restart_learners(str(exc)):
                    continue
                return
            except ray.exceptions.RayTaskError as exc:
                lost_queue = self._disk_full_since is not None or time.monotonic() - self._redis_back_at < self.cfg.queue.timeout_s
                if (NO_SPACE in _cause(exc) and await self._wait_for_space(f"the learner stopped: {_cause(exc)}")) or (
                        lost_queue and await self._space_returned()):  # it lost the queue while Redis was down
                    if await self._restart_learners(f"the learner lost the queue while its Redis was down ({_cause(exc)})"):
                        continue
                    return
                self._fail(f"the learner stopped: {_cause(exc)}")
                break
            self.version = results[0]["version"]
            for metrics in results[0]["steps"]:
                metrics.update(await self._rollout_now())
                metrics["learner/restarts"] = float(self.learner_restarts)
                self._say_control_drops(metrics)
                self._say_learning_checks(metrics)
                self.tracker.log(metrics)
                self._last_step = time.monotonic()
                self._maybe_validate()
        try:
            self.version = (await asyncio.gather(*(a.finish.remote() for a in self.learners)))[0]
        except ray.exceptions.RayError as exc:
            log.error("final checkpoint failed: %s", _cause(exc))
            if self.failure is None:
                self._fail(f"the final checkpoint failed: {_cause(exc)}")

    def _queue_back_at(self) -> float:
        """When the run's queue last answered again after an outage, monotonic seconds: now while
        the embedded Redis waits for disk space (a learner waiting on it is not hung)."""
        return time.monotonic() if self._disk_full_since is not None else self._redis_back_at

    def _learner_bound_s(self) -> float:
        """How long one learner call may take before its silent ranks count as hung, seconds:
        ``trainer.learner_hang_timeout_s``, or 3x the slowest call so far if longer (a step with
        its weight send and checkpoint); 10x the floor before a call has finished (the first
        loads and warms the model). The first call counts only until a later one finished: a
        load slowed by a busy machine (a restart on 2 cores: over 100 s) must not stretch the
        bound of every step after it past the 60 s in which a hang is to be named."""
        floor = self.cfg.trainer.learner_hang_timeout_s
        if self._first_call_s is None:
            return LEARNER_FIRST_CALL_FACTOR * floor
        return max(floor, LEARNER_SLOW_FACTOR * (self._slowest_call_s if self._slowest_call_s is not None else self._first_call_s))

    def _say_control_drops(self, metrics: dict[str, float]) -> None:
        """Name on the console the control messages the weight sender dropped since the last
        step (the counts are the sender's since it started: a restarted learner counts anew)."""
        prefix = "sync/control_dropped/"
        counts = {k.removeprefix(prefix): v for k, v in metrics.items() if k.startswith(prefix)}
        new = {r: n - self._control_dropped.get(r, 0.0) if n >= self._control_dropped.get(r, 0.0) else n for r, n in counts.items()}
        self._control_dropped = counts
        if any(new.values()):
            self._say(f"the weight sender dropped control messages ({', '.join(f'{r} {n:.0f}' for r, n in new.items() if n)}) at "
                      f"{self._sender_address}: something other than this run's servers reaches it; training goes on "
                      "(docs/security.md)")

    def _say_learning_checks(self, metrics: dict[str, float]) -> None:
        """Say each learning check that just became active; its ``warn/<name>`` flags join the step's metrics."""
        for line in self.checks.observe(metrics):
            self._say(line)
        metrics.update(self.checks.flags())

    def _fail(self, reason: str) -> None:
        """End the run with exit status 1 and ``reason`` (the first failure wins)."""
        if self.failure is None:
            log.error("%s; stopping", reason)
            self.failure = reason
        self.stop.set()

    async def _watch(self) -> None:
        """Every few seconds: replace broken or lagging servers, and end a run that stalled
        (neither a group generated nor a learner step taken for ``trainer.stall_timeout_s``)."""
        cfg = self.cfg
        period_s = min(HEALTH_PERIOD_S, cfg.trainer.stall_timeout_s / 4)
        marker, last_progress = None, time.monotonic()
        while not self.stop.is_set():
            await asyncio.sleep(period_s)
            try:
                rollout = await self._redis(self.queue.rollout_stats)
            except QueueUnavailableError as exc:  # Redis stayed down for queue.timeout_s: nothing can go on
                if self._disk_full_since is not None:
                    continue  # its restart waits for disk space, within its own bound (it ends the run past it)
                self._fail(f"the queue's Redis did not answer for queue.timeout_s={cfg.queue.timeout_s:g} s: {exc}")
                return
            version = self.version
            healths = await self.pool.health()
            self.tracker.servers = server_states(healths, version)
            # Tokens a server generated for anything (a validation too) are progress.
            served = sum(h.generated_tokens for h in healths if not isinstance(h, str))
            progress = (version, rollout.get("groups_put", 0.0), rollout.get("tokens_generated", 0.0), served)
            if progress != marker:
                marker, last_progress = progress, time.monotonic()
            elif time.monotonic() - last_progress > cfg.trainer.stall_timeout_s:
                self._fail(f"no progress for {time.monotonic() - last_progress:.0f} s (trainer.stall_timeout_s="
                           f"{cfg.trainer.stall_timeout_s:g}): {await self._diagnose()}")
                return
            for line in await self.pool.heal(self.version, cfg.sync.max_lag_s, healths):
                log.warning("%s", line)
            if time.monotonic() - self._last_step >= VERSION_WATCHDOG_S and not self._restarting:
                await self._republish_version(healths)
            self._watch_disk()

    def _watch_disk(self) -> None:
        """Say once (again only after it cleared) when the run's disk has less room than a
        checkpoint and the queue's AOF need: the run would pause at the next full write."""
        if self.disk_need is None:
            return
        needed = self.disk_need.checkpoint + self.disk_need.aof
        problem = disk.shortage(self.run_dir, needed, f"a checkpoint of {disk.size(self.disk_need.checkpoint)} and the queue's "
                                                      f"append-only file")
        if problem is not None and not self._disk_low:
            self._say(f"{problem}: free space there, or the run pauses when the disk is full")
        self._disk_low = problem is not None

    async def _wait_for_space(self, what: str) -> bool:
        """A write failed for want of space (``what``): say which disk and how much a checkpoint
        needs, then wait up to :data:`~async_rl.queue.embedded.SPACE_WAIT_S` for that much to be
        free; True once it is (False: the run stops, resumable from its last checkpoint)."""
        needed = MIN_FREE_BYTES + (self.disk_need.checkpoint if self.disk_need is not None else 0)
        mount, free = disk.free_bytes(self.run_dir)
        self.recoveries["disk_full"] += 1
        self._say(f"{what}: the disk of {self.run_dir} (mounted at {mount}) has {disk.size(free)} free and a checkpoint needs "
                  f"about {disk.size(needed)}; the checkpoints kept are intact. Free space there: the run waits up to "
                  f"{SPACE_WAIT_S / 60:.0f} min, then restarts the learner from its last checkpoint")
        start = time.monotonic()
        while time.monotonic() - start < SPACE_WAIT_S and not self.stop.is_set():
            if disk.free_bytes(self.run_dir)[1] >= needed:
                self._say(f"disk space is back after {time.monotonic() - start:.0f} s")
                return True
            await asyncio.sleep(1.0)
        if not self.stop.is_set():
            self._fail(f"{what}; the disk of {self.run_dir} stayed full for {SPACE_WAIT_S:.0f} s: free space, then resume the run "
                       "(its last checkpoint is intact)")
        return False

    async def _space_returned(self) -> bool:
        """Wait while the embedded Redis waits for disk space; True once it is back (False: the run stops)."""
        while self._disk_full_since is not None and not self.stop.is_set():
            await asyncio.sleep(1.0)
        return not self.stop.is_set()

    async def _republish_version(self, healths: list[Any]) -> None:
        """The watchdog: with no learner step for :data:`VERSION_WATCHDOG_S` while the published
        version lags the learner's, publish the version every live server acknowledged (the
        learner's own announcement of it did not come); said once per version, counted."""
        snap = await self._snapshot(healths)
        version = provable_version(snap)
        if version is None or not await self._redis(self.queue.raise_version, version):
            return
        self.recoveries["version_republished"] += 1
        self._say(f"no learner step for {time.monotonic() - self._last_step:.0f} s and admission at version {snap.published} while "
                  f"the learner is at {snap.learner_version}: every server holds version {version} (their acknowledgements), "
                  f"published it for admission (recoveries/version_republished)")

    async def _snapshot(self, healths: list[Any], stats: dict[str, Any] | None = None) -> Snapshot:
        """The run's state for :mod:`~async_rl.launch.stall` (``healths``: a :meth:`ServerPool.health`
        just taken; ``stats``: the queue's, read now if not given)."""
        cfg = self.cfg
        stats = await self._redis(self.queue.stats) if stats is None else stats
        return Snapshot(self.version, stats["version"], stats["groups_started"], cfg.algorithm.max_staleness, cfg.learner.batch_size,
                        stats["depth"], stats["inflight"], [h if isinstance(h, str) else (h.server_id, h.version) for h in healths])

    async def _redis(self, call: Callable[..., T], *args: Any) -> T:
        """``call(*args)``, a queue call, in a thread: it may retry for ``queue.timeout_s``."""
        return await asyncio.to_thread(call, *args)

    async def _queue_now(self) -> tuple[dict[str, float], dict[str, Any]]:
        """The rollout workers' counters and the queue's stats (:meth:`ReplayQueue.stats`)."""
        return await self._redis(lambda: (self.queue.rollout_stats(), self.queue.stats()))

    async def _rollout_now(self) -> dict[str, float]:
        """The rollout side's metrics now (counters from Redis, generation rate)."""
        rollout, stats = await self._queue_now()
        return self._rollout_metrics(rollout, stats, self._generated.rate(rollout.get("tokens_generated", 0.0), time.monotonic()))

    async def _serve_requests(self) -> None:
        """About once a second: act on a request to this run (``async-rl scale``,
        :mod:`async_rl.launch.scale`), one at a time; a failing poll is logged and retried."""
        requests = Requests(self.queue.client, self.cfg.trainer.run_name)
        while True:
            await asyncio.sleep(REQUEST_POLL_S)
            try:
                request = await self._redis(requests.take)
                if request is not None:
                    reply = await self._scale(request.servers, request.grace_s)
                    await self._redis(lambda: requests.answer(request.request_id, reply))
            except QueueUnavailableError as exc:  # the watcher decides about Redis; the request waits there
                if self._disk_full_since is None:  # a Redis waiting for disk space was said once already
                    log.warning("scale requests not read: %s", exc)
            if requests.undecodable:
                log.warning("dropped %d entries of the run's request list that were not requests", requests.undecodable)
                requests.undecodable = 0

    async def _scale(self, servers: int, grace_s: float) -> ScaleReply:
        """Run ``servers`` inference servers from now on (refused, with the reason, when Ray lacks
        the resources of the servers to add); the console, ``servers.json`` and the metrics follow."""
        before, r = self.pool.num_servers, self.cfg.rollout
        if servers > before:
            free = ray.available_resources()
            for resource, each in (("CPU", r.cpus_per_server), ("GPU", r.gpus_per_server)):
                if (need := each * (servers - before)) > free.get(resource, 0.0) + 1e-9:
                    error = (f"{servers - before} more servers need {need:g} {resource}s (rollout.{resource.lower()}s_per_server={each:g}); "
                             f"the Ray cluster has {free.get(resource, 0.0):g} free: add a node, or lower rollout.{resource.lower()}s_per_server")
                    self._say(f"scale to {servers} servers refused: {error}")
                    return ScaleReply(False, before, error=error)
        self._say(f"scaling the inference servers {before} -> {servers} (asked by async-rl scale)")
        try:
            lines = await self.pool.scale_to(servers, grace_s)
        except (ray.exceptions.RayError, asyncio.TimeoutError, ValueError) as exc:
            self._say(f"scale to {servers} servers failed: {_cause(exc)}")
            return ScaleReply(False, self.pool.num_servers, error=_cause(exc))
        for line in lines:
            self._say(line)
        self._write_servers()
        ok = self.pool.num_servers == servers
        return ScaleReply(ok, self.pool.num_servers, tuple(lines), None if ok else lines[-1])

    async def _relay_failures(self) -> None:
        """About once a second: the servers' failure reports to the console and the run's
        files; while no step comes, a heartbeat every :data:`HEARTBEAT_S` seconds."""
        last_beat = time.monotonic()
        while True:
            await asyncio.sleep(FAILURE_POLL_S)
            try:
                await self._relay_once()
                now = time.monotonic()
                if now - self._last_step >= HEARTBEAT_S and now - last_beat >= HEARTBEAT_S:
                    last_beat = now
                    await self._heartbeat(now - self._last_step)
            except Exception as exc:  # noqa: BLE001 - diagnostics must never end the run (Redis away: the watcher decides)
                if self._disk_full_since is None:  # a Redis waiting for disk space was said already
                    log.warning("failure reports not read: %s: %s", type(exc).__name__, exc)

    async def _relay_once(self) -> None:
        self._failure_cursor, reports, bad = await self._redis(self.queue.read_failures, self._failure_cursor)
        self.failures.undecodable += bad
        for line in self.failures.ingest(reports, time.monotonic()):
            self._say(line)

    async def _heartbeat(self, waited_s: float) -> None:
        """Log the rollout side's counters to every sink, and say on the console what each side is doing."""
        metrics = {"version": float(self.version), **(await self._rollout_now())}
        self.tracker.log(metrics, heartbeat=True)
        dropped = ", ".join(f"{k.removeprefix('queue/dropped/')} {v:.0f}" for k, v in metrics.items() if k.startswith("queue/dropped/") and v)
        errors = ", ".join(f"{label} {metrics[key]:.0f}" for label, key in (
            ("reward errors", "rollout/reward_errors"), ("of them timeouts", "rollout/reward_timeouts"), ("environment errors", "env/errors"),
            ("environment timeouts", "env/timeouts"))
            if metrics.get(key))
        self._say(f"no learner step for {waited_s:.0f} s: {metrics.get('rollout/groups_put', 0):.0f} groups generated, "
                  f"{metrics.get('rollout/tokens_per_s', 0):.0f} tokens/s; dropped: {dropped or 'none'}; {errors or 'no reward or environment errors'}. "
                  f"{await self._diagnose()}")

    def _say(self, line: str) -> None:
        """A line the user must see: on the console (or in the log when the console is off)."""
        if self.cfg.logging.console and hasattr(self, "tracker"):  # the tracker starts after Redis and Ray
            self.tracker.console.print(line, highlight=False, soft_wrap=True, markup=False)
        else:
            log.warning("%s", line)

    async def _diagnose(self) -> str:
        """What each side of a stalled run waits for, in one paragraph, and the component to blame."""
        cfg, stats = self.cfg, await self._redis(self.queue.stats)
        healths = await self.pool.health()
        limit = admission_limit(stats["version"], cfg.algorithm.max_staleness, cfg.learner.batch_size)
        admission = (f"admission closed: groups_started={stats['groups_started']} >= (published version {stats['version']} + "
                     f"max_staleness {cfg.algorithm.max_staleness} + 1) x batch {cfg.learner.batch_size} = {limit}"
                     if stats["groups_started"] >= limit else f"admission open ({stats['groups_started']}/{limit} started)")
        servers = "; ".join(
            h if isinstance(h, str) else f"{h.server_id} holds version {h.version}, {h.running_requests} requests running"
            for h in healths
        )
        return (f"learner at version {self.version} waits for {cfg.learner.batch_size} groups (queue depth {stats['depth']}, "
                f"pending {stats['pending']}); rollout: {admission}, {stats['inflight']} groups in flight, "
                f"{stats['returned_prompts']} returned prompts waiting; servers: {servers}. "
                f"Waiting on {blame(await self._snapshot(healths, stats))}")

    def _rollout_metrics(self, rollout: dict[str, float], stats: dict[str, Any], tokens_per_s: float) -> dict[str, float]:
        """Console and tracker metrics of the rollout side: the workers' counters (``rollout``,
        from Redis, cumulative over the run) and the queue's state (``stats``)."""
        out = {
            "rollout/tokens_per_s": tokens_per_s,
            "queue/depth": float(stats["depth"]),
            "queue/pending": float(stats["pending"]),
            "queue/dropped_stale": float(stats["dropped_stale"]),
            "queue/dead_lettered": float(stats["dead_lettered"]),
            "queue/oldest_age_s": float(stats["oldest_age_s"]),
            "queue/returned_prompts": float(stats["returned_prompts"]),
            "rollout/servers": float(self.pool.num_servers),
            "rollout/server_restarts": float(self.pool.restarts),
            "queue/redis_restarts": float(self.redis_restarts),
            "rollout/engine_deaths": float(self.pool.engine_deaths),
            "recoveries/version_republished": float(self.recoveries["version_republished"]),
            "recoveries/engine_hangs": float(self.pool.engine_hangs),
            "recoveries/learner_hangs": float(self.recoveries["learner_hangs"]),
            "recoveries/disk_full": float(self.recoveries["disk_full"]),
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

    # -- validation -----------------------------------------------------------------

    def _maybe_validate(self, force: bool = False, final: bool = False) -> None:
        every = self.cfg.trainer.val_every
        if not self.val_prompts or every == 0 or (self._validating is not None and not self._validating.done()):
            return
        if final and self.validations and self.validations[-1].version == self.version:
            return  # the periodic validation already measured these weights
        if force or self.version % every == 0:
            self._validating = asyncio.create_task(self._validate(final))

    async def _validate(self, final: bool) -> None:
        cfg, r = self.cfg, self.cfg.rollout
        generate = self.pool.generate_fn(0)()
        if self.envs is not None:  # success rate of environment episodes
            encoder = ChatEncoder(self.formatter.tokenizer)
            greedy, sampled = (EpisodeSampler(self.envs, r.env, encoder, Sampling(temperature=t, max_tokens=r.max_response_length),
                                              cfg.data.max_prompt_length) for t in (0.0, r.temperature))
            result = await validate_episodes(generate, self.val_rows, greedy, sampled, n=cfg.trainer.val_n)
        else:
            result = await validate(generate, self.val_prompts, self._scorer(),
                                    n=cfg.trainer.val_n, temperature=r.temperature, max_tokens=r.max_response_length)
        self.validations.append(result)
        self.tracker.log({
            "version": float(result.version), "val/greedy_accuracy": result.greedy_accuracy, "val/mean_at_n": result.mean_at_n,
            "val/pass_at_n": result.pass_at_n, "val/seconds": result.seconds, "val/final": float(final),
            "val/max_version": float(result.max_version),
        })


class _RankDied(RuntimeError):
    """A learner rank's process died or hung (the message names the rank and the cause)."""


class _RankHung(_RankDied):
    """Learner ranks answered no call within the hang bound (the message names them)."""


RANK_DEATH_GRACE_S = 10.0
"""After one rank's call failed, how long the driver waits for the others' outcome (a rank
blocked in a collective with a dead peer fails within seconds), seconds."""


async def _all_ranks(calls: list[Any], timeout_s: float | None = None, queue_back_at: Callable[[], float] | None = None) -> list[Any]:
    """The results of one call per learner rank. Raises :class:`_RankDied` when a rank's
    process died (the others then fail in a collective, or hang in one: they are killed and
    restarted anyway) or when some rank has not answered within ``timeout_s`` seconds (hung:
    a stopped process, a stuck kernel or collective), else the first rank's error.
    ``queue_back_at()``: when the run's queue last answered again after an outage (monotonic
    seconds; now while it is down): a rank waiting on the queue is not hung, so the hang
    clock runs from the later of the call's start and that moment."""
    futures = [asyncio.ensure_future(c) for c in calls]
    start = time.monotonic()
    while True:
        since = max(start, queue_back_at()) if queue_back_at is not None else start
        left = None if timeout_s is None else max(0.0, since + timeout_s - time.monotonic())
        done, _ = await asyncio.wait(futures, timeout=left, return_when=asyncio.FIRST_EXCEPTION)
        if len(done) == len(futures) or any(f.exception() is not None for f in done):
            break
        if queue_back_at is None or max(start, queue_back_at()) == since:  # the queue answered throughout: hung
            break
    if all(f in done and f.exception() is None for f in futures):
        return [f.result() for f in futures]
    if not any(f.done() and f.exception() is not None for f in futures):  # timed out: no rank failed, some never answered
        silent = [rank for rank, f in enumerate(futures) if not f.done()]
        for f in futures:
            f.cancel()
        raise _RankHung(f"learner rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} answered no call for "
                        f"{time.monotonic() - since:.0f} s (trainer.learner_hang_timeout_s, or 3x the slowest call so far): declared hung")
    await asyncio.wait(futures, timeout=RANK_DEATH_GRACE_S)
    errors = [(rank, f.exception()) for rank, f in enumerate(futures) if f.done() and f.exception() is not None]
    for f in futures:
        if not f.done():
            f.cancel()
    dead = [(rank, exc) for rank, exc in errors if isinstance(exc, ray.exceptions.RayActorError)]
    if dead:
        rank, exc = dead[0]
        raise _RankDied(f"learner rank {rank} died ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
    raise errors[0][1]


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    """Run ``fn(*args)`` on ``loop`` from another thread; nothing once the loop has closed."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


async def _cancel(task: asyncio.Task) -> None:
    """Cancel ``task`` and wait until it ended."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _until(task: asyncio.Task, stop: asyncio.Event) -> None:
    """Wait for ``task`` or for ``stop``, whichever comes first (the task keeps running)."""
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()


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
