"""The driver's side of ``async-rl scale`` (:mod:`async_rl.launch.scale`): requests read from the
run's Redis about once a second, acted on one at a time (servers added or drained), answered
there; the console, ``servers.json`` and the metrics follow."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import ray

from async_rl.launch.learner_group import cause
from async_rl.launch.run_context import RunContext
from async_rl.queue import QueueUnavailableError
from async_rl.queue.requests import Requests, ScaleReply, ScaleRequest

log = logging.getLogger(__name__)

REQUEST_POLL_S = 1.0
"""How often the driver looks for a request to the run (``async-rl scale``), seconds."""


async def serve_scale_requests(run: RunContext, servers_changed: Callable[[], None]) -> None:
    """Until cancelled: act on each request to this run; a failing poll is logged and retried.
    ``servers_changed()`` after a change (it rewrites ``servers.json``)."""
    requests = Requests(run.queue.client, run.cfg.trainer.run_name)
    while True:
        await asyncio.sleep(REQUEST_POLL_S)
        try:
            request = await run.redis(requests.take)
            if request is not None:
                scale = _scale if request.model is None else _scale_model
                reply = await scale(run, request, servers_changed)
                await run.redis(lambda: requests.answer(request.request_id, reply))
        except QueueUnavailableError as exc:  # the watcher decides about Redis; the request waits there
            if not run.outages.waiting_for_disk:  # a Redis waiting for disk space was said once already
                log.warning("scale requests not read: %s", exc)
        if requests.undecodable:
            log.warning("dropped %d entries of the run's request list that were not requests", requests.undecodable)
            requests.undecodable = 0


def _shortage(servers: int, before: int, per_server: tuple[float, float], section: str) -> str | None:
    """Why Ray cannot place ``servers - before`` more servers of ``per_server`` (CPUs, GPUs)
    each (``section``: where those keys are), or None."""
    if servers <= before:
        return None
    free = ray.available_resources()
    for resource, each in zip(("CPU", "GPU"), per_server, strict=True):
        if (need := each * (servers - before)) > free.get(resource, 0.0) + 1e-9:
            return (f"{servers - before} more servers need {need:g} {resource}s ({section}.{resource.lower()}s_per_server={each:g}); "
                    f"the Ray cluster has {free.get(resource, 0.0):g} free: add a node, or lower {section}.{resource.lower()}s_per_server")
    return None


async def _scale(run: RunContext, request: ScaleRequest, servers_changed: Callable[[], None]) -> ScaleReply:
    """Run ``request.servers`` inference servers from now on (refused, with the reason, when Ray
    lacks the resources of the servers to add)."""
    pool, r, servers = run.pool, run.cfg.rollout, request.servers
    before = pool.num_servers
    if error := _shortage(servers, before, (r.cpus_per_server, r.gpus_per_server), "rollout"):
        run.say(f"scale to {servers} servers refused: {error}")
        return ScaleReply(False, before, error=error)
    run.say(f"scaling the inference servers {before} -> {servers} (asked by async-rl scale)")
    return await _resized(run, lambda: pool.scale_to(servers, request.grace_s), lambda: pool.num_servers, servers, servers_changed)


async def _scale_model(run: RunContext, request: ScaleRequest, servers_changed: Callable[[], None]) -> ScaleReply:
    """Run ``request.servers`` servers of the served model ``request.model`` from now on."""
    name, servers, models = request.model, request.servers, run.models
    if name not in run.cfg.models:
        error = f"the run serves no model {name!r} (its models: {', '.join(run.cfg.models) or 'none'})"
        run.say(f"scale of models.{name} refused: {error}")
        return ScaleReply(False, 0, error=error)
    if url := run.cfg.models[name].url:
        error = f"models.{name} is served outside the run ({url}): its servers are not the run's to resize"
        run.say(f"scale of models.{name} refused: {error}")
        return ScaleReply(False, models.num_servers(name), error=error)
    before = models.num_servers(name)
    model = run.cfg.models[name]
    if error := _shortage(servers, before, (model.cpus_per_server, model.gpus_per_server), f"models.{name}"):
        run.say(f"scale of models.{name} to {servers} servers refused: {error}")
        return ScaleReply(False, before, error=error)
    run.say(f"scaling the servers of models.{name} {before} -> {servers} (asked by async-rl scale)")
    return await _resized(run, lambda: models.scale(name, servers, request.grace_s), lambda: models.num_servers(name), servers, servers_changed)


async def _resized(run: RunContext, scale: Callable[[], Awaitable[list[str]]], count: Callable[[], int], servers: int,
                   servers_changed: Callable[[], None]) -> ScaleReply:
    """Run ``scale()``, say its lines, rewrite ``servers.json``; the reply (``count()``: servers now)."""
    try:
        lines = await scale()
    except (ray.exceptions.RayError, asyncio.TimeoutError, ValueError) as exc:
        run.say(f"scale to {servers} servers failed: {cause(exc)}")
        return ScaleReply(False, count(), error=cause(exc))
    for line in lines:
        run.say(line)
    servers_changed()
    ok = count() == servers
    return ScaleReply(ok, count(), tuple(lines), None if ok else lines[-1])
