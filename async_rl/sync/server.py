"""Engine side of weight sync: the control loop of one inference server.

:class:`WeightUpdateServer` talks to the sender over ZeroMQ and drives the engine's
workers (:class:`~async_rl.sync.vllm_receiver.WeightReceiverExtension`) with
``collective_rpc``. It works with the async engine (``vllm.v1.engine.async_llm.AsyncLLM``,
whose methods are coroutines) and with the offline ``vllm.LLM`` (plain methods).

On the async engine, generation continues while buckets are received; it is paused only
for the load with ``pause_generation(mode="keep", clear_cache=False)``: running requests
are frozen, not dropped, and continue on the new weights after ``resume_generation()``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from async_rl.sync.auth import SyncEndpoint
from async_rl.sync.control import (
    Abort,
    Ack,
    Announce,
    ControlTimeout,
    ErrorKind,
    Hello,
    Leave,
    Message,
    Ready,
    ServerChannel,
    Start,
    clip_error,
    encode,
)
from async_rl.sync.ipc import host_identity

log = logging.getLogger(__name__)

RPC_REPLY_MARGIN_S = 5.0
"""How much longer than the workers' own timeout a ``collective_rpc`` may take to come back, seconds."""


class EngineHandle:
    """Uniform async access to a vLLM engine (``AsyncLLM`` or offline ``LLM``)."""

    def __init__(self, engine: Any):
        self.engine = engine

    async def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        out = getattr(self.engine, name)(*args, **kwargs)
        return await out if inspect.isawaitable(out) else out

    async def rpc(self, method: str, args: tuple = (), timeout_s: float | None = None) -> list[Any]:
        """``collective_rpc`` on every worker; one result per worker. ``timeout_s`` bounds the
        workers (vLLM's own timeout, in the engine process) and, :data:`RPC_REPLY_MARGIN_S`
        later, the wait here: a request or reply lost between this process and the engine
        core raises ``TimeoutError`` too instead of waiting forever."""
        call = self._call("collective_rpc", method, timeout=timeout_s, args=args)
        if timeout_s is None:
            return await call
        try:
            return await asyncio.wait_for(call, timeout_s + RPC_REPLY_MARGIN_S)
        except asyncio.TimeoutError:
            raise TimeoutError(f"the vLLM engine did not answer collective_rpc {method!r} within {timeout_s + RPC_REPLY_MARGIN_S:g} s") from None

    @property
    def dead(self) -> bool:
        """vLLM's own dead-engine flag (``AsyncLLM.errored``; the offline ``LLM`` has none)."""
        return bool(getattr(self.engine, "errored", False))

    async def pause(self) -> None:
        """Freeze scheduling, keeping running requests (no-op on the offline ``LLM``,
        which runs nothing between calls)."""
        if hasattr(self.engine, "pause_generation"):
            await self._call("pause_generation", mode="keep", clear_cache=False)

    async def resume(self) -> None:
        if hasattr(self.engine, "resume_generation"):
            await self._call("resume_generation")

    async def set_version(self, version: int) -> None:
        """Label tokens sampled from now on with ``version`` (vLLM tags each output token with
        the engine's weight version; the offline ``LLM`` has no such label)."""
        if hasattr(self.engine, "update_weight_version"):
            await self._call("update_weight_version", str(version))

    async def reset_prefix_cache(self) -> bool:
        """Forget cached prefixes computed with the old weights. False when blocks are
        still held by (kept) running requests: vLLM then keeps the cache; run the engine
        with ``enable_prefix_caching=False`` if stale prefix hits are not acceptable."""
        return bool(await self._call("reset_prefix_cache"))


@dataclass(frozen=True)
class UpdateOutcome:
    """One update as this server saw it (times in seconds)."""

    update_id: int
    version: int | None
    """Version served after the update (the previous one if it failed)."""
    error: str | None = None
    fatal: bool = False
    receive_s: float = 0.0
    load_s: float = 0.0
    pause_s: float = 0.0
    prefix_cache_reset: bool = False
    error_kind: ErrorKind | None = None
    """See :attr:`~async_rl.sync.control.Ack.error_kind`."""

    @property
    def ok(self) -> bool:
        return self.error is None


LEAVE_LINGER_S = 1.0
"""How long a leaving server's socket may take to write its Leave, seconds (on busy cores 50 ms
was not always enough; a sender that never gets it still stops waiting once the connection closed)."""


