"""A group's samples as multi-turn episodes of an environment (``rollout.env``).

For one dataset row, :class:`EpisodeSampler` runs ``n`` episodes concurrently on the
worker's server. Each model turn is generated after the episode's exact token context
(:class:`~async_rl.envs.conversation.TokenTrajectory`: the first prompt, then every turn's
tokens as generated and the template's and environment's tokens as rendered per message),
so the learner trains on exactly the tokens the model produced. ``rollout.max_response_length``
bounds the tokens of an episode's whole response, template and environment tokens included,
and ``data.max_prompt_length`` its first prompt, so every context fits the engine's
``max_model_len`` (their sum): an episode whose first prompt is longer ends with an error
before any generation, and one whose next observation would overrun the budget ends there
(the observation is not kept: nothing after the last model turn is trained).

The group's prompt is the longest common prefix of its episodes' first prompts (all of it
when ``reset`` depends only on the row); the rest of each episode's prompt opens its
response, untrained. The episode's reward is ``rollout.env.reward`` over its steps.

The environments live in the server's :class:`~async_rl.envs.runner.EnvPool`. An episode the
environment failed carries its :class:`~async_rl.records.Failure`: the sample's ``error`` is
its signature and ``error_kind`` its kind (``env_error`` or ``env_timeout``). An episode whose
environment process was killed under it (another episode's call hung or blocked it) is
played again from the start, once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from async_rl.data.prompts import PromptRow
from async_rl.envs import EnvLost, EnvPool, Trajectory, run_episode
from async_rl.envs.conversation import ChatEncoder, TokenTrajectory
from async_rl.records import Failure, Sample
from async_rl.rollout.types import GenerateFn, Sampling

if TYPE_CHECKING:
    from async_rl.config import EnvConfig

log = logging.getLogger(__name__)


@dataclass
class EpisodeCounters:
    """Cumulative counts of a sampler's episodes, for metrics."""

    episodes: int = 0
    turns: int = 0
    """Model turns over all episodes (``env/turns_mean`` = turns / episodes)."""
    errors: int = 0
    """Episodes the environment failed (``env_error``: it raised, returned something unusable or
    blocked its event loop; also an episode lost to a process restart twice)."""
    timeouts: int = 0
    """Episodes ended by an environment call longer than ``rollout.env.step_timeout_s`` (``env_timeout``)."""
    blocked: int = 0
    """Episodes whose ``async`` method blocked the environment process's event loop (counted in errors or timeouts too)."""
    restarts: int = 0
    """Environment processes replaced because a call of these episodes hung in a thread or blocked the event loop."""
    reruns: int = 0
    """Episodes played again from the start because their process was killed under them."""
    overlong_prompts: int = 0
    """Episodes whose first prompt was longer than ``data.max_prompt_length`` (not generated)."""
    successes: int = 0
    tool_calls: int = 0
    """Tool calls the model made (``ToolEnvironment``), well-formed or not."""
    tool_errors: int = 0
    """Tool calls answered with an error (unparsable, unknown tool, bad arguments, the tool raised)."""
    step_s: float = 0.0
    """Seconds in the environment's ``step`` calls (``env/step_s_mean`` = step_s / turns)."""
    reward: float = 0.0
    """Sum of the episodes' rewards (``env/reward_mean`` = reward / episodes)."""


@dataclass
class Episode:
    """One finished episode: its text view and its tokens."""

    trajectory: Trajectory
    tokens: TokenTrajectory | None
    """None when the episode ended before the model's first turn."""
    overlong: bool = False
    """Its first prompt was longer than ``data.max_prompt_length`` (it was not generated)."""
    lost: bool = False
    """Its environment process was killed under it (another episode's call hung or blocked it, or it crashed)."""


def _failure(episode: Episode) -> Failure | None:
    """The episode's failure; an episode that ended before the model's first turn without one
    (no token budget for a turn) is failed too, since it has nothing to train."""
    if episode.trajectory.failure is None and (episode.tokens is None or not episode.tokens.token_ids):
        return Failure("env_error", "EmptyEpisode: the episode ended before the model's first turn", "", "reset")
    return episode.trajectory.failure


class EpisodeGroup(NamedTuple):
    """A row's ``n`` episodes as a group: the shared prompt, the samples and, per sample, the
    environment's failure (None where it did not fail)."""

    prompt_ids: list[int]
    samples: list[Sample]
    failures: list[Failure | None]


