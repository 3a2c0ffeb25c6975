"""The driver's side of the served models (``models.<name>``, :mod:`async_rl.rollout.served`):
each model's actor started (named, so the rollout workers find it), healed every few seconds
(its dead servers replaced; the actor itself restarted when it died), resized on request,
its metrics read for each step and its servers listed in ``servers.json``."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from async_rl.config import Config
from async_rl.rollout.engine_args import kv_cache_env, openai_api_settings, served_engine_kwargs
from async_rl.rollout.external import ExternalModel
from async_rl.rollout.pool import ServerSpec
from async_rl.rollout.served import ServedModel
from async_rl.rollout.types import served_model_actor
from async_rl.rollout.server import ServerHealth

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0
"""Longest a served model's actor may take to answer the driver's health, heal and stats calls, seconds."""


class ServedModels:
    """Every ``models.<name>`` of a run, as the driver runs them.

    Args:
        cfg: the run's config.
        say: prints a line on the driver's console (replacements, restarts).
    """

    def __init__(self, cfg: Config, say: Callable[[str], None]):
        self.cfg = cfg
        self.say = say
        self.actors: dict[str, Any] = {}
        self.healths: dict[str, list[ServerHealth | str]] = {}
        """Each model's servers at the last check."""
        self.actor_restarts = 0
        """Served-model actors restarted after they died (their servers with them)."""
        self._stats: dict[str, float] = {}
        self._specs: dict[str, ServerSpec] = {}

    def _spec(self, name: str, shared_cores: str | None) -> ServerSpec:
        model = self.cfg.models[name]
        env = kv_cache_env(model.vllm)
        if shared_cores is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = shared_cores
        api = openai_api_settings(self.cfg)
        if api is not None:  # free ports, the run's key, the model's name as the API's model name
            api = dataclasses.replace(api, port=0, model_name=name)
        return ServerSpec(served_engine_kwargs(self.cfg, name), model.cpus_per_server, model.gpus_per_server, env, openai_api=api,
                          hang_timeout_s=self.cfg.rollout.engine_hang_timeout_s)

    async def start(self, shared_cores: str | None) -> None:
        """Start every model's actor and servers (concurrently); raises if one does not start.
        ``shared_cores``: on a pinned CPU run, the cores the models' vLLM threads run on (the
        policy servers' cores, ``VLLM_CPU_OMP_THREADS_BIND``); None: unpinned."""
        self._specs = {name: self._spec(name, shared_cores) for name, model in self.cfg.models.items() if not model.url}
        await asyncio.gather(*(self._start(name) for name in self.cfg.models))

    async def _start(self, name: str) -> None:
        model = self.cfg.models[name]
        options = ray.remote(ExternalModel if model.url else ServedModel).options(
            name=served_model_actor(self.cfg.trainer.run_name, name), num_cpus=0, max_concurrency=10_000)
        if model.url:  # a server outside the run: its key from the driver's environment (never from a file)
            key = os.environ.get(model.api_key_env) if model.api_key_env else None
            actor = options.remote(name, model.url, model.api_model or name, key, model.request_timeout_s, model.max_attempts)
        else:
            actor = options.remote(name, self._specs[name], model.num_servers, model.request_timeout_s, model.max_attempts)
        try:
            self.healths[name] = list(await actor.start.remote())
        except BaseException:
            ray.kill(actor, no_restart=True)
            raise
        self.actors[name] = actor
        for h in self.healths[name]:
            if isinstance(h, ServerHealth) and h.openai_url:
                log.info("%s (pid %d) serves models.%s's OpenAI API at %s", h.server_id, h.pid, name, h.openai_url)

    async def watch_once(self) -> bool:
        """Heal every model: replace its broken servers, restart its actor if it died; say what
        was done. True when the servers listed (:meth:`servers`) changed: ``servers.json`` is stale."""
        listed = self.servers()
        for name in list(self.actors):
            actor = self.actors[name]
            try:
                for line in await asyncio.wait_for(actor.heal.remote(), CALL_TIMEOUT_S):
                    self.say(f"models.{name}: {line}")
                self.healths[name] = list(await asyncio.wait_for(actor.health.remote(), CALL_TIMEOUT_S))
            except (RayActorError, asyncio.TimeoutError) as exc:
                await self._restart(name, actor, f"its actor {'died' if isinstance(exc, RayActorError) else 'answered nothing'} "
                                                 f"({type(exc).__name__})")
            except RayTaskError as exc:
                log.warning("models.%s: the health check failed: %s", name, exc)
        return self.servers() != listed

    async def _restart(self, name: str, dead: Any, why: str) -> None:
        """Replace the actor of ``name`` (its servers die with it) by a new one under the same name."""
        self.say(f"models.{name}: {why}: restarting it and its servers")
        ray.kill(dead, no_restart=True)
        self.actors.pop(name, None)
        self.actor_restarts += 1
        try:
            await self._start(name)
        except (ray.exceptions.RayError, asyncio.TimeoutError) as exc:
            self.say(f"models.{name}: the restart failed ({type(exc).__name__}: {exc}); the next health check tries again")
            self.actors[name] = dead  # found dead again next time: tried again

    async def stats(self) -> dict[str, float]:
        """Every model's request counters and latencies (``models/<name>/*``); the last ones
        read for a model that does not answer now."""
        for name, actor in list(self.actors.items()):
            try:
                self._stats.update(await asyncio.wait_for(actor.stats.remote(), CALL_TIMEOUT_S))
            except (RayActorError, RayTaskError, asyncio.TimeoutError) as exc:
                log.warning("models.%s: no metrics this step (%s)", name, type(exc).__name__)
        return {**self._stats, "models/actor_restarts": float(self.actor_restarts)} if self.actors else {}

    def servers(self) -> list[dict[str, Any]]:
        """The started servers of every model, for ``servers.json``."""
        return [{"model": name, "server_id": h.server_id, "pid": h.pid, "engine_pids": h.engine_pids, "openai_url": h.openai_url}
                for name, healths in self.healths.items() for h in healths if isinstance(h, ServerHealth)]

    async def scale(self, name: str, servers: int, grace_s: float) -> list[str]:
        """Resize ``models.<name>`` to ``servers`` servers; a line per change."""
        actor = self.actors[name]
        lines = await actor.scale_to.remote(servers, grace_s)
        self.healths[name] = list(await asyncio.wait_for(actor.health.remote(), CALL_TIMEOUT_S))
        return [f"models.{name}: {line}" for line in lines]

    def num_servers(self, name: str) -> int:
        """Servers of ``models.<name>`` at the last check."""
        return len(self.healths.get(name, []))

    async def shutdown(self) -> None:
        """Stop every model's servers and actor."""
        for name, actor in list(self.actors.items()):
            try:
                await asyncio.wait_for(actor.shutdown.remote(), 60)
            except (RayActorError, RayTaskError, asyncio.TimeoutError) as exc:
                log.warning("models.%s did not stop cleanly (%s)", name, type(exc).__name__)
            ray.kill(actor, no_restart=True)
        self.actors.clear()
