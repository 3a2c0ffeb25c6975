"""Resize a running run's inference servers from another process: ``async-rl scale``.

    reply = request_scale("runs/quickstart", servers=2)   # blocks until the driver answered

The request goes through the run's Redis (:mod:`async_rl.queue.requests`); the running
driver owns the change (:meth:`async_rl.launch.driver.Trainer` serves it between its other
work): no second driver, no restart of the learner.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import redis
import yaml

from async_rl.queue.client import QueueUnavailableError, connect
from async_rl.queue.embedded import url_of
from async_rl.queue.ownership import LEASE_BACK_S
from async_rl.queue.requests import Requests, ScaleReply

DEFAULT_GRACE_S = 30.0
"""How long a leaving server's groups in flight may take to finish before their prompts go back, seconds."""


REDIS_GONE_S = 15.0
"""How long the run's own (embedded) Redis may stay unreachable after a request before the run
counts as ended, seconds: longer than a restart on its append-only file takes."""


class ScaleError(RuntimeError):
    """The request could not be made or was not answered (the run's files, its Redis, its driver)."""


class RunEndedError(ScaleError):
    """The run ended (its lease released, its Redis stopped) before its driver answered."""


def run_redis_url(run_dir: Path, redis_url: str | None = None) -> tuple[str, str]:
    """``(run name, Redis URL)`` of the run in ``run_dir``: the name from its
    ``resolved_config.yaml``; the URL given, else the embedded server's (``redis/redis.conf``),
    else the config's ``queue.redis_url`` when it holds no redacted password."""
    resolved = run_dir / "resolved_config.yaml"
    if not resolved.is_file():
        raise ScaleError(f"{resolved} does not exist: is {run_dir} the output_dir of a run?")
    cfg = yaml.safe_load(resolved.read_text())
    run = cfg["trainer"]["run_name"]
    if redis_url:
        return run, redis_url
    if (run_dir / "redis" / "redis.conf").is_file():
        return run, url_of(run_dir / "redis")
    configured = cfg["queue"].get("redis_url")
    if not configured or "***" in configured:
        raise ScaleError(f"the run's Redis URL is not in {run_dir} (its password is redacted there): pass --redis-url")
    return run, configured


def request_scale(run_dir: str | Path, servers: int, grace_s: float = DEFAULT_GRACE_S, redis_url: str | None = None,
                  timeout_s: float = 1800.0, progress: Callable[[str], None] | None = None, model: str | None = None) -> ScaleReply:
    """Ask the driver of the run in ``run_dir`` for ``servers`` inference servers (of the served
    model ``models.<model>``; None: the policy's) and wait (at most ``timeout_s`` seconds) for
    its reply; ``progress(line)`` hears about the wait.
    :class:`RunEndedError` when the run ends before answering: its lease released, or its
    embedded Redis gone for :data:`REDIS_GONE_S`."""
    run, url = run_redis_url(Path(run_dir), redis_url)
    embedded = not redis_url and (Path(run_dir) / "redis" / "redis.conf").is_file()
    client = connect(url, socket_timeout_s=10.0)
    try:
        requests = Requests(client, run)
        try:
            driver = client.get(requests.keys.lease)
            deadline = time.monotonic() + LEASE_BACK_S  # a lease lapsed while its Redis was away comes back
            while driver is None and time.monotonic() < deadline:
                time.sleep(0.5)
                driver = client.get(requests.keys.lease)
            if driver is None:
                raise ScaleError(f"no driver runs {run!r} (its lease in Redis is gone): start or resume the run first")
            request_id = requests.post(servers, grace_s, model)
        except (QueueUnavailableError, redis.RedisError) as exc:
            raise ScaleError(f"the run's Redis did not answer: {exc}") from exc
        start = time.monotonic()
        said = start
        unreachable_since: float | None = None
        lease_gone_since: float | None = None
        while True:
            try:
                reply, lease = requests.reply(request_id), client.get(requests.keys.lease)
                unreachable_since = None
            except (QueueUnavailableError, redis.RedisError) as exc:
                unreachable_since = unreachable_since or time.monotonic()
                if time.monotonic() - unreachable_since < (REDIS_GONE_S if embedded else 0.0):
                    time.sleep(0.5)  # the run's Redis may be restarting on its append-only file
                    continue
                if embedded:
                    raise RunEndedError(f"the run ended before answering request {request_id} (its Redis stopped: {exc})") from exc
                raise ScaleError(f"the run's Redis did not answer: {exc}") from exc
            if reply is not None:
                return reply
            lease_gone_since = (lease_gone_since or time.monotonic()) if lease is None else None
            if lease_gone_since is not None and time.monotonic() - lease_gone_since >= LEASE_BACK_S:
                raise RunEndedError(f"the run ended before answering request {request_id} (its driver released its lease)")
            if lease is not None and lease != driver:  # killed: its lease lapsed and a resumed driver holds a new one
                raise ScaleError(f"the driver of {run!r} stopped before it answered request {request_id}: check the run's "
                                 f"console; a resumed run starts rollout.num_servers servers, scale it again then")
            if time.monotonic() - start > timeout_s:
                raise ScaleError(f"the driver did not answer within {timeout_s:.0f} s (request {request_id} stays queued)")
            if progress is not None and time.monotonic() - said >= 10.0:
                said = time.monotonic()
                progress(f"waiting for the driver: {said - start:.0f} s")
            time.sleep(0.5)
    finally:
        client.close()
