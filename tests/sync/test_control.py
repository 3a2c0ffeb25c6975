"""Control messages, their authentication, and the sender's handling of unresponsive or vanished servers."""

import errno
import os
import subprocess
import threading
import time

import msgspec
import pytest
import torch
import zmq

from async_rl.sync import ipc
from async_rl.sync.auth import REPLAY_WINDOW_S, FrameDropped, RunSecret, Sealer, SyncEndpoint, new_connection_id
from async_rl.sync.buckets import plan_buckets, tensor_specs
from async_rl.sync.control import (
    MAX_TO_SENDER_BYTES,
    Ack,
    AdapterSpec,
    Announce,
    ControlError,
    ControlTimeout,
    ErrorKind,
    Hello,
    Leave,
    Message,
    Ready,
    Start,
    decode,
    encode,
)
from async_rl.sync.group import Rendezvous
from async_rl.sync.ipc import host_identity
from async_rl.sync.sender import WeightSender

SECRET = RunSecret.generate()


def _sender(**kwargs) -> WeightSender:
    return WeightSender(secret=SECRET, **kwargs)


class RawServer:
    """A server's control socket without an engine: sends and receives sealed messages with
    ``secret`` (another run's secret: an intruder)."""

    def __init__(self, sender: WeightSender, secret: RunSecret = SECRET, clock_ns=time.time_ns):
        self.sealer = Sealer(secret, "to_sender", 1 << 30, clock_ns)
        self.connection = new_connection_id()
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTING_ID, self.connection)
        self.sock.connect(sender.address)

    def send(self, msg: Message) -> bytes:
        frame = self.sealer.seal(encode(msg), self.connection)
        self.sock.send(frame)
        return frame

    def recv(self, timeout_ms: int = 5000) -> Message:
        if not self.sock.poll(timeout_ms):
            raise TimeoutError("no message from the sender")
        return decode(self.sealer.open(self.sock.recv(), self.connection))

    def close(self) -> None:
        self.sock.close()


def test_messages_round_trip_as_msgpack():
    specs = tensor_specs([("w", torch.zeros(2, 3, dtype=torch.bfloat16))])
    msgs = [
        Hello("s0", 2, None),
        Announce(3, 7, tuple(specs), tuple(plan_buckets(specs, 1024))),
        Announce(4, 8, tuple(specs), tuple(plan_buckets(specs, 1024)), AdapterSpec(8, 16.0, ("q_proj", "v_proj"))),
        Start(3, Rendezvous("10.0.0.1", 1234, 5, 3, "nccl", "wsync/5/00ff"), 1, 12.5),
        Ack(3, "s0", 7, None, False, 0.1, 0.2, 0.05),
        Ack(3, "s0", 6, "IpcUnavailable: cannot map", error_kind="ipc_unavailable"),
    ]
    for m in msgs:
        assert decode(encode(m)) == m
    assert b"\x80\x04" not in encode(msgs[1])  # MessagePack, never a pickle


@pytest.mark.parametrize("bad", [{"r": 0}, {"r": 513}, {"alpha": 0.0}, {"target_modules": ("",)}])
def test_an_adapter_spec_out_of_bounds_is_refused_at_decoding(bad: dict):
    fields = {"r": 8, "alpha": 16.0, "target_modules": ("q_proj",)} | bad
    specs = tensor_specs([("w", torch.zeros(2))])
    frame = msgspec.msgpack.encode(Announce(1, 1, tuple(specs), tuple(plan_buckets(specs, 1024)), AdapterSpec(**fields)))
    with pytest.raises(ControlError, match="bad control message"):
        decode(frame)


def _registered(sender: WeightSender) -> RawServer:
    """A server that registers and then never answers (hung process)."""
    server = RawServer(sender)
    server.send(Hello("mute", 1, None))
    sender.wait_for_servers(1, timeout_s=5.0)
    return server


def test_unresponsive_server_is_reported_within_the_control_timeout():
    sender = _sender(backend="gloo", timeout_s=30.0, control_timeout_s=0.5)
    server = _registered(sender)
    assert sender.behind(1) == ["mute"]
    named = [("w", torch.ones(4))]
    t0 = time.monotonic()
    result = sender.send(iter(named), 1, specs=tensor_specs(named))
    assert time.monotonic() - t0 < 3.0
    assert not result.ok and "no Ready" in result.failed["mute"]
    assert sender.servers == {}  # dropped until its next Hello
    assert isinstance(server.recv(0), Announce)
    server.close()
    sender.close()


def test_wait_for_servers_times_out():
    sender = _sender(backend="gloo", timeout_s=5.0)
    with pytest.raises(ControlTimeout):
        sender.wait_for_servers(1, timeout_s=0.3)
    sender.close()


