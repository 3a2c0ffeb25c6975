"""Requests to a running driver, through the run's Redis: how ``async-rl scale`` reaches it.

The run's Redis is the one place a second process shares with the driver, and it is already
authenticated (the embedded server's generated password sits in the run directory's
``redis/redis.conf``, readable by the run's user only; an external server has its own): no
new socket listens for these requests. A request is a msgspec message pushed on
``<run>:requests``; the driver takes one at a time, acts, and writes its :class:`ScaleReply`
under ``<run>:request-reply:<id>`` (kept :data:`REPLY_TTL_S`). Entries that do not decode are
dropped and counted, never raised to the driver.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Annotated, TypeVar

import msgspec
import redis

from async_rl.queue.client import QueueUnavailableError
from async_rl.queue.keys import RunKeys

T = TypeVar("T")

REPLY_TTL_S = 3600
"""How long a reply waits for its requester, seconds."""
MAX_SERVERS = 4096
"""The most inference servers a request may ask for."""


class ScaleRequest(msgspec.Struct, frozen=True):
    """Run ``servers`` inference servers (or servers of the served model ``model``) from now on."""

    request_id: Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{16}$")]
    servers: Annotated[int, msgspec.Meta(ge=1, le=MAX_SERVERS)]
    grace_s: Annotated[float, msgspec.Meta(ge=0.0, le=3600.0)]
    """How long a leaving server's groups in flight may take to finish, seconds."""
    requested_at: float
    """``time.time()`` of the request."""
    model: Annotated[str, msgspec.Meta(max_length=32)] | None = None
    """The served model (``models.<name>``) whose servers to resize; None: the policy's inference servers."""


class ScaleReply(msgspec.Struct, frozen=True):
    """What the driver did: ``ok`` and a line per change, or ``error`` (nothing changed)."""

    ok: bool
    servers: int
    """Servers running after the request."""
    lines: tuple[str, ...] = ()
    error: str | None = None


_requests = msgspec.json.Decoder(ScaleRequest)
_replies = msgspec.json.Decoder(ScaleReply)


def _requests_key(keys: RunKeys) -> str:
    return f"{keys.run}:requests"


def _reply_key(keys: RunKeys, request_id: str) -> str:
    return f"{keys.run}:request-reply:{request_id}"


class Requests:
    """The run's request mailbox on ``client`` (a ``redis.Redis`` of the run's server)."""

    def __init__(self, client: redis.Redis, run: str) -> None:
        self._client = client
        self.keys = RunKeys(run)
        self.undecodable = 0
        """Entries taken that were not a request (dropped)."""

    def _call(self, what: str, op: Callable[[], T]) -> T:
        try:
            return op()
        except redis.RedisError as exc:  # one attempt: the caller polls again
            raise QueueUnavailableError(f"{what}: {type(exc).__name__}: {exc}") from exc

    def post(self, servers: int, grace_s: float, model: str | None = None) -> str:
        """Ask the driver for ``servers`` servers (of the served model ``model``, None: the
        policy's); returns the request's id. ``ValueError`` for a count or grace out of
        :class:`ScaleRequest`'s bounds."""
        request = ScaleRequest(secrets.token_hex(8), servers, grace_s, time.time(), model)
        try:
            _requests.decode(msgspec.json.encode(request))  # the bounds are checked where it is decoded: check them here too
        except msgspec.ValidationError as exc:
            raise ValueError(f"scale request: {exc}") from None
        self._call("post a request", lambda: self._client.rpush(_requests_key(self.keys), msgspec.json.encode(request)))
        return request.request_id

    def take(self) -> ScaleRequest | None:
        """The oldest request (None: none waits); entries that do not decode are dropped and counted."""
        while (raw := self._call("take a request", lambda: self._client.lpop(_requests_key(self.keys)))) is not None:
            try:
                return _requests.decode(raw)
            except msgspec.DecodeError:
                self.undecodable += 1
        return None

    def answer(self, request_id: str, reply: ScaleReply) -> None:
        self._call("answer a request", lambda: self._client.set(_reply_key(self.keys, request_id), msgspec.json.encode(reply), ex=REPLY_TTL_S))

    def reply(self, request_id: str) -> ScaleReply | None:
        """The driver's reply to ``request_id`` (None: not yet)."""
        raw = self._call("read a reply", lambda: self._client.get(_reply_key(self.keys, request_id)))
        return None if raw is None else _replies.decode(raw)