class WeightUpdateServer:
    """Receives weight updates for one engine; call :meth:`start` once, then
    :meth:`serve` (background task) or :meth:`serve_one`."""

    def __init__(
        self,
        engine: Any,
        endpoint: SyncEndpoint,
        server_id: str,
        *,
        version: int | None = None,
        heartbeat_s: float = 5.0,
        control_timeout_s: float = 10.0,
        poll_s: float = 0.005,
    ):
        """
        Args:
            engine: ``AsyncLLM`` or ``LLM`` built with the receiver extension.
            endpoint: the sender's :attr:`WeightSender.address` and the run's secret.
            server_id: stable name of this server (a restarted one keeps it).
            version: weights version the engine was started with (None: unknown, the
                sender will see this server as behind and send it the current weights).
            heartbeat_s: Hello period while idle (re-registers with a restarted sender).
            control_timeout_s: bound of one control send and of one ``collective_rpc``.
            poll_s: first interval of receive-progress polling (doubles up to 0.1 s).
        """
        self.engine = EngineHandle(engine)
        self.server_id = server_id
        self.version = version
        self.heartbeat_s = heartbeat_s
        self.control_timeout_s = control_timeout_s
        self.poll_s = poll_s
        self._channel = ServerChannel(endpoint.address, endpoint.secret)
        self._num_workers = 0
        self._gpu = ""
        """UUID of the GPU every worker runs on ("": none, or several)."""
        self._pending: Announce | None = None
        """An Announce that arrived while another update was running."""

    async def start(self) -> None:
        """Count the engine's workers, find their GPU and register with the sender."""
        indices = await self.engine.rpc("wsync_worker_index", timeout_s=self.control_timeout_s)
        self._num_workers = len(indices)
        gpus = set(await self.engine.rpc("wsync_gpu", timeout_s=self.control_timeout_s))
        self._gpu = gpus.pop() if len(gpus) == 1 else ""
        await self._hello()

    async def serve(self, on_outcome: Callable[[UpdateOutcome], None] | None = None) -> None:
        """Handle updates forever (cancel the task to stop)."""
        while True:
            outcome = await self.serve_one(self.heartbeat_s * 10)
            if outcome is not None and on_outcome is not None:
                on_outcome(outcome)

    async def serve_one(self, timeout_s: float) -> UpdateOutcome | None:
        """Handle control messages until one update ends (success or failure); None when
        ``timeout_s`` seconds pass without one. Sends a Hello every ``heartbeat_s`` idle."""
        deadline = time.monotonic() + timeout_s
        announce, self._pending = self._pending, None
        if announce is not None and (refusal := await self._ready(announce)) is not None:
            return self._declined(announce, refusal)
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                msg = await self._channel.recv(min(self.heartbeat_s, remaining))
            except ControlTimeout:
                await self._hello()
                continue
            if isinstance(msg, Announce):
                announce = msg
                if (refusal := await self._ready(msg)) is not None:
                    return self._declined(msg, refusal)
            elif isinstance(msg, Start) and announce is not None and msg.update_id == announce.update_id:
                try:
                    outcome = await self._update(announce, msg)
                except Exception as e:  # noqa: BLE001 - e.g. the engine died mid-update: the sender must get an Ack, not wait out its timeout
                    self.version = None
                    outcome = UpdateOutcome(msg.update_id, None, f"{type(e).__name__}: {e}", fatal=True)
                await self._send(
                    Ack(outcome.update_id, self.server_id, outcome.version, None if outcome.error is None else clip_error(outcome.error),
                        outcome.fatal, outcome.receive_s, outcome.load_s, outcome.pause_s, outcome.error_kind)
                )
                if outcome.ok:
                    log.info("weight sync: %s now serves version %s", self.server_id, self.version)
                else:
                    log.warning("weight sync: %s update %d failed: %s", self.server_id, outcome.update_id, outcome.error)
                return outcome
            elif isinstance(msg, Abort) and announce is not None and msg.update_id == announce.update_id:
                announce = None
        return None

    async def leave(self, reason: str) -> None:
        """Tell the sender this server stops (best effort: a sender that is gone has nothing
        to forget), then close the socket. Call once :meth:`serve` is no longer running."""
        linger_s = 0.0
        try:
            await self._send(Leave(self.server_id, clip_error(reason)))
            linger_s = LEAVE_LINGER_S
        except ControlTimeout:
            log.warning("weight sync: %s could not tell the sender it leaves", self.server_id)
        finally:
            self._channel.close(linger_s)

    @property
    def dropped(self) -> dict[str, int]:
        """Control messages this server dropped so far, by reason (:mod:`async_rl.sync.auth`)."""
        return dict(self._channel.dropped)

    def close(self) -> None:
        self._channel.close()

    # -- internals -----------------------------------------------------------------

    async def _send(self, msg: Message) -> None:
        await self._channel.send(msg, self.control_timeout_s)

    async def _ready(self, announce: Announce) -> str | None:
        """Answer ``announce``: take part (None), or decline and return why: the engine is dead,
        or its workers cannot take this update (``wsync_check``: e.g. a LoRA adapter of a rank
        the engine cannot serve). The sender then leaves this server out of the update at once
        instead of waiting for it, and the server keeps serving what it served."""
        if self.engine.dead:
            refusal: str | None = "the vLLM engine is dead"
        else:
            try:
                refusals = await self.engine.rpc("wsync_check", (encode(announce),), self.control_timeout_s)
                refusal = next((r for r in refusals if r is not None), None)
            except Exception as e:  # noqa: BLE001 - an engine that cannot answer cannot take the update either
                refusal = f"the vLLM engine did not check the update: {type(e).__name__}: {e}"
        await self._send(Ready(announce.update_id, self.server_id, error=None if refusal is None else clip_error(refusal)))
        return refusal

    def _declined(self, announce: Announce, refusal: str) -> UpdateOutcome:
        log.warning("weight sync: %s declined update %d: %s", self.server_id, announce.update_id, refusal)
        return UpdateOutcome(announce.update_id, self.version, f"declined: {refusal}")

    async def _hello(self) -> None:
        await self._send(Hello(self.server_id, self._num_workers, self.version, host_identity(), self._gpu))

    async def _update(self, announce: Announce, start: Start) -> UpdateOutcome:
        uid = announce.update_id
        t0 = time.monotonic()
        try:
            await self.engine.rpc("wsync_begin", (encode(announce), encode(start)), self.control_timeout_s)
            failure = await self._wait_received(uid, start.timeout_s)
        except Exception as e:  # an rpc failing or timing out is this update's failure
            failure = f"{type(e).__name__}: {e}", None
        if failure is not None:
            await self.engine.rpc("wsync_discard", (uid,), self.control_timeout_s)
            error, kind = failure
            return UpdateOutcome(uid, self.version, error, receive_s=time.monotonic() - t0, error_kind=kind)
        receive_s = time.monotonic() - t0

        t1 = time.monotonic()
        await self.engine.pause()
        try:
            load_s = max(await self.engine.rpc("wsync_load", (uid,), max(start.timeout_s, self.control_timeout_s)))
        except Exception as e:  # a half-done load leaves undefined weights: fatal
            self.version = None
            return UpdateOutcome(uid, None, f"load failed: {type(e).__name__}: {e}", fatal=True)
        else:
            self.version = announce.version
            await self.engine.set_version(announce.version)  # before resume: no token mislabelled
            reset = await self.engine.reset_prefix_cache()
        finally:
            await self.engine.resume()
        return UpdateOutcome(uid, self.version, None, False, receive_s, load_s, time.monotonic() - t1, reset)

    async def _wait_received(self, uid: int, timeout_s: float) -> tuple[str, ErrorKind | None] | None:
        """Poll the workers until all staged ``uid`` (None) or one failed, the sender
        aborted, or ``timeout_s`` passed (the error text and the first failed worker's
        kind, if any). The workers enforce the same timeout themselves; the extra second
        here only covers a stuck worker thread."""
        deadline = time.monotonic() + timeout_s + 1.0
        delay = self.poll_s
        while True:
            statuses = await self.engine.rpc("wsync_status", (uid,), self.control_timeout_s)
            failed = [(err, kind) for state, err, _, kind in statuses if state == "failed"]
            if failed:
                kind = next((k for _, k in failed if k is not None), None)
                return "; ".join(e or "receive failed" for e, _ in failed), kind
            if all(state == "received" for state, _, _, _ in statuses):
                return None
            if time.monotonic() >= deadline:
                return f"receive timed out after {timeout_s:.1f} s", None
            try:
                msg = await self._channel.recv(delay)
            except ControlTimeout:
                msg = None
            if isinstance(msg, Abort) and msg.update_id == uid:
                return f"aborted by sender: {msg.reason}", None
            if isinstance(msg, Announce):  # the sender gave up on uid and moved on
                self._pending = msg
                return f"superseded by update {msg.update_id}", None
            delay = min(delay * 2, 0.1)
