"""ZeroMQ control channel of weight sync: msgspec/MessagePack messages, no pickle.

Topology: the sender (learner rank 0) binds one ROUTER socket; every inference server
connects one DEALER socket to it and says :class:`Hello` (again every heartbeat, which
also re-registers it with a restarted sender). Sequence of one update, per server::

    sender -> server  Announce(update_id, version, specs, buckets)
    server -> sender  Ready(update_id)                 (or Ready with error)
    sender -> server  Start(update_id, rendezvous, rank_offset, timeout_s)
                      ... buckets flow on the weight group ...
                      (a server on the sender's host instead gets, once the buckets
                      are in shared memory, Start(update_id, shm=ShmSource(...)))
    server -> sender  Ack(update_id, version, error, timings, error_kind)
    sender -> server  Abort(update_id, reason)         (instead of/after Start on failure)

Every send and receive takes a timeout (``poll``) and raises :class:`ControlTimeout`.
"""

from __future__ import annotations

import time
from typing import Literal

import msgspec
import zmq
import zmq.asyncio

from async_rl.sync.buckets import Bucket, TensorSpec
from async_rl.sync.group import Rendezvous
from async_rl.sync.ipc import ShmSource


class ControlError(RuntimeError):
    """The control channel failed (peer unreachable, bad message)."""


class ControlTimeout(ControlError, TimeoutError):
    """No message could be sent or received within the timeout."""


ErrorKind = Literal["ipc_unavailable"]
"""What the sender must act on in a failed update, as a value (an error's text is for
people): ``ipc_unavailable``: a worker could not map the sender's shared memory
(:class:`~async_rl.sync.ipc.IpcUnavailable`, e.g. a container with its own ``/dev/shm``),
so the server gets its weights over the broadcast group from then on."""


class Hello(msgspec.Struct, tag=True, frozen=True):
    """A server registers (at start, then every heartbeat)."""

    server_id: str
    num_workers: int
    """vLLM workers of this engine (TP x PP); each is one rank of the weight group."""
    version: int | None
    """Weights version the server holds; None before it received any."""
    host: str = ""
    """The server's :func:`~async_rl.sync.ipc.host_identity` ("": never served over shared memory)."""


class Announce(msgspec.Struct, tag=True, frozen=True):
    """An update is about to start: what tensors, in which byte layout."""

    update_id: int
    version: int
    specs: tuple[TensorSpec, ...]
    buckets: tuple[Bucket, ...]


class Ready(msgspec.Struct, tag=True, frozen=True):
    """The server takes part in ``update_id`` (``error`` set: it declines)."""

    update_id: int
    server_id: str
    error: str | None = None


class Start(msgspec.Struct, tag=True, frozen=True):
    """Receive the announced buckets: join the weight group (``rendezvous``), or map them
    from the sender's shared memory (``shm``: they are all there already)."""

    update_id: int
    rendezvous: Rendezvous | None
    rank_offset: int
    """Group rank of this server's worker 0; worker i is ``rank_offset + i``."""
    timeout_s: float
    """Seconds left for the transfer, counted from receipt."""
    shm: ShmSource | None = None


class Abort(msgspec.Struct, tag=True, frozen=True):
    """The sender gave up ``update_id``: drop staged buckets, keep the old weights."""

    update_id: int
    reason: str


class Ack(msgspec.Struct, tag=True, frozen=True):
    """Outcome of ``update_id`` on one server."""

    update_id: int
    server_id: str
    version: int | None
    """Version the server serves now (the new one on success, the old one on failure)."""
    error: str | None = None
    fatal: bool = False
    """The load itself failed after it had begun: the engine's weights are undefined and
    the server must be restarted (transfer failures are never fatal)."""
    receive_s: float = 0.0
    """Start received -> all buckets staged on every worker, seconds."""
    load_s: float = 0.0
    """Loading the staged buckets into the model, seconds."""
    pause_s: float = 0.0
    """Generation paused (pause -> resume), seconds."""
    error_kind: ErrorKind | None = None
    """The failure's kind where the sender acts on it (None: any other failure, or none)."""


Message = Hello | Announce | Ready | Start | Abort | Ack

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as e:
        raise ControlError(f"bad control message: {e}") from e


def _ms(timeout_s: float) -> int:
    return max(0, int(timeout_s * 1000))


class SenderChannel:
    """The sender's ROUTER socket (synchronous: the learner is plain torch code)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        """Bind ``tcp://host:port``; port 0 picks a free port (see :attr:`address`).
        ``host`` must be reachable by the servers (the learner node's address)."""
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        # Raise on a departed peer instead of silently dropping its messages.
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"tcp://{host}:{port or '*'}")
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        """Endpoint servers connect to, e.g. ``tcp://127.0.0.1:40123``."""

    def send(self, peer: bytes, msg: Message, timeout_s: float) -> None:
        """Send to one server; ``ControlError`` if it is gone, ``ControlTimeout`` if
        its queue stays full for ``timeout_s`` seconds."""
        if not self._sock.poll(_ms(timeout_s), zmq.POLLOUT):
            raise ControlTimeout(f"send of {type(msg).__name__} timed out after {timeout_s} s")
        try:
            self._sock.send_multipart([peer, encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            if e.errno == zmq.EAGAIN:
                raise ControlTimeout(f"send of {type(msg).__name__} would block") from e
            raise ControlError(f"send of {type(msg).__name__} failed: {e}") from e

    def recv(self, timeout_s: float) -> tuple[bytes, Message]:
        """Next ``(peer, message)``; ``ControlTimeout`` after ``timeout_s`` seconds."""
        if not self._sock.poll(_ms(timeout_s), zmq.POLLIN):
            raise ControlTimeout(f"no control message within {timeout_s} s")
        peer, data = self._sock.recv_multipart(zmq.NOBLOCK)
        return peer, decode(data)

    def recv_until(self, deadline: float) -> tuple[bytes, Message]:
        """:meth:`recv` with an absolute ``time.monotonic()`` deadline."""
        return self.recv(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


class ServerChannel:
    """A server's DEALER socket (asyncio: the server actor hosts an async engine)."""

    def __init__(self, sender_address: str):
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(sender_address)

    async def send(self, msg: Message, timeout_s: float) -> None:
        """Send to the sender; ``ControlTimeout`` when it cannot be queued in time (a
        DEALER queues while disconnected, so this only fails on a full queue)."""
        if not await self._sock.poll(_ms(timeout_s), zmq.POLLOUT):
            raise ControlTimeout(f"send of {type(msg).__name__} timed out after {timeout_s} s")
        await self._sock.send(encode(msg), zmq.NOBLOCK)

    async def recv(self, timeout_s: float) -> Message:
        """Next message from the sender; ``ControlTimeout`` after ``timeout_s`` seconds."""
        if not await self._sock.poll(_ms(timeout_s), zmq.POLLIN):
            raise ControlTimeout(f"no control message within {timeout_s} s")
        return decode(await self._sock.recv(zmq.NOBLOCK))

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
