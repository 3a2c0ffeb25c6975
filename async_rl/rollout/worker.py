"""The rollout worker loop: admission -> prompt -> vLLM -> reward -> replay queue.

One worker keeps up to ``max_inflight`` groups generating against one inference server so
that vLLM's continuous batching stays full; a group that is being scored or put no longer
counts (a slow or hanging reward function must not hold generation back: admission's
staleness bound still limits how many groups are in flight in all). Each group:

1. waits for admission under the staleness bound (AReaL's rule): the queue hands out a
   :class:`~async_rl.queue.Ticket` holding the slot and a claimed prompt index (a
   returned prompt first, else the next of the durable cursor shared by all workers);
2. formats the prompt; an overlong prompt is skipped (counted) or left-truncated;
3. samples ``n`` responses, retrying on a new server handle if the server died;
4. scores them in the reward pool (a raising or hanging reward function marks samples,
   never stops the loop);
5. puts the ``RolloutGroup`` on the queue (blocking while the queue is full).

While the queue's Redis does not answer (restarting, or waiting for disk space) the worker
waits for it: admission is retried, and a finished group is held and put once it answers
(said once per outage, counted in ``queue_wait_s``). The run's driver bounds the outage.

The group's task owns its ticket and ends it exactly once, in ``finally``: enqueued, or
abandoned. An abandoned ticket gives its slot back (the learner is never starved of a
batch); its prompt is done when it was skipped or filtered, and returned (served again
first) when generation failed for good, the worker stopped or the task was cancelled.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
from dataclasses import dataclass
from typing import Any, Callable

from async_rl.data.images import ImageError, PixelBounds, image_blob, load_image
from async_rl.data.prompts import PromptRow
from async_rl.queue import ReplayQueue, Ticket
from async_rl.queue.client import QueueUnavailableError
from async_rl.records import Failure, FailureReport, ImageRef, RolloutGroup, Sample
from async_rl.rollout.episodes import EpisodeSampler
from async_rl.rollout.teacher import Teacher
from async_rl.rollout.types import Completion, GenerateFn, Sampling, Scorer, ScoredTokens

log = logging.getLogger(__name__)


async def _claimed(claim: asyncio.Future[list[Ticket]]) -> list[Ticket]:
    """The tickets of an admission call, or none when Redis stayed away for its whole timeout
    (a ticket it took unanswered stays with its owner, whose release ends it)."""
    try:
        return await claim
    except QueueUnavailableError:
        return []


class GenerationFailed(RuntimeError):
    """Every generation attempt of a group failed."""


@dataclass
class WorkerSettings:
    """Static settings of one worker (from the ``rollout``, ``data`` and ``algorithm`` config)."""

    run_id: str
    server_id: str
    n: int
    sampling: Sampling
    batch_size: int
    """``B``: groups per learner step (admission rule)."""
    max_staleness: int
    """``eta`` (admission rule)."""
    max_inflight: int = 32
    max_prompt_length: int = 512
    overlong_prompt: str = "skip"
    dynamic_sampling: bool = False
    shuffle: bool = True
    seed: int = 1
    put_timeout_s: float = 60.0
    """How long ``put`` may block on a full queue before the group is retried."""
    admit_wait_s: float = 1.0
    """Longest a worker waits on a closed admission before asking again, seconds. A published
    version wakes it at once (it blocks on the queue's ``versions`` stream); the wait bounds
    how late it sees slots given back without one (the learner's drops). Polling every 20 ms
    instead cost Redis a call per worker every 20 ms: at 1,024 servers, a core
    (benchmarks/scale_sim.py)."""
    generate_retries: int = 3
    """Attempts per group when the server fails (a restarted server gets the retries)."""
    owner: str = ""
    """Owner recorded with each ticket, unique per process (``server-0#2``: the server's
    third start), so a dead host's open tickets can be ended; empty: ``server_id``."""
    pixel_bounds: PixelBounds = PixelBounds(262144, 4194304)
    """``data.min_pixels`` / ``data.max_pixels``: the size images are resized into."""
    image_ttl_s: float = 86400.0
    """``queue.image_ttl_s``: how long the queue keeps an image after the last group using it was put."""


@dataclass
class WorkerCounters:
    """Cumulative counts of one worker, for metrics."""

    groups_put: int = 0
    prompts_skipped_overlong: int = 0
    prompts_truncated: int = 0
    groups_filtered: int = 0
    generate_failures: int = 0
    groups_returned_after_failures: int = 0
    """Groups whose generation failed every retry (their prompts go back to the queue)."""
    image_errors: int = 0
    """Prompts skipped because an image no longer loads (it did when the dataset was read)."""
    tokens_generated: int = 0
    admission_wait_s: float = 0.0
    queue_wait_s: float = 0.0
    """Seconds queue calls found the queue's Redis unreachable for their whole timeout (the worker waited)."""


@functools.lru_cache(maxsize=2)
def epoch_order(seed: int, epoch: int, rows: int) -> tuple[int, ...]:
    """The seeded permutation of ``rows`` row positions served in ``epoch``.

    Cached per process: every worker loop of a process (and a loop's next start) shares one
    permutation instead of shuffling its own (0.1-0.2 s of CPU for 200k rows each); the two
    newest epochs are kept, so loops crossing an epoch boundary at different times do not
    rebuild it."""
    order = list(range(rows))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return tuple(order)


class RolloutWorker:
    """Continuously generates groups into the replay queue.

    Args:
        settings: see :class:`WorkerSettings`.
        queue: the run's replay queue (cursor, admission, put).
        rows: the training prompts (dataset order; shuffled per epoch when ``settings.shuffle``).
        encode: ``encode(prompt text)`` -> chat-formatted token ids; ``encode(text, num_images)``
            for a prompt with images (one placeholder token per image).
        scorer: reward function wrapper.
        server: returns the current ``generate`` of this worker's server; called again after a
            failure, so a restarted server is picked up.
        episodes: with an environment (``rollout.env``), a group's samples are its episodes
            (:mod:`async_rl.rollout.episodes`) instead of single responses to the prompt.
        report: receives a :class:`~async_rl.records.FailureReport` for every sample the
            reward function or environment failed on (the host sends them to the driver).
        teacher: with ``algorithm.distill``, scores each sample's tokens beside the reward
            (:mod:`async_rl.rollout.teacher`); its log-probs travel with the sample.
    """

    def __init__(
        self,
        settings: WorkerSettings,
        queue: ReplayQueue,
        rows: list[PromptRow],
        encode: Callable[[str], list[int]],
        scorer: Scorer,
        server: Callable[[], GenerateFn],
        episodes: EpisodeSampler | None = None,
        report: Callable[[list[FailureReport]], None] | None = None,
        teacher: Teacher | None = None,
    ):
        if not rows:
            raise ValueError("the rollout worker needs at least one training prompt (data.train_files has no usable rows)")
        self.settings = settings
        self.queue = queue
        self.rows = rows
        self.encode = encode
        self.scorer = scorer
        self.server = server
        self.episodes = episodes
        self.report = report
        self.teacher = teacher
        self.counters = WorkerCounters()
        self._queue_away = False
        """A queue call found Redis unreachable and none has succeeded since (said once per outage)."""
        self._version_seen = "0-0"
        """Id of the newest entry of the queue's ``versions`` stream this worker has seen."""

    def row_for(self, index: int) -> PromptRow:
        """The dataset row of global cursor ``index`` (a fresh seeded permutation per epoch)."""
        epoch, pos = divmod(index, len(self.rows))
        if not self.settings.shuffle:
            return self.rows[pos]
        return self.rows[epoch_order(self.settings.seed, epoch, len(self.rows))[pos]]

    async def run(self, stop: asyncio.Event, max_groups: int | None = None) -> WorkerCounters:
        """Generate until ``stop`` is set (or ``max_groups`` were started); waits for groups in flight."""
        inflight: dict[asyncio.Task, Ticket] = {}
        slots = asyncio.Semaphore(self.settings.max_inflight)
        started = 0
        try:
            while not stop.is_set() and (max_groups is None or started < max_groups):
                slot = await _GenerationSlot.take(slots, stop)
                if slot is None:
                    break
                # Every slot free now is claimed in the same admission call: one round trip
                # for a burst (a version opens admission for B groups) instead of one each.
                room = self.settings.max_inflight if max_groups is None else max_groups - started
                taken = [slot, *await _GenerationSlot.take_free(slots, room - 1)]
                tickets = await self._admit(stop, len(taken), lambda: sum(not t.done() for t in inflight))
                for unused in taken[len(tickets):]:
                    unused.release()
                if not tickets:
                    break
                started += len(tickets)
                for ticket, slot in zip(tickets, taken, strict=False):
                    inflight[asyncio.create_task(self._group(ticket, slot))] = ticket
                inflight = {t: ticket for t, ticket in inflight.items() if not t.done()}
            if inflight:
                await asyncio.gather(*inflight)
        finally:  # cancelled: every group task ends its ticket in its own finally...
            for task in inflight:
                task.cancel()
            await asyncio.gather(*inflight, return_exceptions=True)
            # ...unless it was cancelled before its first step (its finally never ran); a
            # ticket that already ended is left as it is.
            await asyncio.gather(*(self._abandon(ticket, return_prompt=True) for task, ticket in inflight.items() if task.cancelled()))
        return self.counters

    def _prompt_ids(self, row: PromptRow) -> list[int] | None:
        ids = self.encode(row.prompt, len(row.images)) if row.images else self.encode(row.prompt)
        if len(ids) <= self.settings.max_prompt_length:
            return ids
        if self.settings.overlong_prompt == "truncate":
            self.counters.prompts_truncated += 1
            return ids[-self.settings.max_prompt_length :]
        self.counters.prompts_skipped_overlong += 1
        log.info("skipped prompt of line %d: %d tokens > data.max_prompt_length=%d", row.line, len(ids), self.settings.max_prompt_length)
        return None

    async def _admit(self, stop: asyncio.Event, limit: int, held: Callable[[], int]) -> list[Ticket]:
        """Up to ``limit`` tickets once admission lets any start (asking again when a version
        is published, or after ``admit_wait_s``); none once ``stop`` is set. ``held()``: this
        loop's open tickets at each ask (admission holds a loop to its share of the window)."""
        t0 = time.monotonic()
        try:
            while not stop.is_set():
                owner = self.settings.owner or self.settings.server_id
                claim = asyncio.ensure_future(asyncio.to_thread(self.queue.admit, self.settings.batch_size, self.settings.max_staleness,
                                                                owner, limit, held()))
                called = time.monotonic()
                try:
                    tickets = await asyncio.shield(claim)
                except asyncio.CancelledError:  # the claim may still succeed: end its tickets
                    await asyncio.gather(*(self._abandon(late, return_prompt=True) for late in await _claimed(claim)))
                    raise
                except QueueUnavailableError as exc:
                    self._waited_for_queue(exc, called)
                    continue
                self._queue_answered()
                if tickets:
                    return tickets
                await self._wait_for_version(stop)
            return []
        finally:
            self.counters.admission_wait_s += time.monotonic() - t0

    async def _group(self, ticket: Ticket, slot: _GenerationSlot) -> None:
        """Generate, score and enqueue the group of ``ticket``; end the ticket exactly once.
        ``slot`` (a generation slot) is given back once the responses are sampled (episodes:
        once the group ends, their environment steps are part of generating)."""
        enqueued = False
        return_prompt = True  # unless it is done: skipped or filtered
        try:
            row = self.row_for(ticket.index)
            if self.episodes is not None:
                group = await self._episode_group(ticket.index, row)
            else:
                prompt_ids = self._prompt_ids(row)
                group = None if prompt_ids is None else await self._generate_group(ticket.index, row, prompt_ids, slot)
            if group is None:  # skipped (overlong), filtered (dynamic sampling) or untrainable: this prompt is done
                return_prompt = False
                return
            while True:  # back-pressure: the group waits (never dropped) until the learner consumes or Redis answers
                called = time.monotonic()
                try:
                    await asyncio.to_thread(self.queue.put, group, ticket, self.settings.put_timeout_s)
                    self._queue_answered()
                    break
                except TimeoutError:
                    log.warning("replay queue full for %.0f s; still holding group %s", self.settings.put_timeout_s, group.group_id)
                except QueueUnavailableError as exc:  # a retried put is applied once (the ticket ends with it)
                    self._waited_for_queue(exc, called)
            enqueued = True
        except GenerationFailed as exc:
            log.warning("prompt index %d goes back to the queue: %s", ticket.index, exc)
        except Exception:  # noqa: BLE001 - one group's failure must not stop the worker
            log.exception("group for prompt index %d failed; its prompt goes back to the queue", ticket.index)
        finally:
            slot.release()
            # The put script and the abandon script each end the ticket only if it is still
            # open: a put cancelled mid-flight either won (the group is queued) or fails after this.
            if not enqueued and not await self._abandon(ticket, return_prompt=return_prompt):
                enqueued = True
            self.counters.groups_put += enqueued

    async def _wait_for_version(self, stop: asyncio.Event) -> None:
        """Until a version newer than the last one seen is published, ``admit_wait_s`` passes
        or ``stop`` is set (the blocked read then ends on its own, in its thread)."""
        read = asyncio.ensure_future(asyncio.to_thread(self.queue.wait_for_version, self._version_seen, self.settings.admit_wait_s))
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({read, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when cancelled: a read still blocked ends in its thread, its error retrieved (no warning)
            stopped.cancel()
            read.add_done_callback(lambda f: f.cancelled() or f.exception())
        if read.done():
            try:
                self._version_seen = read.result()
            except QueueUnavailableError as exc:  # the admission call that follows waits for Redis and says so
                log.debug("waiting for a version: %s", exc)

    def _waited_for_queue(self, exc: QueueUnavailableError, since: float) -> None:
        """A queue call found Redis unreachable for its whole timeout, from ``since``: count
        the wait and say it once per outage; the caller tries again."""
        self.counters.queue_wait_s += time.monotonic() - since
        if not self._queue_away:
            log.warning("%s: the replay queue's Redis does not answer (%s); waiting for it, holding finished groups",
                        self.settings.server_id, exc)
        self._queue_away = True

    def _queue_answered(self) -> None:
        if self._queue_away:
            log.warning("%s: the replay queue's Redis answers again", self.settings.server_id)
        self._queue_away = False

    async def _abandon(self, ticket: Ticket, *, return_prompt: bool) -> bool:
        """End ``ticket`` without a group (:meth:`~async_rl.queue.ReplayQueue.abandon`) in a
        thread: with Redis away the call retries for ``queue.timeout_s``, which must not stall
        the server's event loop. Shielded, so it also runs while the calling task is being
        cancelled: a cancellation ends the wait, never the release (the thread finishes it)."""
        return await asyncio.shield(asyncio.to_thread(self.queue.abandon, ticket, return_prompt=return_prompt))

    async def _generate_group(self, index: int, row: PromptRow, prompt_ids: list[int], slot: _GenerationSlot) -> RolloutGroup | None:
        """The scored group, or None when dynamic sampling filtered it (or an image no
        longer loads); ``slot`` is released once the responses are sampled."""
        t0 = time.monotonic()
        images = None
        if row.images:
            try:
                images = await asyncio.to_thread(lambda: [load_image(ref, self.settings.pixel_bounds) for ref in row.images])
            except ImageError as exc:
                self.counters.image_errors += 1
                log.warning("skipped prompt of line %d: %s", row.line, exc)
                return None
        completions = await self._sample(prompt_ids, images)
        slot.release()
        expanded = completions[0].prompt_token_ids if completions else None
        if expanded is not None and len(expanded) > self.settings.max_prompt_length:  # image tokens counted; never truncated
            self.counters.prompts_skipped_overlong += 1
            log.info("skipped prompt of line %d: %d tokens with its image tokens > data.max_prompt_length=%d",
                     row.line, len(expanded), self.settings.max_prompt_length)
            return None
        scoring = self.scorer.score(
            [{"prompt": row.prompt, "response": c.text, "response_length": len(c.token_ids), "ground_truth": row.answer} for c in completions]
        )
        if self.teacher is None:
            scores, taught = await scoring, [None] * len(completions)
        elif images:
            scores = await scoring
            taught = [Failure("teacher_error", "ValueError: distillation of a prompt with images is not supported")] * len(completions)
        else:  # the teacher scores the samples beside the reward function
            scores, taught = await asyncio.gather(scoring, self.teacher.logprobs(prompt_ids, completions))
        if self.settings.dynamic_sampling and not self.scorer.keep_group([s.reward for s in scores]):
            self.counters.groups_filtered += 1
            return None
        failures = [s.failure or (t if isinstance(t, Failure) else None) for s, t in zip(scores, taught, strict=True)]
        samples = [
            Sample.from_lists(c.token_ids, c.logprobs, c.versions, s.reward, s.components, c.finish_reason,
                              f.signature if f else None, error_kind=f.kind if f else None,
                              teacher_logprobs=t.logprobs if isinstance(t, ScoredTokens) else None,
                              teacher_top=(t.top_ids, t.top_logprobs) if isinstance(t, ScoredTokens) and t.top_ids else None)
            for c, s, t, f in zip(completions, scores, taught, failures, strict=True)
        ]
        self._report(f"{self.settings.run_id}:{index}", failures)
        self.counters.tokens_generated += sum(len(c.token_ids) for c in completions)
        refs = await self._store_images(images) if images else None
        return RolloutGroup.from_lists(
            run_id=self.settings.run_id,
            group_id=f"{self.settings.run_id}:{index}",
            prompt_id=index,
            prompt_token_ids=expanded or prompt_ids,
            samples=samples,
            server_id=self.settings.server_id,
            generation_s=time.monotonic() - t0,
            images=refs,
        )

    def _report(self, group_id: str, failures: list[Failure | None]) -> None:
        """Hand the failures of a group's samples (None: the sample is fine) to ``report``."""
        now = time.time()
        reports = [FailureReport(f, self.settings.server_id, group_id, k, now) for k, f in enumerate(failures) if f is not None]
        if reports and self.report is not None:
            self.report(reports)

    async def _store_images(self, images: list[Any]) -> list[ImageRef]:
        """Put the group's images into the queue's image store (once per content) before the
        group that refers to them; returns the references."""
        blobs = await asyncio.to_thread(lambda: [image_blob(im) for im in images])
        await asyncio.to_thread(self.queue.put_images, [(b.sha256, b.png) for b in blobs], self.settings.image_ttl_s)
        return [ImageRef(b.sha256, b.width, b.height) for b in blobs]

    async def _episode_group(self, index: int, row: PromptRow) -> RolloutGroup | None:
        """The group of ``n`` episodes of ``row``, or None when none reached the model."""
        t0 = time.monotonic()
        made = await self.episodes.group(row, self.settings.n, self.server())  # type: ignore[union-attr]
        if made is None:
            return None
        prompt_ids, samples, failures = made  # failures[i]: sample i's records.Failure, or None
        self._report(f"{self.settings.run_id}:{index}", failures)
        self.counters.tokens_generated += sum(sum(s.token_mask()) for s in samples)
        return RolloutGroup.from_lists(
            run_id=self.settings.run_id, group_id=f"{self.settings.run_id}:{index}", prompt_id=index, prompt_token_ids=prompt_ids,
            samples=samples, server_id=self.settings.server_id, generation_s=time.monotonic() - t0,
        )

    async def _sample(self, prompt_ids: list[int], images: list[Any] | None = None) -> list[Completion]:
        """``n`` completions; raises :class:`GenerationFailed` after ``generate_retries`` failures."""
        error: Exception | None = None
        for attempt in range(1, self.settings.generate_retries + 1):
            try:
                generate = self.server()
                n, sampling = self.settings.n, self.settings.sampling
                return await (generate(prompt_ids, n, sampling, images) if images else generate(prompt_ids, n, sampling))
            except Exception as exc:  # noqa: BLE001 - server died or errored: retry on a fresh handle
                error = exc
                self.counters.generate_failures += 1
                log.warning("generation failed on %s (attempt %d/%d): %s", self.settings.server_id, attempt, self.settings.generate_retries, exc)
                await asyncio.sleep(min(2.0**attempt, 10.0))
        self.counters.groups_returned_after_failures += 1
        raise GenerationFailed(f"{self.settings.generate_retries} attempts on {self.settings.server_id} failed; last: {error}")



class _GenerationSlot:
    """One of a worker's ``max_inflight`` generation slots: taken by the worker loop, handed
    to the group's task, which gives it back once (after sampling, or when it ends)."""

    def __init__(self, slots: asyncio.Semaphore) -> None:
        self._slots: asyncio.Semaphore | None = slots

    @classmethod
    async def take(cls, slots: asyncio.Semaphore, stop: asyncio.Event) -> _GenerationSlot | None:
        """A free slot, or None once ``stop`` is set first."""
        if not slots.locked():
            await slots.acquire()
            return cls(slots)
        acquire, stopped = asyncio.ensure_future(slots.acquire()), asyncio.ensure_future(stop.wait())
        await asyncio.wait({acquire, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if acquire.done() and not acquire.cancelled():
            if stop.is_set():
                slots.release()
                return None
            return cls(slots)
        acquire.cancel()
        return None

    @classmethod
    async def take_free(cls, slots: asyncio.Semaphore, most: int) -> list[_GenerationSlot]:
        """Up to ``most`` slots that are free now (an unlocked semaphore's acquire does not wait)."""
        taken: list[_GenerationSlot] = []
        while len(taken) < most and not slots.locked():
            await slots.acquire()
            taken.append(cls(slots))
        return taken

    def release(self) -> None:
        """Give the slot back (once; later calls do nothing)."""
        if self._slots is not None:
            self._slots.release()
            self._slots = None
