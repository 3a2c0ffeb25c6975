"""What a run that takes no learner step waits for: the component to blame, and the version the
servers' acknowledgements prove they hold (what the driver's watchdog publishes when the
learner's own announcement of it did not come). Pure functions of one snapshot."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from async_rl.queue.admission import admission_limit

VERSION_WATCHDOG_S = 60.0
"""After this long without a learner step while the published version lags the learner's, the
driver publishes the version every live server holds (seconds)."""


@dataclass(frozen=True)
class Snapshot:
    """The run's state as the driver reads it while no step comes."""

    learner_version: int
    """The learner's version (its last step)."""
    published: int
    """The version admission counts from (the queue's ``version``)."""
    groups_started: int
    max_staleness: int
    batch_size: int
    depth: int
    """Groups in the stream the learner has not read."""
    inflight: int
    """Groups admitted and not yet put or abandoned."""
    servers: Sequence[tuple[str, int] | str]
    """Each server's ``(id, version it acknowledged)``, or the error text of one that is not healthy."""
    workers_started: bool = True
    """False while the first validation runs: the rollout workers start after it."""

    @property
    def limit(self) -> int:
        """The groups admission lets start at the published version."""
        return admission_limit(self.published, self.max_staleness, self.batch_size)


def provable_version(snap: Snapshot) -> int | None:
    """The version to publish for admission when the learner's announcement did not come: the
    oldest version a live server holds, at most the learner's; None when that is not newer than
    the published one, when a server is not healthy (its weights are unknown) or none serves."""
    if not snap.servers or any(isinstance(s, str) for s in snap.servers):
        return None
    held = min(min(v for _, v in snap.servers if not isinstance(v, str)), snap.learner_version)  # type: ignore[misc]
    return held if held > snap.published else None


def blame(snap: Snapshot) -> str:
    """The component a run without learner steps waits on, in one sentence."""
    broken = [s for s in snap.servers if isinstance(s, str)]
    if broken:
        return f"the inference servers: {'; '.join(broken)}"
    if not snap.workers_started:
        return ("the first validation: the starting weights are validated before the rollout workers start (verl's "
                "val_before_train; trainer.val_before_train=false skips this one), so no group is generated until it ends")
    if snap.depth >= snap.batch_size:
        return (f"the learner: {snap.depth} groups are queued for it ({snap.batch_size} make a step) and it takes no step "
                "(a slow or hung rank: see trainer.learner_hang_timeout_s)")
    if snap.groups_started < snap.limit:
        if snap.inflight:
            return (f"the inference servers: {snap.inflight} groups are in flight and too few finish "
                    "(generation, the reward function or the environment)")
        return "the rollout workers: admission is open and no group is in flight (are the workers running? the data exhausted?)"
    lagging = [(sid, v) for sid, v in snap.servers if v < snap.learner_version]  # type: ignore[misc]
    if snap.published < snap.learner_version and lagging:
        held = ", ".join(f"{sid} holds {v}" for sid, v in lagging)
        return (f"the weight updates: admission waits for version {snap.learner_version} to reach every server ({held}; "
                "a failed update is retried by the learner's catch-up, a server lagging sync.max_lag_s is replaced)")
    if snap.published < snap.learner_version:
        return (f"the learner's announcement: every server holds version {snap.learner_version} but admission counts from "
                f"{snap.published} (the watchdog publishes it after {VERSION_WATCHDOG_S:g} s)")
    return (f"the inference servers: admission is closed at version {snap.published} ({snap.groups_started} >= {snap.limit} started), "
            f"{snap.inflight} groups in flight, {snap.depth} queued: the learner waits for those in flight")
