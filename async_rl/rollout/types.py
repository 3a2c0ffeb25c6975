"""Value types the rollout modules share: a request's sampling, a completion, the ``generate``
call, and the host a server builds for its rollout workers.

They live here, below the server, the worker loop, the episodes and the host, so that each of
those imports this module and none imports another for a type (no import cycle).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Protocol

if TYPE_CHECKING:
    from async_rl.data.prompts import PromptRow
    from async_rl.rewards.scoring import RewardCounters, Score


@dataclass
class Sampling:
    """Sampling settings of one request (mirrors ``rollout.*`` config keys)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    """Longest response in tokens."""
    ignore_eos: bool = False
    """Keep generating past end-of-sequence (fixed-length responses: benchmarks, tests)."""


@dataclass
class Completion:
    """One sampled response.

    ``token_ids``, ``logprobs`` (natural log, behaviour policy after temperature/top-p,
    i.e. the distribution actually sampled from) and ``versions`` (policy version of each
    token) all have one entry per response token.
    """

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    text: str = ""
    prompt_token_ids: list[int] | None = None
    """The prompt as the engine ran it, when images expanded it (each image's placeholder
    token replaced by the model's image tokens); None for a text prompt (it is the request's)."""


@dataclass
class ScoredTokens:
    """A model's scoring of given tokens (a distillation teacher's of a student's sample):
    ``logprobs`` ``[P]`` the log-probability of each token after those before it; with top-k,
    ``top_ids`` and ``top_logprobs`` ``[P][k]`` its k likeliest tokens at each position,
    likeliest first (empty lists without). Natural log, temperature 1."""

    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]

    def tail(self, start: int) -> ScoredTokens:
        """The scores from position ``start`` on (a sample's response tokens)."""
        return ScoredTokens(self.logprobs[start:], self.top_ids[start:], self.top_logprobs[start:])


class GenerateFn(Protocol):
    """``await generate(prompt_token_ids, n, sampling, images)`` on some inference server
    (``images``: PIL images of a vision-language prompt, in prompt order; passed only for
    such prompts, so a text-only stand-in may take three arguments)."""

    def __call__(self, prompt_token_ids: list[int], n: int, sampling: Sampling, images: list[Any] | None = None) -> Awaitable[list[Completion]]: ...


class RolloutHost(Protocol):
    """The rollout workers a server runs in its process (:class:`~async_rl.rollout.host.WorkerHost`)."""

    async def start(self) -> None:
        """Start the workers."""

    def check(self) -> None:
        """Raise if a worker loop ended with an error."""

    async def stop(self, grace_s: float) -> dict[str, float]:
        """Stop the workers (groups in flight get ``grace_s`` seconds); returns their counters."""


class HostFactory(Protocol):
    """Builds a server's :class:`RolloutHost` in the server's own process from the training
    ``rows``, the server's tokenizer and ``generate``, its id and the ticket ``owner``.

    It travels to the server actor pickled by Ray, so it is a module-level callable or a
    ``functools.partial`` of one (the pool sends ``partial(WorkerHost, spec)``); the server
    thereby builds its host without importing the host's module."""

    def __call__(self, rows: list[PromptRow], tokenizer: Any, generate: GenerateFn, server_id: str, owner: str) -> RolloutHost: ...


class Scorer(Protocol):
    """What a rollout worker scores a group's responses with: the reward function's
    :class:`~async_rl.rewards.RewardScorer`, or with a judge :class:`~async_rl.rollout.judging.JudgedScorer`."""

    @property
    def counters(self) -> RewardCounters: ...

    async def score(self, inputs: list[dict[str, Any]]) -> list[Score]: ...

    def keep_group(self, rewards: list[float]) -> bool: ...


def served_model_actor(run_name: str, model: str) -> str:
    """The Ray name of the actor serving ``models.<model>`` of run ``run_name``
    (:class:`~async_rl.rollout.served.ServedModel`; callers in other processes find it by it)."""
    return f"async-rl:{run_name}:model:{model}"


class ServedModelError(RuntimeError):
    """A request to a served model failed on every server it was tried on (or found none in
    its time); the message names the model, the attempts and the last error."""
