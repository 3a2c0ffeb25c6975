"""Models served beside the policy (``models.<name>``): a judge, a reward model, a teacher.

One :class:`ServedModel` Ray actor per model owns that model's vLLM servers (a
:class:`~async_rl.rollout.pool.ServerPool` of :class:`~async_rl.rollout.server.InferenceServer`
actors named ``<name>-<i>``, never registered for weight updates: their weights are the
model's for the whole run) and is the one door to them: callers (the rollout workers, the
driver) send it requests, it sends each to the server with the fewest requests running.

A request is tried on up to ``max_attempts`` servers, each attempt bounded by
``request_timeout_s``: a server whose actor died is replaced by the pool at once, one whose
engine died replaces itself (its watcher), one that timed out is left to the health check
(:meth:`ServedModel.heal`, called by the driver every few seconds, replaces it when its
health check hangs too). The caller gets one answer per request, never two: an attempt that
was given up on is cancelled and whatever it returns later is dropped. An error of the
request itself (a prompt longer than the model's context) is not retried.

The actor is named (:func:`~async_rl.rollout.types.served_model_actor`): a caller whose handle died with the actor looks
the new one up by name once the driver restarted it. Its servers are Ray children of the
actor, so they die with it: a restarted actor starts its own.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

from ray.exceptions import RayActorError, RayTaskError

from async_rl.rollout.pool import ServerPool, ServerSpec
from async_rl.rollout.server import ServerHealth
from async_rl.rollout.types import Completion, Sampling, ScoredTokens, ServedModelError

NO_SERVER_POLL_S = 0.2
"""How often a request waiting for a server to (re)start looks again, seconds."""


def request_fault(error: BaseException) -> bool:
    """Whether ``error`` is the request's own fault, which another server would raise too (not
    retried): a ``ValueError`` or ``TypeError`` (too few tokens), or vLLM's client errors (a
    prompt longer than the model's context: ``VLLMValidationError``, which is no ValueError).
    Anything else (a dead engine, a server stopping, a broken output) is the server's."""
    return isinstance(error, (ValueError, TypeError)) or any(c.__name__ == "VLLMClientError" for c in type(error).__mro__)


class RequestLedger:
    """One served model's request counters and latencies, keyed for the run's metrics
    (``models/<name>/...``): the one place they are counted, for the run's own servers
    (:class:`ServedModel`) and a server outside the run (:class:`~async_rl.rollout.external.ExternalModel`)."""

    def __init__(self, name: str):
        self.name = name
        self.counters: Counter[str] = Counter()
        """``requests``, ``answered``, ``failed`` (gave up), ``retries``, ``timeouts``, ``errors`` (attempts that raised), ``prompt_tokens``, ``generated_tokens``."""
        self.latency_s = 0.0
        """Summed seconds of the requests answered (their retries included)."""
        self.latency_max_s = 0.0

    def answered(self, started: float) -> None:
        """A request that arrived at ``started`` (``time.monotonic()``) was answered now."""
        elapsed = time.monotonic() - started
        self.counters["answered"] += 1
        self.latency_s += elapsed
        self.latency_max_s = max(self.latency_max_s, elapsed)

    def stats(self, running: int, servers: int, restarts: int) -> dict[str, float]:
        """The counters since start, the mean and longest latency (seconds), the requests
        running now, the servers and their replacements."""
        answered = self.counters["answered"]
        out = {f"models/{self.name}/{key}": float(self.counters[key])
               for key in ("requests", "answered", "failed", "retries", "timeouts", "errors", "prompt_tokens", "generated_tokens")}
        out[f"models/{self.name}/latency_mean_s"] = self.latency_s / answered if answered > 0 else 0.0
        out[f"models/{self.name}/latency_max_s"] = self.latency_max_s
        out[f"models/{self.name}/running"] = float(running)
        out[f"models/{self.name}/servers"] = float(servers)
        out[f"models/{self.name}/restarts"] = float(restarts)
        return out


