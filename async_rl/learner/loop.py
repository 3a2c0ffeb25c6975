"""The learner loop of one rank: queue -> step -> publish -> checkpoint -> commit.

Rank 0 is the only queue consumer. It reads ``B`` groups and broadcasts their msgspec bytes to
the other ranks, so every rank trains on the same batch and plans identically. Versions,
staleness and checkpoints follow ARCHITECTURE.md: version += 1 per step that trained, entries
are committed only after the checkpoint containing them is durable, and a restarted learner
commits what its checkpoint covers, then re-reads its own pending entries first.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import msgspec
import torch
import torch.distributed as dist
from torch import Tensor, nn

from async_rl.config import Config
from async_rl.data.images import ImageError, decode_blob
from async_rl.learner import checkpoint, collectives, vision
from async_rl.learner.batching import Batch, Prepared, prepare, screen_group
from async_rl.learner.model import DistInfo, init_distributed, iter_full_parameters, load_sharded
from async_rl.learner.memory import Beside, servers_gpu_share
from async_rl.learner.train_step import Trainer, staleness_metrics
from async_rl.queue import Drop, ReplayQueue, Staleness
from async_rl.records import RolloutGroup, decode, encode
from async_rl.sync.buckets import TensorSpec, tensor_specs
from async_rl.sync.sender import PendingSend, SendResult


class WeightPublisher(Protocol):
    """What rank 0 sends weights with: :class:`async_rl.sync.sender.WeightSender`."""

    def begin(
        self, named_tensors: Iterable[tuple[str, Tensor]], version: int, *, specs: Sequence[TensorSpec],
        servers: Collection[str] | None = None,
    ) -> PendingSend:
        """Broadcast every ``(name, full tensor)`` (in ``specs`` order) as policy ``version``
        to ``servers`` (None: all registered); they load it while the learner goes on."""

    def complete(self, pending: PendingSend, wait: bool = True) -> SendResult | None:
        """Outcome of ``pending`` once every server acknowledged (None: not yet, ``wait=False``)."""

    def behind(self, version: int) -> list[str]:
        """Registered servers that do not hold ``version``."""

    @property
    def servers(self) -> dict[str, int | None]:
        """Registered servers and the version each holds."""


class NoTrainableDataError(RuntimeError):
    """Every group read for a long while was dropped: the run cannot make progress."""


@dataclass
class LoopSummary:
    """What :meth:`LearnerLoop.run` did."""

    version: int
    """Policy version at the end."""
    steps: list[dict[str, float]] = field(default_factory=list)
    """Metrics of each step run (same on every rank)."""


class LearnerLoop:
    """One rank of the learner job.

    ``redis_url`` is the replay queue's; ``publisher`` (rank 0 only; None = no inference
    servers to update) receives the weights every ``sync.every`` steps; the servers load them
    while the learner goes on with the next step, and the version is published for admission
    once every server acknowledged it (at the latest before the learner waits for data).
    Rank 0 appends one JSON line per step to ``{output_dir}/learner_steps.jsonl`` (version,
    entry ids, prompt ids, metrics).
    """

    def __init__(
        self,
        cfg: Config,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        redis_url: str,
        publisher: WeightPublisher | None = None,
    ) -> None:
        self.cfg = cfg
        torch.manual_seed(cfg.trainer.seed)
        # Collectives wait at most this long: longer than any queue wait or weight sync on rank 0.
        timeout_s = 2 * max(cfg.queue.timeout_s, cfg.sync.timeout_s)
        self.info: DistInfo = init_distributed(rank, world_size, master_addr, master_port, timeout_s)
        lrn = cfg.learner
        beside, share = Beside.of(cfg.algorithm), servers_gpu_share(cfg.rollout, lrn)
        policy = load_sharded(lrn.model_path, lrn, self.info.device, trainable=True, beside=beside, servers_share=share)
        reference = load_sharded(lrn.model_path, lrn, self.info.device, trainable=False) if beside.reference else None
        critic = (load_sharded(lrn.critic.model_path or lrn.model_path, lrn, self.info.device, trainable=True, beside=beside,
                               servers_share=share, value_model=True) if beside.critic else None)
        self.vocab_size = int(policy.config.get_text_config().vocab_size)
        self.model_type = str(policy.config.model_type)
        self.process_images = vision.load_image_processor(lrn.model_path) if vision.is_vision_language(policy.config.to_dict()) else None
        """A vision-language policy's image processor (None for a text model)."""
        self.image_token: int | None = getattr(policy.config, "image_token_id", None) if self.process_images is not None else None
        """A vision-language policy's image token: a response that holds it is not trained."""
        self._images: dict[str, bytes] = {}
        """Rank 0: PNG bytes of the images of the groups read and not yet trained, by sha256."""
        self.trainer = Trainer(policy, reference, lrn, cfg.algorithm, self.info, cfg.trainer.total_steps, cfg.trainer.seed,
                               temperature=cfg.rollout.temperature, critic=critic)
        self.publisher = publisher
        self._pending: PendingSend | None = None
        """Rank 0: the update the servers may still be loading."""
        self._sync_metrics: dict[str, float] = {}
        """Rank 0: timings of the updates settled since the last logged step (``sync/*``)."""
        # Every rank must know whether rank 0 publishes: the gathers are collective.
        self.publishing = bool(_broadcast_bytes(b"1" if publisher is not None else b"", self.info))
        self.output_dir = Path(cfg.trainer.output_dir)
        self.queue = (
            ReplayQueue(redis_url, cfg.trainer.run_name, cfg.queue.max_depth, consumer=f"{cfg.trainer.run_name}-learner",
                        claim_idle_s=cfg.queue.recover_idle_s, op_timeout_s=cfg.queue.timeout_s)
            if self.info.rank == 0 else None
        )
        self.version = 0
        self.uncommitted: list[str] = []
        self.counters: Counter[str] = Counter()
        self.backlog: list[tuple[str, RolloutGroup]] = []
        self._recent_drops: Counter[str] = Counter()
        """Rank 0: why the groups read since the last one kept were dropped (see :meth:`_failure`)."""
        self._resume()
        self._served = self.version
        """Rank 0: the version every server should hold (the last one sent to all of them)."""
        self._announced = self.version
        """Rank 0: the last version published for admission."""

    # -- lifecycle ----------------------------------------------------------------

    def _critic(self) -> tuple[nn.Module, torch.optim.Optimizer] | None:
        """The critic and its optimizer, checkpointed beside the policy (None without one)."""
        trainer = self.trainer
        return (trainer.critic, trainer.critic_optimizer) if trainer.critic is not None and trainer.critic_optimizer is not None else None

    def _resume(self) -> None:
        path = checkpoint.resolve_resume(self.cfg.trainer.resume, self.output_dir) if self.info.rank == 0 else None
        chosen = _broadcast_bytes(str(path).encode() if path else b"", self.info).decode()
        if chosen:
            state = checkpoint.load(Path(chosen), self.trainer.policy, self.trainer.optimizer, self._critic())
            self.trainer.scheduler.load_state_dict(state.scheduler)
            if self.trainer.critic_scheduler is not None:
                self.trainer.critic_scheduler.load_state_dict(state.critic_scheduler)
            self.version = state.version
            self.counters.update(state.counters)
            if self.trainer.kl_ctrl is not None and state.kl_ctrl:
                self.trainer.kl_ctrl.load_state_dict(state.kl_ctrl)
            if self.queue is not None:  # the checkpoint holds these; a crash may have come before the commit
                self.queue.commit(state.uncommitted_entry_ids)
        if self.queue is not None:
            # Entries read but not in the checkpoint: train them first, in their original order.
            self.backlog = self.queue.recover(self._staleness(), check=self._check, include_own=True)
            self._note_screen()

    def run(self, max_steps: int | None = None, wait_s: float | None = None) -> LoopSummary:
        """Train until ``trainer.total_steps`` (then save a final checkpoint), or for at most
        ``max_steps`` steps (no final save: the caller will continue or the run is cut short).

        ``wait_s`` bounds the wait for one batch: if it does not fill in time, the call returns
        without that step (the groups read so far are kept for the next call). The driver
        uses it to stay in control (progress, shutdown) while the learner waits for data.
        """
        summary = LoopSummary(self.version)
        steps = 0
        while self.version < self.cfg.trainer.total_steps and (max_steps is None or steps < max_steps):
            deadline = None if wait_s is None else time.monotonic() + wait_s
            metrics = self._step(deadline)
            if metrics is None:
                break
            steps += 1
            summary.steps.append(metrics)
        if self.version >= self.cfg.trainer.total_steps:
            self.finish()
        summary.version = self.version
        return summary

    def finish(self) -> int:
        """Checkpoint (and commit) whatever was trained or consumed since the last checkpoint;
        returns the version. Collective. Called at the end of a run and on shutdown."""
        self._settle(wait=True)
        if self.uncommitted or not checkpoint.checkpoint_dir(self.output_dir, self.version).exists():
            if self.version > 0 or self.uncommitted:
                self._save()
        return self.version

    def close(self) -> None:
        """Release the queue connection and leave the process group."""
        if self.queue is not None:
            self.queue.close()
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- one step -----------------------------------------------------------------

    def _step(self, deadline: float | None = None) -> dict[str, float] | None:
        start = time.perf_counter()
        entries = self._next_batch(deadline)
        if entries is None:
            return None
        wait_s = time.perf_counter() - start
        groups = [group for _, group in entries]
        prepared = prepare(groups, self.cfg.learner.max_tokens_per_microbatch, self.vocab_size, self.image_token)
        self.counters.update({f"dropped/{k}": v for k, v in prepared.dropped.items()})
        self.counters["groups_consumed"] += len(groups)
        if prepared.batch is None:  # screen_group let through only groups with a trainable sample
            raise RuntimeError(f"no trainable sample in a screened batch (dropped: {dict(prepared.dropped)}): a bug in screen_group")
        if any(g.images for g in groups):  # the same on every rank: they hold the same groups
            prepared = dataclasses.replace(prepared, batch=self._with_images(prepared, groups))
        metrics: dict[str, float] = staleness_metrics(prepared.batch, self.version)
        metrics["reward/mean"] = float(prepared.batch.rewards.float().mean())
        metrics["response_length/mean"] = float(prepared.batch.response_mask.sum(1).float().mean())
        result = self.trainer.step(prepared.batch, self.version)
        self.version += 1
        metrics["version"] = float(self.version)  # the version this step produced
        sync_s = self._publish() if self.version % self.cfg.sync.every == 0 else 0.0
        step_s = time.perf_counter() - start
        metrics.update(result.metrics)
        metrics.update({
            "perf/tokens": float(result.tokens),
            "perf/tokens_per_s": result.tokens / max(step_s - wait_s, 1e-9),
            "time/prox": result.times.prox, "time/perception": result.times.perception, "time/fwd_bwd": result.times.fwd_bwd,
            "time/optim": result.times.optim, "time/sync": sync_s,
        })
        metrics.update({"time/wait": wait_s, "time/step": step_s, "perf/idle_fraction": wait_s / max(step_s, 1e-9)})
        metrics.update(self._sync_metrics)
        self._sync_metrics = {}
        metrics.update({f"counters/{k}": float(v) for k, v in self.counters.items()})
        self.uncommitted.extend(entry_id for entry_id, _ in entries)
        # Log before the checkpoint: a kill between the two then repeats the line (a resumed
        # run retrains the version; the last line counts) instead of losing the step's record.
        self._log(metrics, entries)
        if self.version % self.cfg.trainer.save_every == 0:
            started = time.perf_counter()
            self._save()
            # For the driver (its ETA); the line of learner_steps.jsonl is already written.
            metrics["time/checkpoint"] = time.perf_counter() - started
        return metrics

    def _next_batch(self, deadline: float | None = None) -> list[tuple[str, RolloutGroup]] | None:
        """Rank 0 collects ``B`` fresh-enough groups and broadcasts them; returns them on every
        rank (entry ids only on rank 0). After each bounded queue read that leaves the batch
        short, rank 0 broadcasts a wait beat, so no rank sits in one collective for longer
        than a queue timeout. Past ``deadline`` (monotonic seconds) rank 0 gives up: every
        rank returns None and the groups read so far go back to the backlog."""
        size = self.cfg.learner.batch_size
        entries: list[tuple[str, RolloutGroup]] = []
        while True:
            self._catch_up()
            if self.queue is not None:
                entries.extend(self._read(size - len(entries)))
            received = _broadcast_groups([g for _, g in entries] if len(entries) >= size else [], self.info)
            if received is not None:
                return entries if self.queue is not None else [("", g) for g in received]
            give_up = self.info.rank == 0 and deadline is not None and time.monotonic() >= deadline
            signal = _broadcast_bytes(self._failure() or (b"1" if give_up else b""), self.info)
            if signal == b"1":
                self.backlog = entries + self.backlog
                return None
            if signal:
                raise NoTrainableDataError(signal.decode())

    def _read(self, n: int) -> list[tuple[str, RolloutGroup]]:
        """Up to ``n`` entries: recovered ones first, then new ones (one bounded queue read)."""
        take, self.backlog = self.backlog[:n], self.backlog[n:]
        if len(take) < n and self._pending is not None:
            # Train on data that is already there while the servers load; but if the batch
            # must wait for new groups, publish the version first (admission may need it).
            take += self._get(n - len(take), 0.0)
            if len(take) < n:
                self._settle(wait=True)
        if len(take) < n:
            # Short reads: between them the ranks exchange a wait beat and catch up late servers.
            take += self._get(n - len(take), min(self.cfg.queue.timeout_s, 2.0))
        return take

    def _get(self, n: int, timeout_s: float) -> list[tuple[str, RolloutGroup]]:
        """One screened queue read (rank 0)."""
        entries = self.queue.get(n, self._staleness(), timeout_s, check=self._check)  # type: ignore[union-attr]
        self._note_screen()
        return entries

    def _staleness(self) -> Staleness:
        """The staleness rule, against this learner's own version (the one place it is applied)."""
        return Staleness(self.version, self.cfg.algorithm.max_staleness)

    def _check(self, group: RolloutGroup) -> Drop | None:
        """Groups not worth a place in the batch are dropped (or dead-lettered) when read. A
        group's images are fetched here, once (rank 0), and must decode."""
        problem = screen_group(group, self.cfg.learner.max_tokens_per_microbatch, self.vocab_size, self.image_token)
        if problem is not None:
            return Drop(*problem)
        if not group.images:
            return None
        if self.process_images is None:
            return Drop("images_for_text_model", f"{len(group.images)} images, but {self.cfg.learner.model_path} is a text model", True)
        found = self.queue.get_images([ref.sha256 for ref in group.images])  # type: ignore[union-attr]
        missing = [ref.sha256[:12] for ref in group.images if ref.sha256 not in found]
        if missing:
            return Drop("missing_image", f"image(s) {', '.join(missing)} no longer in the queue (expired after queue.image_ttl_s)")
        try:
            for png in found.values():
                decode_blob(png)
        except ImageError as exc:
            return Drop("bad_image", str(exc), True)
        self._images.update(found)
        return None

    def _with_images(self, prepared: Prepared, groups: Sequence[RolloutGroup]) -> Batch:
        """The batch with its groups' processed images: rank 0 sends the PNG bytes it fetched
        when reading the groups to every rank (one broadcast), each rank decodes and processes
        them once per group."""
        kept = [groups[i] for i in prepared.kept]
        wanted = list(dict.fromkeys(ref.sha256 for g in kept for ref in g.images))
        payload = msgspec.msgpack.encode({sha: self._images[sha] for sha in wanted}) if self.info.rank == 0 else b""
        blobs: dict[str, bytes] = msgspec.msgpack.decode(_broadcast_bytes(payload, self.info), type=dict[str, bytes])
        if self.info.rank == 0:  # keep only what groups still waiting in the backlog refer to
            waiting = {ref.sha256 for _, g in self.backlog for ref in g.images}
            self._images = {sha: png for sha, png in self._images.items() if sha in waiting}
        decoded = {sha: decode_blob(png) for sha, png in blobs.items()}
        inputs = vision.VisionInputs.build(self.model_type, [[decoded[ref.sha256] for ref in g.images] for g in kept], self.process_images)  # type: ignore[arg-type]
        return dataclasses.replace(prepared.batch, vision=inputs)  # type: ignore[arg-type]

    def _note_screen(self) -> None:
        report = self.queue.last_screen  # type: ignore[union-attr]
        if report.kept:
            self._recent_drops = Counter()
        self._recent_drops.update(report.trailing)

    def _failure(self) -> bytes:
        """Rank 0: why the run cannot go on (every group read lately was dropped), or b""."""
        limit = min(100, 10 * self.cfg.learner.batch_size)
        in_row = sum(self._recent_drops.values())
        if self.info.rank != 0 or in_row < limit:
            return b""
        reasons = ", ".join(f"{reason}: {count}" for reason, count in self._recent_drops.most_common())
        return (f"the last {in_row} groups read were all dropped ({reasons}); nothing is trainable. "
                f"reward_error: the reward function fails (see the driver log, rollout/reward_errors); bad_token: "
                f"the dead-letter stream {self.cfg.trainer.run_name}:dead says why; stale: raise algorithm.max_staleness").encode()

    def _catch_up(self) -> None:
        """Send the current weights to servers that do not hold them: a restarted or newly
        added server, or one whose last update failed (collective: rank 0 decides)."""
        if not self.publishing:
            return
        self._settle(wait=False)
        behind = self._lagging()
        names = _broadcast_bytes("\n".join(behind).encode(), self.info)
        if names:
            self.counters["sync_catch_up"] += 1
            self._publish(servers=behind)

    def _lagging(self) -> list[str]:
        """Rank 0: registered servers older than the served version (a catch-up sends the
        current weights, which may be newer: with ``sync.every > 1`` that is fine)."""
        if self.publisher is None:
            return []
        held = self.publisher.servers
        return [sid for sid in self.publisher.behind(self._served) if (v := held.get(sid)) is None or v < self._served]

    def _publish(self, servers: list[str] | None = None) -> float:
        """Gather full parameters bucket by bucket and broadcast them (rank 0); return seconds.

        With ``servers`` only those get them (a catch-up: the version is the one every
        server should hold already); otherwise every server does. The servers'
        acknowledgements are handled later, by :meth:`_settle`.
        """
        if not self.publishing:
            return 0.0
        start = time.perf_counter()
        policy = self.trainer.policy
        buckets = iter_full_parameters(policy, self.cfg.sync.bucket_mb << 20)
        try:
            if self.publisher is not None:
                self._settle(wait=True)
                if servers is None:
                    self._served = self.version
                named = (item for bucket in buckets for item in bucket)
                pending = self.publisher.begin(named, self.version, specs=tensor_specs(policy.named_parameters()), servers=servers)
                self._pending = pending
        finally:
            for _ in buckets:  # every rank takes part in every gather, even if the send stopped early
                pass
        return time.perf_counter() - start

    def _settle(self, wait: bool) -> None:
        """Act on the acknowledgements of the last update (rank 0): count a failure (the
        server keeps its weights; a later catch-up retries), then publish the served
        version for admission if every registered server holds it (ARCHITECTURE.md: a
        version counts once its weights reached the servers, so a server that joined or
        failed is caught up first). With ``wait=False`` and acknowledgements still
        missing, nothing happens yet."""
        if self._pending is None or self.publisher is None:
            return
        result = self.publisher.complete(self._pending, wait)
        if result is None:
            return
        self._pending = None
        self._sync_metrics = _sync_timings(result)
        if not result.ok and result.servers:
            self.counters["sync_failed"] += 1
        if self._served > self._announced and self.publisher.servers and not self._lagging():
            self.queue.publish_version(self._served)  # type: ignore[union-attr]
            self._announced = self._served

    def _save(self) -> None:
        trainer = self.trainer
        kl_ctrl = trainer.kl_ctrl.state_dict() if trainer.kl_ctrl is not None else {}
        critic_scheduler = trainer.critic_scheduler.state_dict() if trainer.critic_scheduler is not None else {}
        state = checkpoint.TrainingState(self.version, trainer.scheduler.state_dict(), list(self.uncommitted), dict(self.counters), kl_ctrl,
                                         critic_scheduler)
        path = checkpoint.checkpoint_dir(self.output_dir, self.version)
        checkpoint.save(path, trainer.policy, trainer.optimizer, state, self.cfg.learner.model_path, self.cfg.trainer.keep_checkpoints,
                        critic=self._critic())
        if self.queue is not None:
            self.queue.commit(self.uncommitted)
        self.uncommitted = []

    def _log(self, metrics: dict[str, float], entries: list[tuple[str, RolloutGroup]]) -> None:
        if self.info.rank != 0:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        record = {"version": self.version, "entry_ids": [e for e, _ in entries], "prompt_ids": [g.prompt_id for _, g in entries], "metrics": metrics}
        with open(self.output_dir / "learner_steps.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")


