"""Redis connections with bounded waits, and deadline-based retries on connection loss."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

__all__ = ["QueueUnavailableError", "attempts", "connect", "redact", "retrying"]

T = TypeVar("T")

_MAX_BACKOFF_S = 1.0


class QueueUnavailableError(ConnectionError):
    """Redis stayed unreachable for the whole timeout of an operation."""


def redact(url: str) -> str:
    """The URL with its password replaced by ``***`` (for messages and logs)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


def connect(url: str, socket_timeout_s: float) -> redis.Redis:
    """A client for a ``redis://`` or ``rediss://`` (TLS) URL, password included.

    Every socket read/connect is bounded by ``socket_timeout_s`` seconds. redis-py's own
    retries are off: :func:`retrying` owns retry policy, bounded by the caller's deadline.
    """
    if urlsplit(url).scheme not in ("redis", "rediss"):
        raise ValueError(f"expected a redis:// or rediss:// URL, got {redact(url)!r}")
    return redis.Redis.from_url(
        url,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=socket_timeout_s,
        retry=Retry(NoBackoff(), 0),
        protocol=2,  # reply shapes the queue parses; RESP3 would turn some into maps
    )


def attempts(deadline: float, first_s: float, cap_s: float) -> Iterator[None]:
    """Yield now, then after sleeps doubling from ``first_s`` to ``cap_s`` seconds, the last
    one cut short to end at ``deadline`` (a ``time.monotonic()`` value), then stop."""
    delay = first_s
    yield
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(delay, left))
        delay = min(2 * delay, cap_s)
        yield


def retrying(op: Callable[[], T], deadline: float, what: str) -> T:
    """Run ``op``; on connection loss retry with exponential backoff until ``deadline``.

    ``deadline`` is a ``time.monotonic()`` value. Wrong credentials are not retried.
    A reply lost in transit means the command may have run: retried non-idempotent
    commands (XADD, INCR) can then apply twice.
    """
    failure: Exception | None = None
    for _ in attempts(deadline, first_s=0.01, cap_s=_MAX_BACKOFF_S):
        try:
            return op()
        except redis.AuthenticationError:
            raise
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            # BusyLoadingError (Redis replaying its AOF) is a ConnectionError: wait it out.
            failure = exc
    raise QueueUnavailableError(
        f"{what}: Redis unreachable until the deadline ({failure})"
    ) from failure
