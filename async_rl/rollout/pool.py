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

The pool resizes while it serves (:meth:`ServerPool.scale_to`, docs/rollout.md "Scaling a
live run"): a new server gets the next index, catches up to the current weights in
``on_start`` before its workers admit anything, and produces; a server taken away drains:
its workers stop admitting, finish their groups in flight within a grace period or return
their prompts and end their tickets, then it says ``Leave`` to the weight sender (which never
waits on it again) and stops. Servers keep their index for life; the highest go first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Awaitable, Callable

import ray
from ray.exceptions import RayActorError, RayTaskError

from async_rl.rollout.host import WorkerHost, WorkerHostSpec
from async_rl.rollout.openai_api import OpenAIApiSettings
from async_rl.rollout.server import HUNG, InferenceServer, ServerHealth
from async_rl.rollout.types import Completion, GenerateFn, Sampling
from async_rl.sync.auth import SyncEndpoint

log = logging.getLogger(__name__)

STACKS_TIMEOUT_S = 10.0
"""How long a server that hangs may take to report its stacks, seconds."""


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
    hang_timeout_s: float = 60.0
    """A server whose engine answers no probe for this long kills it and is replaced (``rollout.engine_hang_timeout_s``), seconds."""
    sync: SyncEndpoint | None = None
    """The weight sender the servers register with for weight updates (its address and the
    run's secret, handed over as an actor argument); None for none."""
    openai_api: OpenAIApiSettings | None = None
    """Where the servers serve vLLM's OpenAI-compatible HTTP API (server ``i`` on port + i if fixed); None for none."""
    server_cls: type = InferenceServer
    """The actor class (``InferenceServer``; the benchmarks' ``FakeServer`` has the same interface)."""


@dataclass
class _Slot:
    """One server of the pool, for its whole life (its actor is replaced when it dies)."""

    env: dict[str, str]
    """Added to ``spec.env_vars`` for this server (e.g. its CPU cores)."""
    handle: Any = None
    """The Ray actor of its current process (None while it starts or after it stopped)."""
    started: ServerHealth | None = None
    """Health it reported at its (latest) start, before ``on_start`` runs."""
    owner: str | None = None
    """The ticket owner of its running workers (None: no workers running)."""
    starts: int = 0
    watcher: asyncio.Task | None = None
    """The task waiting for its engine's death (:meth:`ServerPool._watch_engine`)."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held while it is replaced or removed."""
    behind_since: float | None = None
    """``time.monotonic()`` since when it lags the learner's version (see :meth:`ServerPool.heal`)."""


def _in_transition(name: str, i: int) -> tuple[str, str]:
    """What :meth:`ServerPool.health` says of server ``i`` while it starts, and while it is
    replaced or removed (:meth:`ServerPool.heal` never acts on either: it changed since)."""
    return f"{name}-{i} is starting", f"{name}-{i} is being replaced or removed"


class ServerPool:
    """:class:`InferenceServer` actors, restarted when they die, resized on demand."""

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
        on_resize: Callable[[int], None] | None = None,
        name: str = "server",
    ):
        """``env_per_server[i]`` adds to ``spec.env_vars`` for server ``i`` (e.g. its CPU
        cores); a server added later takes ``env_per_server[i % len(env_per_server)]`` (it
        shares those cores). With ``workers``, every server runs rollout workers over ``rows``
        (the prompt rows, best a ``ray.put`` reference: stored once, fetched once per server),
        and ``on_lost(owner)`` (``ReplayQueue.release_owner``) ends the tickets of a replaced
        one. ``report(line)`` tells the user why a server is replaced (the driver's console;
        default: a warning in the log). ``on_resize(producers)`` (``ReplayQueue.set_producers``)
        hears how many worker loops admit whenever a server's workers start or a server leaves.
        ``name``: the servers are ``<name>-<i>`` (a served model's pool is named after the model)."""
        self.name = name
        self.spec = spec
        self.workers = workers
        self.rows = rows
        self.on_lost = on_lost
        self.on_resize = on_resize
        self.env_per_server = env_per_server or [{}]
        self.version = version
        self.on_start = on_start
        self.report = report or (lambda line: log.warning("%s", line))
        self.restarts = 0
        """Servers replaced (dead, broken or lagging)."""
        self.engine_deaths = 0
        """Servers whose vLLM engine process died or hung while the server lived (each one replaced)."""
        self.engine_hangs = 0
        """Of :attr:`engine_deaths`, the engines declared hung (``rollout.engine_hang_timeout_s``)."""
        self._slots: dict[int, _Slot] = {}
        self._next = 0
        self._health_of: list[int] = []
        """The servers the last :meth:`health` was taken of, in order (:meth:`heal` checks it still holds)."""
        for _ in range(num_servers):
            self._new_slot()

    def _new_slot(self) -> int:
        i, self._next = self._next, self._next + 1
        self._slots[i] = _Slot(dict(self.env_per_server[i % len(self.env_per_server)]))
        return i

    @property
    def num_servers(self) -> int:
        """Servers in the pool now (starting ones included, draining ones not)."""
        return len(self._slots)

    @property
    def indices(self) -> list[int]:
        """The servers' indices (``server-<i>``), oldest first."""
        return list(self._slots)

    @property
    def started(self) -> list[ServerHealth | None]:
        """Health each server reported at its (latest) start, before ``on_start`` runs."""
        return [slot.started for slot in self._slots.values()]

    def _items(self) -> Iterator[tuple[int, _Slot]]:
        return iter(list(self._slots.items()))

    async def start(self, workers: bool = True, sync: Awaitable[SyncEndpoint | None] | None = None) -> list[ServerHealth]:
        """Start every server (concurrently); returns their health. With ``workers=False``
        the rollout workers wait for :meth:`start_workers` (e.g. for a validation of the
        starting weights that no update interrupts); a server restarted meanwhile starts its own.

        ``sync``: the weight sender's endpoint, not known yet (e.g. the learner is starting):
        each server builds its engine meanwhile and registers once ``sync`` resolves (it becomes
        ``spec.sync``); if ``sync`` raises, the servers are killed and it propagates."""
        return list(await asyncio.gather(*(self._launch(i, workers, sync) for i in self._slots)))

    async def start_workers(self) -> None:
        """Start the rollout workers of every server that runs none."""
        await asyncio.gather(*(self._start_workers(i, slot.handle) for i, slot in self._items()
                               if slot.handle is not None and slot.owner is None))

    def handle(self, i: int) -> Any:
        """Ray actor handle of server ``i``."""
        return self._slots[i].handle

    def serving(self) -> list[int]:
        """The servers that take requests now: started, not being replaced or removed."""
        return [i for i, slot in self._slots.items() if slot.handle is not None and not slot.lock.locked()]

    async def _launch(self, i: int, workers: bool = True, sync: Awaitable[SyncEndpoint | None] | None = None) -> ServerHealth:
        slot = self._slots[i]
        actor_cls = ray.remote(self.spec.server_cls).options(
            num_cpus=self.spec.num_cpus,
            num_gpus=self.spec.num_gpus,
            runtime_env={"env_vars": {**self.spec.env_vars, **slot.env}},
            name=None,
        )
        openai_api = self.spec.openai_api.for_server(i) if self.spec.openai_api is not None else None
        handle = actor_cls.remote(f"{self.name}-{i}", self.spec.engine_kwargs, self.version(), openai_api, self.spec.hang_timeout_s)
        try:  # this call owns the actor until the slot holds it: a start that fails or hangs kills it
            if sync is not None:  # the engine builds while the weight sender starts
                await self._start_on(i, handle, None)
                endpoint = await sync
                if self.spec.sync is None:  # else the sender moved meanwhile (move_sender): the newer one
                    self.spec.sync = endpoint
            health = await self._start_on(i, handle, self.spec.sync)
            slot.started = health
            if health.openai_url is not None:
                log.info("%s-%d (pid %d) serves the OpenAI API at %s", self.name, i, health.pid, health.openai_url)
            if self.on_start is not None:
                await self.on_start(i, handle)
            if workers:
                await self._start_workers(i, handle)
        except BaseException:
            ray.kill(handle, no_restart=True)
            raise
        slot.handle = handle
        slot.watcher = asyncio.create_task(self._watch_engine(i, handle))
        return health

    async def _start_on(self, i: int, handle: Any, sync: SyncEndpoint | None) -> ServerHealth:
        """``handle.start(sync)`` within ``spec.start_timeout_s``; a hang names its step."""
        try:
            return await asyncio.wait_for(handle.start.remote(sync), self.spec.start_timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(await self._stuck(i, handle, f"did not start within {self.spec.start_timeout_s:g} s")) from None

    async def _stuck(self, i: int, handle: Any, what: str) -> str:
        """``server-i <what>`` and the step it was at; its tasks' and threads' stacks go to
        the log (where a start hangs is otherwise invisible: the actor just never answers)."""
        try:
            step, stacks = await asyncio.wait_for(handle.stacks.remote(), STACKS_TIMEOUT_S)
        except (RayActorError, RayTaskError, asyncio.TimeoutError) as exc:
            return f"{self.name}-{i} {what} (its stacks could not be read: {type(exc).__name__})"
        log.warning("%s-%d %s, %s; its stacks:\n%s", self.name, i, what, step, stacks)
        return f"{self.name}-{i} {what}, {step} (its stacks are in the driver's log)"

    async def _watch_engine(self, i: int, handle: Any) -> None:
        """Wait for server ``i``'s engine to die, then replace the server. The server answers
        only once its rollout workers gave back their groups in flight (slots released,
        prompts returned); whatever is left open, ``restart`` ends like a dead actor's."""
        try:
            reason = await handle.engine_died.remote()
        except (RayActorError, RayTaskError):
            return  # the actor itself died or stopped: a failing request or heal() replaces it
        slot = self._slots.get(i)
        if slot is None or slot.handle is not handle:
            return
        slot.watcher = None  # this task does the restart: it must not cancel itself
        self.engine_deaths += 1
        self.engine_hangs += HUNG in reason
        try:
            await self.restart(i, handle, f"lost its engine: {reason}; its groups in flight go back to the queue")
        except Exception as exc:  # noqa: BLE001 - heal() finds the server broken and tries again
            self.report(f"{self.name}-{i}: replacement failed ({type(exc).__name__}: {exc}); the next health check tries again")

    async def _resized(self) -> None:
        """Tell ``on_resize`` the worker loops of the servers in the pool now."""
        if self.on_resize is not None and self.workers is not None:
            try:
                await asyncio.to_thread(self.on_resize, max(1, self.num_servers * self.workers.workers))
            except Exception as exc:  # noqa: BLE001 - a fairness hint: admission is correct without it
                log.warning("the admission share of %d servers was not recorded: %s", self.num_servers, exc)

    async def _start_workers(self, i: int, handle: Any) -> None:
        if self.workers is not None:
            await self._resized()
            slot = self._slots[i]
            owner = f"{self.name}-{i}#{slot.starts}"
            slot.starts += 1
            await handle.start_workers.remote(partial(WorkerHost, self.workers), self.rows, owner)
            slot.owner = owner

    async def _release(self, slot: _Slot, i: int) -> None:
        """End the open tickets of server ``i``'s workers, whose process is gone."""
        owner, slot.owner = slot.owner, None
        if owner is not None and self.on_lost is not None:
            released = await asyncio.to_thread(self.on_lost, owner)
            if released:
                log.warning("%s-%d: %d groups in flight were lost with its process; their prompts are served again", self.name, i, released)

    async def _stop_workers(self, i: int, slot: _Slot, grace_s: float) -> dict[str, float]:
        """Stop server ``i``'s rollout workers (groups in flight get ``grace_s`` seconds, then
        end their tickets); one that cannot be reached has its tickets ended by ``on_lost``."""
        if slot.handle is None or slot.owner is None:
            return {}
        try:
            totals = await asyncio.wait_for(slot.handle.stop_workers.remote(grace_s), grace_s + 30)
            slot.owner = None
            return totals
        except (RayActorError, RayTaskError, asyncio.TimeoutError) as exc:
            log.warning("%s-%d: rollout workers did not stop cleanly (%s: %s)", self.name, i, type(exc).__name__, exc)
            await self._release(slot, i)
            return {}

    async def stop_workers(self, grace_s: float) -> list[dict[str, float]]:
        """Stop every server's rollout workers (groups in flight get ``grace_s`` seconds, then
        end their tickets); a server that cannot be reached has its tickets ended by
        ``on_lost``. Returns each stopped host's counters."""
        return list(await asyncio.gather(*(self._stop_workers(i, slot, grace_s) for i, slot in self._items())))

    def openai_urls(self) -> list[str | None]:
        """Per server, the base URL of its OpenAI-compatible API (None: not served or not started)."""
        return [h.openai_url if h is not None else None for h in self.started]

    async def generate(self, i: int, prompt_token_ids: list[int], n: int, sampling: Sampling, images: list[Any] | None = None) -> list[Completion]:
        """Generate on server ``i``; if it died, replace it before re-raising (the caller retries)."""
        handle = self._slots[i].handle
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
        saw it die; none once it was removed): kill it, end its workers' open tickets
        (``on_lost``), start a new one. ``reason`` completes "server-i ..." in the line reported
        to the user."""
        slot = self._slots.get(i)
        if slot is None or dead is None:  # None: in its first start, whose call owns the actor
            return
        async with slot.lock:
            if slot.handle is not dead or self._slots.get(i) is not slot:
                return
            self.report(f"{self.name}-{i} {reason}: starting a replacement")
            if (watcher := slot.watcher) is not None:
                watcher.cancel()
                slot.watcher = None
            ray.kill(dead, no_restart=True)
            await self._release(slot, i)
            await self._launch(i)
            self.restarts += 1

    async def move_sender(self, sync: SyncEndpoint, reason: str) -> None:
        """The weight sender moved (a restarted learner's rank 0 is on another node): servers
        register with ``sync`` from now on. Each running server is replaced (its new process
        registers there; ``reason`` completes "server-i ..."); one still in its first start
        registers there when it gets to it."""
        self.spec.sync = sync
        for i, slot in self._items():
            await self.restart(i, slot.handle, reason)

    async def add(self, workers: bool = True) -> int:
        """Start one more server (the next index); returns its index once it serves (its
        ``on_start`` ran: caught up) and, with ``workers``, its rollout workers run. A start that
        fails or hangs removes the server again (:meth:`_launch` killed its actor) and raises."""
        i = self._new_slot()
        try:
            await self._launch(i, workers)
        except BaseException:
            del self._slots[i]
            raise
        return i

    async def remove(self, i: int, grace_s: float) -> dict[str, float]:
        """Drain server ``i`` and stop it: its workers stop admitting, their groups in flight
        get ``grace_s`` seconds, then end their tickets (prompts served again); it tells the
        weight sender it leaves, stops and is killed. Returns its workers' counters."""
        slot = self._slots[i]
        async with slot.lock:  # after a replacement in progress; heal() skips it from here on
            del self._slots[i]
            await self._resized()
            if (watcher := slot.watcher) is not None:
                watcher.cancel()
                slot.watcher = None
            totals = await self._stop_workers(i, slot, grace_s)
            handle, slot.handle = slot.handle, None
            if handle is not None:
                try:
                    await asyncio.wait_for(handle.shutdown.remote(), 60)  # says Leave to the weight sender
                except (RayActorError, RayTaskError, asyncio.TimeoutError) as exc:
                    log.warning("%s-%d did not stop cleanly (%s: %s)", self.name, i, type(exc).__name__, exc)
                ray.kill(handle, no_restart=True)
            await self._release(slot, i)  # tickets a worker could not end itself
        return totals

    async def scale_to(self, n: int, grace_s: float) -> list[str]:
        """Add or remove servers (the newest first) until ``n`` serve; returns a line per change."""
        if n < 1:
            raise ValueError(f"a pool needs at least 1 server, not {n}")
        if n > self.num_servers:
            added = await asyncio.gather(*(self.add() for _ in range(n - self.num_servers)), return_exceptions=True)
            failed = [a for a in added if isinstance(a, BaseException)]
            lines = [f"{self.name}-{a} added" for a in added if isinstance(a, int)]
            if failed:
                lines.append(f"{len(failed)} servers could not start: {type(failed[0]).__name__}: {failed[0]}")
            return lines
        leaving = sorted(self._slots, reverse=True)[: self.num_servers - n]
        totals = await asyncio.gather(*(self.remove(i, grace_s) for i in leaving))
        put = (lambda t: f" ({t.get('groups_put', 0):.0f} groups put by its workers)") if self.workers is not None else (lambda t: "")
        return [f"{self.name}-{i} drained and stopped{put(t)}" for i, t in zip(leaving, totals, strict=True)]

    async def health(self, timeout_s: float = 30.0) -> list[ServerHealth | str]:
        """Health of every server, or the error text for a dead, broken or unstarted one."""

        async def one(i: int, slot: _Slot) -> ServerHealth | str:
            h = slot.handle
            if h is None:
                return _in_transition(self.name, i)[0]
            if slot.lock.locked():  # restart() or remove() holds it: its old actor is gone or going
                return _in_transition(self.name, i)[1]
            try:
                return await asyncio.wait_for(h.health.remote(), timeout_s)
            except asyncio.TimeoutError:  # its actor's event loop answers nothing: hung (heal() replaces it)
                return f"{self.name}-{i} did not answer its health check within {timeout_s:g} s (its process hangs)"
            except RayTaskError as exc:  # its health check raised: the original error, not Ray's traceback
                cause = exc.cause if isinstance(exc.cause, BaseException) else exc
                return f"{self.name}-{i}: {type(cause).__name__}: {str(cause).removeprefix(f'{self.name}-{i}: ')}"
            except RayActorError as exc:
                return f"{self.name}-{i}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"

        items = list(self._items())
        self._health_of = [i for i, _ in items]
        return list(await asyncio.gather(*(one(i, slot) for i, slot in items)))

    async def heal(self, version: int, max_lag_s: float, healths: list[ServerHealth | str] | None = None) -> list[str]:
        """Replace every server that is dead, broken (its health check raises, e.g. after a
        failed weight load) or has not held ``version`` for ``max_lag_s`` seconds; a
        replacement serves only once caught up (``on_start``). ``healths``: a :meth:`health`
        result just taken (else one is taken). Returns what was done, a line per server."""
        now = time.monotonic()
        actions = []
        items = list(self._items())
        if healths is None or self._health_of != [i for i, _ in items]:  # none given, or taken before the pool changed
            healths = await self.health()
            items = list(self._items())
        for (i, slot), health in zip(items, healths, strict=False):
            handle = slot.handle
            if handle is None or slot.lock.locked() or self._slots.get(i) is not slot:  # being replaced or removed
                continue
            if isinstance(health, str) and health in _in_transition(self.name, i):  # it started or was replaced since: its next health counts
                continue
            if isinstance(health, str) and health.startswith(f"{self.name}-{i}: EngineDied") and slot.watcher is not None and not slot.watcher.done():
                continue  # its engine died or hung: its watcher replaces it once its workers gave their groups back, and counts it
            if isinstance(health, str):
                reason = f"is unhealthy ({health})"
            elif health.version >= version:
                slot.behind_since = None
                continue
            else:
                since = slot.behind_since = slot.behind_since or now
                if now - since < max_lag_s:
                    continue
                reason = f"has held version {health.version} for {now - since:.0f} s while the learner is at {version} (sync.max_lag_s={max_lag_s:g})"
            slot.behind_since = None
            try:
                await self.restart(i, handle, reason)
                actions.append(f"{self.name}-{i} {reason}: replaced")
            except Exception as exc:  # noqa: BLE001 - the next round tries again
                actions.append(f"{self.name}-{i} {reason}: replacement failed ({type(exc).__name__}: {exc}); retrying later")
        return actions

    async def shutdown(self) -> None:
        """Stop every engine and actor."""
        for _, slot in self._items():
            if slot.watcher is not None:
                slot.watcher.cancel()
                slot.watcher = None
        for _, slot in self._items():
            if slot.handle is None:
                continue
            try:
                await asyncio.wait_for(slot.handle.shutdown.remote(), 60)
            except (RayActorError, asyncio.TimeoutError):
                pass  # already dead: nothing to stop
            ray.kill(slot.handle, no_restart=True)
