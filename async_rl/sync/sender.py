"""Learner side of weight sync: :class:`WeightSender` (use from learner rank 0 only).

Membership: servers register themselves over the control channel (:class:`Hello`, sent
at start and every heartbeat). Each update first asks every target server whether it
takes part (Announce -> Ready, bounded by ``control_timeout_s``), then builds the weight
group from the servers that answered. The group is kept while the membership stays the
same and every update succeeds (NCCL communicator creation costs seconds at scale), and
rebuilt under a new epoch otherwise: a server that joined, left or failed, or any failed
collective (a group whose collective failed is in an undefined state). A dead server
thus costs one short Ready timeout at most (usually none: ZeroMQ reports the closed
connection), never a stuck broadcast. A server that leaves during an update (its ``Leave``,
or its connection closing: probed every :data:`PROBE_EVERY_S` while acknowledgements are
awaited) is not waited for and no longer counts for the update's outcome.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist

from async_rl.sync.auth import RunSecret
from async_rl.sync.buckets import Bucket, TensorSpec, plan_buckets
from async_rl.sync.control import (
    Abort,
    Ack,
    AdapterSpec,
    Announce,
    ControlError,
    ControlTimeout,
    Hello,
    Leave,
    Message,
    Probe,
    Ready,
    SenderChannel,
    Start,
)
from async_rl.sync.group import (
    GroupError,
    Rendezvous,
    WeightGroup,
    host_store,
    new_key_prefix,
    resolve_backend,
)
from async_rl.sync.cuda_ipc import CudaIpcWriter, CudaSource
from async_rl.sync.ipc import IpcUnavailable, ShmSource, ShmWriter, host_identity, sweep_segments
from async_rl.sync.streaming import stream_buckets

log = logging.getLogger(__name__)

PROBE_EVERY_S = 1.0
"""While acknowledgements are awaited, how often the silent servers' connections are checked,
seconds: one that closed (its process gone) is not waited for until the update's deadline."""
PROBE_SEND_TIMEOUT_S = 0.1
"""Bound of one probe's send, seconds."""

Route = Literal["cuda", "host", "group"]
"""How a server gets an update: the sender's CUDA IPC buffer (a server on its GPU), its host
shared memory (on its machine), or the broadcast group."""
HandOff = Literal["cuda", "host"]
_ROUTE_NAMES: dict[Route, str] = {"cuda": "CUDA IPC", "host": "host shared memory", "group": "the broadcast group"}


@dataclass(frozen=True)
class ServerReport:
    """Outcome of one update on one server (times in seconds)."""

    server_id: str
    ok: bool
    error: str | None = None
    fatal: bool = False
    """The server's weights are undefined (load failed midway): restart it."""
    receive_s: float = 0.0
    load_s: float = 0.0
    pause_s: float = 0.0


@dataclass(frozen=True)
class SendResult:
    """Outcome and timings (seconds) of one :meth:`WeightSender.send`."""

    version: int
    update_id: int
    announce_s: float
    """Announce -> all Ready -> Start sent."""
    group_s: float
    """Rendezvous and group construction (0 when the previous group was reused)."""
    transfer_s: float
    """Consuming the tensors, packing and broadcasting every bucket (incl. ``group_s``)."""
    ack_s: float
    """Waiting for the servers to load and acknowledge."""
    total_s: float
    bytes: int
    """Payload bytes broadcast (sum of bucket sizes)."""
    servers: dict[str, ServerReport]

    @property
    def ok(self) -> bool:
        """At least one target server and all of them updated."""
        return bool(self.servers) and all(r.ok for r in self.servers.values())

    @property
    def failed(self) -> dict[str, str]:
        """``server_id -> error`` of the servers that did not update."""
        return {s: r.error or "failed" for s, r in self.servers.items() if not r.ok}


@dataclass
class _Moved:
    """How far one update's transfer got: the group's creation, seconds, and the bytes streamed."""

    group_s: float = 0.0
    nbytes: int = 0