def _sync_timings(result: SendResult) -> dict[str, float]:
    """``sync/*`` metrics of a settled update, seconds: the sender's whole update and its
    wait for the acknowledgements, and the slowest server's receive, load and pause."""
    reports = list(result.servers.values())
    return {
        "sync/update_s": result.total_s, "sync/ack_wait_s": result.ack_s,
        "sync/receive_s": max((r.receive_s for r in reports), default=0.0),
        "sync/load_s": max((r.load_s for r in reports), default=0.0),
        "sync/pause_s": max((r.pause_s for r in reports), default=0.0),
    }


def _broadcast_bytes(payload: bytes, info: DistInfo) -> bytes:
    """Rank 0's ``payload`` on every rank (length first, then the bytes as a uint8 tensor)."""
    length = collectives.broadcast(torch.tensor([len(payload)], dtype=torch.long, device=info.device), info.device, 0, "payload length")
    if info.rank == 0 or int(length) == 0:
        if int(length):
            collectives.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(info.device), info.device, 0, "payload")
        return payload if info.rank == 0 else b""
    data = collectives.broadcast(torch.empty(int(length), dtype=torch.uint8, device=info.device), info.device, 0, "payload")
    return data.cpu().numpy().tobytes()


def _broadcast_groups(groups: list[RolloutGroup], info: DistInfo) -> list[RolloutGroup] | None:
    """Rank 0's ``groups`` on every rank, as msgspec bytes; None everywhere for a wait beat
    (rank 0 passed no groups)."""
    encoded = [encode(g) for g in groups] if info.rank == 0 else []
    count = collectives.broadcast(torch.tensor([len(encoded)], dtype=torch.long, device=info.device), info.device, 0, "group count")
    if int(count) == 0:
        return None
    sizes = torch.tensor([len(e) for e in encoded] or [0] * int(count), dtype=torch.long, device=info.device)
    collectives.broadcast(sizes, info.device, 0, "group sizes")
    if info.rank == 0:
        _broadcast_bytes(b"".join(encoded), info)
        return list(groups)
    data = _broadcast_bytes(b"", info)
    out, offset = [], 0
    for size in sizes.tolist():
        out.append(decode(data[offset: offset + size]))
        offset += size
    return out
