"""Requests to a served model (``models.<name>``) from another process than the driver's: a
rollout worker's, in its inference server. The model's actor
(:class:`~async_rl.rollout.served.ServedModel`) is found by its Ray name and found again
when the driver restarted it after it died."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from async_rl.rollout.types import Completion, Sampling, ScoredTokens, ServedModelError

LOOKUP_POLL_S = 1.0
"""How often a caller looks for a served model's actor again while it is gone (restarting), seconds."""


class ServedModelClient:
    """Requests to one served model's actor from another process (a rollout worker's), found
    by its Ray name (:func:`~async_rl.rollout.types.served_model_actor`) and found again when the
    driver restarted it; a request waits at most ``wait_s`` seconds for the actor to be back."""

    def __init__(self, actor_name: str, wait_s: float):
        self.actor_name = actor_name
        self.wait_s = wait_s
        self._handle: Any = None

    async def generate(self, prompt_token_ids: list[int], n: int, sampling: Sampling) -> list[Completion]:
        """The served model's ``generate``; :class:`ServedModelError` when it gave no answer."""
        return await self._call("generate", prompt_token_ids, n, sampling)

    async def prompt_logprobs(self, token_ids: list[int], top_k: int = 0) -> ScoredTokens:
        """The served model's ``prompt_logprobs`` (``len - 1`` positions, with its ``top_k``
        likeliest tokens at each); :class:`ServedModelError` when it gave none."""
        return await self._call("prompt_logprobs", token_ids, top_k)

    async def classify(self, token_ids: list[int]) -> list[float]:
        """The served reward model's ``classify`` (each label's probability); :class:`ServedModelError` when it gave none."""
        return await self._call("classify", token_ids)

    async def _call(self, method: str, *args: Any) -> Any:
        deadline = time.monotonic() + self.wait_s
        while True:
            handle = self._handle or await self._lookup(deadline)
            try:
                return await getattr(handle, method).remote(*args)
            except RayActorError as exc:  # the actor died: the driver's health check starts a new one
                self._handle = None
                if time.monotonic() > deadline:
                    raise ServedModelError(f"{self.actor_name} died and was not back within {self.wait_s:g} s ({type(exc).__name__})") from None
                await asyncio.sleep(LOOKUP_POLL_S)
            except RayTaskError as exc:
                raise (exc.cause if isinstance(exc.cause, BaseException) else exc) from None

    async def _lookup(self, deadline: float) -> Any:
        while True:
            try:
                self._handle = await asyncio.to_thread(ray.get_actor, self.actor_name)
                return self._handle
            except ValueError:  # no actor of that name (yet, or again)
                if time.monotonic() > deadline:
                    raise ServedModelError(f"no served model {self.actor_name} within {self.wait_s:g} s") from None
                await asyncio.sleep(LOOKUP_POLL_S)
