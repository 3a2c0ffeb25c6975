"""The learner's data feed: queue -> screened groups -> the same step's groups on every rank.

Rank 0 is the only queue consumer (:class:`QueueReader`): it reads groups, screens each once
when reading it (:func:`~async_rl.learner.screening.screen`; the queue drops or dead-letters
what fails), fetches a vision-language group's images, and keeps what a step did not take in
a backlog. Once a batch is full it broadcasts one :class:`FeedMessage` holding the groups'
records as read from the queue (no re-encoding) and their images; every other rank decodes
and screens them the same way, so all ranks plan the same step. While the batch is short,
rank 0 sends a wait beat after each bounded read, so no rank sits in one collective for
longer than a queue timeout.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import msgspec
import torch

from async_rl.data.images import ImageError, decode_blob
from async_rl.learner import collectives
from async_rl.learner.screening import Limits, ScreenedGroup, screen
from async_rl.queue import Drop, ReplayQueue, Staleness
from async_rl.queue.admission import admission_limit
from async_rl.records import RolloutGroup, Sample, decode


_DROP_HINTS = {
    "reward_error": "the reward function raises (the driver's console and reward_errors.jsonl in the run directory show each error)",
    "reward_timeout": "the reward function takes longer than rollout.reward.timeout_s (reward_errors.jsonl shows the inputs)",
    "judge_error": "the judge model (rollout.reward.judge) gives no answer (reward_errors.jsonl and models/<name>/* say why)",
    "teacher_error": "the teacher (algorithm.distill.teacher) gives no log-probs (reward_errors.jsonl and models/<name>/* say why)",
    "env_error": "the environment raises (the driver's console and env_errors.jsonl in the run directory show each error)",
    "env_timeout": "an environment call takes longer than rollout.env.step_timeout_s (env_errors.jsonl shows the calls)",
    "too_few_samples": "too few samples of each group were scored for a baseline (see the reward and environment errors)",
    "bad_token": "the dead-letter stream {run}:dead says why",
    "stale": "raise algorithm.max_staleness",
    "too_long": "raise learner.max_tokens_per_microbatch or lower rollout.max_response_length",
    "empty_response": "the model answers with no token (check the chat template and rollout.max_response_length)",
}
"""What to do about each drop reason, for the message of :class:`NoTrainableDataError`."""


FILL_POLL_S = 0.05
"""``learner.fill_staleness_window``: seconds between two looks at the admission counters while
the window fills (each look is one Redis round trip; a wait beat follows every look)."""


class NoTrainableDataError(RuntimeError):
    """Every group read for a long while was dropped: the run cannot make progress."""


class FeedMessage(msgspec.Struct, frozen=True):
    """Rank 0 -> every rank, once per read round."""

    kind: Literal["batch", "wait", "give_up", "fail"]
    """``batch``: the step's groups follow; ``wait``: still short, read again; ``give_up``:
    the caller's deadline passed; ``fail``: nothing is trainable (``reason`` says why)."""
    records: list[bytes] = []
    """The groups' msgspec records, as read from the queue."""
    images: dict[str, bytes] = {}
    """PNG bytes of every image the groups refer to, by SHA-256."""
    reason: str = ""


@dataclass(frozen=True)
class Fed:
    """One group of a step: its queue entry id (rank 0; "" on the other ranks), its record
    as read, and the screen's verdicts."""

    entry_id: str
    record: bytes
    screened: ScreenedGroup


@dataclass(frozen=True)
class StepData:
    """The groups of one step, the same on every rank."""

    fed: list[Fed]
    images: dict[str, bytes]
    """PNG bytes of their images by SHA-256 (empty for text)."""

    @property
    def groups(self) -> list[ScreenedGroup]:
        return [f.screened for f in self.fed]


class WaitHooks(Protocol):
    """What the feed asks of the weight publisher (:class:`~async_rl.learner.publish.Publication`) while a batch fills."""

    def catch_up(self, version: int) -> None:
        """Collective, once per read round: send ``version``'s weights to servers that lack them."""

    @property
    def loading(self) -> bool:
        """Rank 0: a weight update may still be loading on the servers."""

    def settle(self, wait: bool) -> None:
        """Rank 0: act on the last update's acknowledgements (publish its version for admission)."""


