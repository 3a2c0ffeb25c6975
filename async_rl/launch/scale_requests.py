"""The driver's side of ``async-rl scale`` (:mod:`async_rl.launch.scale`): requests read from the
run's Redis about once a second, acted on one at a time (servers added or drained), answered
there; the console, ``servers.json`` and the metrics follow."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import ray

from async_rl.launch.learner_group import cause
from async_rl.launch.run_context import RunContext
from async_rl.queue import QueueUnavailableError
from async_rl.queue.requests import Requests, ScaleReply

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
                reply = await _scale(run, request.servers, request.grace_s, servers_changed)
                await run.redis(lambda: requests.answer(request.request_id, reply))
        except QueueUnavailableError as exc:  # the watcher decides about Redis; the request waits there
            if not run.outages.waiting_for_disk:  # a Redis waiting for disk space was said once already
                log.warning("scale requests not read: %s", exc)
        if requests.undecodable:
            log.warning("dropped %d entries of the run's request list that were not requests", requests.undecodable)
            requests.undecodable = 0


async def _scale(run: RunContext, servers: int, grace_s: float, servers_changed: Callable[[], None]) -> ScaleReply:
    """Run ``servers`` inference servers from now on (refused, with the reason, when Ray lacks
    the resources of the servers to add)."""
    pool, r = run.pool, run.cfg.rollout
    before = pool.num_servers
    if servers > before:
        free = ray.available_resources()
        for resource, each in (("CPU", r.cpus_per_server), ("GPU", r.gpus_per_server)):
            if (need := each * (servers - before)) > free.get(resource, 0.0) + 1e-9:
                error = (f"{servers - before} more servers need {need:g} {resource}s (rollout.{resource.lower()}s_per_server={each:g}); "
                         f"the Ray cluster has {free.get(resource, 0.0):g} free: add a node, or lower rollout.{resource.lower()}s_per_server")
                run.say(f"scale to {servers} servers refused: {error}")
                return ScaleReply(False, before, error=error)
    run.say(f"scaling the inference servers {before} -> {servers} (asked by async-rl scale)")
    try:
        lines = await pool.scale_to(servers, grace_s)
    except (ray.exceptions.RayError, asyncio.TimeoutError, ValueError) as exc:
        run.say(f"scale to {servers} servers failed: {cause(exc)}")
        return ScaleReply(False, pool.num_servers, error=cause(exc))
    for line in lines:
        run.say(line)
    servers_changed()
    ok = pool.num_servers == servers
    return ScaleReply(ok, pool.num_servers, tuple(lines), None if ok else lines[-1])
