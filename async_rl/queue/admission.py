"""The admission/staleness ledger: policy version, AReaL admission, dataset cursor.

All state is in the run's ``counters`` hash so every producer and learner process shares
it; each operation is a single atomic Redis command or Lua script.
"""

from __future__ import annotations

import redis

from async_rl.queue.keys import RunKeys

__all__ = ["AdmissionLedger"]

# AReaL's rule: start a group only while groups_started < (v + eta + 1) * B. Checking and
# incrementing in one script makes it exact however many producers race.
_ADMIT_LUA = """
local v = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
local started = tonumber(redis.call('HGET', KEYS[1], 'groups_started') or '0')
if started < (v + tonumber(ARGV[2]) + 1) * tonumber(ARGV[1]) then
  redis.call('HINCRBY', KEYS[1], 'groups_started', 1)
  return 1
end
return 0
"""


class AdmissionLedger:
    """Shared counters of one run, read and updated atomically in Redis."""

    def __init__(self, client: redis.Redis, keys: RunKeys) -> None:
        self._client = client
        self._keys = keys
        self._admit = client.register_script(_ADMIT_LUA)

    def publish_version(self, version: int) -> None:
        """Record ``version`` as the policy version whose weights reached the servers."""
        if version < 0:
            raise ValueError(f"policy version must be >= 0, got {version}")
        self._client.hset(self._keys.counters, "version", version)

    def version(self) -> int:
        """The last published policy version (0 before any publish)."""
        return int(self._client.hget(self._keys.counters, "version") or 0)

    def try_admit(self, batch_size: int, max_staleness: int) -> bool:
        """Count one more started group if the AReaL rule allows it; ``True`` if so."""
        if batch_size <= 0 or max_staleness < 0:
            raise ValueError("need batch_size > 0 and max_staleness >= 0")
        return bool(self._admit(keys=[self._keys.counters], args=[batch_size, max_staleness]))

    def release(self) -> None:
        """Undo one successful :meth:`try_admit` (the group will never reach the queue)."""
        self._client.hincrby(self._keys.counters, "groups_started", -1)

    def next_prompt_index(self) -> int:
        """Claim the next dataset index (0, 1, 2, ...) for this process, durably."""
        return int(self._client.hincrby(self._keys.counters, "prompt_cursor", 1)) - 1
