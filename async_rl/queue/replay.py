"""The replay queue: rollout groups on a Redis stream, read by the ``learner`` group.

Entry lifecycle: ``put`` appends (XADD) -> *waiting*; ``get`` hands it to exactly one
consumer (XREADGROUP) -> *pending* on that consumer; ``commit`` acknowledges and deletes
it (XACK + XDEL). So the stream holds only unacknowledged entries, and

    depth = waiting entries = XLEN - pending.

Back-pressure blocks producers on *depth*, not on unacknowledged entries: the learner
keeps what it read pending until its checkpoint is durable, and counting those would
deadlock a learner that checkpoints less often than every ``max_depth`` groups.

Every write that a lost reply may make a caller retry applies once: the put checks its
producer's sequence number, every other write is a :class:`~async_rl.queue.client.OnceScript`
called with one call id for all its retries.
"""

from __future__ import annotations

import itertools
import os
import secrets
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar, cast

import msgspec
import redis

from async_rl.config import redact_url
from async_rl.queue.admission import AdmissionLedger, Reconciled, Ticket
from async_rl.queue.client import OnceScript, attempts, connect, retrying
from async_rl.queue.keys import (
    CONSUMER_GROUP,
    FAILURE_FIELD,
    FAILURES_MAXLEN,
    PAYLOAD_FIELD,
    RunKeys,
)
from async_rl.records import (
    FailureReport,
    RecordDecodeError,
    RolloutGroup,
    decode,
    encode,
)

_FAILURE_DECODER = msgspec.msgpack.Decoder(FailureReport)

__all__ = ["Check", "Drop", "ReplayQueue", "ScreenReport", "Staleness", "TicketEndedError"]

T = TypeVar("T")
Entry = tuple[str, RolloutGroup]
RawEntry = tuple[bytes, dict[bytes, bytes]]  # (entry id, fields) as redis-py returns them
StreamReply = list[tuple[bytes, list[RawEntry]]]  # XREADGROUP: [(stream, entries)]

# Check depth and append in one script, so racing producers cannot overshoot max_depth;
# the append ends the group's ticket (KEYS[3] = inflight, ARGV[7] = its prompt index,
# ARGV[8] = its claim; '' for a put outside admission) and hands its admission slot to the
# entry (KEYS[4] = slotted).
# KEYS[2] remembers this producer's last put as "<seq> <entry id>": a put retried after
# its reply was lost (same seq) returns the first entry id instead of appending twice.
_PUT_LUA = """
local last = redis.call('GET', KEYS[2])
if last then
  local sep = string.find(last, ' ', 1, true)
  if string.sub(last, 1, sep - 1) == ARGV[5] then
    return string.sub(last, sep + 1)
  end
end
if ARGV[7] ~= '' and redis.call('HGET', KEYS[3], ARGV[7]) ~= ARGV[8] then
  return redis.error_reply('TICKET_ENDED')
end
local pending = redis.call('XPENDING', KEYS[1], ARGV[2])[1]
if redis.call('XLEN', KEYS[1]) - pending >= tonumber(ARGV[1]) then
  return false
end
local id = redis.call('XADD', KEYS[1], '*', ARGV[3], ARGV[4])
if ARGV[7] ~= '' then
  redis.call('HDEL', KEYS[3], ARGV[7])
  redis.call('SADD', KEYS[4], id)
end
redis.call('SET', KEYS[2], ARGV[5] .. ' ' .. id, 'EX', ARGV[6])
return id
"""

# KEYS: rollouts, slotted. ARGV: consumer group, entry ids. Acknowledge and delete (a trained
# group keeps its admission slot: groups_started counts it for good); how many were pending.
_COMMIT_LUA = """
local acked = 0
for i = 2, #ARGV do
  acked = acked + redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
  redis.call('XDEL', KEYS[1], ARGV[i])
  redis.call('SREM', KEYS[2], ARGV[i])
end
return acked
"""

