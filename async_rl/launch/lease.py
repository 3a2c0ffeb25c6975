"""The run's claim on its name: the output directory and the run name's queue bound to one run
id (:func:`~async_rl.launch.run_state.claim_run`), and the run name's lease renewed from a
thread of its own until the run ends."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

from async_rl.launch.plan import StartupError
from async_rl.launch.run_context import RunContext
from async_rl.launch.run_state import RunStateError, claim_run, driver_owner
from async_rl.queue import QueueUnavailableError
from async_rl.queue.ownership import LEASE_RENEW_S, LEASE_RETRY_S, LeaseLostError, RunInUseError, RunOwnership

log = logging.getLogger(__name__)


async def claim_and_hold(stack: contextlib.AsyncExitStack, run: RunContext, redis_url: str, embedded: bool) -> None:
    """Claim the run (a :class:`StartupError` when another run holds its directory or name)
    and renew its lease until ``stack`` closes; the lease is released last of all that writes
    to the queue (``stack`` unwinds in reverse)."""
    cfg = run.cfg
    ownership = stack.enter_context(RunOwnership(redis_url, cfg.trainer.run_name, op_timeout_s=cfg.queue.timeout_s))
    try:
        await asyncio.to_thread(claim_run, ownership, cfg, embedded=embedded, owner=driver_owner())
    except (RunStateError, RunInUseError) as exc:
        raise StartupError(str(exc)) from None
    stack.callback(ownership.release)  # after everything that writes to the queue has stopped
    done = threading.Event()
    holder = threading.Thread(target=_hold_lease, args=(ownership, done, asyncio.get_running_loop(), run),
                              name="run-lease", daemon=True)
    holder.start()
    # At the end: stop renewing, and give a renewal in progress a moment to finish before the
    # release (a late renewal would hold the lease for another TTL); never wait on a dead Redis.
    stack.callback(holder.join, 5.0)
    stack.callback(done.set)


def _hold_lease(ownership: RunOwnership, done: threading.Event, loop: asyncio.AbstractEventLoop, run: RunContext) -> None:
    """Renew the run name's lease every few seconds until ``done``; end the run if another
    driver took it. A thread of its own: neither a busy event loop nor a thread pool whose
    workers all wait (on Redis, on a server's start) may delay it past the lease's TTL, or
    the run would look dead to ``async-rl scale`` and to a second driver."""
    wait_s = LEASE_RENEW_S
    while not done.wait(wait_s):
        try:
            ownership.renew()
            wait_s = LEASE_RENEW_S
        except LeaseLostError as exc:
            loop.call_soon_threadsafe(run.fail, str(exc))
            return
        except QueueUnavailableError as exc:  # Redis away: the queue's own calls decide the run's fate
            # Retried soon: a Redis away past the TTL (a full disk, a restart) dropped the
            # lease, and until it is renewed `async-rl scale` finds no driver (LEASE_BACK_S).
            if not run.outages.waiting_for_disk:  # a Redis waiting for disk space was said already
                log.warning("the run's lease was not renewed: %s", exc)
            wait_s = LEASE_RETRY_S

