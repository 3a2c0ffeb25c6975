"""The inference server: one persistent vLLM async engine serving token-in/token-out requests.

It runs as a Ray actor (``ray.remote(InferenceServer)``; its methods are async, so Ray
runs them on the actor's event loop and many requests share the engine's continuous
batching). Token versions come from vLLM itself: the engine core labels every sampled
token with the weight version it held (``update_weight_version``), and the final output
carries them as spans, so a generation that straddles a weight update is tagged exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import io
import logging
import os
import signal
import sys
import time
import traceback
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from async_rl.rollout.openai_api import OpenAIApi, OpenAIApiSettings, refuse_dev_mode
from async_rl.rollout.types import Completion, HostFactory, RolloutHost, Sampling, ScoredTokens
from async_rl.sync.auth import SyncEndpoint

if TYPE_CHECKING:
    from async_rl.data.prompts import PromptRow

log = logging.getLogger(__name__)

RECEIVER_EXTENSION = "async_rl.sync.vllm_receiver.WeightReceiverExtension"
"""vLLM worker extension that receives weight broadcasts (see async_rl/sync/vllm_receiver.py)."""
ENGINE_POLL_S = 1.0
"""How often a server checks that its vLLM engine lives, seconds: the longest a dead engine goes unnoticed."""
ENGINE_PROBE_S = 5.0
"""How often a server sends its vLLM engine a probe (a ``collective_rpc`` round trip through
the engine core and every worker, queued behind the step running), seconds: a hung engine (a
stuck kernel or collective, a stopped process) answers none (``rollout.engine_hang_timeout_s``)."""
RETURN_WORK_TIMEOUT_S = 10.0
"""After its engine died, how long a server's rollout workers may take to end their tickets
(their prompts go back to the queue) before the pool replaces the server anyway, seconds."""

HUNG = "declared hung"
"""In the reason :meth:`InferenceServer.engine_died` gives for an engine that hung (not died)."""

T = TypeVar("T")


class EngineDied(RuntimeError):
    """The server's vLLM engine died (its process was killed or crashed: a CUDA fault, the OOM
    killer) while the server actor lives. Requests on it fail at once; the pool replaces the server."""


def engine_processes(engine: Any) -> list[Any]:
    """The engine core processes (``multiprocessing`` processes) vLLM started for ``engine``;
    none when the engine runs in this process. Reads vLLM's client internals, which vLLM
    exposes no public accessor for; missing attributes give an empty list."""
    resources = getattr(getattr(engine, "engine_core", None), "resources", None)
    return list(getattr(getattr(resources, "engine_manager", None), "processes", None) or [])


def engine_death(engine: Any) -> str | None:
    """Why ``engine`` is dead, or None while it lives: an engine core process that exited (the
    server is its parent, so this is a non-blocking ``waitpid``), or vLLM's own dead-engine
    flag (``AsyncLLM.errored``: its monitor saw a process die, or its output loop ended)."""
    for proc in engine_processes(engine):
        code = proc.exitcode
        if code is not None:
            how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
            return f"its vLLM engine process {proc.name} (pid {proc.pid}) {how}"
    if getattr(engine, "errored", False):
        return "vLLM reports its engine dead (EngineDeadError)"
    return None


def kill_engine(engine: Any) -> list[int]:
    """SIGKILL ``engine``'s engine core processes and all their descendants (a stopped or hung
    process cannot end itself); returns the pids killed. The tree is read before any kill: a
    child of a killed process is reparented and could no longer be found."""
    import psutil

    tree: list[psutil.Process] = []
    for proc in engine_processes(engine):
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(proc.pid)
            tree += [root, *root.children(recursive=True)]
    killed = []
    for member in tree:
        with contextlib.suppress(psutil.Error):
            member.kill()
            killed.append(member.pid)
    return killed


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _suspended_coroutines() -> list[traceback.StackSummary]:
    """Where every suspended coroutine of this process waits, one stack per outermost one.
    Found through the garbage collector: Ray's task wrappers are Cython coroutines that hide
    what they await, so ``Task.get_stack`` shows nothing below them."""
    coros = [o for o in gc.get_objects() if inspect.iscoroutine(o) and o.cr_frame is not None]
    awaited = {id(c.cr_await) for c in coros if c.cr_await is not None}
    stacks = []
    for coro in coros:
        if id(coro) in awaited:
            continue
        frames = []
        while inspect.iscoroutine(coro) and coro.cr_frame is not None:
            frames.append((coro.cr_frame, coro.cr_frame.f_lineno))
            coro = coro.cr_await
        stacks.append(traceback.StackSummary.extract(frames))
    return stacks


class EngineOutputError(RuntimeError):
    """vLLM's output broke an invariant the records rely on (no final output, or log-probs that
    do not follow the sampled tokens). The request fails; the worker retries and counts it."""


@dataclass
class ServerHealth:
    """What ``health()`` reports."""

    server_id: str
    version: int
    running_requests: int
    generated_tokens: int
    uptime_s: float
    weight_updates: int = 0
    """Weight updates applied since start."""
    last_update_pause_s: float | None = None
    """Seconds generation was paused by the last weight update."""
    busy_s: float = 0.0
    """Seconds with at least one request running since start (for busy fractions)."""
    pid: int = field(default_factory=os.getpid)
    openai_url: str | None = None
    """Base URL of the server's OpenAI-compatible HTTP API (``http://HOST:PORT/v1``); None when not served."""
    engine_pids: list[int] = field(default_factory=list)
    """Process ids of the vLLM engine core processes (empty when the engine runs in the server's process)."""


