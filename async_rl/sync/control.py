"""ZeroMQ control channel of weight sync: msgspec/MessagePack messages, no pickle.

Topology: the sender (learner rank 0) binds one ROUTER socket; every inference server
connects one DEALER socket to it and says :class:`Hello` (again every heartbeat, which
also re-registers it with a restarted sender). Sequence of one update, per server::

    sender -> server  Announce(update_id, version, specs, buckets)
    server -> sender  Ready(update_id)                 (or Ready with error)
    sender -> server  Start(update_id, rendezvous, rank_offset, timeout_s)
                      ... buckets flow on the weight group ...
                      (a server on the sender's host instead gets, once the buckets
                      are in shared memory, Start(update_id, handoff=ShmSource(...)); one
                      on the sender's own GPU, Start(update_id, handoff=CudaSource(...)))
    server -> sender  Ack(update_id, version, error, timings, error_kind)
    sender -> server  Abort(update_id, reason)         (instead of/after Start on failure)

A server that stops (a pool scaled down, a run ending) says :class:`Leave` last: the sender
forgets it at once and never waits for it again (an update it was part of goes on without it).

Every send and receive takes a timeout (``poll``) and raises :class:`ControlTimeout`.
Every message is sealed with the run's secret (:mod:`async_rl.sync.auth`); what a socket
receives that is oversized, unauthenticated, stale, replayed or malformed is dropped and
counted (:attr:`SenderChannel.dropped`), and the receive goes on waiting: nothing a peer
sends raises out of a receive. Fields a server sets are bounded in their types.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Annotated, Literal

import msgspec
import zmq
import zmq.asyncio

from async_rl.config import LORA_MAX_RANK
from async_rl.sync.auth import FrameDropped, RunSecret, Sealer, new_connection_id
from async_rl.sync.buckets import Bucket, TensorSpec
from async_rl.sync.group import Rendezvous
from async_rl.sync.cuda_ipc import CudaSource
from async_rl.sync.ipc import ShmSource


log = logging.getLogger(__name__)

MAX_TO_SENDER_BYTES = 64 << 10
"""Longest frame the sender accepts (a server's Hello, Ready or Ack is well under 16 KiB)."""
MAX_TO_SERVER_BYTES = 64 << 20
"""Longest frame a server accepts (an Announce lists every tensor of the model)."""
ZMQ_MAX_FACTOR = 16
"""ZeroMQ itself closes a connection sending a frame over this many times the bound, before
it is buffered whole (those are not counted: only the connection's end is seen)."""
MAX_WORKERS = 4096
"""Most vLLM workers (weight-group ranks) one server may declare."""
MAX_ERROR_CHARS = 4096
"""A server's error text is cut to this before it is sent."""

ServerId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Version = Annotated[int, msgspec.Meta(ge=0)]
ErrorText = Annotated[str, msgspec.Meta(max_length=MAX_ERROR_CHARS)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0)]


class ControlError(RuntimeError):
    """The control channel failed (peer unreachable, bad message)."""


class ControlTimeout(ControlError, TimeoutError):
    """No message could be sent or received within the timeout."""


ErrorKind = Literal["ipc_unavailable"]
"""What the sender must act on in a failed update, as a value (an error's text is for
people): ``ipc_unavailable``: a worker could not open the hand-off it was given
(:class:`~async_rl.sync.ipc.IpcUnavailable`: a container with its own ``/dev/shm``, a
CUDA IPC handle that does not open there), so the server gets its weights one way down
from then on: host shared memory instead of CUDA IPC, the broadcast group instead of
host shared memory."""


class Hello(msgspec.Struct, tag=True, frozen=True):
    """A server registers (at start, then every heartbeat)."""

    server_id: ServerId
    num_workers: Annotated[int, msgspec.Meta(ge=1, le=MAX_WORKERS)]
    """vLLM workers of this engine (TP x PP); each is one rank of the weight group."""
    version: Version | None
    """Weights version the server holds; None before it received any."""
    host: Annotated[str, msgspec.Meta(max_length=256)] = ""
    """The server's :func:`~async_rl.sync.ipc.host_identity` ("": never served over shared memory)."""
    gpu: Annotated[str, msgspec.Meta(max_length=256)] = ""
    """UUID of the GPU all the server's workers run on (:func:`~async_rl.sync.cuda_ipc.gpu_identity`;
    "": none, or more than one): the sender's own GPU makes it a CUDA IPC reader."""


class AdapterSpec(msgspec.Struct, frozen=True):
    """The update is a LoRA adapter, not the model's weights: the tensors are PEFT's
    ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight``
    ``[out, r]``; the served layer computes ``W x + (alpha / r) B A x``."""

    r: Annotated[int, msgspec.Meta(ge=1, le=LORA_MAX_RANK)]
    alpha: Annotated[float, msgspec.Meta(gt=0.0)]
    target_modules: tuple[Annotated[str, msgspec.Meta(min_length=1, max_length=256)], ...]
    """Module names the adapter covers (e.g. ``q_proj``), as PEFT's ``target_modules``."""