# KEYS: rollouts, dead, counters, returned, slotted. ARGV: consumer group, dead_maxlen, d = how
# many are dead-lettered, then d x (entry id, reason, record as read), then (entry id, reason,
# prompt index to serve again or '') of each dropped one. Acknowledges, counts, gives back the
# admission slots the entries hold (the ledger's groups_started: they will never be trained;
# an entry that never took one, e.g. written into the stream by hand, gives none) and returns
# the prompts of future groups, together.
_DROP_LUA = """
local held = 0
local function remove(id)
  redis.call('XACK', KEYS[1], ARGV[1], id)
  redis.call('XDEL', KEYS[1], id)
  held = held + redis.call('SREM', KEYS[5], id)
end
local i, removed = 4, 0
for _ = 1, tonumber(ARGV[3]) do
  remove(ARGV[i])
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'id', ARGV[i], 'reason', ARGV[i + 1], 'raw', ARGV[i + 2])
  redis.call('HINCRBY', KEYS[3], 'dead_lettered', 1)
  i, removed = i + 3, removed + 1
end
while i <= #ARGV do
  remove(ARGV[i])
  redis.call('HINCRBY', KEYS[3], 'dropped_' .. ARGV[i + 1], 1)
  if ARGV[i + 2] ~= '' then
    redis.call('RPUSH', KEYS[4], ARGV[i + 2])
  end
  i, removed = i + 3, removed + 1
end
if held > 0 then  -- Lua writes -0 as "-0", which HINCRBY refuses
  redis.call('HINCRBY', KEYS[3], 'groups_started', -held)
end
return removed
"""

# KEYS: rollout stats. ARGV: (counter name, delta) pairs.
_ADD_STATS_LUA = """
for i = 1, #ARGV, 2 do
  redis.call('HINCRBYFLOAT', KEYS[1], ARGV[i], ARGV[i + 1])
end
return 1
"""

# KEYS: failures. ARGV: maxlen, field, encoded reports.
_REPORT_LUA = """
for i = 3, #ARGV do
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[1], '*', ARGV[2], ARGV[i])
end
return #ARGV - 2
"""

_CLAIM_BATCH = 100  # pending entries examined per round trip


class TicketEndedError(RuntimeError):
    """A put with a ticket that had already ended (abandoned, or reconciled at a restart)."""


@dataclass(frozen=True)
class Drop:
    """Why a consumer will not train a group (from a :data:`Check` or the :class:`Staleness` rule)."""

    reason: str
    """Short name; counted as ``dropped_<reason>`` (or dead-lettered with it)."""
    detail: str
    dead_letter: bool = False
    """Malformed data (e.g. token ids outside the vocabulary): keep it in the dead-letter stream."""
    return_prompt: bool = False
    """The group is not trained but its prompt is served again (nothing is lost): it does not
    count toward "every group read was dropped" (:attr:`ScreenReport.trailing`)."""


@dataclass(frozen=True)
class Staleness:
    """The consumer's staleness rule (docs/architecture.md): a group is trained only while
    ``|version - behaviour version| <= max_staleness``.

    Beyond the bound on the old side the group is ``stale`` (its prompt counts as done, as
    for every other drop); on the new side it is ``future``: generated by weights newer than
    the consumer's, which a resume from a checkpoint older than the queue's groups finds (or
    a queue that holds another run's groups). A future group's prompt is returned and
    served again.
    """

    version: int
    max_staleness: int

    def judge(self, group: RolloutGroup) -> Drop | None:
        """None when ``group`` may be trained at ``version``, else why not."""
        behind = self.version - group.behaviour_version
        if behind > self.max_staleness:
            return Drop("stale", f"{behind} versions behind {self.version} > max_staleness={self.max_staleness}")
        if -behind > self.max_staleness:
            return Drop("future", f"behaviour version {group.behaviour_version} is {-behind} versions ahead of {self.version} "
                                  f"> max_staleness={self.max_staleness}", return_prompt=True)
        return None


Check = Callable[[RolloutGroup, bytes], "Drop | None"]
"""A consumer's per-group validation of a decoded group and its record as read (the
msgspec bytes, for a consumer that passes the record on): None keeps the group."""


