"""Rollout workers hosted in their inference server's process: a group never leaves it until Redis.

A server actor (:class:`~async_rl.rollout.server.InferenceServer`, or the benchmarks'
:class:`~async_rl.rollout.fake_engine.FakeServer`) starts a :class:`WorkerHost` once its
engine is up and holds the learner's weights. For the life of that server process the host
owns its ``rollout.workers_per_server`` worker loops, its reward pool
(``rollout.reward.num_workers`` processes), its Redis connection and its counters. A group
goes admission -> prompt -> engine (same process, no Ray hop) -> reward (this host's pool)
-> Redis; nothing of it passes through the driver, which only starts, watches and stops.

Counters reach the driver through Redis: every ``stats_period_s`` the host adds what its
workers counted since the last flush to the run's ``rollout_stats`` hash
(:meth:`~async_rl.queue.ReplayQueue.add_rollout_stats`), so the totals outlive a replaced
server. Tickets carry the host's ``owner`` name (unique per server process): a host that
stops ends its own (the workers' ``finally``); the tickets of a host that was killed are
ended by its supervisor with :meth:`~async_rl.queue.ReplayQueue.release_owner`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from async_rl.data.prompts import ImageFields, PromptFormatter, PromptRow
from async_rl.envs import EnvPool
from async_rl.envs.conversation import ChatEncoder
from async_rl.queue import ReplayQueue
from async_rl.records import FailureReport
from async_rl.rewards import RewardPool, RewardScorer
from async_rl.rollout.episodes import EpisodeCounters, EpisodeSampler
from async_rl.rollout.judging import Judge, JudgedScorer, judge_reward_configs
from async_rl.rollout.served_client import ServedModelClient
from async_rl.rollout.teacher import Teacher
from async_rl.rollout.types import GenerateFn, Sampling, Scorer, served_model_actor
from async_rl.rollout.worker import RolloutWorker, WorkerCounters, WorkerSettings

if TYPE_CHECKING:
    from async_rl.config import Config, EnvConfig, RewardConfig

log = logging.getLogger(__name__)

STATS_PERIOD_S = 1.0
"""How often a host adds its counters to Redis, seconds (what a killed host loses at most)."""
MAX_PENDING_FAILURES = 1000
"""Failure reports a host holds while Redis is away; beyond, the oldest are dropped (counted)."""

EPISODE_COUNTERS = tuple(f"env_{f.name}" for f in dataclasses.fields(EpisodeCounters))
COUNTERS = (tuple(f.name for f in dataclasses.fields(WorkerCounters))
            + ("reward_errors", "reward_timeouts", "judge_errors", "teacher_errors", "reward_restarts", "reward_interrupted", "reward_killed",
               "failure_reports_dropped")
            + EPISODE_COUNTERS)
"""Names of the counters in the run's ``rollout_stats`` hash (all cumulative)."""


class WorkerHostError(RuntimeError):
    """A worker loop of the host ended with an error (the server is then reported unhealthy)."""


