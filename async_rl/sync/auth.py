"""Authentication of the weight-sync control channel: the run's secret and sealed frames.

The driver makes one :class:`RunSecret` per run and hands it to the learner's rank 0 and to
every inference server as a Ray actor argument (never a command line, an environment
variable or a log line: its ``repr`` hides it). Every control message travels sealed::

    frame = mac (32 B) | connection (16 B) | time_ns (8 B, big-endian) | nonce (8 B) | body (MessagePack)
    mac   = HMAC-SHA256(secret, direction | connection | time_ns | nonce | body)

``direction`` tells the two ways apart (a server's message cannot be reflected back to a
server as the sender's). ``connection`` is the ZeroMQ routing id of the server's connection
(:func:`new_connection_id`, random per server process): a frame is valid only on the
connection it was sealed for, so a copy sent from another connection is dropped even before
the original was read (the sender's ROUTER reads its connections in turn), and the ROUTER
refuses a second connection claiming a routing id in use. A receiver keeps a frame only when
it is at most ``max_bytes`` long, its MAC verifies, it was sealed for the connection it came
on, its time is within :data:`REPLAY_WINDOW_S` of the receiver's clock and the same frame
was not seen in that window; anything else is dropped and counted under one
:data:`DropReason` (:class:`FrameDropped`), never raised to the caller.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import secrets
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

SECRET_BYTES = 32
"""Length of a generated secret (256 bits); shorter secrets are refused."""
REPLAY_WINDOW_S = 120.0
"""A frame stamped further than this from the receiver's clock is dropped as ``stale``;
frames inside it are remembered so a copy is dropped as ``replayed``. It bounds the clock
difference between the learner's node and the servers' nodes (NTP keeps it in milliseconds)."""

_MAC = hashlib.sha256().digest_size
CONNECTION_ID_BYTES = 16
_STAMP = struct.Struct("!Q8s")
HEADER_BYTES = _MAC + CONNECTION_ID_BYTES + _STAMP.size
"""Bytes a sealed frame adds to its body."""

Direction = Literal["to_sender", "to_server"]
DropReason = Literal["oversized", "unauthenticated", "stale", "replayed", "malformed"]
DROP_REASONS: tuple[DropReason, ...] = ("oversized", "unauthenticated", "stale", "replayed", "malformed")
"""Why a control frame was dropped: longer than the receiver's bound; no valid MAC (garbage,
a forged or a truncated frame, another run's secret); stamped outside the replay window; a
copy of a frame already received, or of one sealed for another connection; authenticated but
not a message this version understands (or a multipart frame)."""


def new_connection_id() -> bytes:
    """A server connection's ZeroMQ routing id: 16 random bytes, the first never zero (ZeroMQ
    reserves ids that start with a zero byte for the ones it makes up)."""
    raw = secrets.token_bytes(CONNECTION_ID_BYTES)
    return bytes([raw[0] | 0x80]) + raw[1:]


@dataclass(frozen=True)
class RunSecret:
    """The run's control secret: 32 random bytes from :meth:`generate` (hidden from ``repr``)."""

    key: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.key, bytes) or len(self.key) < SECRET_BYTES:
            raise ValueError(f"a run secret must be at least {SECRET_BYTES} bytes")

    @classmethod
    def generate(cls) -> RunSecret:
        return cls(secrets.token_bytes(SECRET_BYTES))


@dataclass(frozen=True)
class SyncEndpoint:
    """Where a server finds the weight sender, and the secret its control messages carry."""

    address: str
    """The sender's ZeroMQ endpoint, e.g. ``tcp://127.0.0.1:40123``."""
    secret: RunSecret


class FrameDropped(Exception):
    """A received control frame was not accepted (``reason``: one of :data:`DROP_REASONS`)."""

    def __init__(self, reason: DropReason, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason: DropReason = reason


class Sealer:
    """Seals the frames one side sends and opens those it receives (one per socket)."""

    def __init__(self, secret: RunSecret, sends: Direction, max_bytes: int,
                 clock_ns: Callable[[], int] = time.time_ns) -> None:
        """``sends``: the direction of this side's frames (it receives the other one);
        ``max_bytes``: the longest frame it accepts; ``clock_ns``: wall clock (tests)."""
        self._key = secret.key
        self._out = sends.encode()
        self._in = ("to_server" if sends == "to_sender" else "to_sender").encode()
        self.max_bytes = max_bytes
        self._clock_ns = clock_ns
        self._window_ns = int(REPLAY_WINDOW_S * 1e9)
        self._seen: dict[bytes, int] = {}
        """MAC -> when it may be forgotten (ns): the authenticated frames of the window."""
        self._expiry: collections.deque[tuple[int, bytes]] = collections.deque()

    def _mac(self, direction: bytes, stamp: bytes, body: bytes) -> bytes:
        return hmac.new(self._key, direction + stamp + body, hashlib.sha256).digest()

    def seal(self, body: bytes, connection: bytes) -> bytes:
        """``body`` sealed for the server connection ``connection`` (its routing id)."""
        if len(connection) != CONNECTION_ID_BYTES:
            raise ValueError(f"a connection id is {CONNECTION_ID_BYTES} bytes, not {len(connection)}")
        stamp = connection + _STAMP.pack(self._clock_ns(), secrets.token_bytes(8))
        return self._mac(self._out, stamp, body) + stamp + body

    def open(self, frame: bytes, connection: bytes) -> bytes:
        """The body of ``frame``, received on the server connection ``connection``, if it is
        accepted; :class:`FrameDropped` otherwise."""
        if len(frame) > self.max_bytes:
            raise FrameDropped("oversized", f"{len(frame)} bytes, more than {self.max_bytes}")
        if len(frame) < HEADER_BYTES:
            raise FrameDropped("unauthenticated", f"{len(frame)} bytes, shorter than a sealed frame")
        mac, stamp, body = frame[:_MAC], frame[_MAC:HEADER_BYTES], frame[HEADER_BYTES:]
        if not hmac.compare_digest(mac, self._mac(self._in, stamp, body)):
            raise FrameDropped("unauthenticated", "its MAC does not verify with this run's secret")
        if not hmac.compare_digest(stamp[:CONNECTION_ID_BYTES], connection):
            raise FrameDropped("replayed", "a copy of a frame sealed for another connection")
        stamp = stamp[CONNECTION_ID_BYTES:]
        now = self._clock_ns()
        sent_ns = _STAMP.unpack(stamp)[0]
        if abs(now - sent_ns) > self._window_ns:
            raise FrameDropped("stale", f"stamped {(now - sent_ns) / 1e9:+.0f} s from now (clocks of the nodes apart?)")
        while self._expiry and self._expiry[0][0] < now:
            self._seen.pop(self._expiry.popleft()[1], None)
        if mac in self._seen:
            raise FrameDropped("replayed", "a copy of a frame already received")
        forget = now + 2 * self._window_ns  # a copy is fresh until sent + window <= now + 2 windows
        self._seen[mac] = forget
        self._expiry.append((forget, mac))
        return body
