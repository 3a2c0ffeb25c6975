"""Which run owns a run name's keys in Redis: its run id, kept with the queue, and the lease
of the driver that runs it now.

A run gets an id at its first start; the launcher stores it here (``{run}:run``, a JSON
:class:`RunRecord`) and in its output directory, and refuses a start whose two ids disagree
(:mod:`async_rl.launch.run_state`). While a driver runs it holds ``{run}:lease`` (``"<run id>
<owner>"``), renewed every :data:`LEASE_RENEW_S` seconds with a TTL of :data:`LEASE_TTL_S`: a
second driver of the same run name on a shared Redis is refused while the lease lives, and
a driver resuming the same run after a crash takes it once it expired.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

import msgspec

from async_rl.config import redact_url
from async_rl.queue.client import connect, retrying
from async_rl.queue.keys import RunKeys

__all__ = ["LEASE_BACK_S", "LEASE_RENEW_S", "LEASE_RETRY_S", "LEASE_TTL_S", "Lease", "LeaseLostError", "RunInUseError", "RunOwnership", "RunRecord"]

log = logging.getLogger(__name__)

T = TypeVar("T")

LEASE_TTL_S = 30.0
"""A driver's lease lapses this many seconds after its last renewal (a killed driver's run
name is free again after at most this long)."""
LEASE_RENEW_S = 10.0
"""How often a live driver renews its lease, seconds."""
LEASE_RETRY_S = 1.0
"""How soon a driver retries a renewal that failed (its Redis away), seconds."""
LEASE_BACK_S = 5.0
"""A Redis away for longer than the TTL (a restart, a full disk) dropped the lease: a live
driver holds it again within this many seconds of its Redis answering (one retry, with a
margin), so a reader waits this long before it reads a missing lease as no driver."""

# KEYS: lease. ARGV: "<run id> <owner>", ttl_ms, take over ('1': whoever holds it is gone).
# Returns the holder when another one holds the lease, else takes or renews it.
_CLAIM_LUA = """
local held = redis.call('GET', KEYS[1])
if held and held ~= ARGV[1] and ARGV[3] ~= '1' then
  return held
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return false
"""

# KEYS: lease. ARGV: "<run id> <owner>". Only the holder releases.
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# Keys whose presence means the run name holds a run's data (the stream itself exists as
# soon as a queue handle was opened, so it counts only when it holds entries).
_DATA_KEYS = ("counters", "inflight", "returned", "dead", "failures", "rollout_stats")


class RunRecord(msgspec.Struct, frozen=True):
    """The run that owns a run name's keys."""

    run_id: str
    output_dir: str
    """The run's ``trainer.output_dir`` (absolute)."""
    host: str
    """The host of the driver that started it."""
    started_at: float
    """Unix time of its first start, seconds."""


class Lease(msgspec.Struct, frozen=True):
    """The lease as found: who holds it and for how much longer."""

    run_id: str
    owner: str
    """``<host>-<pid>`` of the driver."""
    ttl_s: float


class RunInUseError(RuntimeError):
    """A live driver of another run (or another driver of this one) holds the run name."""


class LeaseLostError(RuntimeError):
    """Another driver took this driver's lease (it could not renew it in time)."""