class Announce(msgspec.Struct, tag=True, frozen=True):
    """An update is about to start: what tensors, in which byte layout."""

    update_id: int
    version: int
    specs: tuple[TensorSpec, ...]
    buckets: tuple[Bucket, ...]
    adapter: AdapterSpec | None = None
    """Set: the tensors are this LoRA adapter, which replaces the served one (the base
    weights stay); None: they are the model's weights."""


class Ready(msgspec.Struct, tag=True, frozen=True):
    """The server takes part in ``update_id`` (``error`` set: it declines)."""

    update_id: Version
    server_id: ServerId
    error: ErrorText | None = None


class Start(msgspec.Struct, tag=True, frozen=True):
    """Receive the announced buckets: join the weight group (``rendezvous``), or read them
    from the sender's memory (``handoff``: they are all there already): host shared memory
    or, for a server on the sender's GPU, a CUDA IPC buffer."""

    update_id: int
    rendezvous: Rendezvous | None
    rank_offset: int
    """Group rank of this server's worker 0; worker i is ``rank_offset + i``."""
    timeout_s: float
    """Seconds left for the transfer, counted from receipt."""
    handoff: ShmSource | CudaSource | None = None


class Abort(msgspec.Struct, tag=True, frozen=True):
    """The sender gave up ``update_id``: drop staged buckets, keep the old weights."""

    update_id: int
    reason: str


class Ack(msgspec.Struct, tag=True, frozen=True):
    """Outcome of ``update_id`` on one server."""

    update_id: Version
    server_id: ServerId
    version: Version | None
    """Version the server serves now (the new one on success, the old one on failure)."""
    error: ErrorText | None = None
    fatal: bool = False
    """The load itself failed after it had begun: the engine's weights are undefined and
    the server must be restarted (transfer failures are never fatal)."""
    receive_s: Seconds = 0.0
    """Start received -> all buckets staged on every worker, seconds."""
    load_s: Seconds = 0.0
    """Loading the staged buckets into the model, seconds."""
    pause_s: Seconds = 0.0
    """Generation paused (pause -> resume), seconds."""
    error_kind: ErrorKind | None = None
    """The failure's kind where the sender acts on it (None: any other failure, or none)."""


class Leave(msgspec.Struct, tag=True, frozen=True):
    """The server stops: forget it (its pending Ready or Ack will not come)."""

    server_id: ServerId
    reason: ErrorText = ""


class Probe(msgspec.Struct, tag=True, frozen=True):
    """The sender checks that a server's connection is still open (a send to a closed one
    fails at the sender); the server ignores it."""


Message = Hello | Announce | Ready | Start | Abort | Ack | Leave | Probe

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    """A message's body (MessagePack, unsealed: the channels seal it; the receiver
    extension gets Announce and Start this way from its own server)."""
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as e:  # includes a bound of a field broken (ValidationError)
        raise ControlError(f"bad control message: {e}") from e


def clip_error(text: str) -> str:
    """``text`` cut to what a server may send (:data:`MAX_ERROR_CHARS`)."""
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 20] + " [... cut]"


def _ms(timeout_s: float) -> int:
    return max(0, int(timeout_s * 1000))


class _Inbox:
    """What a socket's receives have in common: open sealed frames, count and log the drops."""

    LOG_EVERY_S = 60.0
    """A drop reason is logged at most this often (with the count since), so a flood cannot fill the log."""

    def __init__(self, sealer: Sealer, side: str) -> None:
        self.sealer, self.side = sealer, side
        self.dropped: Counter[str] = Counter()
        """Frames dropped so far, by :data:`~async_rl.sync.auth.DropReason`."""
        self._logged: dict[str, tuple[float, int]] = {}

    def open(self, frames: list[bytes], connection: bytes, source: str) -> Message | None:
        """The message of one multipart ``frames`` received on the server connection
        ``connection`` (None: dropped and counted)."""
        try:
            if len(frames) != 1:
                raise FrameDropped("malformed", f"{len(frames)} frames, not one")
            body = self.sealer.open(frames[0], connection)
            try:
                return decode(body)
            except ControlError as e:
                raise FrameDropped("malformed", str(e)) from None
        except FrameDropped as e:
            self._count(e, source)
            return None

    def _count(self, e: FrameDropped, source: str) -> None:
        self.dropped[e.reason] += 1
        last, count_then = self._logged.get(e.reason, (float("-inf"), 0))
        now = time.monotonic()
        if now - last >= self.LOG_EVERY_S:
            since = self.dropped[e.reason] - count_then
            log.warning("weight sync %s: dropped a control message from %s (%s); %d dropped for this reason since the last warning",
                        self.side, source, e, since)
            self._logged[e.reason] = (now, self.dropped[e.reason])


