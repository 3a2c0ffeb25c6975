"""A served model outside the run (``models.<name>.url``): an OpenAI-compatible server that
answers the model's requests instead of servers of the run's own.

:class:`ExternalModel` is a Ray actor with :class:`~async_rl.rollout.served.ServedModel`'s
interface, named the same way, so the rollout workers' clients and the driver's health
checks cannot tell the two apart. A judge's generation is ``POST /completions`` with the
prompt's token ids (its text answer is what a judge reads); a teacher's scoring is the same
endpoint with vLLM's ``prompt_logprobs`` extension (a vLLM server only). Each attempt is
bounded by ``request_timeout_s``; a request is tried up to ``max_attempts`` times while the
server times out, cannot be reached or answers 5xx/429; a 4xx answer is the request's own
fault (or a wrong key) and is not retried. The server is not the run's: it is never
restarted or resized, and the health check only says when it stops or starts answering.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import httpx

from async_rl.rollout.served import RequestLedger
from async_rl.rollout.server import ServerHealth
from async_rl.rollout.types import Completion, Sampling, ScoredTokens, ServedModelError

RETRY_PAUSE_S = 1.0
"""Pause before the next attempt after the server could not be reached or answered 5xx/429, seconds."""
HEALTH_TIMEOUT_S = 10.0
"""Longest the health check's ``GET /models`` may take, seconds."""


class RequestRefused(ValueError):
    """The server answered 4xx: the request's own fault (or a wrong key), not retried."""


