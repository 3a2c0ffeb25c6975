"""The admission ledger: policy version, AReaL admission, prompt claims, reconciliation.

It is the one owner of the run's shared counters in Redis (``counters`` hash) and of the
prompt bookkeeping (``inflight`` hash, ``returned`` list). A group's life, as seen here:

1. :meth:`AdmissionLedger.admit` checks AReaL's rule, counts the group as started and
   claims a prompt index (a returned one first, else the next of the cursor), all in one
   script, and hands out a :class:`Ticket`. The index is recorded in ``inflight``.
2. The ticket ends exactly once: *enqueued* (the queue's put script appends the group and
   clears the ``inflight`` record atomically) or *abandoned* (:meth:`abandon`: the slot is
   released; the prompt either goes back to ``returned``, to be served first, or is done).
   A producer that died with tickets open has them all ended by :meth:`release_owner`
   (its replacement's supervisor calls it: every ticket names its owner).
3. The learner drops a group it reads but will not train (stale, malformed, failed
   reward): the queue's drop script acknowledges and counts it and gives its slot back
   (``groups_started`` - 1), in one step.
4. On every start, :meth:`reconcile` rebuilds the ledger from what is really there: prompts
   still recorded in flight (their worker is gone) are returned, and ``groups_started``
   becomes ``version * B + entries in the stream``. A learner restarted while the workers
   run reconciles ``live``: the open tickets stay and count.

So ``groups_started = trained groups (version * B) + groups in the stream + groups in
flight`` at all times, and a crash or stop neither skips nor repeats a prompt.

Every script here runs as a :class:`~async_rl.queue.client.OnceScript`: its caller retries
it after a lost reply with the same ``call_id``, and the retry gets the first reply back
instead of claiming, releasing or counting a second time.
"""

from __future__ import annotations

from dataclasses import dataclass
import redis

from async_rl.queue.client import OnceScript
from async_rl.queue.keys import RunKeys

__all__ = ["AdmissionLedger", "Reconciled", "Ticket"]

# KEYS: counters, inflight, returned. ARGV: B, eta, owner.
# AReaL's rule: start a group only while groups_started < (v + eta + 1) * B. Checking,
# counting and claiming in one script makes it exact however many producers race, and
# leaves no moment where a slot is counted without its prompt being recorded.
_ADMIT_LUA = """
local v = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
local started = tonumber(redis.call('HGET', KEYS[1], 'groups_started') or '0')
if started >= (v + tonumber(ARGV[2]) + 1) * tonumber(ARGV[1]) then
  return false
end
redis.call('HINCRBY', KEYS[1], 'groups_started', 1)
local index = redis.call('LPOP', KEYS[3])
if not index then
  index = redis.call('HINCRBY', KEYS[1], 'prompt_cursor', 1) - 1
end
local claim = redis.call('HINCRBY', KEYS[1], 'tickets', 1) .. ' ' .. ARGV[3]
redis.call('HSET', KEYS[2], index, claim)
return {tonumber(index), claim}
"""

# KEYS: counters, inflight, returned. ARGV: index, claim, return the prompt (1/0).
# The inflight record is the ticket's proof of life: only the first end releases, and a
# ticket of a killed run (its prompt claimed again since) cannot end the new claim.
_ABANDON_LUA = """
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then
  return 0
end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HINCRBY', KEYS[1], 'groups_started', -1)
if ARGV[3] == '1' then
  redis.call('RPUSH', KEYS[3], ARGV[1])
end
return 1
"""

# KEYS: counters, inflight, returned. ARGV: owner. Every open ticket of one producer that
# is gone (its process was killed): the same release as an abandon that returns the prompt.
_RELEASE_OWNER_LUA = """
local claims = redis.call('HGETALL', KEYS[2])
local suffix = ' ' .. ARGV[1]
local released = {}
for i = 1, #claims, 2 do
  local claim = claims[i + 1]
  if string.sub(claim, -#suffix) == suffix then
    table.insert(released, claims[i])
  end
end
table.sort(released, function(a, b) return tonumber(a) < tonumber(b) end)
for _, index in ipairs(released) do
  redis.call('HDEL', KEYS[2], index)
  redis.call('RPUSH', KEYS[3], index)
end
if #released > 0 then
  redis.call('HINCRBY', KEYS[1], 'groups_started', -#released)
end
return #released
"""

