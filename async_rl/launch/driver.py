"""``async-rl train``: start every process, drive the learner, validate, log, and shut down.

The driver (this process) owns the run's lifecycle. It starts, in order: the embedded
redis-server (unless ``queue.redis_url``), Ray, the learner ranks (their rank 0 hosts the
weight sender) and the inference servers (registered with that sender), each running its
rollout workers in its own process (:mod:`async_rl.rollout.host`): generated groups go
from the server straight to Redis, never through this process. It then calls the learner
one step at a time with a bounded wait, so it can log progress, start validation and react
to Ctrl-C / SIGTERM. Shutdown (normal end or signal) runs in reverse: workers stop, the
learner writes a final checkpoint and commits its queue entries, servers and learner actors
stop, Ray stops, the embedded Redis stops.

The roles beside the lifecycle, each in a module of its own and sharing one
:class:`~async_rl.launch.run_context.RunContext`: the user's inputs (:mod:`~async_rl.launch.inputs`),
the run's claim and lease (:mod:`~async_rl.launch.lease`), supervision of the learner group
and the servers (:mod:`~async_rl.launch.supervision`, :mod:`~async_rl.launch.learner_group`),
Redis and disk outages (:mod:`~async_rl.launch.outages`), reporting (:mod:`~async_rl.launch.reporting`),
validation (:mod:`~async_rl.launch.validating`) and scale requests (:mod:`~async_rl.launch.scale_requests`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray

from async_rl.config import Config, save_resolved
from async_rl.launch import disk
from async_rl.launch.cores import SupportCores, cpu_layout, support_cores
from async_rl.launch.inputs import open_inputs
from async_rl.launch.learner_group import RankDied, RankHung, cause
from async_rl.launch.lease import claim_and_hold
from async_rl.launch.outages import Outages
from async_rl.launch.plan import Plan, StartupError, startable_plan
from async_rl.launch.ray_cluster import init_ray
from async_rl.launch.reaper import reap_on_exit
from async_rl.launch.reporting import Reporter
from async_rl.launch.run_context import RunContext
from async_rl.launch.run_state import make_private, set_aside
from async_rl.launch.scale_requests import serve_scale_requests
from async_rl.launch.served_models import ServedModels
from async_rl.launch.supervision import Supervisor
from async_rl.launch.tracking import Tracker
from async_rl.launch.validating import Validator
from async_rl.learner.memory import servers_gpu_share
from async_rl.queue import EmbeddedRedis, QueueUnavailableError, ReplayQueue
from async_rl.queue.embedded import NO_SPACE
from async_rl.rollout.engine_args import engine_kwargs, kv_cache_env, openai_api_settings
from async_rl.rollout.host import WorkerHostSpec
from async_rl.rollout.pool import ServerPool, ServerSpec
from async_rl.rollout.validation import ValidationResult

log = logging.getLogger(__name__)

LEARNER_WAIT_S = 2.0
"""Longest one learner call waits for a batch before control returns to the driver, seconds."""
WORKER_GRACE_S = 10.0
"""How long stopping workers may finish their groups in flight before they are cancelled, seconds."""


class RunFailed(RuntimeError):
    """The run started but could not go on (stalled, nothing trainable, the learner died)."""


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
        self.run = RunContext(cfg, Path(cfg.trainer.output_dir))
        run = self.run
        run.outages = Outages(run.run_dir, disk_need, cfg.queue.timeout_s, run.stop, run.say, run.fail, run.recoveries)
        run.models = ServedModels(cfg, run.say)
        self.reporter = Reporter(self.run)
        self.train_wall_s = 0.0
        self.server_busy_s: list[float] = []

    async def main(self) -> RunResult:
        cfg, run = self.cfg, self.run
        # What this process and its children (redis-server, a local Ray and its workers) write
        # is this user's only: prompts, responses, weights, the Redis password.
        os.umask(0o077)
        set_aside(cfg)  # trainer.resume=fresh: the previous run's files go to previous-<run id>/ first
        make_private(run.run_dir)
        save_resolved(cfg, run.run_dir)
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
            make_private(run.run_dir)
        if run.failure is not None:
            raise RunFailed(run.failure)
        validations = self.validator.results if hasattr(self, "validator") else []
        return RunResult(run.version, run.run_dir, run.interrupted, validations, self.train_wall_s, self.server_busy_s)

    def _install_signal_handlers(self) -> None:
        # Called again right after ray.init: Ray installs its own C++ SIGTERM handler,
        # which would otherwise run too and abort the process at exit.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: int) -> None:
        if not self.run.stop.is_set():
            log.warning("%s: stopping generation, writing a final checkpoint, shutting down", signal.Signals(sig).name)
            self.run.interrupted = True
            self.run.stop.set()

    async def _start(self, stack: contextlib.AsyncExitStack) -> None:
        cfg, run = self.cfg, self.run
        layout = cpu_layout(cfg)
        # Once the servers started, what runs beside them goes to their cores (the start uses every core).
        self._support = stack.enter_context(SupportCores(support_cores(layout))) if layout else None
        stack.enter_context(reap_on_exit())  # before any process starts: each ends with this one, even on SIGKILL
        self.inputs = await open_inputs(cfg, run.run_dir, stack)  # what fails on the user's files fails before any process starts
        self.validator = Validator(run, self.inputs)
        redis_url = await self._start_redis(stack, all_cores=os.sched_getaffinity(0) if layout else None)
        await claim_and_hold(stack, run, redis_url, embedded=not cfg.queue.redis_url)
        run.queue = stack.enter_context(await run.redis(lambda: ReplayQueue(redis_url, cfg.trainer.run_name, cfg.queue.max_depth,
                                                                            op_timeout_s=cfg.queue.timeout_s)))
        await self.reporter.open()
        try:
            init_ray(cfg.ray.address, cfg.ray.num_cpus, configure_logging=False)
        except ConnectionError as exc:
            raise StartupError(str(exc)) from None
        stack.callback(ray.shutdown)
        self._install_signal_handlers()
        self.supervisor = Supervisor(run, self.reporter, redis_url, layout.ranks if layout else None)
        env = kv_cache_env(cfg.rollout.vllm)
        spec = ServerSpec(engine_kwargs(cfg), cfg.rollout.cpus_per_server, cfg.rollout.gpus_per_server, env,
                          openai_api=openai_api_settings(cfg), hang_timeout_s=cfg.rollout.engine_hang_timeout_s)
        run.pool = ServerPool(spec, cfg.rollout.num_servers, on_start=self.supervisor.on_server_start,
                              env_per_server=[{"VLLM_CPU_OMP_THREADS_BIND": cores} for cores in layout.servers] if layout else None,
                              workers=WorkerHostSpec.from_config(cfg, redis_url), rows=ray.put(self.inputs.rows),
                              on_lost=run.queue.release_owner, report=run.say, on_resize=run.queue.set_producers)
        stack.push_async_callback(run.pool.shutdown)
        stack.push_async_callback(run.models.shutdown)
        # Beside the learner's start; the rollout workers wait for it.
        self._models_starting = asyncio.create_task(run.models.start(",".join(layout.servers) if layout else None))
        stack.push_async_callback(_cancel, self._models_starting)
        self._sync_known: asyncio.Future = asyncio.get_running_loop().create_future()
        """The weight sender's endpoint, once the learner started and the driver is ready for the servers."""
        self._servers_starting: asyncio.Task | None = None
        if servers_gpu_share(cfg.rollout, cfg.learner) == 0:
            # The engines build while the learner starts. Not on a GPU they share: vLLM would
            # size its KV cache by the memory the learner is still taking.
            self._servers_starting = asyncio.create_task(run.pool.start(workers=False, sync=self._sync_known))
            stack.push_async_callback(_cancel, self._servers_starting)  # a start that fails on the way kills them
        # After trainer.resume=fresh moved the old state aside, the learner starts from the base model.
        await self.supervisor.start_learners(replace(cfg, trainer=replace(cfg.trainer, resume="off")) if cfg.trainer.resume == "fresh" else cfg)
        stack.callback(lambda: run.learners.kill())  # the group of the moment: a restart replaces it
        try:
            run.tracker = Tracker(cfg, run.run_dir, cfg.trainer.total_steps, resumed=run.version > 0)
        except OSError as exc:  # the Prometheus port is taken
            raise StartupError(str(exc)) from None
        stack.callback(run.tracker.close)
        if run.tracker.prometheus is not None:
            log.info("Prometheus metrics at %s", run.tracker.prometheus.url)
            if cfg.logging.console:
                run.tracker.console.print(f"Prometheus metrics: {run.tracker.prometheus.url}", highlight=False)
        self.reporter.write_servers()
        self._sync_known.set_result(self.supervisor.sync_endpoint())

    async def _start_redis(self, stack: contextlib.AsyncExitStack, all_cores: set[int] | None) -> str:
        """The queue's Redis URL: ``queue.redis_url``, or an embedded redis-server's, watched
        (:meth:`Outages.on_redis_exit`). Redis answers every admission, put and read: on the
        rollout cores, which vLLM keeps busy, it waited seconds for the CPU and held generation
        and the learner back with it (20 steps: 30-190 s instead of 8 s); it is light, so it
        runs on every core (``all_cores``, None: unpinned)."""
        if self.cfg.queue.redis_url:
            return self.cfg.queue.redis_url
        embedded = EmbeddedRedis(self.run.run_dir / "redis")
        redis_url = await asyncio.to_thread(stack.enter_context, embedded)  # replaying a long AOF takes a while
        outages, loop = self.run.outages, asyncio.get_running_loop()
        outages.redis_pid = embedded.pid
        embedded.watch(lambda event: _call_soon(loop, outages.on_redis_exit, event, all_cores))
        return redis_url

    # -- the run --------------------------------------------------------------------

    async def _train(self) -> None:
        run, pool = self.run, self.run.pool
        learner = asyncio.create_task(self._drive_learner())
        watcher: asyncio.Task | None = None
        relay: asyncio.Task | None = None
        requests: asyncio.Task | None = None
        try:
            try:
                await (self._servers_starting or pool.start(workers=False, sync=self._sync_known))
            except (ray.exceptions.RayError, asyncio.TimeoutError) as exc:  # e.g. a server's node cannot reach queue.redis_url
                run.fail(f"the inference servers did not start: {cause(exc)}")
                return
            try:
                await self._models_starting
            except (ray.exceptions.RayError, asyncio.TimeoutError) as exc:
                run.fail(f"the served models did not start: {cause(exc)}")
                return
            # They start beside the learner and may come up after the last write (the CI failure of 2026-12-06: no models listed).
            self.reporter.write_servers()
            if self._support is not None:
                redis_pid = run.outages.redis_pid
                self._support.place(keep={redis_pid} if redis_pid is not None else ())
            if self.cfg.logging.console and any(pool.openai_urls()):
                run.tracker.console.print(f"OpenAI-compatible API: {' '.join(u or '-' for u in pool.openai_urls())} "
                                          f"(servers listed in {run.run_dir / 'servers.json'})", highlight=False)
            watcher = asyncio.create_task(self.supervisor.watch())
            relay = asyncio.create_task(self.reporter.relay_failures())
            # The first validation measures the starting weights alone: the rollout workers
            # (and so the learner's first updates) start after it (verl's val_before_train).
            if self.cfg.trainer.val_before_train:
                self.validator.maybe_start(force=True)
            if self.validator.running is not None:
                await _until(self.validator.running, run.stop)
            if run.stop.is_set():
                return
            await pool.start_workers()
            run.workers_started = True
            requests = asyncio.create_task(serve_scale_requests(run, self.reporter.write_servers))
            started = run.last_step = time.monotonic()
            r = self.cfg.rollout
            run.say(f"rollout workers started: {r.num_servers} server(s) x {r.workers_per_server} worker(s); "
                    f"the learner steps on every {self.cfg.learner.batch_size} groups of {r.n}")
            await learner
            self.train_wall_s = time.monotonic() - started
        finally:
            run.stop.set()
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
                await self.reporter.relay_once()  # what the workers reported as they stopped
            with contextlib.suppress(Exception):  # the summary's counters; the queue may be gone after a failure
                run.tracker.latest.update(self.reporter.rollout_metrics(*await self.reporter.queue_now(), 0.0))
        self.server_busy_s = [h.busy_s for h in await pool.health() if not isinstance(h, str)]
        await self.validator.wait()
        if run.failure is None:
            self.validator.maybe_start(force=True, final=True)
        await self.validator.wait()

    async def _stop_workers(self) -> None:
        await self.run.pool.stop_workers(WORKER_GRACE_S)
        try:
            open_tickets = (await self.run.redis(self.run.queue.stats))["inflight"]
        except QueueUnavailableError as exc:  # the stop goes on: the next start reconciles the ledger
            log.error("open admission tickets not checked: %s", exc)
            return
        if open_tickets:  # each group ends its ticket: a bug if not
            log.error("%d admission tickets are still open after the workers stopped; the next start returns their prompts", open_tickets)

    async def _drive_learner(self) -> None:
        """Step the learner to ``trainer.total_steps`` (:meth:`_step_learner`); a fault in that
        supervision itself ends the run with its cause on the console, not as an exception no
        one retrieves while the servers wait for weights that never come."""
        try:
            await self._step_learner()
        except Exception as exc:  # noqa: BLE001 - reported, the run ends
            log.exception("the learner's supervision failed")
            self.run.fail(f"the learner's supervision failed: {cause(exc)} (traceback in the driver's log)")

    async def _step_learner(self) -> None:
        run, outages = self.run, self.run.outages
        while run.version < self.cfg.trainer.total_steps and not run.stop.is_set():
            try:
                results = await run.learners.step(LEARNER_WAIT_S, outages.queue_back_at)
            except RankDied as exc:
                run.recoveries["learner_hangs"] += isinstance(exc, RankHung)
                if await self.supervisor.restart_learners(str(exc)):
                    continue
                return
            except ray.exceptions.RayTaskError as exc:
                lost_queue = outages.queue_lost_lately()
                if (NO_SPACE in cause(exc) and await outages.wait_for_space(f"the learner stopped: {cause(exc)}")) or (
                        lost_queue and await outages.space_returned()):  # it lost the queue while Redis was down
                    if await self.supervisor.restart_learners(f"the learner lost the queue while its Redis was down ({cause(exc)})"):
                        continue
                    return
                run.fail(f"the learner stopped: {cause(exc)}")
                break
            run.version = results[0]["version"]
            for metrics in results[0]["steps"]:
                await self.reporter.log_step(metrics)
                self.validator.maybe_start()
        try:
            run.version = await run.learners.finish()
        except ray.exceptions.RayError as exc:
            log.error("final checkpoint failed: %s", cause(exc))
            if run.failure is None:
                run.fail(f"the final checkpoint failed: {cause(exc)}")


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
