"""A fake inference server for benchmarks of the rollout data path: no vLLM, light on CPU.

:class:`FakeServer` has :class:`~async_rl.rollout.server.InferenceServer`'s actor interface
(``start``, ``generate``, ``health``, ``start_workers``, ...), so the real
:class:`~async_rl.rollout.pool.ServerPool`, worker hosts, reward pools and Redis run around
it unchanged. It models a saturated accelerator: each server emits ``tokens_per_s`` tokens a
second in total, requests served in arrival order, and a request returns when its last
token would have been generated. One sleep per request; the responses are random digits
(so rule-based rewards vary) with log-prob -1.0 per token.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

from async_rl.rollout.server import InferenceServer, ServerHealth
from async_rl.rollout.types import Completion, Sampling
from async_rl.sync.auth import SyncEndpoint

FAKE_TOKENS_PER_S = 2000.0
"""Default throughput of one fake server, tokens per second."""


class CharTokenizer:
    """The tokenizer the fake server reports: one id per character, a minimal chat template."""

    chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool = False, add_generation_prompt: bool = True) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) % 256 for c in text]}


class FakeServer(InferenceServer):
    """An inference server that generates random tokens at a fixed rate.

    ``engine_kwargs``: ``tokens_per_s`` (float, default :data:`FAKE_TOKENS_PER_S`) and ``seed``.
    """

    def __init__(self, server_id: str, engine_kwargs: dict[str, Any], version: int = 0, openai_api: Any = None, hang_timeout_s: float = 60.0):
        super().__init__(server_id, engine_kwargs, version, None, hang_timeout_s)
        self.tokens_per_s = float(engine_kwargs.get("tokens_per_s", FAKE_TOKENS_PER_S))
        if self.tokens_per_s <= 0:
            raise ValueError(f"tokens_per_s must be > 0, got {self.tokens_per_s}")
        self._rng = random.Random(engine_kwargs.get("seed", 0))
        self._free_at = 0.0
        """Monotonic time when the fake accelerator finishes the requests queued so far."""

    async def start(self, sync: SyncEndpoint | None = None, control_timeout_s: float = 10.0) -> ServerHealth:
        return await self.health()

    def tokenizer(self) -> Any:
        return CharTokenizer()

    async def generate(self, prompt_token_ids: list[int], n: int, sampling: Sampling, images: list[Any] | None = None) -> list[Completion]:
        lengths = [self._rng.randint(1, sampling.max_tokens) if not sampling.ignore_eos else sampling.max_tokens for _ in range(n)]
        now = time.monotonic()
        self._free_at = max(now, self._free_at) + sum(lengths) / self.tokens_per_s
        if self._running == 0:
            self._busy_since = now
        self._running += 1
        try:
            await asyncio.sleep(self._free_at - now)
        finally:
            self._running -= 1
            if self._running == 0:
                self._busy_s += time.monotonic() - self._busy_since
        self._generated += sum(lengths)
        out = []
        for length in lengths:
            digits = [self._rng.randrange(10) for _ in range(length)]
            out.append(Completion([48 + d for d in digits], [-1.0] * length, [self._version] * length,
                                  "length" if length == sampling.max_tokens else "stop", "".join(map(str, digits))))
        return out