class ShmServer:
    """A server on the sender's host that answers every Announce with Ready and every
    hand-off Start with a failed Ack (``error``, ``error_kind``), or none when ``ack`` is
    False (a reader that stays silent); it never joins a broadcast group. Records each
    Start it received."""

    def __init__(self, sender: WeightSender, error: str, error_kind: ErrorKind | None, hello: Hello | None = None,
                 ack: bool = True):
        self.starts: list[Start] = []
        self._error, self._kind, self._ack = error, error_kind, ack
        self._peer = RawServer(sender)
        self._hello = hello or Hello("local", 1, None, host_identity())
        self._peer.send(self._hello)
        known = len(sender.servers)
        sender.wait_for_servers(known + (self._hello.server_id not in sender.servers), timeout_s=5.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                msg = self._peer.recv(50)
            except TimeoutError:
                continue
            if isinstance(msg, Announce):
                self._peer.send(Ready(msg.update_id, self._hello.server_id))
            elif isinstance(msg, Start):
                self.starts.append(msg)
                if msg.handoff is not None and self._ack:
                    self._peer.send(Ack(msg.update_id, self._hello.server_id, None, self._error, error_kind=self._kind))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._peer.close()


@pytest.mark.dist
@pytest.mark.parametrize(
    ("kind", "then_group"),
    [("ipc_unavailable", True), (None, False)],
    ids=["ipc-unavailable-kind", "other-failure-naming-IpcUnavailable"],
)
def test_a_server_is_moved_to_the_group_by_the_acks_error_kind_not_its_text(kind: ErrorKind | None, then_group: bool):
    """The Ack's typed ``error_kind`` decides whether a same-host server gets the group from
    then on; an error text that merely names ``IpcUnavailable`` does not."""
    sender = _sender(backend="ipc", timeout_s=1.0, control_timeout_s=1.0)
    server = ShmServer(sender, "IpcUnavailable: cannot map shared memory", kind)
    named = [("w", torch.ones(4))]
    try:
        first = sender.send(iter(named), 1, specs=tensor_specs(named))
        assert not first.ok and "IpcUnavailable" in first.failed["local"]
        sender.send(iter(named), 1, specs=tensor_specs(named))  # over the group it times out: the fake never joins
        assert server.starts[0].handoff is not None
        assert (server.starts[1].handoff is None and server.starts[1].rendezvous is not None) == then_group
    finally:
        server.close()
        sender.close()


@pytest.mark.dist
def test_shared_memory_that_cannot_be_reserved_sends_the_update_over_the_group(monkeypatch):
    """``/dev/shm`` filling up after the free-space check (posix_fallocate: ENOSPC) costs the
    learner nothing: a same-host server gets that update over the group."""
    def no_space(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ipc.os, "posix_fallocate", no_space)
    sender = _sender(backend="ipc", timeout_s=1.0, control_timeout_s=1.0)
    server = ShmServer(sender, "unused", None)
    named = [("w", torch.ones(4))]
    try:
        sender.send(iter(named), 1, specs=tensor_specs(named))  # over the group it times out: the fake never joins
        assert server.starts[0].handoff is None and server.starts[0].rendezvous is not None
    finally:
        server.close()
        sender.close()


@pytest.mark.parametrize(("backend", "swept"), [("ipc", True), ("gloo", False)])
def test_a_sender_using_shared_memory_sweeps_dead_owners_segments_at_start(monkeypatch, tmp_path, backend: str, swept: bool):
    monkeypatch.setattr(ipc, "SHM_DIR", str(tmp_path))
    proc = subprocess.Popen(["true"])
    proc.wait()
    segment = tmp_path / f"{ipc.SHM_PREFIX}{proc.pid}-{ipc._pid_namespace()}-{'a' * 16}"
    segment.write_bytes(b"left by a killed learner")
    _sender(backend=backend, timeout_s=5.0).close()  # type: ignore[arg-type]
    assert segment.exists() != swept


def test_a_replacement_registering_ends_the_wait_for_the_dead_servers_ack():
    """A server that took an update and died before acknowledging it (its process killed) is
    reported failed as soon as its replacement registers, not after the update's timeout."""
    sender = _sender(backend="ipc", timeout_s=60.0, control_timeout_s=1.0)
    dead = RawServer(sender)
    dead.send(Hello("s0", 1, None, host_identity()))
    sender.wait_for_servers(1, timeout_s=5.0)
    named = [("w", torch.ones(4))]
    ready = threading.Thread(target=lambda: dead.send(Ready(dead.recv().update_id, "s0")), daemon=True)
    ready.start()
    pending = sender.begin(iter(named), 1, specs=tensor_specs(named))  # Ready, then Start over shared memory
    ready.join(5)
    assert isinstance(dead.recv(), Start) and not pending.acknowledged
    dead.close()  # it dies without an Ack
    replacement = RawServer(sender)
    replacement.send(Hello("s0", 1, None, host_identity()))
    t0 = time.monotonic()
    result = sender.complete(pending)
    assert time.monotonic() - t0 < 5.0
    assert not result.ok and "replaced during the update" in result.failed["s0"]
    assert sender.behind(1) == ["s0"]  # the replacement is registered and gets the next catch-up
    replacement.close()
    sender.close()


_REGISTRATION = {"wsync_worker_index": 0, "wsync_gpu": ""}
"""What a one-worker CPU engine's workers answer when its server registers."""


class _DeadEngine:
    """A vLLM engine whose process is gone: vLLM's ``errored`` flag is set (every call would
    raise ``EngineDeadError``; none is made here but the worker count at registration)."""

    errored = True

    async def collective_rpc(self, method, timeout=None, args=()):
        return [_REGISTRATION[method]]


class _UnansweringEngine:
    """A live vLLM engine whose workers cannot run the update's check."""

    errored = False

    async def collective_rpc(self, method, timeout=None, args=()):
        if method == "wsync_check":
            raise RuntimeError("the engine core is gone")
        return [_REGISTRATION[method]]


@pytest.mark.parametrize("engine, why", [
    (_DeadEngine, "the vLLM engine is dead"),
    (_UnansweringEngine, "the vLLM engine did not check the update: RuntimeError: the engine core is gone"),
], ids=["dead", "unanswering"])
def test_a_server_whose_engine_cannot_take_an_update_declines_it_at_once_and_serves_on(engine, why: str):
    """Declined at Ready: the sender leaves it out at once, and the server's loop ends the
    update with an outcome (not fatal, the old version kept) instead of raising."""
    import asyncio

    from async_rl.sync.server import WeightUpdateServer

    sender = _sender(backend="gloo", timeout_s=60.0, control_timeout_s=5.0)

    async def go():
        server = WeightUpdateServer(engine(), SyncEndpoint(sender.address, SECRET), "s0", version=0)
        await server.start()
        await asyncio.to_thread(sender.wait_for_servers, 1, 5.0)
        serving = asyncio.ensure_future(server.serve_one(10.0))
        named = [("w", torch.ones(4))]
        t0 = time.monotonic()
        result = await asyncio.to_thread(sender.send, iter(named), 1, specs=tensor_specs(named))
        outcome = await serving
        server.close()
        return result, outcome, time.monotonic() - t0

    result, outcome, took = asyncio.run(go())
    assert took < 3.0 and not result.ok and f"declined: {why}" in result.failed["s0"]
    assert outcome is not None and not outcome.ok and not outcome.fatal and outcome.version == 0
    sender.close()


def test_what_is_not_this_runs_sealed_message_is_dropped_and_counted_never_raised():
    """Garbage, another secret's Hello, an oversized frame, a copy of a real Hello sent from
    another connection and from its own, one from a connection claiming the real one's id
    (refused by ZeroMQ, uncounted), a stale one, a multipart one and an authenticated Hello with an
    unbounded field: each is dropped and counted under its reason; the real server stays
    registered at its own connection and takes the update."""
    sender = _sender(backend="ipc", timeout_s=10.0, control_timeout_s=2.0)
    real, intruder = RawServer(sender), RawServer(sender, RunSecret.generate())
    late = RawServer(sender, clock_ns=lambda: time.time_ns() - int(2 * REPLAY_WINDOW_S * 1e9))
    impostor = zmq.Context.instance().socket(zmq.DEALER)  # claims the real connection's id: refused by the ROUTER
    impostor.setsockopt(zmq.LINGER, 0)
    impostor.setsockopt(zmq.ROUTING_ID, real.connection)
    try:
        captured = real.send(Hello("server-0", 1, 0, host_identity()))
        sender.wait_for_servers(1, timeout_s=5.0)
        intruder.sock.send(b"\x00garbage")
        intruder.send(Hello("server-0", 1, 0, host_identity()))
        intruder.sock.send(b"x" * (MAX_TO_SENDER_BYTES + 1))
        intruder.sock.send(captured)  # a replay from another connection: sealed for the real one's
        real.sock.send(captured)  # a replay on the real connection: seen already
        impostor.connect(sender.address)
        impostor.send(captured)
        late.send(Hello("server-0", 1, 0, host_identity()))
        intruder.sock.send_multipart([captured, captured])
        real.send(Hello("server-0", 10**9, 0, host_identity()))  # more workers than a server can have
        sender.poll(1.0)
        assert sender.dropped == {"unauthenticated": 2, "oversized": 1, "replayed": 2, "stale": 1, "malformed": 2}
        assert sender.servers == {"server-0": 0}
        named = [("w", torch.ones(4))]
        answer = threading.Thread(target=lambda: real.send(Ready(real.recv().update_id, "server-0")), daemon=True)
        answer.start()
        pending = sender.begin(iter(named), 1, specs=tensor_specs(named))
        answer.join(5)
        start = real.recv()  # the real server's connection got the update, nobody else's
        assert isinstance(start, Start) and start.handoff is not None and not pending.acknowledged
        with pytest.raises(TimeoutError):
            intruder.recv(100)
    finally:
        for peer in (real, intruder, late):
            peer.close()
        impostor.close()
        sender.close()


def test_a_frame_is_bound_to_its_direction_and_secret():
    """A message the sender sealed cannot be reflected back to it; another run's frames and
    a flipped bit do not open."""
    to_server = Sealer(SECRET, "to_server", 1 << 20)
    at_server = Sealer(SECRET, "to_sender", 1 << 20)
    connection, other = new_connection_id(), new_connection_id()
    frame = to_server.seal(b"body", connection)
    assert at_server.open(frame, connection) == b"body"
    with pytest.raises(FrameDropped, match="unauthenticated"):
        Sealer(SECRET, "to_server", 1 << 20).open(frame, connection)  # reflected back to the sender
    for bad in (Sealer(RunSecret.generate(), "to_server", 1 << 20).seal(b"body", connection), frame[:-1] + b"x"):
        with pytest.raises(FrameDropped, match="unauthenticated"):
            at_server.open(bad, connection)
    with pytest.raises(FrameDropped, match="replayed: a copy of a frame sealed for another connection"):
        at_server.open(to_server.seal(b"body", other), connection)
    assert repr(SECRET) == "RunSecret()"
    with pytest.raises(ValueError, match="at least 32 bytes"):
        RunSecret(b"short")


@pytest.mark.parametrize("leaves_after", ["announce", "start"])
def test_a_server_that_leaves_is_forgotten_and_never_waited_for(leaves_after: str):
    """A server that says Leave (a pool scaled down) instead of its Ready or its Ack: the
    update ends at once without it, not at a timeout, and it is no longer registered."""
    sender = _sender(backend="ipc", timeout_s=60.0, control_timeout_s=30.0)
    server = RawServer(sender)
    server.send(Hello("server-1", 1, 0, host_identity()))
    sender.wait_for_servers(1, timeout_s=5.0)

    def serve() -> None:
        announce = server.recv()
        if leaves_after == "start":
            server.send(Ready(announce.update_id, "server-1"))
            server.recv()
        server.send(Leave("server-1", "scaled down"))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    named = [("w", torch.ones(4))]
    t0 = time.monotonic()
    try:
        result = sender.send(iter(named), 1, specs=tensor_specs(named))
        thread.join(5)
        assert time.monotonic() - t0 < 5.0 and result.servers == {} and sender.servers == {}
        assert sender.behind(1) == []
    finally:
        server.close()
        sender.close()


def test_a_server_whose_connection_closes_during_an_update_is_not_waited_for():
    """A server that took an update and stopped without its Leave arriving (killed, or its Leave
    lost with the socket): the sender sees the closed connection within a probe period and ends
    the wait, not at the update's deadline (300 s by default: the stall of a scale-down racing an
    update); the server is no longer registered, so it counts for no version's announcement."""
    sender = _sender(backend="ipc", control_timeout_s=10.0)  # the default timeout_s
    stays, goes = ShmServer(sender, None, None, Hello("server-0", 1, 0, host_identity())), RawServer(sender)  # type: ignore[arg-type]
    goes.send(Hello("server-1", 1, 0, host_identity()))
    sender.wait_for_servers(2, timeout_s=5.0)
    named = [("w", torch.ones(4))]
    ready = threading.Thread(target=lambda: goes.send(Ready(goes.recv().update_id, "server-1")), daemon=True)
    ready.start()
    try:
        pending = sender.begin(iter(named), 1, specs=tensor_specs(named))
        ready.join(5)
        assert isinstance(goes.recv(), Start) and not pending.acknowledged
        goes.close()  # gone without a word
        t0 = time.monotonic()
        result = sender.complete(pending)
        assert time.monotonic() - t0 < 5.0
        assert result.servers["server-0"].ok and "connection closed" in result.failed["server-1"]
        assert list(sender.servers) == ["server-0"]
    finally:
        stays.close()
        sender.close()