@dataclass(frozen=True)
class WorkerHostSpec:
    """Everything a server process needs to run its rollout workers (sent once per server start)."""

    redis_url: str
    run_name: str
    max_depth: int
    """``queue.max_depth``: back-pressure bound of the replay queue, groups."""
    op_timeout_s: float
    """``queue.timeout_s``: how long a Redis call retries, and a put waits on a full queue, seconds."""
    settings: WorkerSettings
    """Template of each worker's settings (``server_id`` and ``owner`` are set per host)."""
    workers: int
    """``rollout.workers_per_server``: worker loops in each server process."""
    reward: RewardConfig
    max_response_length: int
    """``rollout.max_response_length`` in tokens (DAPO's overlong penalty)."""
    system_prompt: str | None = None
    format_prompt: str | None = None
    env: EnvConfig | None = None
    """``rollout.env`` when it names an environment: the samples are its episodes."""
    stats_period_s: float = STATS_PERIOD_S
    judge_model_path: str | None = None
    """With ``rollout.reward.judge``: the judge model's directory (its tokenizer renders the judge's prompts)."""
    judge_wait_s: float = 0.0
    """With ``rollout.reward.judge``: how long a judge request may wait for the judge's actor to be back, seconds."""
    judge_classifies: bool = False
    """With ``rollout.reward.judge``: the judge is a reward model (``task: classify``): its probability is the score, no function reads it."""
    teacher: str | None = None
    """With ``algorithm.distill``: the teacher's name under ``models``."""
    teacher_wait_s: float = 0.0
    """With ``algorithm.distill``: how long a teacher request may wait for the teacher's actor to be back, seconds."""
    teacher_top_k: int = 0
    """``algorithm.distill.top_k``: the teacher's likeliest tokens kept at each response position."""

    @classmethod
    def from_config(cls, cfg: Config, redis_url: str) -> WorkerHostSpec:
        """The spec of run ``cfg`` whose queue is at ``redis_url``."""
        r = cfg.rollout
        settings = WorkerSettings(
            run_id=cfg.trainer.run_name, server_id="", n=r.n,
            sampling=Sampling(r.temperature, r.top_p, r.top_k, r.max_response_length),
            batch_size=cfg.learner.batch_size, max_staleness=cfg.algorithm.max_staleness,
            max_inflight=r.max_inflight, max_prompt_length=cfg.data.max_prompt_length,
            overlong_prompt=cfg.data.overlong_prompt, dynamic_sampling=r.reward.dynamic_sampling,
            shuffle=cfg.data.shuffle, seed=cfg.data.seed, put_timeout_s=cfg.queue.timeout_s,
            pixel_bounds=ImageFields.from_config(cfg.data).bounds, image_ttl_s=cfg.queue.image_ttl_s,
        )
        judge = cfg.models[r.reward.judge.model] if r.reward.judge is not None else None
        distill = cfg.algorithm.distill
        teacher = cfg.models[distill.teacher] if distill is not None else None
        return cls(redis_url, cfg.trainer.run_name, cfg.queue.max_depth, cfg.queue.timeout_s, settings, r.workers_per_server,
                   r.reward, r.max_response_length, cfg.data.system_prompt, cfg.data.format_prompt,
                   r.env if r.env.name is not None else None,
                   judge_model_path=judge.model_path if judge else None,
                   judge_wait_s=judge.answer_within_s if judge else 0.0,
                   judge_classifies=judge is not None and judge.task == "classify",
                   teacher=distill.teacher if distill is not None else None,
                   teacher_wait_s=teacher.answer_within_s if teacher else 0.0,
                   teacher_top_k=distill.top_k if distill is not None else 0)