class QueueReader:
    """Rank 0's side of the feed: reads and screens groups, holds their images and the backlog.

    ``takes_images``: the policy is a vision-language model (a text model dead-letters a group
    with images). ``model_path`` only words that error. ``fill_window``
    (``learner.fill_staleness_window``, for benchmarks): read nothing until every group admission
    allows at the published version has been generated.
    """

    def __init__(self, queue: ReplayQueue, limits: Limits, max_staleness: int, batch_size: int, read_timeout_s: float,
                 takes_images: bool, model_path: str, run_name: str, fill_window: bool = False) -> None:
        self.queue, self.limits, self.max_staleness = queue, limits, max_staleness
        self.fill_window = fill_window
        self.batch_size, self.read_timeout_s = batch_size, read_timeout_s
        self.takes_images, self.model_path, self.run_name = takes_images, model_path, run_name
        self.backlog: list[Fed] = []
        """Groups read (or recovered) and not yet trained, oldest first."""
        self._screened: dict[int, tuple[bytes, ScreenedGroup]] = {}
        """What :meth:`_check` kept during the current queue call, by ``id()`` of the decoded
        group (the queue returns the very object it checked; two entries may hold equal groups)."""
        self._images: dict[str, bytes] = {}
        """PNG bytes of the images of the groups read and not yet trained, by SHA-256."""
        self._recent_drops: Counter[str] = Counter()
        self._last_detail: dict[str, str] = {}
        """The detail of the last group dropped for each reason (for the stop message)."""
        """Why the groups read since the last one kept were dropped (see :meth:`failure`)."""

    def recover(self) -> None:
        """Take this learner's own pending entries and those of dead consumers into the
        backlog (after a restart: trained first, in their original order). Their staleness
        is judged when their step comes (:meth:`read`): after a resume from version ``c`` the
        entries first read at version ``c + k`` (behaviour versions up to ``c + k``) are
        trained again at ``c + k``, where they pass, however far ``k`` exceeds the bound."""
        entries = self.queue.recover(check=self._check, include_own=True)
        self.backlog = self._fed(entries)

    def read(self, n: int, version: int, hooks: WaitHooks) -> list[Fed]:
        """Up to ``n`` groups: the backlog first, then new ones (one bounded queue read); none
        while the staleness window fills (``fill_window``)."""
        if self.fill_window and not self._window_filled(hooks):
            return []
        take = self._from_backlog(n, version)
        if len(take) < n and hooks.loading:
            # Train on data that is already there while the servers load; but if the batch
            # must wait for new groups, publish the version first (admission may need it).
            take += self._get(n - len(take), 0.0, version)
            if len(take) < n:
                hooks.settle(wait=True)
        if len(take) < n:
            # Short reads: between them the ranks exchange a wait beat and catch up late servers.
            take += self._get(n - len(take), min(self.read_timeout_s, 2.0), version)
        return take

    def _window_filled(self, hooks: WaitHooks) -> bool:
        """Whether every group admission allows at the published version ``v`` has been generated:
        ``groups_started >= (v + max_staleness + 1) * batch_size`` and none in flight. The oldest
        of them, the next batch, then came from version ``v - max_staleness``. When not, waits
        :data:`FILL_POLL_S` first, so the caller's wait beats do not spin."""
        hooks.settle(wait=True)  # the window to fill is the one this learner's version opens
        stats = self.queue.stats()
        if stats["groups_started"] >= admission_limit(stats["version"], self.max_staleness, self.batch_size) and stats["inflight"] == 0:
            return True
        time.sleep(FILL_POLL_S)
        return False

    def _from_backlog(self, n: int, version: int) -> list[Fed]:
        """Up to ``n`` backlog groups trainable at ``version``, oldest first; the queue drops
        those the staleness rule rejects now."""
        rule = self._staleness(version)
        take: list[Fed] = []
        late: list[tuple[str, RolloutGroup, Drop]] = []
        while self.backlog and len(take) < n:
            fed = self.backlog.pop(0)
            drop = rule.judge(fed.screened.group)
            if drop is None:
                take.append(fed)
            else:
                late.append((fed.entry_id, fed.screened.group, drop))
        if late:
            self.queue.drop(late)
            self._note_screen()
        return take

    def message(self, fed: list[Fed], deadline: float | None) -> FeedMessage:
        """What to tell the other ranks after a read round that left ``fed``."""
        if len(fed) >= self.batch_size:
            return FeedMessage("batch", [f.record for f in fed], self._take_images(fed))
        reason = self.failure()
        if reason:
            return FeedMessage("fail", reason=reason)
        return FeedMessage("give_up" if deadline is not None and time.monotonic() >= deadline else "wait")

    def failure(self) -> str:
        """Why the run cannot go on (every group read lately was dropped), or ""."""
        limit = min(100, 10 * self.batch_size)
        in_row = sum(self._recent_drops.values())
        if in_row < limit:
            return ""
        reasons = ", ".join(f"{reason}: {count}" for reason, count in self._recent_drops.most_common())
        causes = "; ".join(f"{reason}: {_DROP_HINTS.get(reason, 'see the queue/dropped metrics').format(run=self.run_name)}"
                           + (f" (last: {self._last_detail[reason][:300]})" if reason in self._last_detail else "")
                           for reason in self._recent_drops)
        return f"the last {in_row} groups read were all dropped ({reasons}); nothing is trainable. {causes}"

    def _staleness(self, version: int) -> Staleness:
        """The staleness rule, against the learner's own version (the one place it is applied)."""
        return Staleness(version, self.max_staleness)

    def _get(self, n: int, timeout_s: float, version: int) -> list[Fed]:
        return self._fed(self.queue.get(n, self._staleness(version), timeout_s, check=self._check))

    def _fed(self, entries: Sequence[tuple[str, RolloutGroup]]) -> list[Fed]:
        """The entries a queue call returned, with what :meth:`_check` kept of them."""
        self._note_screen()
        fed = [Fed(entry_id, *self._screened[id(group)]) for entry_id, group in entries]
        self._screened.clear()
        return fed

    def _note_screen(self) -> None:
        """Count what the latest queue call dropped toward "nothing is trainable"."""
        report = self.queue.last_screen
        if report.kept:
            self._recent_drops = Counter()
        self._recent_drops.update(report.trailing)

    def _check(self, group: RolloutGroup, record: bytes) -> Drop | None:
        """Screen a group as it is read; fetch its images once, which must decode."""
        screened = screen(group, self.limits)
        if screened.verdict is not None:
            self._last_detail[screened.verdict.reason] = screened.verdict.detail
            return Drop(*screened.verdict)
        if group.images:
            if not self.takes_images:
                return Drop("images_for_text_model", f"{len(group.images)} images, but {self.model_path} is a text model", True)
            found = self.queue.get_images([ref.sha256 for ref in group.images])
            missing = [ref.sha256[:12] for ref in group.images if ref.sha256 not in found]
            if missing:
                return Drop("missing_image", f"image(s) {', '.join(missing)} no longer in the queue (expired after queue.image_ttl_s)")
            try:
                for png in found.values():
                    decode_blob(png, self.limits.max_image_pixels)
            except ImageError as exc:
                return Drop("bad_image", str(exc), True)
            self._images.update(found)
        self._screened[id(group)] = (record, screened)
        return None

    def _take_images(self, fed: list[Fed]) -> dict[str, bytes]:
        """The images of the step's groups; the cache keeps only those the backlog still needs."""
        wanted = {ref.sha256: self._images[ref.sha256] for f in fed for ref in f.screened.group.images}
        waiting = {ref.sha256 for f in self.backlog for ref in f.screened.group.images}
        self._images = {sha: png for sha, png in self._images.items() if sha in waiting}
        return wanted