class RunOwnership:
    """The run record and the driver's lease of run ``run`` on the Redis at ``url``.

    ``op_timeout_s``: how long an operation retries a lost connection; ``socket_timeout_s``
    bounds every network read/connect.
    """

    def __init__(self, url: str, run: str, *, op_timeout_s: float = 30.0, socket_timeout_s: float = 5.0) -> None:
        self.run = run
        self.keys = RunKeys(run)
        self.url = redact_url(url)
        self.op_timeout_s = op_timeout_s
        self._client = connect(url, socket_timeout_s)
        self._claim = self._client.register_script(_CLAIM_LUA)
        self._release = self._client.register_script(_RELEASE_LUA)
        self._held: str | None = None
        """``"<run id> <owner>"`` of the lease this handle holds."""

    def _call(self, what: str, op: Callable[[], T]) -> T:
        return retrying(op, time.monotonic() + self.op_timeout_s, f"{what} of run {self.run!r} on {self.url}")

    # -- the run record ------------------------------------------------------------

    def record(self) -> RunRecord | None:
        """The run that owns the run name (None: no run id stored)."""
        raw = self._call("read the run record", lambda: self._client.get(self.keys.run_record))
        return None if raw is None else msgspec.json.decode(raw, type=RunRecord)

    def set_record(self, record: RunRecord) -> None:
        """Store ``record`` as the run name's owner."""
        self._call("store the run record", lambda: self._client.set(self.keys.run_record, msgspec.json.encode(record)))

    def holds_data(self) -> bool:
        """Whether the run name holds queue data: counters, queued groups, prompts, failures."""
        def read() -> bool:
            pipe = self._client.pipeline(transaction=False)
            pipe.exists(*(getattr(self.keys, name) for name in _DATA_KEYS))
            pipe.xlen(self.keys.rollouts)
            found, queued = pipe.execute()
            return bool(found or queued)

        return self._call("look for data", read)

    def move_aside(self, to_run: str) -> int:
        """Rename every key of the run (its lease excepted) to the same key of run ``to_run``,
        e.g. ``quickstart:rollouts`` -> ``quickstart.previous-<id>:rollouts``: the old run's
        queue stays readable under that name and this one starts empty. Keys keep their TTLs.
        Returns how many were moved."""
        def rename() -> int:
            keys = [k.decode() for k in self._client.scan_iter(match=self.keys.pattern, count=1000)]
            moved = {key: to_run + key[len(self.run):] for key in keys if key != self.keys.lease}
            if moved and self._client.exists(*moved.values()):
                raise FileExistsError(f"keys of run {to_run!r} exist already on {self.url}: not moving run {self.run!r} over them")
            pipe = self._client.pipeline(transaction=True)
            for key, new in moved.items():
                pipe.rename(key, new)
            pipe.execute()
            return len(moved)

        return self._call("move the run's keys aside", rename)

    # -- the lease -----------------------------------------------------------------

    def lease(self) -> Lease | None:
        """Who holds the run name now (None: nobody)."""
        def read() -> tuple[bytes | None, int]:
            pipe = self._client.pipeline(transaction=False)
            pipe.get(self.keys.lease)
            pipe.pttl(self.keys.lease)
            held, ttl_ms = pipe.execute()
            return held, int(ttl_ms)

        held, ttl_ms = self._call("read the lease", read)
        return None if held is None else _parse(held, ttl_ms / 1000)

    def acquire(self, run_id: str, owner: str, *, take_over: bool = False) -> None:
        """Hold the run name's lease as ``owner`` (``<host>-<pid>``, no spaces) of run ``run_id``.

        ``take_over``: whoever holds it is certainly gone (the embedded Redis of this run
        directory: its previous driver died with it). Otherwise a lease of another run is
        refused at once (:class:`RunInUseError`); one of the same run (its driver was killed,
        or still runs) is waited for until it lapses, at most :data:`LEASE_TTL_S` seconds: if
        it is renewed meanwhile, that driver lives and this one is refused. Blocks up to that
        long: call it off the event loop.
        """
        if not owner or " " in owner:
            raise ValueError(f"owner must be a non-empty name without spaces, got {owner!r}")
        value = f"{run_id} {owner}"
        deadline: float | None = None
        while True:
            held = self._call("take the lease", lambda: self._claim(keys=[self.keys.lease], args=[value, int(LEASE_TTL_S * 1000), int(take_over)]))
            if held is None:
                self._held = value
                return
            holder = self.lease() or _parse(held, 0.0)
            if holder.run_id != run_id:
                raise RunInUseError(
                    f"trainer.run_name={self.run!r} is in use on {self.url} by run {holder.run_id} (driver {holder.owner}, which renews "
                    f"its lease every {LEASE_RENEW_S:g} s): pick another trainer.run_name for this run (its queue keys are "
                    f"'<run_name>:*'), or stop that run first")
            if deadline is None:
                deadline = time.monotonic() + holder.ttl_s + 1.0
                log.warning("run %s is held by driver %s (lease renewed %.0f s ago): waiting up to %.0f s for it to lapse "
                            "(a killed driver's lease does)", run_id, holder.owner, LEASE_TTL_S - holder.ttl_s, holder.ttl_s + 1.0)
            elif time.monotonic() > deadline:
                raise RunInUseError(
                    f"run {run_id} (trainer.run_name={self.run!r}) is already running on {self.url}: driver {holder.owner} keeps "
                    f"renewing its lease. Stop that driver first, or start this one with another trainer.run_name and output_dir")
            time.sleep(1.0)

    def renew(self) -> None:
        """Renew the lease this handle holds; :class:`LeaseLostError` if another driver took it."""
        if self._held is None:
            raise RuntimeError("renew() before acquire()")
        value = self._held
        held = self._call("renew the lease", lambda: self._claim(keys=[self.keys.lease], args=[value, int(LEASE_TTL_S * 1000), 0]))
        if held is not None:
            holder = _parse(held, 0.0)
            self._held = None
            raise LeaseLostError(
                f"driver {holder.owner} (run {holder.run_id}) took trainer.run_name={self.run!r} on {self.url}: this driver could not "
                f"renew its lease within {LEASE_TTL_S:g} s (Redis unreachable?), so two runs now write to one queue; stopping this one")

    def release(self) -> None:
        """Give the lease back (nothing if another driver holds it)."""
        if self._held is not None:
            value, self._held = self._held, None
            self._call("release the lease", lambda: self._release(keys=[self.keys.lease], args=[value]))

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()

    def __enter__(self) -> RunOwnership:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _parse(held: bytes, ttl_s: float) -> Lease:
    run_id, _, owner = held.decode().partition(" ")
    return Lease(run_id, owner, max(ttl_s, 0.0))
