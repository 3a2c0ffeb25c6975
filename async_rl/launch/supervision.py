"""Keeping a run going: the learner group started (and the admission ledger reconciled at its
version) and restarted from its last checkpoint when a rank died or hung; every few seconds,
broken or lagging servers replaced, a stalled run ended with its diagnosis, the version
republished when the learner's announcement of it did not come, the disk watched; a
(re)started server admitted once it holds the learner's weights."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace
from typing import Any

import ray

from async_rl.config import Config
from async_rl.launch.learner_group import LearnerGroup, cause
from async_rl.launch.prometheus import server_states
from async_rl.launch.reporting import Reporter
from async_rl.launch.run_context import RunContext
from async_rl.launch.stall import VERSION_WATCHDOG_S, provable_version
from async_rl.queue import QueueUnavailableError
from async_rl.sync.auth import RunSecret, SyncEndpoint

log = logging.getLogger(__name__)

HEALTH_PERIOD_S = 10.0
"""Period of the server health check and of the stall check, seconds."""


class Supervisor:
    def __init__(self, run: RunContext, reporter: Reporter, redis_url: str, rank_cores: list[list[int]] | None):
        self.run = run
        self.reporter = reporter
        self.redis_url = redis_url
        self.rank_cores = rank_cores
        self.secret = RunSecret.generate()
        """Seals the weight-sync control messages; reaches the learner and the servers as an actor argument only."""
        self.restarting = False
        """A learner group is being restarted (its ledger reconciled): the watchdog publishes no version meanwhile."""

    async def start_learners(self, cfg: Config, live: bool = False) -> None:
        """Start the learner group, which loads the latest checkpoint (or the model), and
        reconcile the ledger at its version. ``live``: a restart while the rollout workers
        run (their open tickets stay; the new weight sender takes the old one's port)."""
        run = self.run
        previous = run.learners.sender_address if live else None
        run.learners = await LearnerGroup.start(cfg, self.redis_url, self.secret, self.rank_cores, previous)
        run.version = run.learners.version
        # The learner resumed (its checkpoint's entries are committed): rebuild the ledger from
        # what is really there, so slots and prompts of groups lost with a killed run come back.
        found = await run.redis(lambda: run.queue.reconcile(run.version, cfg.learner.batch_size, live=live))
        if found.returned or found.groups_started != found.groups_started_before:
            log.info("ledger reconciled at version %d: %d prompts returned (claimed, never enqueued), %d groups queued, "
                     "groups_started %d -> %d", run.version, found.returned, found.queued, found.groups_started_before, found.groups_started)

    def sync_endpoint(self) -> SyncEndpoint | None:
        """Where the servers register for weight updates (None: the learner has no sender)."""
        address = self.run.learners.sender_address
        return None if address is None else SyncEndpoint(address, self.secret)

    async def restart_learners(self, why: str) -> bool:
        """A learner rank died or hung: restart the whole group from the last checkpoint, as a
        resume does, while the servers keep generating within the staleness bound; False (the
        run ends) once ``trainer.max_restarts`` restarts are spent or the restart failed."""
        run = self.run
        limit = run.cfg.trainer.max_restarts
        if run.learner_restarts >= limit:
            run.fail(f"{why}; not restarted: trainer.max_restarts={limit} restarts spent")
            return False
        run.learner_restarts += 1
        before, sender_before = run.version, self.sync_endpoint()
        run.say(f"{why}; restarting the learner from its last checkpoint (restart {run.learner_restarts} of "
                f"trainer.max_restarts={limit})")
        run.learners.kill(graceful=False)
        self.restarting = True
        try:  # the same load path as a resume: the newest checkpoint of this run, on learner.world_size ranks
            await self.start_learners(replace(run.cfg, trainer=replace(run.cfg.trainer, resume="auto")), live=True)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            run.fail(f"{why}; the learner's restart failed: {cause(exc)}")
            return False
        finally:
            self.restarting = False
        # On rank 0's node the new sender binds the old one's port and the servers re-register
        # by themselves. Compared with the sender before, not with the pool's: a server still in
        # its first start has none yet (the CI failure of 2026-12-03: every server "replaced").
        if (sync := self.sync_endpoint()) is not None and sync != sender_before:
            run.say(f"the weight sender moved to {run.learners.sender_address}: replacing the servers")
            await run.pool.move_sender(sync, "registered with the old weight sender")
        self.reporter.write_servers()
        redone = f"steps {run.version + 1}-{before} are redone" if before > run.version else "no step is redone"
        run.say(f"learner restarted at version {run.version} (it was at {before}); {redone}")
        return True

    async def on_server_start(self, index: int, handle: Any) -> None:
        """A (re)started or added server serves only once it holds the learner's version of the
        moment it registered, or a later one (the learner's catch-up or next update sends it;
        from then on it gets every update). Not the version of each moment: the learner may
        step faster than a new engine loads, and a server chasing it would never start."""
        target, timeout_s = self.run.version, self.run.cfg.sync.timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                while (await handle.health.remote()).version < target:
                    await asyncio.sleep(0.5)
        except TimeoutError:
            raise TimeoutError(f"server-{index} did not receive version {target} within sync.timeout_s={timeout_s:g}") from None
        self.reporter.write_servers()

    async def watch(self) -> None:
        """Every few seconds: replace broken or lagging servers, and end a run that stalled
        (neither a group generated nor a learner step taken for ``trainer.stall_timeout_s``)."""
        run, cfg = self.run, self.run.cfg
        period_s = min(HEALTH_PERIOD_S, cfg.trainer.stall_timeout_s / 4)
        marker, last_progress = None, time.monotonic()
        while not run.stop.is_set():
            await asyncio.sleep(period_s)
            try:
                rollout = await run.redis(run.queue.rollout_stats)
            except QueueUnavailableError as exc:  # Redis stayed down for queue.timeout_s (a full disk is waited out in run.redis)
                if run.stop.is_set():
                    return  # the run stopped while Redis waited for disk space (past its bound, or a signal)
                run.fail(f"the queue's Redis did not answer for queue.timeout_s={cfg.queue.timeout_s:g} s: {exc}")
                return
            version = run.version
            healths = await run.pool.health()
            run.tracker.servers = server_states(healths, version)
            # Tokens a server generated for anything (a validation too) are progress.
            served = sum(h.generated_tokens for h in healths if not isinstance(h, str))
            progress = (version, rollout.get("groups_put", 0.0), rollout.get("tokens_generated", 0.0), served)
            if progress != marker:
                marker, last_progress = progress, time.monotonic()
            elif time.monotonic() - last_progress > cfg.trainer.stall_timeout_s:
                run.fail(f"no progress for {time.monotonic() - last_progress:.0f} s (trainer.stall_timeout_s="
                         f"{cfg.trainer.stall_timeout_s:g}): {await self.reporter.diagnose()}")
                return
            for line in await run.pool.heal(run.version, cfg.sync.max_lag_s, healths):
                log.warning("%s", line)
            if await run.models.watch_once():
                self.reporter.write_servers()
            if time.monotonic() - run.last_step >= VERSION_WATCHDOG_S and not self.restarting:
                await self._republish_version(healths)
            run.outages.watch_disk()

    async def _republish_version(self, healths: list[Any]) -> None:
        """The watchdog: with no learner step for :data:`VERSION_WATCHDOG_S` while the published
        version lags the learner's, publish the version every live server acknowledged (the
        learner's own announcement of it did not come); said once per version, counted."""
        run = self.run
        snap = await self.reporter.snapshot(healths)
        version = provable_version(snap)
        if version is None or not await run.redis(run.queue.raise_version, version):
            return
        run.recoveries["version_republished"] += 1
        run.say(f"no learner step for {time.monotonic() - run.last_step:.0f} s and admission at version {snap.published} while "
                f"the learner is at {snap.learner_version}: every server holds version {version} (their acknowledgements), "
                f"published it for admission (recoveries/version_republished)")
