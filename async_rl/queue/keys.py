"""Redis key and field names of one run: the layout `redis-cli` users see."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CONSUMER_GROUP", "FAILURES_MAXLEN", "FAILURE_FIELD", "PAYLOAD_FIELD", "VERSIONS_MAXLEN", "RunKeys"]

CONSUMER_GROUP = "learner"
PAYLOAD_FIELD = b"group"  # stream entry field holding the msgspec-encoded RolloutGroup
FAILURE_FIELD = b"report"  # failures stream entry field holding a msgspec-encoded FailureReport
FAILURES_MAXLEN = 10_000
"""Failure reports the queue keeps (the driver appends each to a file within about a second)."""
VERSIONS_MAXLEN = 16
"""Published versions the ``versions`` stream keeps (a waiter needs only the newest)."""


@dataclass(frozen=True)
class RunKeys:
    """Keys of run ``run``.

    - ``rollouts``: stream of unacknowledged encoded groups (acked entries are deleted).
    - ``dead``: stream of undecodable entries (fields ``id``, ``reason``, ``raw``).
    - ``counters``: hash of integers shared by every process: ``version``,
      ``groups_started``, ``prompt_cursor``, ``producers`` (worker loops admitting, set by
      the driver: admission's per-call share), ``dropped_stale``, ``dead_lettered``,
      ``dropped_<reason>`` (groups the learner read but would not train).
    - ``inflight``: hash ``prompt index -> "<ticket number> <owner>"`` of admitted groups
      not yet enqueued (``counters.tickets`` numbers the tickets).
    - ``returned``: list of prompt indices claimed but never enqueued, served first.
    - ``slotted``: set of the ``rollouts`` entry ids that hold an admission slot (put with a
      ticket): only their drops give a slot back, and reconciling counts only them (an
      entry written into the stream some other way never took one).
    - ``versions``: stream of the published versions (field ``version``; the newest
      :data:`VERSIONS_MAXLEN` kept), appended whenever the published version rises: rollout
      workers waiting on a closed admission block on it (``XREAD BLOCK``) instead of polling.
    - ``idle``: sorted set of the worker loops with no open ticket that admission refused
      (owner -> when it asked, ms since the epoch): busy loops leave them a slot each;
      entries expire after :data:`~async_rl.queue.admission.IDLE_LOOP_TTL_MS`.
    - ``rollout_stats``: hash of the rollout workers' cumulative counters (``groups_put``,
      ``tokens_generated``, ``reward_errors``, ...), added to by every worker host.
    - ``failures``: stream of msgspec-encoded :class:`~async_rl.records.FailureReport`
      (field ``report``): every sample the user's reward function or environment failed
      on, from every server; capped at the newest ``FAILURES_MAXLEN`` entries.
    - ``reply(call)``: the JSON reply of one call of a script that writes (admit, abandon,
      drop, commit, ...), kept a minute longer than the call's retries: a call retried
      after its reply was lost gets it back instead of applying twice.
    - ``last_put(producer)``: ``"<seq> <entry id>"`` of a producer's last put, expiring
      a minute after its retries end (makes retried puts idempotent).
    - ``run_record``: JSON of the run that owns these keys (``run_id``, ``output_dir``,
      ``host``, ``started_at``): set at the run's first start (:mod:`async_rl.queue.ownership`).
    - ``lease``: ``"<run id> <owner>"`` of the live driver, with a TTL it keeps renewing.
    - ``image(sha256)``: PNG bytes of one image of a vision-language prompt, stored once
      per content however many groups use it; every put of a group that uses it renews
      its expiry (``queue.image_ttl_s``).
    """

    run: str

    @property
    def rollouts(self) -> str:
        return f"{self.run}:rollouts"

    @property
    def dead(self) -> str:
        return f"{self.run}:dead"

    @property
    def counters(self) -> str:
        return f"{self.run}:counters"

    @property
    def inflight(self) -> str:
        return f"{self.run}:inflight"

    @property
    def returned(self) -> str:
        return f"{self.run}:returned"

    @property
    def slotted(self) -> str:
        return f"{self.run}:slotted"

    @property
    def versions(self) -> str:
        return f"{self.run}:versions"

    @property
    def idle(self) -> str:
        return f"{self.run}:idle"

    @property
    def rollout_stats(self) -> str:
        return f"{self.run}:rollout-stats"

    @property
    def failures(self) -> str:
        return f"{self.run}:failures"

    def reply(self, call_id: str) -> str:
        return f"{self.run}:reply:{call_id}"

    @property
    def run_record(self) -> str:
        return f"{self.run}:run"

    @property
    def lease(self) -> str:
        return f"{self.run}:lease"

    @property
    def pattern(self) -> str:
        """SCAN pattern of every key of the run (glob characters of the name escaped)."""
        return "".join("\\" + c if c in "*?[]\\" else c for c in self.run) + ":*"

    def last_put(self, producer: str) -> str:
        return f"{self.run}:last-put:{producer}"

    def image(self, sha256: str) -> str:
        return f"{self.run}:image:{sha256}"