class BatchFeed:
    """Every rank's view of the feed: the step's groups, read on rank 0 (``reader``; None on
    the other ranks) and broadcast in one message."""

    def __init__(self, rank: int, device: torch.device, limits: Limits, reader: QueueReader | None) -> None:
        self.rank, self.device, self.limits, self.reader = rank, device, limits, reader

    def next(self, size: int, version: int, hooks: WaitHooks, deadline: float | None = None) -> StepData | None:
        """The next ``size`` groups trainable at ``version`` (collective). Past ``deadline``
        (monotonic seconds) rank 0 gives up: every rank returns None and the groups read so
        far go back to the backlog. :class:`NoTrainableDataError` when nothing is trainable."""
        fed: list[Fed] = []
        while True:
            hooks.catch_up(version)
            message = FeedMessage("wait")
            if self.reader is not None:
                fed += self.reader.read(size - len(fed), version, hooks)
                message = self.reader.message(fed, deadline)
            payload = collectives.broadcast_bytes(msgspec.msgpack.encode(message) if self.rank == 0 else b"", self.device, self.rank)
            if self.rank != 0:
                message = msgspec.msgpack.decode(payload, type=FeedMessage)
                fed = [Fed("", record, screen(decode(record), self.limits)) for record in message.records]
            if message.kind == "batch":
                return StepData(fed, message.images)
            if message.kind == "give_up":
                if self.reader is not None:
                    self.reader.backlog = fed + self.reader.backlog
                return None
            if message.kind == "fail":
                raise NoTrainableDataError(message.reason)


def staleness_metrics(groups: Sequence[RolloutGroup], version: int) -> dict[str, float]:
    """Staleness (``version`` minus the group's behaviour version, in versions) of the
    step's trained groups: mean, max and a histogram ``staleness/hist/{k}`` (groups)."""
    lags = [version - g.behaviour_version for g in groups]
    out = {"staleness/mean": sum(lags) / len(lags), "staleness/max": float(max(lags))}
    out.update({f"staleness/hist/{k}": float(n) for k, n in sorted(Counter(lags).items())})
    return out


def truncation_metrics(groups: Sequence[RolloutGroup], max_turns: int | None) -> dict[str, float]:
    """``batch/truncated_fraction``: the share of the step's scored samples (failed ones left
    out) that ended on the token budget (``rollout.max_response_length``) rather than on their
    own: a response vLLM cut (``finish_reason`` ``length``), or, in a multi-turn run
    (``max_turns``: ``rollout.env.max_turns``), an episode the environment did not end that
    played fewer than ``max_turns`` turns (its ``turns`` reward component)."""
    scored = [s for g in groups for s in g.samples if s.error is None]

    def truncated(sample: Sample) -> bool:
        if sample.finish_reason != "length":
            return False
        return max_turns is None or sample.reward_components.get("turns", 0.0) < max_turns

    return {"batch/truncated_fraction": sum(map(truncated, scored)) / len(scored) if scored else 0.0}