class InferenceServer:
    """Hosts one vLLM ``AsyncLLM`` for the whole run.

    Args:
        server_id: name used in records and metrics.
        engine_kwargs: ``AsyncEngineArgs`` keyword arguments (see ``engine_args.engine_kwargs``).
            With ``enable_lora`` the server serves a LoRA policy: the base model plus one
            adapter (a zero adapter at start, version 0), which weight updates replace; every
            request names it (:func:`~async_rl.sync.lora.policy_lora_request`).
        version: policy version of the weights at ``engine_kwargs["model"]``.
        openai_api: where to serve vLLM's OpenAI-compatible HTTP API from the same engine; None serves none.
        hang_timeout_s: an engine that answers no probe for this long is declared hung and
            killed (``rollout.engine_hang_timeout_s``; :meth:`engine_died` reports it), seconds.
    """

    def __init__(self, server_id: str, engine_kwargs: dict[str, Any], version: int = 0, openai_api: OpenAIApiSettings | None = None,
                 hang_timeout_s: float = 60.0):
        self.server_id = server_id
        self.hang_timeout_s = hang_timeout_s
        self.engine_kwargs = dict(engine_kwargs)
        self.lora_rank: int | None = self.engine_kwargs["max_lora_rank"] if self.engine_kwargs.get("enable_lora") else None
        """The largest LoRA rank served (a LoRA policy), or None (full weights)."""
        self.openai_api = openai_api
        self._http: OpenAIApi | None = None
        self._version = version
        self._engine: Any = None
        self._started = time.monotonic()
        self._running = 0
        self._generated = 0
        self._busy_s = 0.0
        self._busy_since = 0.0
        self._sync: Any = None
        self._sync_task: asyncio.Task | None = None
        self._fatal: str | None = None
        self._death: asyncio.Future[str] | None = None
        """Resolved with the reason when the engine is found dead (requests waiting on it fail)."""
        self._engine_watch: asyncio.Task[str] | None = None
        self.updates: list[Any] = []
        """Outcomes of the successful weight updates (``async_rl.sync.server.UpdateOutcome``)."""
        self._host: RolloutHost | None = None
        self.step = "not started"
        """Where :meth:`start` is (for :meth:`stacks`)."""

    async def start(self, sync: SyncEndpoint | None = None, control_timeout_s: float = 10.0) -> ServerHealth:
        """Build the engine (about 15 s on CPU for the tiny model) and its HTTP API; idempotent.

        With ``sync`` (a ``WeightSender``'s address and the run's secret), the server registers for weight
        updates and applies them in the background for the rest of its life. With an HTTP
        API to serve, ``VLLM_SERVER_DEV_MODE`` in this process's environment raises
        :class:`~async_rl.rollout.openai_api.DevModeError` before the engine is built.
        """
        if self.openai_api is not None:
            refuse_dev_mode()  # the driver checked its own environment; this is the actor's (a node's `ray start`)
        if self._engine is None:
            self.step = "building its vLLM engine"
            from vllm import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            args = AsyncEngineArgs(logprobs_mode="processed_logprobs", worker_extension_cls=RECEIVER_EXTENSION, **self.engine_kwargs)
            self._engine = AsyncLLM.from_engine_args(args)
            if self.lora_rank is not None:
                from async_rl.sync.server import EngineHandle

                self.step = "installing its zero LoRA adapter"
                await EngineHandle(self._engine).rpc("wsync_lora_init", (self.lora_rank,), control_timeout_s)
            await self._engine.update_weight_version(str(self._version))
            self._death = asyncio.get_running_loop().create_future()
            self._engine_watch = asyncio.create_task(self._watch_engine())
        if self.openai_api is not None and self._http is None:
            self.step = "starting its OpenAI API"
            self._http = await OpenAIApi.start(self._engine, self.engine_kwargs["model"], self.openai_api)
            self._serve_policy_adapter()
        if sync is not None and self._sync is None:
            from async_rl.sync.server import WeightUpdateServer

            self.step = "registering for weight updates"
            self._sync = WeightUpdateServer(self._engine, sync, self.server_id, version=self._version, control_timeout_s=control_timeout_s)
            await self._sync.start()
            self._sync_task = asyncio.create_task(self._sync.serve(on_outcome=self._on_update))
        self.step = "started"
        return await self.health()

    async def stacks(self) -> tuple[str, str]:
        """``(step, stacks)``: the step of :meth:`start` it is at (``"started"`` once done) and
        the stacks of its asyncio tasks and threads, to find where a start or a call hangs."""
        out = io.StringIO()
        for chain in _suspended_coroutines():
            out.write(f"Coroutine:\n{''.join(chain.format())}")
        for ident, frame in sys._current_frames().items():
            out.write(f"Thread {ident}:\n{''.join(traceback.format_stack(frame, limit=12))}")
        return f"at step: {self.step}", out.getvalue()

    def tokenizer(self) -> Any:
        """The engine's tokenizer (HF API: chat template, encode, decode)."""
        return self._engine.tokenizer

    async def start_workers(self, host: HostFactory, rows: list[PromptRow], owner: str) -> None:
        """Run the rollout workers in this process (``host``: their builder, e.g.
        ``partial(WorkerHost, spec)``): they generate here and write their groups straight to
        Redis. ``owner`` names their tickets (unique per server process)."""
        if self._host is not None:
            raise RuntimeError(f"{self.server_id}: rollout workers already started")
        built = host(rows, self.tokenizer(), self.generate, self.server_id, owner)
        await built.start()
        self._host = built

    async def stop_workers(self, grace_s: float) -> dict[str, float]:
        """Stop the rollout workers (groups in flight get ``grace_s`` seconds, then end their
        tickets); returns their counters ({} if none ran)."""
        host, self._host = self._host, None
        return {} if host is None else await host.stop(grace_s)

    async def _watch_engine(self) -> str:
        """Every :data:`ENGINE_POLL_S` seconds, check the engine lives, and every
        :data:`ENGINE_PROBE_S` seconds probe it; one that answered no probe for
        ``hang_timeout_s`` is hung: its processes are killed. When it died or hung: fail the
        requests waiting on it, stop the rollout workers at once (each group in flight ends
        its ticket: its admission slot is released and its prompt returned to the queue),
        and return why (:meth:`engine_died`)."""
        probe: asyncio.Future[Any] | None = None
        answered = sent = time.monotonic()
        try:
            while (reason := engine_death(self._engine)) is None:
                now = time.monotonic()
                if probe is not None and probe.done():
                    if not probe.cancelled():
                        probe.exception()  # retrieved: an answer that is an error is a sign of life too
                    answered, probe = now, None
                if probe is None and now - sent >= ENGINE_PROBE_S:
                    probe, sent = asyncio.ensure_future(self._engine.collective_rpc("wsync_worker_index")), now
                if probe is not None and now - answered > self.hang_timeout_s:
                    reason = self._kill_hung(now - answered)
                    break
                await asyncio.sleep(ENGINE_POLL_S)
        finally:
            if probe is not None and not probe.done():
                probe.cancel()
        log.error("%s: %s; failing its requests and returning its rollout workers' groups in flight", self.server_id, reason)
        if self._death is not None and not self._death.done():
            self._death.set_result(reason)
        try:
            await asyncio.wait_for(self.stop_workers(0.0), RETURN_WORK_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - the pool still replaces us; it ends the tickets left open
            log.warning("%s: rollout workers did not stop cleanly (%s: %s)", self.server_id, type(exc).__name__, exc)
        return reason

    def _kill_hung(self, silent_s: float) -> str:
        """Kill the hung engine's process tree; returns the reason the pool reports."""
        names = ", ".join(f"{p.name} (pid {p.pid})" for p in engine_processes(self._engine)) or "in the server's process"
        killed = kill_engine(self._engine)
        return (f"its vLLM engine {names} answered no probe for {silent_s:.0f} s while {self._running} requests ran "
                f"(rollout.engine_hang_timeout_s={self.hang_timeout_s:g}): {HUNG}, {len(killed)} processes killed")

    async def engine_died(self) -> str:
        """Wait until the engine dies (forever while it lives); returns why (e.g. "its vLLM engine
        process EngineCore (pid 123) was killed by SIGKILL"), once the rollout
        workers have given back their groups in flight. The pool waits on this to replace
        the server at once instead of at its next health check."""
        if self._engine_watch is None:  # no engine of our own (a stand-in server): it never dies
            await asyncio.get_running_loop().create_future()
        return await asyncio.shield(self._engine_watch)  # type: ignore[arg-type]

    def _check_engine(self) -> None:
        """Raise :class:`EngineDied` if the engine is dead."""
        reason = self._death.result() if self._death is not None and self._death.done() else engine_death(self._engine)
        if reason is not None:
            raise EngineDied(f"{self.server_id}: {reason}")

    async def _unless_dead(self, work: Awaitable[T]) -> T:
        """``work``'s result, or :class:`EngineDied` as soon as the engine is found dead: a
        request on a dead engine fails within :data:`ENGINE_POLL_S`, it never hangs."""
        task = asyncio.ensure_future(work)
        if self._death is None:
            return await task
        try:
            await asyncio.wait((task, self._death), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()  # vLLM aborts the request (a no-op on a dead engine)
                task.add_done_callback(lambda t: t.cancelled() or t.exception())  # its error is the engine's death: seen
        if task.done() and not task.cancelled():
            return task.result()
        raise EngineDied(f"{self.server_id}: {self._death.result()}")

    async def _final_output(self, request: dict[str, Any], params: Any, pooling: bool = False) -> Any:
        final = None
        if pooling:  # a classifier's one output
            async for out in self._engine.encode(request, params, request_id=uuid.uuid4().hex):
                final = out
            return final
        lora_request = None
        if self.lora_rank is not None:
            from async_rl.sync.lora import policy_lora_request

            lora_request = policy_lora_request(self._version)
        final = None
        async for out in self._engine.generate(request, params, request_id=uuid.uuid4().hex, lora_request=lora_request):
            final = out
        return final

    def _serve_policy_adapter(self) -> None:
        """A LoRA policy's OpenAI API answers with the adapter of the version held: requests
        naming the API's model get the trained policy, not the base model (nothing to do for
        full weights, which the engine holds itself)."""
        if self.lora_rank is not None and self._http is not None:
            from async_rl.sync.lora import policy_lora_request

            self._http.serve_adapter(policy_lora_request(self._version, self._http.model_name))

    def _on_update(self, outcome: Any) -> None:
        if outcome.ok:
            self._version = outcome.version
            self.updates.append(outcome)
            self._serve_policy_adapter()
        elif outcome.fatal:
            self._fatal = outcome.error  # weights undefined: health() fails, the pool replaces us
        else:
            log.warning("%s: weight update %d failed, still serving version %d: %s", self.server_id, outcome.update_id, self._version, outcome.error)

    async def generate(self, prompt_token_ids: list[int], n: int, sampling: Sampling, images: list[Any] | None = None) -> list[Completion]:
        """Sample ``n`` responses to one tokenised prompt; returns them in index order.

        ``images`` (PIL images, in prompt order) go to a vision-language model with the prompt
        holding one placeholder token per image; vLLM's processor expands each into the
        model's image tokens, and the completions carry the expanded prompt."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if self._fatal is not None:  # undefined weights: take no request until the pool replaces this server
            raise RuntimeError(f"{self.server_id} holds undefined weights after a failed load: {self._fatal}")
        self._check_engine()

        params = SamplingParams(
            n=n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_tokens,
            ignore_eos=sampling.ignore_eos,
            logprobs=0,
            output_kind=RequestOutputKind.FINAL_ONLY,
            # No per-token detokenisation or Logprob objects in the engine's output loop
            # (it shares the CPU with generation): the text is decoded once at the end.
            detokenize=False,
            flat_logprobs=True,
        )
        request: dict[str, Any] = {"prompt_token_ids": prompt_token_ids}
        if images:
            request["multi_modal_data"] = {"image": images if len(images) > 1 else images[0]}
        final = await self._request(request, params)
        outputs = sorted(final.outputs, key=lambda c: c.index)
        texts = self._engine.tokenizer.batch_decode([list(c.token_ids) for c in outputs], skip_special_tokens=True)
        completions = [self._completion(c, text) for c, text in zip(outputs, texts, strict=True)]
        if images:
            expanded = list(final.prompt_token_ids)
            for c in completions:
                c.prompt_token_ids = expanded
        self._generated += sum(len(c.token_ids) for c in completions)
        return completions

    async def _request(self, request: dict[str, Any], params: Any, pooling: bool = False) -> Any:
        """The final output of one engine request (a generation; ``pooling``: a classification),
        counted as running while it runs."""
        if self._running == 0:
            self._busy_since = time.monotonic()
        self._running += 1
        try:
            final = await self._unless_dead(self._final_output(request, params, pooling))
        finally:
            self._running -= 1
            if self._running == 0:
                self._busy_s += time.monotonic() - self._busy_since
        if final is None or not final.finished:
            raise EngineOutputError(f"{self.server_id}: vLLM returned no final output for a request")
        return final

    async def prompt_logprobs(self, token_ids: list[int], top_k: int = 0) -> ScoredTokens:
        """The log-probability of each token of ``token_ids`` after the tokens before it, under
        this server's weights: ``len(token_ids) - 1`` positions (the first token has none),
        with this model's ``top_k`` likeliest tokens at each (``top_k`` at most the engine's
        ``max_logprobs``, 20 by default). A teacher's scoring of a student's sample (prompt +
        response tokens): one prefill, no sampled token kept."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        if self._fatal is not None:
            raise RuntimeError(f"{self.server_id} holds undefined weights after a failed load: {self._fatal}")
        self._check_engine()
        if len(token_ids) < 2:
            raise ValueError(f"{self.server_id}: scoring needs at least 2 tokens, got {len(token_ids)}")
        params = SamplingParams(max_tokens=1, prompt_logprobs=top_k, output_kind=RequestOutputKind.FINAL_ONLY, detokenize=False,
                                flat_logprobs=True)
        final = await self._request({"prompt_token_ids": list(token_ids)}, params)
        flat = final.prompt_logprobs  # FlatLogprobs: position 0 holds nothing, each later one the given token, then its top-k by rank
        starts = flat.start_indices[1:] if flat is not None else []
        if len(starts) != len(token_ids) - 1 or [flat.token_ids[i] for i in starts] != list(token_ids[1:]):
            raise EngineOutputError(f"{self.server_id}: vLLM's prompt log-probs do not follow the given tokens")
        if top_k and any(flat.ranks[i + 1:i + 1 + top_k] != list(range(1, top_k + 1)) for i in starts):
            raise EngineOutputError(f"{self.server_id}: vLLM's prompt log-probs hold no top-{top_k} after a given token")
        return ScoredTokens([flat.logprobs[i] for i in starts],
                            [flat.token_ids[i + 1:i + 1 + top_k] for i in starts] if top_k else [],
                            [flat.logprobs[i + 1:i + 1 + top_k] for i in starts] if top_k else [])

    async def classify(self, token_ids: list[int]) -> list[float]:
        """A sequence classifier's probability of each label for ``token_ids`` (a reward model's
        score of a text; one label: its sigmoid). Needs an engine on vLLM's pooling runner
        (``runner="pooling"``, a served model's ``task: classify``)."""
        from vllm import PoolingParams

        if not token_ids:
            raise ValueError(f"{self.server_id}: classifying needs at least 1 token")
        if self.engine_kwargs.get("runner") != "pooling":
            raise ValueError(f"{self.server_id} generates (it is not a classify model, task: classify)")
        self._check_engine()
        final = await self._request({"prompt_token_ids": list(token_ids)}, PoolingParams(task="classify"), pooling=True)
        return [float(p) for p in final.outputs.data.tolist()]

    def _completion(self, out: Any, text: str) -> Completion:
        token_ids = list(out.token_ids)
        flat = out.logprobs  # FlatLogprobs: the sampled token comes first at each position
        logprobs = [flat.logprobs[i] for i in flat.start_indices]
        if [flat.token_ids[i] for i in flat.start_indices] != token_ids:
            raise EngineOutputError(f"{self.server_id}: vLLM log-probs do not follow the sampled tokens")
        versions = [self._version] * len(token_ids)
        for span in out.weight_versions or []:
            versions[span.start : span.end] = [int(span.version)] * (span.end - span.start)
        return Completion(token_ids, logprobs, versions, out.finish_reason or "stop", text)

    async def set_version(self, version: int) -> None:
        """Label tokens sampled from now on with ``version`` (weight updates do this themselves)."""
        self._version = version
        await self._engine.update_weight_version(str(version))

    async def pause(self) -> None:
        """Stop scheduling without dropping requests (they resume on :meth:`resume`)."""
        await self._engine.pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        """Resume scheduling after :meth:`pause`."""
        await self._engine.resume_generation()

    async def health(self) -> ServerHealth:
        """Liveness and load; raises if the engine has died (:class:`EngineDied`) or a weight load broke it."""
        self._check_engine()
        if self._fatal is not None:
            raise RuntimeError(f"{self.server_id} holds undefined weights after a failed load: {self._fatal}")
        if self._sync_task is not None and self._sync_task.done() and not self._sync_task.cancelled():
            raise RuntimeError(f"{self.server_id}: weight-update loop died: {self._sync_task.exception()!r}")
        if self._http is not None and self._http.stopped:
            raise RuntimeError(f"{self.server_id}: the OpenAI API server stopped")
        if self._host is not None:
            self._host.check()
        last = self.updates[-1].pause_s if self.updates else None
        busy = self._busy_s + (time.monotonic() - self._busy_since if self._running else 0.0)
        return ServerHealth(self.server_id, self._version, self._running, self._generated, time.monotonic() - self._started,
                            len(self.updates), last, busy, openai_url=self._http.url if self._http else None,
                            engine_pids=[p.pid for p in engine_processes(self._engine)])

    async def shutdown(self) -> None:
        """Stop the HTTP API, the weight-update loop, the engine and its worker processes."""
        if self._engine_watch is not None:  # an engine we stop ourselves is no death to report
            self._engine_watch.cancel()
        await self.stop_workers(0.0)
        if self._http is not None:
            await self._http.stop()
            self._http = None
        if self._sync_task is not None:
            self._sync_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._sync_task  # the socket is the loop's until it stopped
            await self._sync.leave("the server stops")
            self._sync_task = self._sync = None
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
