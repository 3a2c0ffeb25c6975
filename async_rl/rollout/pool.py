"""The pool of inference servers: Ray actors, placed and restarted, each hosting its rollout workers.

A server that dies (its process killed, its engine crashed) is replaced by a fresh actor
when a request to it fails or :meth:`ServerPool.heal` finds it broken; a server whose vLLM
engine process died tells the pool itself (``engine_died``, within about a second) after its
rollout workers gave back their groups in flight, and is replaced at once. The ``on_start``
hook runs on every new server before it serves (the trainer waits there until a restarted
server holds the current weights); then, given a :class:`~async_rl.rollout.host.WorkerHostSpec`,
the pool starts the server's rollout workers in its process (it sends the server
``partial(WorkerHost, spec)``, which the server calls: the server never imports the host). Their tickets carry the
owner name ``server-<i>#<start>``, unique per server process: when a server is replaced,
``on_lost(owner)`` ends the dead process's open tickets (their prompts are served again),
so a group is neither lost nor duplicated.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Awaitable, Callable

import ray
from ray.exceptions import RayActorError, RayTaskError

from async_rl.rollout.host import WorkerHost, WorkerHostSpec
from async_rl.rollout.openai_api import OpenAIApiSettings
from async_rl.rollout.server import InferenceServer, ServerHealth
from async_rl.rollout.types import Completion, GenerateFn, Sampling
from async_rl.sync.auth import SyncEndpoint

log = logging.getLogger(__name__)


@dataclass
class ServerSpec:
    """How to start one server actor."""

    engine_kwargs: dict[str, Any]
    """``AsyncEngineArgs`` keyword arguments."""
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    env_vars: dict[str, str] = field(default_factory=dict)
    """Environment of the actor (and so of the vLLM processes it starts)."""
    start_timeout_s: float = 600.0
    """Longest a server may take to build its engine, seconds."""
    sync: SyncEndpoint | None = None
    """The weight sender the servers register with for weight updates (its address and the
    run's secret, handed over as an actor argument); None for none."""
    openai_api: OpenAIApiSettings | None = None
    """Where the servers serve vLLM's OpenAI-compatible HTTP API (server ``i`` on port + i if fixed); None for none."""
    server_cls: type = InferenceServer
    """The actor class (``InferenceServer``; the benchmarks' ``FakeServer`` has the same interface)."""


class ServerPool:
    """``num_servers`` :class:`InferenceServer` actors, restarted when they die."""

    def __init__(
        self,
        spec: ServerSpec,
        num_servers: int,
        version: Callable[[], int] = lambda: 0,
        on_start: Callable[[int, Any], Awaitable[None]] | None = None,
        env_per_server: list[dict[str, str]] | None = None,
        workers: WorkerHostSpec | None = None,
        rows: Any = None,
        on_lost: Callable[[str], int] | None = None,
        report: Callable[[str], None] | None = None,
    ):
        """``env_per_server[i]`` adds to ``spec.env_vars`` for server ``i`` (e.g. its CPU cores).
        With ``workers``, every server runs rollout workers over ``rows`` (the prompt rows,
        best a ``ray.put`` reference: stored once, fetched once per server), and
        ``on_lost(owner)`` (``ReplayQueue.release_owner``) ends the tickets of a replaced one.
        ``report(line)`` tells the user why a server is replaced (the driver's console;
        default: a warning in the log)."""
        self.spec = spec
        self.workers = workers
        self.rows = rows
        self.on_lost = on_lost
        self._owners: list[str | None] = [None] * num_servers
        """Per server, the ticket owner of its running workers (None: no workers running)."""
        self._starts = [0] * num_servers
        self.env_per_server = env_per_server or [{} for _ in range(num_servers)]
        self.num_servers = num_servers
        self.version = version
        self.on_start = on_start
        self.report = report or (lambda line: log.warning("%s", line))
        self.restarts = 0
        """Servers replaced (dead, broken or lagging)."""
        self.engine_deaths = 0
        """Servers whose vLLM engine process died while the server lived (each one replaced)."""
        self._watchers: list[asyncio.Task | None] = [None] * num_servers
        """Per server, the task waiting for its engine's death (:meth:`_watch_engine`)."""
        self._handles: list[Any] = [None] * num_servers
        self.started: list[ServerHealth | None] = [None] * num_servers
        """Health each server reported at its (latest) start, before ``on_start`` runs."""
        self._locks = [asyncio.Lock() for _ in range(num_servers)]
        self._behind_since: list[float | None] = [None] * num_servers
        """Per server, ``time.monotonic()`` since when it lags the learner's version (see :meth:`heal`)."""

    async def start(self, workers: bool = True) -> list[ServerHealth]:
        """Start every server (concurrently); returns their health. With ``workers=False``
        the rollout workers wait for :meth:`start_workers` (e.g. for a validation of the
        starting weights that no update interrupts); a server restarted meanwhile starts its own."""
        return list(await asyncio.gather(*(self._launch(i, workers) for i in range(self.num_servers))))

    async def start_workers(self) -> None:
        """Start the rollout workers of every server that runs none."""
        await asyncio.gather(*(self._start_workers(i, h) for i, h in enumerate(self._handles) if h is not None and self._owners[i] is None))

    def handle(self, i: int) -> Any:
        """Ray actor handle of server ``i``."""
        return self._handles[i]

    async def _launch(self, i: int, workers: bool = True) -> ServerHealth:
        actor_cls = ray.remote(self.spec.server_cls).options(
            num_cpus=self.spec.num_cpus,
            num_gpus=self.spec.num_gpus,
            runtime_env={"env_vars": {**self.spec.env_vars, **self.env_per_server[i]}},
            name=None,
        )
        openai_api = self.spec.openai_api.for_server(i) if self.spec.openai_api is not None else None
        handle = actor_cls.remote(f"server-{i}", self.spec.engine_kwargs, self.version(), openai_api)
        health = await asyncio.wait_for(handle.start.remote(self.spec.sync), self.spec.start_timeout_s)
        self.started[i] = health
        if health.openai_url is not None:
            log.info("server-%d (pid %d) serves the OpenAI API at %s", i, health.pid, health.openai_url)
        if self.on_start is not None:
            await self.on_start(i, handle)
        if workers:
            await self._start_workers(i, handle)
        self._handles[i] = handle
        self._watchers[i] = asyncio.create_task(self._watch_engine(i, handle))
        return health

    async def _watch_engine(self, i: int, handle: Any) -> None:
        """Wait for server ``i``'s engine to die, then replace the server. The server answers
        only once its rollout workers gave back their groups in flight (slots released,
        prompts returned); whatever is left open, ``restart`` ends like a dead actor's."""
        try:
            reason = await handle.engine_died.remote()
        except (RayActorError, RayTaskError):
            return  # the actor itself died or stopped: a failing request or heal() replaces it
        if self._handles[i] is not handle:
            return
        self._watchers[i] = None  # this task does the restart: it must not cancel itself
        self.engine_deaths += 1
        try:
            await self.restart(i, handle, f"lost its engine: {reason}; its groups in flight go back to the queue")
        except Exception as exc:  # noqa: BLE001 - heal() finds the server broken and tries again
            self.report(f"server-{i}: replacement failed ({type(exc).__name__}: {exc}); the next health check tries again")

    async def _start_workers(self, i: int, handle: Any) -> None:
        if self.workers is not None:
            owner = f"server-{i}#{self._starts[i]}"
            self._starts[i] += 1
            await handle.start_workers.remote(partial(WorkerHost, self.workers), self.rows, owner)
            self._owners[i] = owner

    async def _release(self, i: int) -> None:
        """End the open tickets of server ``i``'s workers, whose process is gone."""
        owner, self._owners[i] = self._owners[i], None
        if owner is not None and self.on_lost is not None:
            released = await asyncio.to_thread(self.on_lost, owner)
            if released:
                log.warning("server-%d: %d groups in flight were lost with its process; their prompts are served again", i, released)

    async def stop_workers(self, grace_s: float) -> list[dict[str, float]]:
        """Stop every server's rollout workers (groups in flight get ``grace_s`` seconds, then
        end their tickets); a server that cannot be reached has its tickets ended by
        ``on_lost``. Returns each stopped host's counters."""

        async def one(i: int, h: Any) -> dict[str, float]:
            if h is None or self._owners[i] is None:
                return {}
            try:
                totals = await asyncio.wait_for(h.stop_workers.remote(grace_s), grace_s + 30)
                self._owners[i] = None
                return totals
            except (RayActorError, RayTaskError, asyncio.TimeoutError) as exc:
                log.warning("server-%d: rollout workers did not stop cleanly (%s: %s)", i, type(exc).__name__, exc)
                await self._release(i)
                return {}

        return list(await asyncio.gather(*(one(i, h) for i, h in enumerate(self._handles))))

    def openai_urls(self) -> list[str | None]:
        """Per server, the base URL of its OpenAI-compatible API (None: not served or not started)."""
        return [h.openai_url if h is not None else None for h in self.started]

    async def generate(self, i: int, prompt_token_ids: list[int], n: int, sampling: Sampling, images: list[Any] | None = None) -> list[Completion]:
        """Generate on server ``i``; if it died, replace it before re-raising (the caller retries)."""
        handle = self._handles[i]
        try:
            return await handle.generate.remote(prompt_token_ids, n, sampling, images)
        except RayActorError as exc:
            await self.restart(i, handle, f"died ({type(exc).__name__})")
            raise

    def generate_fn(self, i: int) -> Callable[[], GenerateFn]:
        """What a rollout worker bound to server ``i`` calls to get its ``generate``."""
        return lambda: (lambda prompt, n, sampling, images=None: self.generate(i, prompt, n, sampling, images))

    async def restart(self, i: int, dead: Any, reason: str = "failed") -> None:
        """Replace server ``i`` if ``dead`` is still its handle (one restart however many callers
        saw it die): kill it, end its workers' open tickets (``on_lost``), start a new one.
        ``reason`` completes "server-i ..." in the line reported to the user."""
        async with self._locks[i]:
            if self._handles[i] is not dead:
                return
            self.report(f"server-{i} {reason}: starting a replacement")
            if (watcher := self._watchers[i]) is not None:
                watcher.cancel()
                self._watchers[i] = None
            ray.kill(dead, no_restart=True)
            await self._release(i)
            await self._launch(i)
            self.restarts += 1

    async def health(self, timeout_s: float = 30.0) -> list[ServerHealth | str]:
        """Health of every server, or the error text for a dead, broken or unstarted one."""

        async def one(i: int, h: Any) -> ServerHealth | str:
            if h is None:
                return f"server-{i} is starting"
            try:
                return await asyncio.wait_for(h.health.remote(), timeout_s)
            except (RayActorError, RayTaskError, asyncio.TimeoutError) as exc:
                return f"server-{i}: {type(exc).__name__}: {exc}"

        return list(await asyncio.gather(*(one(i, h) for i, h in enumerate(self._handles))))

    async def heal(self, version: int, max_lag_s: float, healths: list[ServerHealth | str] | None = None) -> list[str]:
        """Replace every server that is dead, broken (its health check raises, e.g. after a
        failed weight load) or has not held ``version`` for ``max_lag_s`` seconds; a
        replacement serves only once caught up (``on_start``). ``healths``: a :meth:`health`
        result just taken (else one is taken). Returns what was done, a line per server."""
        now = time.monotonic()
        actions = []
        for i, (handle, health) in enumerate(zip(list(self._handles), healths or await self.health())):
            if handle is None or self._locks[i].locked():  # being replaced already (e.g. its engine died)
                continue
            if isinstance(health, str):
                reason = f"is unhealthy ({health})"
            elif health.version >= version:
                self._behind_since[i] = None
                continue
            else:
                since = self._behind_since[i] = self._behind_since[i] or now
                if now - since < max_lag_s:
                    continue
                reason = f"has held version {health.version} for {now - since:.0f} s while the learner is at {version} (sync.max_lag_s={max_lag_s:g})"
            self._behind_since[i] = None
            try:
                await self.restart(i, handle, reason)
                actions.append(f"server-{i} {reason}: replaced")
            except Exception as exc:  # noqa: BLE001 - the next round tries again
                actions.append(f"server-{i} {reason}: replacement failed ({type(exc).__name__}: {exc}); retrying later")
        return actions

    async def shutdown(self) -> None:
        """Stop every engine and actor."""
        for watcher in self._watchers:
            if watcher is not None:
                watcher.cancel()
        self._watchers = [None] * self.num_servers
        for h in self._handles:
            if h is None:
                continue
            try:
                await asyncio.wait_for(h.shutdown.remote(), 60)
            except (RayActorError, asyncio.TimeoutError):
                pass  # already dead: nothing to stop
            ray.kill(h, no_restart=True)