class WorkerHost:
    """The rollout workers, reward pool and Redis connection of one server process.

    Args:
        spec: see :class:`WorkerHostSpec`.
        rows: the training prompts (sent once per server start, through Ray's object store).
        tokenizer: the server's tokenizer (chat template and encoding of the prompts).
        generate: the server's own ``generate`` (called in this process).
        server_id: e.g. ``server-0`` (recorded in every group).
        owner: ticket owner, unique per server process (e.g. ``server-0#1``).
    """

    def __init__(self, spec: WorkerHostSpec, rows: list[PromptRow], tokenizer: Any, generate: GenerateFn, server_id: str, owner: str):
        self.spec = spec
        self.rows = rows
        self.tokenizer = tokenizer
        self.generate = generate
        self.server_id = server_id
        self.owner = owner
        self.workers: list[RolloutWorker] = []
        self.rewards: RewardPool | None = None
        self.verdict_rewards: RewardPool | None = None
        """With a judge: the pool of the judge's function (``rollout.reward.judge.function``)."""
        self.envs: EnvPool | None = None
        self.queue: ReplayQueue | None = None
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._flusher: asyncio.Task | None = None
        self._flushed = dict.fromkeys(COUNTERS, 0.0)
        self._failures: list[FailureReport] = []
        """Failure reports not yet sent to Redis."""
        self._failures_dropped = 0

    async def start(self) -> None:
        """Connect, start the reward pool and the worker loops (on the event loop's thread:
        the reward processes die with the thread that started them)."""
        spec = self.spec
        try:
            formatter = PromptFormatter(self.tokenizer, spec.system_prompt, spec.format_prompt)
            if spec.env is not None and spec.env.name:
                self.envs = EnvPool(spec.env)
                await self.envs.start()  # EnvStartupError names rollout.env.name and the import error
            self.queue = await asyncio.to_thread(ReplayQueue, spec.redis_url, spec.run_name, spec.max_depth, op_timeout_s=spec.op_timeout_s)
            judge = spec.reward.judge
            rule_cfg, verdict_cfg = judge_reward_configs(spec.reward) if judge is not None else (spec.reward, None)
            self.rewards = RewardPool(rule_cfg)
            self.rewards.start()
            if judge is not None:
                if not spec.judge_classifies:  # a reward model's probability is read by no function
                    self.verdict_rewards = RewardPool(verdict_cfg)
                    self.verdict_rewards.start()
                judge_tokenizer = await asyncio.to_thread(_tokenizer, spec.judge_model_path)
                client = ServedModelClient(served_model_actor(spec.run_name, judge.model), spec.judge_wait_s)
        except BaseException:
            self._close()
            raise
        settings = dataclasses.replace(spec.settings, server_id=self.server_id, owner=self.owner)
        teacher_client = ServedModelClient(served_model_actor(spec.run_name, spec.teacher), spec.teacher_wait_s) if spec.teacher else None
        for _ in range(spec.workers):
            scorer: Scorer = RewardScorer(self.rewards, rule_cfg, spec.max_response_length)
            if judge is not None:
                verdicts = RewardScorer(self.verdict_rewards, verdict_cfg, spec.max_response_length) if self.verdict_rewards else None
                scorer = JudgedScorer(scorer, verdicts, Judge(judge, client, PromptFormatter(judge_tokenizer).token_ids, spec.judge_classifies),
                                      spec.reward, spec.max_response_length)
            episodes = None if self.envs is None else EpisodeSampler(
                self.envs, spec.env, ChatEncoder(self.tokenizer), settings.sampling, settings.max_prompt_length)  # type: ignore[arg-type]
            teacher = Teacher(teacher_client, spec.teacher_top_k) if teacher_client is not None else None
            self.workers.append(RolloutWorker(settings, self.queue, self.rows, formatter.token_ids, scorer, lambda: self.generate, episodes,
                                              report=self._failures.extend, teacher=teacher))
        self._tasks = [asyncio.create_task(w.run(self._stop)) for w in self.workers]
        self._flusher = asyncio.create_task(self._flush_every(spec.stats_period_s))

    def check(self) -> None:
        """Raise :class:`WorkerHostError` if a worker loop ended with an error."""
        for task in self._tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise WorkerHostError(f"{self.server_id}: a rollout worker loop failed: {task.exception()!r}")

    def totals(self) -> dict[str, float]:
        """This host's cumulative counters (:data:`COUNTERS`)."""
        out = dict.fromkeys(COUNTERS, 0.0)
        for w in self.workers:
            for name, value in dataclasses.asdict(w.counters).items():
                out[name] += value
            out["reward_errors"] += w.scorer.counters.errors
            out["reward_timeouts"] += w.scorer.counters.timeouts
            if isinstance(w.scorer, JudgedScorer):
                out["judge_errors"] += w.scorer.judge.errors
            if w.teacher is not None:
                out["teacher_errors"] += w.teacher.errors
            if w.episodes is not None:
                for name, value in dataclasses.asdict(w.episodes.counters).items():
                    out[f"env_{name}"] += value
        if self.rewards is not None:
            out["reward_restarts"] = float(self.rewards.restarts)
            out["reward_interrupted"] = float(self.rewards.interrupted)
            out["reward_killed"] = float(self.rewards.killed)
        out["failure_reports_dropped"] = float(self._failures_dropped)
        return out

    async def stop(self, grace_s: float) -> dict[str, float]:
        """Stop admitting; let groups in flight finish for up to ``grace_s`` seconds, then cancel
        them (each ends its ticket); flush the counters; close. Returns :meth:`totals`."""
        self._stop.set()
        try:
            if self._tasks:
                _, late = await asyncio.wait(self._tasks, timeout=grace_s)
                for task in late:
                    task.cancel()
                await asyncio.gather(*self._tasks, return_exceptions=True)
            if self._flusher is not None:
                self._flusher.cancel()
                await asyncio.gather(self._flusher, return_exceptions=True)
            with contextlib.suppress(Exception):  # counters are metrics: a failed last flush loses no data
                await self._flush()
            return self.totals()
        finally:
            self._close()

    async def _flush_every(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                await self._flush()
            except Exception as exc:  # noqa: BLE001 - Redis unreachable for op_timeout_s: the next flush carries it
                log.warning("%s: rollout counters not flushed: %s", self.server_id, exc)

    async def _flush(self) -> None:
        if len(self._failures) > MAX_PENDING_FAILURES:
            self._failures_dropped += len(self._failures) - MAX_PENDING_FAILURES
            del self._failures[:-MAX_PENDING_FAILURES]
        if self._failures and self.queue is not None:
            sending = self._failures[:]
            await asyncio.to_thread(self.queue.report_failures, sending)
            del self._failures[:len(sending)]
        totals = self.totals()
        deltas = {k: v - self._flushed[k] for k, v in totals.items() if v != self._flushed[k]}
        if deltas and self.queue is not None:
            await asyncio.to_thread(self.queue.add_rollout_stats, deltas)
            self._flushed = totals

    def _close(self) -> None:
        if self.envs is not None:
            self.envs.close()
        if self.rewards is not None:
            self.rewards.close()
        if self.verdict_rewards is not None:
            self.verdict_rewards.close()
        if self.queue is not None:
            self.queue.close()


def _tokenizer(model_path: str | None) -> Any:
    """The tokenizer of the model at ``model_path`` (the judge's)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)