@dataclass
class ScreenReport:
    """What one read screened, in order: for "every group dropped" detection."""

    kept: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    trailing: Counter[str] = field(default_factory=Counter)
    """Reasons of the entries dropped after the last kept one (all of them if none was kept),
    except drops that return their prompt (they lose nothing)."""

    def note(self, drop: Drop | None) -> None:
        if drop is None:
            self.kept += 1
            self.trailing.clear()
        else:
            self.dropped[drop.reason] += 1
            if not drop.return_prompt:
                self.trailing[drop.reason] += 1


class ReplayQueue:
    """Producer and consumer handle on the replay stream of run ``run``.

    ``url``: ``redis://`` or ``rediss://`` with the password, e.g. ``EmbeddedRedis``'s.
    ``max_depth``: waiting groups at which ``put`` blocks. ``consumer``: this reader's name
    in the ``learner`` group (default: unique per process). ``claim_idle_s``: seconds an
    entry must sit unacknowledged before ``recover`` takes it from another consumer; keep
    it above the longest get-to-commit time of a live learner. ``op_timeout_s``: how
    long operations without a ``timeout`` argument retry a lost connection.
    ``socket_timeout_s``: bound on every single network read/connect.
    """

    def __init__(
        self,
        url: str,
        run: str,
        max_depth: int = 256,
        *,
        consumer: str | None = None,
        claim_idle_s: float = 300.0,
        op_timeout_s: float = 30.0,
        socket_timeout_s: float = 5.0,
        dead_maxlen: int = 10_000,
    ) -> None:
        if max_depth <= 0:
            raise ValueError(f"max_depth must be > 0, got {max_depth}")
        self.run = run
        self.max_depth = max_depth
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.claim_idle_s = claim_idle_s
        self.op_timeout_s = op_timeout_s
        self.dead_maxlen = dead_maxlen
        self.keys = RunKeys(run)
        self._url = redact_url(url)
        # XREADGROUP blocks in slices shorter than the socket timeout, which bounds each read.
        self._block_slice_s = min(1.0, socket_timeout_s / 2)
        self._client = connect(url, socket_timeout_s)
        # A call's reply is kept a minute longer than the call may retry (op_timeout_s).
        reply_ttl_s = int(op_timeout_s) + 60
        self._ledger = AdmissionLedger(self._client, self.keys, reply_ttl_s)
        self._put_script = self._client.register_script(_PUT_LUA)
        self._commit, self._drop, self._add_stats, self._report = (
            OnceScript(self._client, body, self.keys.reply, reply_ttl_s) for body in (_COMMIT_LUA, _DROP_LUA, _ADD_STATS_LUA, _REPORT_LUA)
        )
        # Dedup state is per instance: a restart that reuses `consumer` starts afresh.
        self._last_put_key = self.keys.last_put(f"{self.consumer}.{secrets.token_hex(4)}")
        self._put_seq = itertools.count()
        self.last_screen = ScreenReport()
        """What the latest :meth:`get` or :meth:`recover` screened."""
        self._call("create consumer group", self._create_group)

    @property
    def client(self) -> redis.Redis:
        """The connection to the run's Redis (for the run's other key families: :mod:`async_rl.queue.requests`)."""
        return self._client

    def _call(self, what: str, op: Callable[[], T], deadline: float | None = None) -> T:
        if deadline is None:
            deadline = time.monotonic() + self.op_timeout_s
        return retrying(op, deadline, f"{what} on {self._url}")

    def _once(self, what: str, op: Callable[[str], T]) -> T:
        """:meth:`_call` of ``op(call_id)``, a :class:`OnceScript` call: one call id for
        all its retries, so a retry after a lost reply does not apply it twice."""
        call_id = secrets.token_hex(8)
        return self._call(what, lambda: op(call_id))

    def _create_group(self) -> None:
        try:
            # From id 0 so groups put before the first reader existed are delivered too.
            self._client.xgroup_create(self.keys.rollouts, CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # -- producer side -------------------------------------------------------------

    def put(self, group: RolloutGroup, ticket: Ticket | None = None, timeout: float = 30.0) -> str:
        """Append ``group`` and end its ``ticket``; block while depth >= ``max_depth``.
        Returns the entry id. Without a ticket the group bypasses admission (tests,
        replaying recorded groups): rollout workers always pass theirs.

        Raises ``TimeoutError`` if the queue stays full for ``timeout`` seconds (the ticket
        is still open: retry or abandon it), ``TicketEndedError`` if the ticket already
        ended (abandoned, or reconciled by a later start), and ``QueueUnavailableError``
        if Redis stays unreachable that long. When ``put`` returns, the group is in Redis's
        AOF (fsynced under ``appendfsync always``). Retries after connection loss never
        append the group twice.
        """
        data = encode(group)
        deadline = time.monotonic() + timeout
        keys = [self.keys.rollouts, self._last_put_key, self.keys.inflight, self.keys.slotted]
        # The dedup record only has to outlive this call's retries.
        ttl_s = int(timeout) + 60
        args: list[bytes | str | int] = [
            self.max_depth, CONSUMER_GROUP, PAYLOAD_FIELD, data, next(self._put_seq), ttl_s,
            "" if ticket is None else ticket.index, "" if ticket is None else ticket.claim,
        ]

        def put_once() -> Any:
            try:
                return self._put_script(keys=keys, args=args)
            except redis.ResponseError as exc:
                if "TICKET_ENDED" in str(exc):
                    raise TicketEndedError(f"prompt {ticket.index if ticket else '?'}: its ticket already ended; "
                                           f"group {group.group_id} not put") from None
                raise

        for _ in attempts(deadline, first_s=0.001, cap_s=0.05):
            entry_id = self._call("put", put_once, deadline)
            if entry_id is not None:
                return str(entry_id, "ascii")
        raise TimeoutError(f"replay queue {self.run!r} stayed at max_depth={self.max_depth} "
                           f"for {timeout} s: is the learner consuming?")

    def put_images(self, blobs: Sequence[tuple[str, bytes]], ttl_s: float) -> int:
        """Store images ``(sha256, png bytes)`` under their content keys, each once, and renew
        the expiry of every key to ``ttl_s`` seconds from now. Call it before :meth:`put` of a
        group that refers to them. Returns how many were new."""
        if not blobs:
            return 0
        ttl_ms = max(1, int(ttl_s * 1000))

        def store() -> int:
            pipe = self._client.pipeline(transaction=False)
            for sha, png in blobs:
                pipe.set(self.keys.image(sha), png, px=ttl_ms, nx=True)
                pipe.pexpire(self.keys.image(sha), ttl_ms)
            return sum(bool(ok) for ok in pipe.execute()[::2])

        return self._call("put_images", store)

    def get_images(self, shas: Sequence[str]) -> dict[str, bytes]:
        """The stored PNG bytes of ``shas`` (one round trip); a key that expired or was never
        stored is absent from the result."""
        if not shas:
            return {}
        unique = list(dict.fromkeys(shas))
        values = self._call("get_images", lambda: self._client.mget([self.keys.image(sha) for sha in unique]))
        return {sha: value for sha, value in zip(unique, values) if value is not None}

    def publish_version(self, version: int) -> None:
        """Announce the policy version whose weights have reached every server."""
        self._call("publish_version", lambda: self._ledger.publish_version(version))

    def raise_version(self, version: int) -> bool:
        """Publish ``version`` if it is newer than the published one (:meth:`AdmissionLedger.raise_version`)."""
        return self._call("raise_version", lambda: self._ledger.raise_version(version))

    def set_producers(self, producers: int) -> None:
        """Record the worker loops that admit now (:meth:`AdmissionLedger.set_producers`)."""
        self._call("set_producers", lambda: self._ledger.set_producers(producers))

    def wait_for_version(self, after: str, timeout_s: float) -> str:
        """Block until a version is published after stream id ``after``, or ``timeout_s``
        (:meth:`AdmissionLedger.wait_for_version`); the newest id seen."""
        return self._call("wait_for_version", lambda: self._ledger.wait_for_version(after, timeout_s))

    def admit(self, batch_size: int, max_staleness: int, owner: str, limit: int = 1, held: int = 0) -> list[Ticket]:
        """AReaL admission and prompt claims (:meth:`AdmissionLedger.admit`): up to ``limit``
        tickets, each to end with :meth:`put` or :meth:`abandon`; none while the rule holds
        producers back, or while the caller's ``held`` open tickets are its share of the window."""
        return self._once("admit", lambda call_id: self._ledger.admit(batch_size, max_staleness, owner, call_id, limit, held))

    def abandon(self, ticket: Ticket, *, return_prompt: bool) -> bool:
        """End ``ticket`` without a group (:meth:`AdmissionLedger.abandon`)."""
        return self._once("abandon", lambda call_id: self._ledger.abandon(ticket, return_prompt=return_prompt, call_id=call_id))

    def release_owner(self, owner: str) -> int:
        """End the open tickets of a producer that is gone (:meth:`AdmissionLedger.release_owner`)."""
        return self._once("release_owner", lambda call_id: self._ledger.release_owner(owner, call_id))

    def reconcile(self, version: int, batch_size: int, *, live: bool = False) -> Reconciled:
        """Rebuild the ledger after the learner resumed: at a start, before any producer runs,
        or ``live`` while they run (:meth:`AdmissionLedger.reconcile`)."""
        return self._once("reconcile", lambda call_id: self._ledger.reconcile(version, batch_size, call_id, live=live))

    # -- consumer side -------------------------------------------------------------

    def get(self, n: int, staleness: Staleness | None = None, timeout: float = 30.0, check: Check | None = None) -> list[Entry]:
        """Up to ``n`` groups for this consumer, as ``(entry_id, group)``.

        Waits up to ``timeout`` seconds for ``n``; returns what it has then (maybe none).
        Every entry read is screened (:meth:`_screen`): undecodable ones and those ``check``
        dead-letters go to the dead-letter stream, stale and future ones (``staleness``) and
        those ``check`` rejects are dropped; both are acknowledged, counted and give their
        admission slot back at once (a future group its prompt too). Returned entries stay pending until :meth:`commit`.
        """
        if n <= 0:
            raise ValueError(f"n must be > 0, got {n}")
        deadline = time.monotonic() + timeout
        out: list[Entry] = []
        report = ScreenReport()
        while True:
            block_s = min(max(deadline - time.monotonic(), 0.0), self._block_slice_s)
            read = partial(
                self._client.xreadgroup, CONSUMER_GROUP, self.consumer,
                {self.keys.rollouts: ">"}, count=n - len(out), block=max(1, int(block_s * 1000)),
            )
            # ``timeout`` bounds the wait for data, not the recovery from a Redis stall: a reply
            # slower than the socket timeout (an fsync, a loaded machine) is retried for
            # ``op_timeout_s`` like every other operation instead of failing the learner.
            reply = cast(StreamReply, self._call("get", read, max(deadline, time.monotonic() + self.op_timeout_s)))
            if reply:
                out.extend(self._screen(reply[0][1], staleness, check, report))
            if len(out) >= n or time.monotonic() >= deadline:
                self.last_screen = report
                return out

    def commit(self, entry_ids: Iterable[str]) -> int:
        """Acknowledge and delete entries once the state that used them is durable.

        Returns how many were still pending (already committed ones count 0).
        """
        ids = list(entry_ids)
        if not ids:
            return 0
        return int(self._once("commit", lambda call_id: self._commit([self.keys.rollouts, self.keys.slotted], [CONSUMER_GROUP, *ids], call_id)))

    def recover(
        self,
        staleness: Staleness | None = None,
        *,
        check: Check | None = None,
        min_idle_s: float | None = None,
        include_own: bool = False,
    ) -> list[Entry]:
        """Take over entries other consumers read but never committed (e.g. they died).

        Only entries unacknowledged for at least ``min_idle_s`` seconds (default
        ``claim_idle_s``) are taken, so live consumers keep theirs; XCLAIM re-checks the
        idle time, so two recovering consumers never take the same entry. With
        ``include_own`` this consumer's own pending entries are returned too: what a
        learner restarted under the same consumer name wants. Entries are screened like
        :meth:`get` and are now pending on this consumer.
        """
        idle_ms = int(1000 * (self.claim_idle_s if min_idle_s is None else min_idle_s))
        entries = self._call("recover", lambda: self._claim_idle(idle_ms))
        if include_own:
            entries = self._call("recover own", self._own_pending) + entries
        report = ScreenReport()
        kept = self._screen(entries, staleness, check, report)
        self.last_screen = report
        return kept

    def _claim_idle(self, idle_ms: int) -> list[RawEntry]:
        claimed: list[RawEntry] = []
        start: bytes | str = "-"
        while page := cast(list[dict[str, Any]], self._client.xpending_range(
            self.keys.rollouts, CONSUMER_GROUP, start, "+", _CLAIM_BATCH, idle=idle_ms
        )):
            ids = [p["message_id"] for p in page if p["consumer"].decode() != self.consumer]
            if ids:
                claimed += cast(list[RawEntry], self._client.xclaim(
                    self.keys.rollouts, CONSUMER_GROUP, self.consumer, idle_ms, ids
                ))
            start = b"(" + page[-1]["message_id"]
        return claimed

    def _own_pending(self) -> list[RawEntry]:
        own: list[RawEntry] = []
        start: bytes | str = "0"
        while reply := cast(StreamReply, self._client.xreadgroup(
            CONSUMER_GROUP, self.consumer, {self.keys.rollouts: start}, count=_CLAIM_BATCH
        )):
            page = reply[0][1]
            if not page:
                break
            own += page
            start = page[-1][0]
        return own

    def drop(self, entries: Sequence[tuple[str, RolloutGroup, Drop]]) -> None:
        """Drop entries this consumer read and will not train after all (the learner judges a
        recovered entry's staleness when its step comes): acknowledged, counted and released
        like a drop at read time. :attr:`last_screen` reports them."""
        report = ScreenReport()
        for _, _, drop in entries:
            report.note(drop)
        self.last_screen = report
        dropped = [(entry_id.encode(), group.prompt_id, drop) for entry_id, group, drop in entries]
        if dropped:
            self._once("record drops", lambda call_id: self._record([], dropped, call_id))

    def _screen(
        self, entries: Sequence[RawEntry], staleness: Staleness | None, check: Check | None, report: ScreenReport
    ) -> list[Entry]:
        """Decode entries; keep the trainable ones, drop the rest.

        An entry is dead-lettered when it does not decode or ``check`` says so, dropped as
        ``stale`` or ``future`` when ``staleness`` says so, dropped under ``check``'s reason otherwise.
        """
        keep: list[Entry] = []
        dead: list[tuple[bytes, str, bytes]] = []
        dropped: list[tuple[bytes, int, Drop]] = []
        for entry_id, fields in entries:
            raw = fields.get(PAYLOAD_FIELD)
            try:
                if raw is None:
                    raise RecordDecodeError(f"entry has no {PAYLOAD_FIELD.decode()!r} field")
                group = decode(raw)
            except RecordDecodeError as exc:
                dead.append((entry_id, str(exc), raw or b""))
                report.note(Drop("dead_lettered", str(exc), dead_letter=True))
                continue
            drop = staleness.judge(group) if staleness is not None else None
            if drop is None and check is not None:
                drop = check(group, raw)
            report.note(drop)
            if drop is None:
                keep.append((entry_id.decode(), group))
            elif drop.dead_letter:
                dead.append((entry_id, f"{drop.reason}: {drop.detail}", raw))
            else:
                dropped.append((entry_id, group.prompt_id, drop))
        if dead or dropped:
            self._once("record screening", lambda call_id: self._record(dead, dropped, call_id))
        return keep

    def _record(self, dead: list[tuple[bytes, str, bytes]], dropped: list[tuple[bytes, int, Drop]], call_id: str) -> None:
        """The one release path of entries that will never be trained: dead-letter or count
        them, acknowledge and delete them, give their admission slots back and serve again the
        prompts of drops that return theirs (``future``), in one script (:data:`_DROP_LUA`)."""
        args = [CONSUMER_GROUP, self.dead_maxlen, len(dead), *itertools.chain.from_iterable(dead),
                *itertools.chain.from_iterable((entry_id, drop.reason, prompt if drop.return_prompt else "")
                                               for entry_id, prompt, drop in dropped)]
        self._drop([self.keys.rollouts, self.keys.dead, self.keys.counters, self.keys.returned, self.keys.slotted], args, call_id)

    # -- observability -------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Queue health, shared by all processes.

        ``depth`` (waiting groups), ``pending`` (read, not committed), ``dead_lettered``,
        ``dropped_stale``, ``dropped`` ({reason: groups the learner dropped}),
        ``oldest_age_s`` (seconds since the oldest uncommitted group was put; 0 if none),
        ``version``, ``groups_started``, ``prompt_cursor``, ``inflight`` (admitted groups not
        yet enqueued), ``returned_prompts`` (claimed prompts waiting to be served again).
        """
        def read() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            pipe.xlen(self.keys.rollouts)
            pipe.xpending(self.keys.rollouts, CONSUMER_GROUP)
            pipe.hgetall(self.keys.counters)
            pipe.xrange(self.keys.rollouts, count=1)
            pipe.hlen(self.keys.inflight)
            pipe.llen(self.keys.returned)
            pipe.time()  # entry ids carry the server's clock, so age is measured on it
            return list(pipe.execute())

        length, pending, counters, oldest, inflight, returned, (sec, usec) = self._call("stats", read)
        counts = {k.decode(): int(v) for k, v in counters.items()}
        age_s = 0.0
        if oldest:
            put_ms = int(oldest[0][0].split(b"-")[0])
            age_s = max(0.0, sec + usec / 1e6 - put_ms / 1000)
        return {
            "depth": length - pending["pending"],
            "pending": pending["pending"],
            "dead_lettered": counts.get("dead_lettered", 0),
            "dropped_stale": counts.get("dropped_stale", 0),
            "dropped": {k.removeprefix("dropped_"): v for k, v in counts.items() if k.startswith("dropped_")},
            "oldest_age_s": age_s,
            "version": counts.get("version", 0),
            "groups_started": counts.get("groups_started", 0),
            "prompt_cursor": counts.get("prompt_cursor", 0),
            "inflight": int(inflight),
            "returned_prompts": int(returned),
        }

    def add_rollout_stats(self, deltas: Mapping[str, float]) -> None:
        """Add ``deltas`` to the run's shared rollout counters (one round trip)."""
        if not deltas:
            return
        args = [x for name, delta in deltas.items() for x in (name, repr(float(delta)))]
        self._once("add_rollout_stats", lambda call_id: self._add_stats([self.keys.rollout_stats], args, call_id))

    def rollout_stats(self) -> dict[str, float]:
        """The rollout workers' cumulative counters (see :class:`RunKeys`), summed over every
        worker host of the run since its first start."""
        raw = self._call("rollout_stats", lambda: self._client.hgetall(self.keys.rollout_stats))
        return {k.decode(): float(v) for k, v in raw.items()}

    def report_failures(self, reports: Sequence[FailureReport]) -> None:
        """Append ``reports`` to the run's failures stream (one round trip; the oldest
        entries beyond ``FAILURES_MAXLEN`` are trimmed)."""
        if not reports:
            return
        args = [FAILURES_MAXLEN, FAILURE_FIELD, *(msgspec.msgpack.encode(r) for r in reports)]
        self._once("report_failures", lambda call_id: self._report([self.keys.failures], args, call_id))

    def last_failure_id(self) -> str:
        """The id of the newest failure report ("0-0" when there is none): where a reader
        that wants only new reports starts."""
        newest = self._call("last_failure_id", lambda: self._client.xrevrange(self.keys.failures, count=1))
        return newest[0][0].decode() if newest else "0-0"

    def read_failures(self, after: str, count: int = 1000) -> tuple[str, list[FailureReport], int]:
        """Failure reports after entry id ``after``, oldest first: ``(last id read, reports,
        entries that did not decode)``. Undecodable entries are skipped (they are diagnostics,
        never training data); the caller counts them."""
        entries = self._call("read_failures", lambda: self._client.xrange(self.keys.failures, min=f"({after}", count=count))
        reports, bad = [], 0
        for entry_id, fields_ in entries:
            try:
                reports.append(_FAILURE_DECODER.decode(fields_.get(FAILURE_FIELD, b"")))
            except msgspec.DecodeError:  # ValidationError is a subclass
                bad += 1
        return (entries[-1][0].decode() if entries else after), reports, bad

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()

    def __enter__(self) -> ReplayQueue:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