class EpisodeSampler:
    """Runs the episodes of a row on one server.

    Args:
        envs: the server's environment processes (``rollout.env.name``), started.
        cfg: ``rollout.env``.
        encoder: the chat template of the server's tokenizer.
        sampling: per-turn sampling; its ``max_tokens`` is the budget of a whole episode.
        max_prompt_length: the most tokens of an episode's first prompt (``data.max_prompt_length``).
    """

    def __init__(self, envs: EnvPool, cfg: EnvConfig, encoder: ChatEncoder, sampling: Sampling, max_prompt_length: int):
        self.envs = envs
        self.cfg = cfg
        self.encoder = encoder
        self.sampling = sampling
        self.max_prompt_length = max_prompt_length
        self.counters = EpisodeCounters()

    async def episode(self, row: PromptRow, generate: GenerateFn) -> Episode:
        """One episode of ``row`` (its fields ``problem`` and ``answer`` go to ``reset(row)``),
        played again once when its environment process is killed under it."""
        episode = await self._play(row, generate)
        if episode.lost:
            self.counters.reruns += 1
            episode = await self._play(row, generate)  # lost again: it stays failed (env_error)
        c = self.counters
        trajectory, failure = episode.trajectory, episode.trajectory.failure
        c.episodes += 1
        c.turns += trajectory.num_turns
        c.errors += failure is not None and failure.kind == "env_error" and not episode.overlong
        c.timeouts += failure is not None and failure.kind == "env_timeout"
        c.overlong_prompts += episode.overlong
        c.successes += failure is None and trajectory.success
        c.tool_calls += int(trajectory.info_total("tool_calls"))
        c.tool_errors += int(trajectory.info_total("tool_errors"))
        c.step_s += trajectory.step_s
        c.reward += 0.0 if failure is not None else trajectory.total_reward(self.cfg.reward)
        if failure is not None:
            log.debug("episode of dataset line %d ended by the environment: %s (%s)", row.line, failure.signature, failure.where)
        return episode

    async def _play(self, row: PromptRow, generate: GenerateFn) -> Episode:
        """One try at an episode (``lost`` when its process was killed under it)."""
        tokens: TokenTrajectory | None = None
        budget = self.sampling.max_tokens
        closed = True  # the last reply's closing template tokens fitted the budget

        async def act(new_messages: list[dict[str, str]]) -> str | None:
            nonlocal tokens, closed
            if tokens is None:
                prompt = self.encoder.start(new_messages, env.tools)
                if len(prompt) > self.max_prompt_length:
                    raise _Overlong(f"the first prompt has {len(prompt)} tokens > data.max_prompt_length={self.max_prompt_length}")
                tokens = TokenTrajectory(prompt)
            else:
                added = self.encoder.append(new_messages)
                if not closed or len(tokens.token_ids) + len(added) >= budget:
                    return None  # no room for another model turn
                tokens.add_context(added)
            left = budget - len(tokens.token_ids)
            if self.cfg.max_turn_tokens:
                left = min(left, self.cfg.max_turn_tokens)
            if left < 1:
                return None
            (reply,) = await generate(tokens.context(), 1, dataclasses.replace(self.sampling, max_tokens=left))
            tokens.add_model(reply.token_ids, reply.logprobs, reply.versions)
            close = self.encoder.close_reply(reply.token_ids)
            closed = len(tokens.token_ids) + len(close) <= budget  # else the episode ends after this turn
            if closed:
                tokens.add_context(close)
            return reply.text

        env = self.envs.open()
        try:
            trajectory = await run_episode(env, act, max_turns=self.cfg.max_turns, row={"problem": row.prompt, "answer": row.answer})
        except _Overlong as exc:
            return Episode(Trajectory(failure=Failure("env_error", f"PromptTooLong: {exc}", "", "reset")), None, overlong=True)
        except EnvLost as exc:  # its text view ended with run_episode; its tokens so far are kept
            return Episode(Trajectory(failure=Failure("env_error", f"EnvLost: {exc}"[:500], "", "reset")), tokens, lost=True)
        finally:
            env.close()
            self.counters.restarts += env.restarted
            self.counters.blocked += env.blocked
        return Episode(trajectory, tokens)

    async def group(self, row: PromptRow, n: int, generate: GenerateFn) -> EpisodeGroup | None:
        """``n`` concurrent episodes of ``row`` as a group; None when no episode reached the
        model's first turn (every ``reset`` failed: nothing to train)."""
        episodes = await asyncio.gather(*(self.episode(row, generate) for _ in range(n)))
        started = [e.tokens for e in episodes if e.tokens is not None and e.tokens.token_ids]
        if not started:
            failure = next((e.trajectory.failure for e in episodes if e.trajectory.failure), None)
            log.warning("dataset line %d: no episode reached the model's first turn (%s); the prompt is skipped",
                        row.line, f"{failure.signature} at {failure.where or '?'}" if failure else "no tokens")
            return None
        prompt = _common_prefix([t.prompt_ids for t in started])
        failures = [_failure(e) for e in episodes]
        return EpisodeGroup(prompt, [self._sample(e, f, len(prompt)) for e, f in zip(episodes, failures)], failures)

    def _sample(self, episode: Episode, failure: Failure | None, shared: int) -> Sample:
        trajectory, tokens = episode.trajectory, episode.tokens
        reward = 0.0 if failure is not None else trajectory.total_reward(self.cfg.reward)
        components = {"turns": float(trajectory.num_turns), "success": float(failure is None and trajectory.success)}
        finish = "error" if failure is not None else "stop" if trajectory.done else "length"
        error, kind = (None, None) if failure is None else (failure.signature, failure.kind)
        if tokens is None or not tokens.token_ids:
            return Sample.from_lists([], [], [], reward, components, finish, error, error_kind=kind)
        opening = tokens.prompt_ids[shared:]  # this episode's own start of the prompt: context, not trained
        first = next(v for v, m in zip(tokens.versions, tokens.mask) if m)
        return Sample.from_lists(
            opening + tokens.token_ids, [0.0] * len(opening) + tokens.logprobs, [first] * len(opening) + tokens.versions,
            reward, components, finish, error, mask=[0] * len(opening) + tokens.mask, error_kind=kind,
        )


class _Overlong(Exception):
    """An episode's first prompt is longer than ``data.max_prompt_length``."""


def _common_prefix(sequences: list[list[int]]) -> list[int]:
    """The longest prefix shared by every sequence."""
    first = sequences[0]
    end = len(first)
    for seq in sequences[1:]:
        end = min(end, len(seq))
        for i in range(end):
            if seq[i] != first[i]:
                end = i
                break
    return first[:end]