# KEYS: counters, inflight, returned, rollouts. ARGV: version, B, live (1/0).
# Live (producers running, e.g. a restarted learner): the open tickets are theirs, so they
# stay and count as started; else they are orphans of a killed run and their prompts return.
_RECONCILE_LUA = """
local orphans = {}
if ARGV[3] ~= '1' then
  orphans = redis.call('HKEYS', KEYS[2])
  table.sort(orphans, function(a, b) return tonumber(a) < tonumber(b) end)
  for _, index in ipairs(orphans) do
    redis.call('RPUSH', KEYS[3], index)
  end
  redis.call('DEL', KEYS[2])
end
local before = tonumber(redis.call('HGET', KEYS[1], 'groups_started') or '0')
local queued = redis.call('XLEN', KEYS[4])
local started = tonumber(ARGV[1]) * tonumber(ARGV[2]) + queued + redis.call('HLEN', KEYS[2])
redis.call('HSET', KEYS[1], 'groups_started', started, 'version', ARGV[1])
return {#orphans, queued, before, started, redis.call('LLEN', KEYS[3])}
"""


@dataclass(frozen=True)
class Ticket:
    """One admitted group: its admission slot and its claimed prompt index.

    End it exactly once: ``ReplayQueue.put(group, ticket)`` or ``ReplayQueue.abandon``.
    """

    index: int
    """Global prompt index (the dataset cursor's position; epochs continue the count)."""
    claim: str
    """``"<ticket number> <owner>"``: the ``inflight`` record that proves the ticket is open."""


@dataclass(frozen=True)
class Reconciled:
    """What :meth:`AdmissionLedger.reconcile` found and set."""

    returned: int
    """Prompts that were claimed but never enqueued (now first in line)."""
    queued: int
    """Entries in the stream (waiting or pending)."""
    groups_started_before: int
    groups_started: int
    returned_waiting: int
    """Length of the returned-prompts list after reconciling."""


class AdmissionLedger:
    """Shared counters and prompt claims of one run, read and updated atomically in Redis."""

    def __init__(self, client: redis.Redis, keys: RunKeys, reply_ttl_s: int) -> None:
        """``reply_ttl_s``: how long a call's reply is kept for its retries, seconds (longer
        than any caller retries one call)."""
        self._client = client
        self._keys = keys
        self._admit, self._abandon, self._release_owner, self._reconcile = (
            OnceScript(client, body, keys.reply, reply_ttl_s) for body in (_ADMIT_LUA, _ABANDON_LUA, _RELEASE_OWNER_LUA, _RECONCILE_LUA)
        )

    @property
    def _claim_keys(self) -> list[str]:
        return [self._keys.counters, self._keys.inflight, self._keys.returned]

    def publish_version(self, version: int) -> None:
        """Record ``version`` as the policy version whose weights reached every server."""
        if version < 0:
            raise ValueError(f"policy version must be >= 0, got {version}")
        self._client.hset(self._keys.counters, "version", version)

    def admit(self, batch_size: int, max_staleness: int, owner: str, call_id: str) -> Ticket | None:
        """A :class:`Ticket` if AReaL's rule lets one more group start, else None.

        ``owner`` (e.g. ``server-0``) is recorded with the claimed prompt, for ``redis-cli``
        readers and diagnostics. ``call_id`` (here and below) is unique per call and the
        same for its retries: a retry whose first try was admitted returns that ticket."""
        if batch_size <= 0 or max_staleness < 0:
            raise ValueError("need batch_size > 0 and max_staleness >= 0")
        admitted = self._admit(self._claim_keys, [batch_size, max_staleness, owner], call_id)
        return None if admitted is None else Ticket(int(admitted[0]), admitted[1].decode())

    def abandon(self, ticket: Ticket, *, return_prompt: bool, call_id: str) -> bool:
        """End ``ticket`` without a group: release its slot; with ``return_prompt`` its prompt
        is served again before new ones (a stop, a failure), else it counts as done (a
        filtered or overlong prompt). Returns False if the ticket had already ended
        (nothing changes then)."""
        return bool(self._abandon(self._claim_keys, [ticket.index, ticket.claim, int(return_prompt)], call_id))

    def release_owner(self, owner: str, call_id: str) -> int:
        """End every open ticket of ``owner`` (a producer that is gone: its process was
        killed mid-group) as :meth:`abandon` with ``return_prompt`` would; returns how many.
        Owners must be unique per process, so a replacement's tickets are never touched."""
        if not owner or " " in owner:
            raise ValueError(f"owner must be a non-empty name without spaces, got {owner!r}")
        return int(self._release_owner(self._claim_keys, [owner], call_id))

    def reconcile(self, version: int, batch_size: int, call_id: str, *, live: bool = False) -> Reconciled:
        """Rebuild the ledger after the learner resumed at ``version`` (its checkpoint's
        entries are then committed and gone from the stream): set ``version`` and
        ``groups_started = version * B + stream length + open tickets``. At a start (no
        producer running, ``live=False``) every prompt still recorded in flight is an orphan
        and is returned first; with ``live=True`` (a learner restarted while the rollout
        workers run) the open tickets are theirs and stay."""
        if version < 0 or batch_size <= 0:
            raise ValueError("need version >= 0 and batch_size > 0")
        found = self._reconcile([*self._claim_keys, self._keys.rollouts], [version, batch_size, int(live)], call_id)
        return Reconciled(*(int(x) for x in found))