class SenderChannel:
    """The sender's ROUTER socket (synchronous: the learner is plain torch code)."""

    def __init__(self, secret: RunSecret, host: str = "127.0.0.1", port: int = 0):
        """Bind ``tcp://host:port``; port 0 picks a free port (see :attr:`address`).
        ``host`` must be reachable by the servers (the learner node's address)."""
        self._inbox = _Inbox(Sealer(secret, "to_server", MAX_TO_SENDER_BYTES), "sender")
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        # Raise on a departed peer instead of silently dropping its messages.
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A second connection claiming a server's routing id is refused, not handed the id.
        self._sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, ZMQ_MAX_FACTOR * MAX_TO_SENDER_BYTES)
        self._sock.bind(f"tcp://{host}:{port or '*'}")
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        """Endpoint servers connect to, e.g. ``tcp://127.0.0.1:40123``."""

    @property
    def dropped(self) -> Counter[str]:
        """Received frames dropped so far, by reason (see :mod:`async_rl.sync.auth`)."""
        return self._inbox.dropped

    def send(self, peer: bytes, msg: Message, timeout_s: float) -> None:
        """Send to one server; ``ControlError`` if it is gone, ``ControlTimeout`` if
        its queue stays full for ``timeout_s`` seconds."""
        if not self._sock.poll(_ms(timeout_s), zmq.POLLOUT):
            raise ControlTimeout(f"send of {type(msg).__name__} timed out after {timeout_s} s")
        try:
            self._sock.send_multipart([peer, self._inbox.sealer.seal(encode(msg), peer)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            if e.errno == zmq.EAGAIN:
                raise ControlTimeout(f"send of {type(msg).__name__} would block") from e
            raise ControlError(f"send of {type(msg).__name__} failed: {e}") from e

    def recv(self, timeout_s: float) -> tuple[bytes, Message]:
        """Next accepted ``(peer, message)``; ``ControlTimeout`` after ``timeout_s`` seconds."""
        return self.recv_until(time.monotonic() + timeout_s)

    def recv_until(self, deadline: float) -> tuple[bytes, Message]:
        """:meth:`recv` with an absolute ``time.monotonic()`` deadline."""
        while self._sock.poll(_ms(deadline - time.monotonic()), zmq.POLLIN):
            peer, *frames = self._sock.recv_multipart(zmq.NOBLOCK)
            msg = self._inbox.open(frames, peer, f"peer {peer.hex()}")
            if msg is not None:
                return peer, msg
        raise ControlTimeout("no control message by the deadline")

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


class ServerChannel:
    """A server's DEALER socket (asyncio: the server actor hosts an async engine)."""

    def __init__(self, sender_address: str, secret: RunSecret):
        self._inbox = _Inbox(Sealer(secret, "to_sender", MAX_TO_SERVER_BYTES), "server")
        self.connection = new_connection_id()
        """This socket's routing id: the sender's ROUTER knows the server's connection by it
        (and refuses a second connection that claims it), and every frame is sealed for it."""
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTING_ID, self.connection)
        self._sock.setsockopt(zmq.MAXMSGSIZE, ZMQ_MAX_FACTOR * MAX_TO_SERVER_BYTES)
        self._sock.connect(sender_address)

    @property
    def dropped(self) -> Counter[str]:
        """Received frames dropped so far, by reason."""
        return self._inbox.dropped

    async def send(self, msg: Message, timeout_s: float) -> None:
        """Send to the sender; ``ControlTimeout`` when it cannot be queued in time (a
        DEALER queues while disconnected, so this only fails on a full queue)."""
        if not await self._sock.poll(_ms(timeout_s), zmq.POLLOUT):
            raise ControlTimeout(f"send of {type(msg).__name__} timed out after {timeout_s} s")
        await self._sock.send(self._inbox.sealer.seal(encode(msg), self.connection), zmq.NOBLOCK)

    async def recv(self, timeout_s: float) -> Message:
        """Next accepted message from the sender; ``ControlTimeout`` after ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while await self._sock.poll(_ms(deadline - time.monotonic()), zmq.POLLIN):
            msg = self._inbox.open(await self._sock.recv_multipart(zmq.NOBLOCK), self.connection, "the sender")
            if msg is not None:
                return msg
        raise ControlTimeout(f"no control message within {timeout_s} s")

    def close(self, linger_s: float = 0.0) -> None:
        """Close the socket; messages still queued get ``linger_s`` seconds to be written."""
        self._sock.close(linger=_ms(linger_s))
        self._ctx.term()