class ServedModel:
    """The servers of one served model and the requests to them (run as a Ray actor).

    Args:
        name: the model's name (``models.<name>``); its servers are ``<name>-<i>``.
        spec: how to start one server (``sync`` None: no weight updates).
        num_servers: servers at start.
        request_timeout_s: longest one attempt of a request may take on one server, seconds.
        max_attempts: servers one request is tried on before its caller gets the error.
    """

    def __init__(self, name: str, spec: ServerSpec, num_servers: int, request_timeout_s: float = 60.0, max_attempts: int = 3):
        if spec.sync is not None:
            raise ValueError(f"{name}: a served model takes no weight updates (its spec has a weight sender)")
        self.name = name
        self.request_timeout_s = request_timeout_s
        self.max_attempts = max_attempts
        self._events: list[str] = []
        """What the pool did on its own (a server replaced after a failed request), for the driver's console."""
        self.pool = ServerPool(spec, num_servers, report=self._events.append, name=name)
        self._gone: set[int] = set()
        """``id()`` of the server handles found dead whose replacement is on its way."""
        self._running: Counter[int] = Counter()
        """Requests running on each server index (this actor's own count: the routing needs no round trip)."""
        self.ledger = RequestLedger(name)

    async def start(self) -> list[ServerHealth]:
        """Start every server (concurrently); returns their health."""
        return await self.pool.start(workers=False)

    async def generate(self, prompt_token_ids: list[int], n: int, sampling: Sampling) -> list[Completion]:
        """Sample ``n`` responses to one tokenised prompt (a judge's verdicts)."""
        out = await self._call("generate", prompt_token_ids, n, sampling)
        self.ledger.counters["prompt_tokens"] += len(prompt_token_ids)
        self.ledger.counters["generated_tokens"] += sum(len(c.token_ids) for c in out)
        return out

    async def prompt_logprobs(self, token_ids: list[int], top_k: int = 0) -> ScoredTokens:
        """The model's log-probability of each token of ``token_ids`` after those before it
        (``len - 1`` positions), with its ``top_k`` likeliest tokens at each: a teacher's
        scoring of a student's prompt and response."""
        out = await self._call("prompt_logprobs", token_ids, top_k)
        self.ledger.counters["prompt_tokens"] += len(token_ids)
        return out

    async def classify(self, token_ids: list[int]) -> list[float]:
        """A reward model's probability of each label for ``token_ids`` (``task: classify``)."""
        out = await self._call("classify", token_ids)
        self.ledger.counters["prompt_tokens"] += len(token_ids)
        return out

    async def _call(self, method: str, *args: Any) -> Any:
        """``method(*args)`` on the least busy server, tried on up to ``max_attempts`` servers."""
        started = time.monotonic()
        self.ledger.counters["requests"] += 1
        tried: list[int] = []
        last = "no server started"
        for attempt in range(self.max_attempts):
            if attempt:
                self.ledger.counters["retries"] += 1
            i = await self._pick(tried, started)
            if i is None:
                break
            tried.append(i)
            handle = self.pool.handle(i)
            self._running[i] += 1
            try:
                result = await asyncio.wait_for(getattr(handle, method).remote(*args), self.request_timeout_s)
            except asyncio.TimeoutError:
                self.ledger.counters["timeouts"] += 1
                last = f"{self.name}-{i} did not answer within request_timeout_s={self.request_timeout_s:g} s"
            except RayActorError as exc:
                self.ledger.counters["errors"] += 1
                last = f"{self.name}-{i} died ({type(exc).__name__})"
                await self._replace(i, handle, f"died ({type(exc).__name__}) during a request")
            except RayTaskError as exc:
                cause = exc.cause if isinstance(exc.cause, BaseException) else exc
                if request_fault(cause):  # no server would answer it
                    self.ledger.counters["failed"] += 1
                    raise cause from None
                self.ledger.counters["errors"] += 1
                last = f"{self.name}-{i}: {type(cause).__name__}: {cause}"
            else:
                self.ledger.answered(started)
                return result
            finally:
                self._running[i] -= 1
        self.ledger.counters["failed"] += 1
        raise ServedModelError(f"models.{self.name}: a {method} request failed on {len(tried)} server(s) "
                               f"(max_attempts={self.max_attempts}); the last: {last}")

    async def _replace(self, i: int, handle: Any, reason: str) -> None:
        """Have the pool replace server ``i`` in the background (the request goes on elsewhere)."""

        async def replace() -> None:
            try:
                await self.pool.restart(i, handle, reason)
            except Exception as exc:  # noqa: BLE001 - heal() tries again
                self._events.append(f"{self.name}-{i}: replacement failed ({type(exc).__name__}: {exc}); the next health check tries again")
            finally:
                self._gone.discard(id(handle))

        self._gone.add(id(handle))  # no request goes to it while its replacement starts
        asyncio.get_running_loop().create_task(replace())

    async def _pick(self, tried: list[int], started: float) -> int | None:
        """The started server with the fewest requests running, one not tried yet if any;
        waits (within ``request_timeout_s`` of ``started``) while none is started."""
        while True:
            ready = [i for i in self.pool.serving() if id(self.pool.handle(i)) not in self._gone]
            fresh = [i for i in ready if i not in tried] or ready
            if fresh:
                return min(fresh, key=lambda i: (self._running[i], i))
            if time.monotonic() - started > self.request_timeout_s:
                return None
            await asyncio.sleep(NO_SERVER_POLL_S)

    async def health(self) -> list[ServerHealth | str]:
        """Each server's health, or the error text of a dead, broken or starting one."""
        return await self.pool.health()

    async def heal(self) -> list[str]:
        """Replace every dead, broken or hung server; returns what was done and what the pool
        did on its own since the last call, a line each (for the driver's console)."""
        actions = await self.pool.heal(0, max_lag_s=float("inf"))
        events, self._events[:] = list(self._events), []
        return events + actions

    async def scale_to(self, n: int, grace_s: float) -> list[str]:
        """Add or remove servers (the newest first) until ``n`` serve; a line per change."""
        return await self.pool.scale_to(n, grace_s)

    def stats(self) -> dict[str, float]:
        """The counters since start, the mean and longest request latency (seconds) and the
        requests running now, keyed for the run's metrics (``models/<name>/...``)."""
        return self.ledger.stats(sum(self._running.values()), self.pool.num_servers, self.pool.restarts)

    async def shutdown(self) -> None:
        """Stop every server."""
        await self.pool.shutdown()
