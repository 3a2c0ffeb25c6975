"""Redis connections with bounded waits, deadline-based retries on connection loss, and
scripts that apply once however often a call is retried."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from async_rl.config import redact_url

__all__ = ["OnceScript", "QueueUnavailableError", "attempts", "connect", "retrying"]

T = TypeVar("T")

_MAX_BACKOFF_S = 1.0


class QueueUnavailableError(ConnectionError):
    """Redis stayed unreachable for the whole timeout of an operation."""


def connect(url: str, socket_timeout_s: float) -> redis.Redis:
    """A client for a ``redis://`` or ``rediss://`` (TLS) URL, password included.

    Every socket read/connect is bounded by ``socket_timeout_s`` seconds. redis-py's own
    retries are off: :func:`retrying` owns retry policy, bounded by the caller's deadline.
    """
    if urlsplit(url).scheme not in ("redis", "rediss"):
        raise ValueError(f"expected a redis:// or rediss:// URL, got {redact_url(url)!r}")
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
    A reply lost in transit means the command may have run: every write that is retried
    is therefore idempotent (a :class:`OnceScript`, or the put's own sequence check).
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


# The reply key and its expiry travel as the last key and argument; the body sees the
# call's own KEYS and ARGV. A body that returns false (nil) changed nothing: that reply is
# not kept, so a retry runs it again.
_ONCE_LUA = """
local reply_key = table.remove(KEYS)
local ttl_s = table.remove(ARGV)
local previous = redis.call('GET', reply_key)
if previous then
  return cjson.decode(previous)
end
local reply = (function()
%s
end)()
if reply then
  redis.call('SET', reply_key, cjson.encode(reply), 'EX', ttl_s)
end
return reply
"""


class OnceScript:
    """A Lua script that applies at most once per call id.

    The first run keeps its reply (JSON) under ``reply_key(call_id)`` for ``ttl_s``
    seconds; a retry of the same call (its reply was lost in transit: a dropped
    connection, a socket timeout) returns that reply without running the body again. So a
    script that decrements a counter or appends to a stream is safe to retry for as long
    as its caller retries, which must be shorter than ``ttl_s``. ``body`` returns an
    integer, a string, false (changed nothing, not kept), or an array of those.
    """

    def __init__(self, client: redis.Redis, body: str, reply_key: Callable[[str], str], ttl_s: int) -> None:
        self._script = client.register_script(_ONCE_LUA % body)
        self._reply_key = reply_key
        self._ttl_s = ttl_s

    def __call__(self, keys: Sequence[str], args: Sequence[Any], call_id: str) -> Any:
        """Run (or replay) call ``call_id``: the same id for every retry of one call."""
        return self._script(keys=[*keys, self._reply_key(call_id)], args=[*args, self._ttl_s])