@dataclass
class _Server:
    peer: bytes
    """ZeroMQ routing id of the server's current connection."""
    num_workers: int
    version: int | None
    host: str = ""
    gpu: str = ""


@dataclass
class PendingSend:
    """An update whose tensors are broadcast and whose acknowledgements may still be coming
    (:meth:`WeightSender.begin`); the servers load the weights meanwhile."""

    version: int
    update_id: int
    t0: float
    """``time.monotonic()`` at the start of the update."""
    announce_s: float
    group_s: float
    transfer_s: float
    nbytes: int
    ack_deadline: float
    """``time.monotonic()`` after which missing acknowledgements count as failures."""
    reports: dict[str, ServerReport]
    """Final outcome of each server known so far."""
    waiting: dict[bytes, str]
    """Servers (ZeroMQ peer -> id) whose acknowledgement has not arrived yet."""
    settled_at: float | None = None
    """``time.monotonic()`` when the last acknowledgement arrived (or the deadline passed)."""
    via: dict[str, HandOff] = field(default_factory=dict)
    """Servers that read this update from the sender's memory, and from which."""

    @property
    def acknowledged(self) -> bool:
        """Every target server answered (or was reported failed)."""
        return not self.waiting


class WeightSender:
    """Broadcasts named tensors to every registered inference server."""

    def __init__(
        self,
        *,
        secret: RunSecret,
        host: str = "127.0.0.1",
        port: int = 0,
        bucket_mb: int = 256,
        backend: Literal["auto", "ipc", "nccl", "gloo"] = "auto",
        timeout_s: float = 300.0,
        control_timeout_s: float = 10.0,
        cuda_ipc: bool = True,
    ):
        """
        Args:
            secret: the run's secret; every control message is sealed with it and
                every received one that is not is dropped (:mod:`async_rl.sync.auth`).
            host: address servers reach this process at (control socket and store).
            port: control socket port (0: any free port; see :attr:`address`).
            bucket_mb: bucket size in MiB; bounds the sender's and each server's extra
                device memory to one bucket (servers stage received buckets on CPU).
            backend: ``auto`` or ``ipc``: servers on this machine read each update from
                shared memory (:mod:`async_rl.sync.ipc`; on this process's own GPU, CUDA IPC:
                :mod:`async_rl.sync.cuda_ipc`), the others get it on a broadcast
                group (NCCL when this process sees a GPU, else gloo); ``nccl`` or ``gloo``:
                that group for every server.
            timeout_s: bound of one update from Announce to the end of the broadcast;
                acknowledgements get ``control_timeout_s`` more (the load).
            control_timeout_s: bound of one control round trip (Ready, a send).
            cuda_ipc: with ``auto`` or ``ipc`` in a process that sees a GPU, servers whose
                workers all run on that GPU read each update from a buffer in its memory
                (:mod:`async_rl.sync.cuda_ipc`); False: host shared memory for them too.
        """
        self.bucket_bytes = bucket_mb * 2**20
        self.backend = resolve_backend("auto" if backend == "ipc" else backend)
        """The broadcast group's backend (servers not served over shared memory)."""
        self._shm = ShmWriter() if backend in ("auto", "ipc") else None
        if self._shm is not None:  # segments of learners killed with their resource tracker
            for line in sweep_segments():
                log.info("weight sync: %s", line)
        self._cuda = CudaIpcWriter(torch.device("cuda", torch.cuda.current_device())) if (
            cuda_ipc and self._shm is not None and torch.cuda.is_available()) else None
        """The device buffer of servers on this process's GPU (it must see one)."""
        self._host = host_identity()
        self._no_shm: set[str] = set()
        """Servers on this host that could not map the shared memory: they get the group."""
        self._no_cuda: set[str] = set()
        """Servers on this GPU that could not open the CUDA IPC buffer: they get shared memory."""
        self.timeout_s = timeout_s
        self.control_timeout_s = control_timeout_s
        self._bind_host = host
        self._channel = SenderChannel(secret, host, port)
        self._store: dist.TCPStore | None = None
        """The weight group's store, from the first update with a server to broadcast to."""
        self._key_prefix = ""
        self._servers: dict[str, _Server] = {}
        self._update_id = 0
        self._epoch = 0
        self._group: WeightGroup | None = None
        self._members: tuple[tuple[str, bytes, int], ...] = ()
        self._pending: PendingSend | None = None

    @property
    def address(self) -> str:
        """Control endpoint the servers connect to, e.g. ``tcp://10.0.0.1:40123``."""
        return self._channel.address

    @property
    def dropped(self) -> dict[str, int]:
        """Control messages dropped so far by reason (oversized, unauthenticated, stale,
        replayed, malformed; see :mod:`async_rl.sync.auth`)."""
        return dict(self._channel.dropped)

    @property
    def servers(self) -> dict[str, int | None]:
        """Registered servers and the weights version each acknowledged last."""
        return {sid: s.version for sid, s in self._servers.items()}

    def poll(self, timeout_s: float = 0.0) -> None:
        """Process control messages that arrived (registrations) for up to ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                peer, msg = self._channel.recv_until(deadline)
            except ControlTimeout:
                return
            self._handle(peer, msg)

    def wait_for_servers(self, n: int, timeout_s: float) -> list[str]:
        """Block until at least ``n`` servers registered; ``ControlTimeout`` otherwise."""
        deadline = time.monotonic() + timeout_s
        while len(self._servers) < n:
            if time.monotonic() >= deadline:
                raise ControlTimeout(f"{len(self._servers)}/{n} servers after {timeout_s} s")
            self.poll(min(0.1, max(0.0, deadline - time.monotonic())))
        return list(self._servers)

    def behind(self, version: int) -> list[str]:
        """Registered servers not holding ``version`` (new, restarted or failed ones):
        send them the current weights before they serve again. Servers still loading an
        update of ``version`` (:meth:`begin` without :meth:`complete`) are not behind."""
        self.poll()
        loading = set(self._pending.waiting.values()) if self._pending is not None and self._pending.version == version else set()
        return [sid for sid, s in self._servers.items() if s.version != version and sid not in loading]

    def send(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        specs: Sequence[TensorSpec],
        servers: Collection[str] | None = None,
        adapter: AdapterSpec | None = None,
    ) -> SendResult:
        """Publish one weights version and wait until the servers have loaded it
        (:meth:`begin` then :meth:`complete`; arguments as for :meth:`begin`)."""
        result = self.complete(self.begin(named_tensors, version, specs=specs, servers=servers, adapter=adapter))
        if result is None:  # complete(wait=True) ends every pending send; None would be a bug here
            raise ControlError(f"weights version {version}: the send ended without an outcome")
        return result

    def begin(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        specs: Sequence[TensorSpec],
        servers: Collection[str] | None = None,
        adapter: AdapterSpec | None = None,
    ) -> PendingSend:
        """Publish one weights version without waiting for the servers to load it.

        Returns once every tensor is broadcast: the caller may then change its tensors
        (e.g. take the next optimizer step) while the servers pause, load and resume.
        Get the outcome with :meth:`complete`; an earlier update still pending is
        completed first (its result is then lost to the caller: complete it yourself).

        Args:
            named_tensors: ``(name, tensor)`` pairs in ``specs`` order, consumed lazily,
                one bucket at a time (a generator gathering FSDP shards layer by layer
                never materializes the whole model). Any device; full (unsharded) values.
            version: version number the servers will report.
            specs: names, dtypes, shapes of ``named_tensors`` (from
                :func:`~async_rl.sync.buckets.tensor_specs`; works on sharded/meta
                tensors, so it costs no gather).
            servers: target server ids (default: all registered).
            adapter: set when ``named_tensors`` are a LoRA adapter (PEFT names) that
                replaces the servers' served adapter; their base weights stay.

        Per-server failures are reported in the result, never raised (a failed server
        keeps serving its previous weights). Raises ``ValueError`` if ``named_tensors``
        does not match ``specs`` (the servers are told to abort first), and re-raises
        whatever the iterable raises.
        """
        if self._pending is not None:
            self.complete(self._pending)
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        self.poll()
        self._update_id += 1
        uid = self._update_id
        wanted = self._servers.keys() if servers is None else servers
        targets = {sid: self._servers[sid] for sid in wanted if sid in self._servers}
        reports = {sid: ServerReport(sid, False, "not registered") for sid in wanted if sid not in self._servers}
        buckets = plan_buckets(specs, self.bucket_bytes)
        announce = Announce(uid, version, tuple(specs), tuple(buckets), adapter)

        ready = self._ready(announce, targets, reports, min(deadline, t0 + self.control_timeout_s))
        if not ready:
            return self._done(version, uid, t0, 0.0, 0.0, 0.0, 0, reports)
        routes, sources = self._hand_offs(ready, buckets)
        local = {sid: s for sid, s in ready.items() if routes[sid] != "group"}
        members = tuple((sid, s.peer, s.num_workers) for sid, s in ready.items() if sid not in local)
        rv = self._rendezvous(members)
        if not self._start_members(uid, rv, members, ready, reports, deadline):
            return self._done(version, uid, t0, time.monotonic() - t0, 0.0, 0.0, 0, reports)
        announce_s = time.monotonic() - t0

        t1 = time.monotonic()
        moved = _Moved()
        try:
            self._transfer(rv, members, named_tensors, specs, buckets, sources, deadline, moved)
        except GroupError as e:
            self._abort(uid, ready, f"sender: {e}")
            for sid in ready:
                reports[sid] = ServerReport(sid, False, f"transfer failed: {e}")
            return self._done(version, uid, t0, announce_s, moved.group_s, time.monotonic() - t1, moved.nbytes, reports)
        except BaseException as e:
            self._abort(uid, ready, f"sender raised {type(e).__name__}: {e}")
            raise
        for sid, s in local.items():  # only now: the buckets are all in the hand-off buffers
            start = Start(uid, None, 0, max(0.0, deadline - time.monotonic()), handoff=sources[routes[sid]])  # type: ignore[index]
            self._send_or_report(s.peer, sid, start, reports)
        transfer_s = time.monotonic() - t1
        group_s, nbytes = moved.group_s, moved.nbytes
        waiting = {s.peer: sid for sid, s in ready.items() if sid not in reports}
        self._pending = PendingSend(version, uid, t0, announce_s, group_s, transfer_s, nbytes,
                                    deadline + self.control_timeout_s, reports, waiting,
                                    via={sid: routes[sid] for sid in local})  # type: ignore[misc]
        return self._pending

    def _transfer(self, rv: Rendezvous, members: tuple[tuple[str, bytes, int], ...], named_tensors: Iterable[tuple[str, torch.Tensor]],
                  specs: Sequence[TensorSpec], buckets: Sequence[Bucket], sources: dict[HandOff, ShmSource | CudaSource], deadline: float,
                  moved: _Moved) -> None:
        """Join the broadcast group when it is new, then stream every bucket to it and into the
        hand-off buffers (``sources``); ``moved`` says how far it got (read after a failure too)."""
        if members and self._group is None and self._store is not None:
            self._group = WeightGroup.join(rv, 0, self._store, deadline - time.monotonic())
            self._members = members
            moved.group_s = self._group.create_s
        writers = [(self._writer(kind), source) for kind, source in sources.items()]
        moved.nbytes = stream_buckets(self._group if members else None, named_tensors, specs, buckets, deadline, writers)
        for writer, _ in writers:
            writer.finish()

    def _rendezvous(self, members: tuple[tuple[str, bytes, int], ...]) -> Rendezvous:
        """Where the broadcast group of ``members`` (server id, peer, workers) meets: the group
        of the last update while its members are the same, else a new epoch (new store keys)."""
        if members and (members != self._members or self._group is None):
            self._drop_group()
            self._epoch += 1
            self._key_prefix = new_key_prefix(self._epoch)
        if members and self._store is None:
            self._store = host_store(self._bind_host, self.timeout_s)
        world = 1 + sum(n for _, _, n in members)
        return Rendezvous(self._bind_host, self._store.port if self._store is not None else 0, self._epoch, world, self.backend,
                          self._key_prefix)

    def _start_members(self, uid: int, rv: Rendezvous, members: tuple[tuple[str, bytes, int], ...], ready: dict[str, _Server],
                       reports: dict[str, ServerReport], deadline: float) -> bool:
        """Send each group member its ranks (:class:`Start`); False when one is unreachable
        (the group cannot form without it: the others are released and reported aborted)."""
        offset = 1
        for sid, peer, n in members:
            start = Start(uid, rv, offset, max(0.0, deadline - time.monotonic()))
            offset += n
            if not self._send_or_report(peer, sid, start, reports):
                self._abort(uid, ready, f"server {sid} unreachable")
                for other in ready.keys() - reports.keys():
                    reports[other] = ServerReport(other, False, f"aborted: server {sid} unreachable")
                return False
        return True

    def complete(self, pending: PendingSend, wait: bool = True) -> SendResult | None:
        """The outcome of ``pending`` once every server acknowledged (or its deadline
        passed: the missing ones count as failed). With ``wait=False``, only the
        acknowledgements already received are read, and None means some are missing."""
        if pending is self._pending:
            if wait:
                self._collect_acks(pending)
            else:
                self.poll()
            if not pending.acknowledged:
                return None
            self._pending = None
            if not all(r.ok for r in pending.reports.values()):
                self._drop_group()
        end = pending.settled_at or time.monotonic()
        done = pending.t0 + pending.announce_s + pending.transfer_s
        return SendResult(pending.version, pending.update_id, pending.announce_s, pending.group_s, pending.transfer_s,
                          max(0.0, end - done), end - pending.t0, pending.nbytes, pending.reports)

    def close(self) -> None:
        """Release the group, the shared memory, the store and the socket."""
        self._drop_group()
        for writer in (self._shm, self._cuda):
            if writer is not None:
                writer.close()
        self._channel.close()

    # -- internals -----------------------------------------------------------------

    def _handle(self, peer: bytes, msg: Message) -> None:
        # Acks of the pending update are recorded; replies to updates that already ended
        # (late Ready/Ack) are dropped here.
        pending = self._pending
        if isinstance(msg, Ack) and pending is not None and msg.update_id == pending.update_id and peer in pending.waiting:
            sid = pending.waiting.pop(peer)
            pending.reports[sid] = ServerReport(sid, msg.error is None, msg.error, msg.fatal, msg.receive_s, msg.load_s, msg.pause_s)
            pending.settled_at = time.monotonic()
            handoff = pending.via.get(sid)
            if handoff is not None and msg.error_kind == "ipc_unavailable":
                (self._no_cuda if handoff == "cuda" else self._no_shm).add(sid)
                log.warning("weight sync: %s cannot open the sender's %s (%s); it gets %s from now on",
                            sid, _ROUTE_NAMES[handoff], msg.error, _ROUTE_NAMES[self._route(sid, self._servers.get(sid))])
            if sid in self._servers:
                self._servers[sid].version = msg.version
        elif isinstance(msg, Hello):
            known = self._servers.get(msg.server_id)
            if known is None or known.peer != peer:
                log.info("weight sync: server %s registered (version %s)", msg.server_id, msg.version)
            if known is not None and known.peer != peer and pending is not None and pending.waiting.get(known.peer) == msg.server_id:
                # A replacement registers: the process the update waits for is gone, its Ack never comes.
                del pending.waiting[known.peer]
                pending.reports[msg.server_id] = ServerReport(msg.server_id, False, "replaced during the update (its process died)")
                pending.settled_at = time.monotonic()
            self._servers[msg.server_id] = _Server(peer, msg.num_workers, msg.version, msg.host, msg.gpu)
        elif isinstance(msg, Leave) and (known := self._servers.get(msg.server_id)) is not None and known.peer == peer:
            del self._servers[msg.server_id]
            log.info("weight sync: server %s left (%s)", msg.server_id, msg.reason or "no reason given")
            if pending is not None and pending.waiting.pop(peer, None) is not None:
                pending.settled_at = time.monotonic()  # the update goes on without it: no Ack to wait for

    def _send_or_report(
        self, peer: bytes, sid: str, msg: Message, reports: dict[str, ServerReport]
    ) -> bool:
        try:
            self._channel.send(peer, msg, self.control_timeout_s)
        except ControlError as e:
            reports[sid] = ServerReport(sid, False, f"unreachable: {e}")
            self._servers.pop(sid, None)  # re-registers with its next Hello if alive
            return False
        return True

    def _ready(
        self,
        announce: Announce,
        targets: dict[str, _Server],
        reports: dict[str, ServerReport],
        deadline: float,
    ) -> dict[str, _Server]:
        """Announce to ``targets``; return those that answered Ready without error."""
        asked = {
            s.peer: sid
            for sid, s in targets.items()
            if self._send_or_report(s.peer, sid, announce, reports)
        }
        ready: dict[str, _Server] = {}
        while asked:
            try:
                peer, msg = self._channel.recv_until(deadline)
            except ControlTimeout:
                break
            if isinstance(msg, Leave) and asked.get(peer) == msg.server_id:
                del asked[peer]  # it stops: no Ready to wait for, and no target any more
                self._handle(peer, msg)
            elif isinstance(msg, Ready) and msg.update_id == announce.update_id and peer in asked:
                sid = asked.pop(peer)
                if msg.error is None:
                    ready[sid] = targets[sid]
                else:
                    reports[sid] = ServerReport(sid, False, f"declined: {msg.error}")
            else:
                self._handle(peer, msg)
        for sid in asked.values():
            reports[sid] = ServerReport(sid, False, "no Ready within the control timeout")
            self._servers.pop(sid, None)
        return ready

    def _collect_acks(self, pending: PendingSend) -> None:
        """Read control messages until ``pending`` is acknowledged or its deadline passes;
        servers still silent then are reported failed and told to abort."""
        probe_at = time.monotonic() + PROBE_EVERY_S
        while pending.waiting and (now := time.monotonic()) < pending.ack_deadline:
            if now >= probe_at:
                self._forget_vanished(pending)
                probe_at = now + PROBE_EVERY_S
                continue
            try:
                peer, msg = self._channel.recv_until(min(pending.ack_deadline, probe_at))
            except ControlTimeout:
                continue
            self._handle(peer, msg)
        silent = dict(pending.waiting)
        if silent:
            pending.settled_at = time.monotonic()
            for kind in {pending.via[sid] for sid in silent.values() if sid in pending.via}:
                self._writer(kind).abandon()  # a silent reader may still be reading it: the next update writes a new one
        pending.waiting.clear()
        for sid in silent.values():
            pending.reports[sid] = ServerReport(sid, False, "no Ack within the timeout")
        if silent:
            self._abort(pending.update_id, {sid: self._servers[sid] for sid in silent.values() if sid in self._servers},
                        "sender: no Ack in time")

    def _forget_vanished(self, pending: PendingSend) -> None:
        """Stop waiting for the servers whose connection closed (a probe to them fails): their
        process stopped or died, and a Leave of theirs did not arrive. They are reported failed
        and unregistered (a replacement registers anew and is caught up)."""
        for peer, sid in list(pending.waiting.items()):
            try:
                self._channel.send(peer, Probe(), PROBE_SEND_TIMEOUT_S)
            except ControlTimeout:
                continue  # its queue is full: it lives, the deadline decides
            except ControlError as e:
                del pending.waiting[peer]
                pending.reports[sid] = ServerReport(sid, False, f"its connection closed during the update ({e})")
                pending.settled_at = time.monotonic()
                if (known := self._servers.get(sid)) is not None and known.peer == peer:
                    del self._servers[sid]
                log.warning("weight sync: %s closed its connection during update %d without acknowledging it; "
                            "not waited for, nor counted for the version's announcement", sid, pending.update_id)

    def _route(self, sid: str, server: _Server | None) -> Route:
        """How ``server`` gets updates now: CUDA IPC when all its workers are on this
        process's GPU, host shared memory when it is on this machine, else the group; a
        way it could not open before is not tried again."""
        if server is None or server.host != self._host:
            return "group"
        if self._cuda is not None and server.gpu and server.gpu == self._cuda.gpu and sid not in self._no_cuda:
            return "cuda"
        return "host" if self._shm is not None and sid not in self._no_shm else "group"

    def _writer(self, kind: HandOff) -> ShmWriter | CudaIpcWriter:
        writer = self._cuda if kind == "cuda" else self._shm
        if writer is None:
            raise RuntimeError(f"no {_ROUTE_NAMES[kind]} writer: a route to it is a bug")
        return writer

    def _hand_offs(
        self, ready: dict[str, _Server], buckets: Sequence[Bucket]
    ) -> tuple[dict[str, Route], dict[HandOff, ShmSource | CudaSource]]:
        """Each ready server's route for this update and the hand-off buffers laid out for
        ``buckets``; a buffer that cannot be made (:class:`IpcUnavailable`) sends its servers
        one way down for this update: CUDA IPC to host shared memory, that to the group."""
        routes: dict[str, Route] = {sid: self._route(sid, s) for sid, s in ready.items()}
        sources: dict[HandOff, ShmSource | CudaSource] = {}
        for kind, lower in (("cuda", "host" if self._shm is not None else "group"), ("host", "group")):
            if kind not in routes.values():
                continue
            try:
                sources[kind] = self._writer(kind).prepare(buckets)  # type: ignore[arg-type]
            except IpcUnavailable as e:
                log.warning("weight sync: %s unusable (%s); this update goes through %s instead",
                            _ROUTE_NAMES[kind], e, _ROUTE_NAMES[lower] if lower == "host" else f"the {self.backend} group")  # type: ignore[index]
                routes = {sid: (lower if r == kind else r) for sid, r in routes.items()}  # type: ignore[misc]
        return routes, sources

    def _abort(self, uid: int, servers: dict[str, _Server], reason: str) -> None:
        """Tell ``servers`` to drop ``uid`` now rather than at their timeout."""
        self._drop_group()
        for sid, s in servers.items():
            try:
                self._channel.send(s.peer, Abort(uid, reason), self.control_timeout_s)
            except ControlError as e:
                log.warning("weight sync: could not send Abort to %s: %s", sid, e)

    def _drop_group(self) -> None:
        if self._group is not None:
            self._group.close()
        self._group = None
        self._members = ()

    @staticmethod
    def _done(
        version: int,
        uid: int,
        t0: float,
        announce_s: float,
        group_s: float,
        transfer_s: float,
        nbytes: int,
        reports: dict[str, ServerReport],
    ) -> PendingSend:
        """An update that ended before any acknowledgement was due (nothing to wait for)."""
        now = time.monotonic()
        return PendingSend(version, uid, t0, announce_s, group_s, transfer_s, nbytes, now, reports, {}, now)