class ExternalModel:
    """Requests to one model on an OpenAI-compatible server outside the run (run as a Ray actor).

    Args:
        name: the model's name (``models.<name>``): its metrics' key and, with ``api_model``
            empty, the request's ``model``.
        url: the server's OpenAI API base (``http://HOST:PORT/v1``).
        api_model: the model's name on that server.
        api_key: the server's API key (a bearer token), or None.
        request_timeout_s: longest one attempt may take, seconds.
        max_attempts: attempts of one request before its caller gets the error.
    """

    def __init__(self, name: str, url: str, api_model: str, api_key: str | None, request_timeout_s: float = 60.0, max_attempts: int = 3):
        self.name = name
        self.url = url.rstrip("/")
        self.api_model = api_model
        self.request_timeout_s = request_timeout_s
        self.max_attempts = max_attempts
        self.ledger = RequestLedger(name)
        self._http = httpx.AsyncClient(base_url=self.url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
                                       timeout=request_timeout_s)
        self._running = 0
        self._started = time.monotonic()
        self._down: str | None = None
        """Why the server did not answer the last health check (None: it did)."""

    async def start(self) -> list[ServerHealth]:
        """Check that the server answers and serves the model; raises :class:`ServedModelError` otherwise."""
        health = await self.health()
        if isinstance(health[0], str):
            raise ServedModelError(health[0])
        return health  # type: ignore[return-value]

    async def generate(self, prompt_token_ids: list[int], n: int, sampling: Sampling) -> list[Completion]:
        """``n`` answers to one tokenised prompt (a judge's verdicts): their text and finish
        reason; token ids and log-probs where the server returns them (vLLM's
        ``return_token_ids``), else empty."""
        body: dict[str, Any] = {"prompt": list(prompt_token_ids), "n": n, "max_tokens": sampling.max_tokens,
                                "temperature": sampling.temperature, "top_p": sampling.top_p}
        if sampling.ignore_eos:
            body["ignore_eos"] = True  # vLLM's extension
        reply = await self._call(body, len(prompt_token_ids))
        self.ledger.counters["generated_tokens"] += int((reply.get("usage") or {}).get("completion_tokens") or 0)
        return [Completion(list(c.get("token_ids") or []), [], [], c.get("finish_reason") or "stop", c.get("text") or "")
                for c in sorted(reply["choices"], key=lambda c: c.get("index", 0))]

    async def prompt_logprobs(self, token_ids: list[int], top_k: int = 0) -> ScoredTokens:
        """The model's log-probability of each token of ``token_ids`` after those before it
        (``len - 1`` positions), with its ``top_k`` likeliest tokens at each, from vLLM's
        ``prompt_logprobs`` extension."""
        if len(token_ids) < 2:
            raise ValueError(f"models.{self.name}: scoring needs at least 2 tokens, got {len(token_ids)}")
        reply = await self._call({"prompt": list(token_ids), "max_tokens": 1, "prompt_logprobs": top_k}, len(token_ids))
        positions = reply["choices"][0].get("prompt_logprobs")
        if not positions or len(positions) != len(token_ids):
            raise ServedModelError(f"models.{self.name}: {self.url} returned no prompt log-probs (a vLLM server's prompt_logprobs is needed)")
        try:
            given = [float(position[str(token)]["logprob"]) for position, token in zip(positions[1:], token_ids[1:], strict=True)]
            # each position: {token id: {logprob, rank}}, the given token and the top-k by rank (one entry if it is among them)
            tops = [sorted((entry["rank"], int(token), float(entry["logprob"])) for token, entry in position.items()
                           if 1 <= entry["rank"] <= top_k) for position in positions[1:]] if top_k else []
        except (KeyError, TypeError, ValueError):
            raise ServedModelError(f"models.{self.name}: {self.url}'s prompt log-probs do not follow the given tokens") from None
        if any(len(top) != top_k for top in tops):
            raise ServedModelError(f"models.{self.name}: {self.url} returned fewer than top-{top_k} prompt log-probs a position")
        return ScoredTokens(given, [[t for _, t, _ in top] for top in tops], [[x for _, _, x in top] for top in tops])

    async def classify(self, token_ids: list[int]) -> list[float]:
        raise ValueError(f"models.{self.name} is outside the run (url): a reward model there is not supported")

    async def _call(self, body: dict[str, Any], prompt_tokens: int) -> dict[str, Any]:
        """``POST /completions`` of ``body`` for the model, retried (module docstring); the reply's JSON."""
        started = time.monotonic()
        counters = self.ledger.counters
        counters["requests"] += 1
        counters["prompt_tokens"] += prompt_tokens
        last = ""
        self._running += 1
        try:
            for attempt in range(self.max_attempts):
                if attempt:
                    counters["retries"] += 1
                try:
                    response = await self._http.post("/completions", json={"model": self.api_model, **body})
                except httpx.TimeoutException:
                    counters["timeouts"] += 1
                    last = f"no answer within request_timeout_s={self.request_timeout_s:g} s"
                    continue
                except httpx.TransportError as exc:
                    counters["errors"] += 1
                    last = f"{type(exc).__name__}: {exc}"
                else:
                    if response.status_code < 400:
                        self.ledger.answered(started)
                        return response.json()
                    text = response.text[:300]
                    if response.status_code != 429 and response.status_code < 500:
                        counters["failed"] += 1
                        raise RequestRefused(f"models.{self.name}: {self.url} refused the request ({response.status_code}: {text})"
                                             + (f" - check the key in models.{self.name}.api_key_env's variable" if response.status_code in (401, 403) else ""))
                    counters["errors"] += 1
                    last = f"{response.status_code}: {text}"
                if attempt + 1 < self.max_attempts:  # no pause after the last attempt
                    await asyncio.sleep(RETRY_PAUSE_S)
        finally:
            self._running -= 1
        counters["failed"] += 1
        raise ServedModelError(f"models.{self.name}: a request to {self.url} failed {self.max_attempts} time(s) "
                               f"(max_attempts={self.max_attempts}); the last: {last}")

    async def health(self) -> list[ServerHealth | str]:
        """The server as one "server" (``<name>-external``), or why it does not answer or does not serve the model."""
        try:
            response = await self._http.get("/models", timeout=HEALTH_TIMEOUT_S)
            response.raise_for_status()
            served = [m.get("id") for m in response.json().get("data", [])]
        except (httpx.HTTPError, ValueError) as exc:
            return [f"{self.name}-external: {self.url} does not answer ({type(exc).__name__}: {str(exc)[:200]})"]
        if self.api_model not in served:
            return [f"{self.name}-external: {self.url} does not serve {self.api_model!r} (it serves {served}): set models.{self.name}.api_model"]
        return [ServerHealth(f"{self.name}-external", 0, self._running, self.ledger.counters["generated_tokens"], time.monotonic() - self._started,
                             pid=os.getpid(), openai_url=self.url)]

    async def heal(self) -> list[str]:
        """Nothing to replace (the server is not the run's): a line when it stops or starts answering."""
        health = (await self.health())[0]
        down = health if isinstance(health, str) else None
        lines = []
        if down and down != self._down:
            lines.append(f"{down}; its requests are retried and then fail their samples")
        elif self._down and not down:
            lines.append(f"{self.name}-external: {self.url} answers again")
        self._down = down
        return lines

    async def scale_to(self, n: int, grace_s: float) -> list[str]:
        raise ValueError(f"models.{self.name} is served outside the run ({self.url}): its servers are not the run's to resize")

    def stats(self) -> dict[str, float]:
        """The counters since start, latencies and requests running (``models/<name>/...``); one server, never replaced."""
        return self.ledger.stats(self._running, 1, 0)

    async def shutdown(self) -> None:
        """Close the connections (the server goes on)."""
        await self._http.aclose()
