"""The learner loop of one rank: feed -> step -> publish -> checkpoint -> commit.

The feed (:mod:`async_rl.learner.feed`) gives every rank the same step's groups, read by
rank 0, the only queue consumer; the publication (:mod:`async_rl.learner.publish`) sends
new weights to the inference servers. Versions, staleness and checkpoints follow
docs/architecture.md: version += 1 per step that trained, entries are committed only after the
checkpoint containing them is durable, and a restarted learner commits what its checkpoint
covers, then re-reads its own pending entries first.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from async_rl.algos.options import estimator_info
from async_rl.appendlog import append_lines
from async_rl.config import Config
from async_rl.data.images import decode_blob
from async_rl.heap import release_freed_heap
from async_rl.learner import checkpoint, collectives, vision
from async_rl.learner.batching import Batch, Prepared, prepare
from async_rl.learner.feed import BatchFeed, QueueReader, StepData, staleness_metrics, truncation_metrics
from async_rl.learner.memory import RankExtras, cuda_ipc_handoff, servers_gpu_share
from async_rl.learner.model import DistInfo, init_distributed, load_sharded
from async_rl.learner.publish import Publication, WeightPublisher
from async_rl.learner.screening import Limits
from async_rl.learner.train_step import Trainer
from async_rl.queue import ReplayQueue

log = logging.getLogger(__name__)


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
        # A LoRA policy (learner.lora) trains only its adapter; its reference is itself with the
        # adapter disabled (beside.reference is then False: no second model).
        share = servers_gpu_share(cfg.rollout, lrn)
        beside = RankExtras.of(cfg.algorithm, lrn.lora, handoff=cuda_ipc_handoff(cfg.sync, share))
        policy = load_sharded(lrn.model_path, lrn, self.info.device, trainable=True, beside=beside, servers_share=share, lora=lrn.lora)
        reference = load_sharded(lrn.model_path, lrn, self.info.device, trainable=False) if beside.reference else None
        critic = (load_sharded(lrn.critic.model_path or lrn.model_path, lrn, self.info.device, trainable=True, beside=beside,
                               servers_share=share, value_model=True) if beside.critic else None)
        self.model_type = str(policy.config.model_type)
        self.process_images = vision.load_image_processor(lrn.model_path) if vision.is_vision_language(policy.config.to_dict()) else None
        """A vision-language policy's image processor (None for a text model)."""
        limits = Limits(lrn.max_tokens_per_microbatch, int(policy.config.get_text_config().vocab_size),
                        getattr(policy.config, "image_token_id", None) if self.process_images is not None else None,
                        cfg.algorithm.failed_samples, 2 if estimator_info(cfg.algorithm.advantage.name).group else 1, cfg.data.max_pixels,
                        needs_teacher=cfg.algorithm.distill is not None,
                        teacher_top_k=cfg.algorithm.distill.top_k if cfg.algorithm.distill is not None else 0)
        self.trainer = Trainer(policy, reference, lrn, cfg.algorithm, self.info, cfg.trainer.total_steps, cfg.trainer.seed,
                               temperature=cfg.rollout.temperature, critic=critic, lora=lrn.lora)
        self.output_dir = Path(cfg.trainer.output_dir)
        self.queue = (
            ReplayQueue(redis_url, cfg.trainer.run_name, cfg.queue.max_depth, consumer=f"{cfg.trainer.run_name}-learner",
                        claim_idle_s=cfg.queue.recover_idle_s, op_timeout_s=cfg.queue.timeout_s)
            if self.info.rank == 0 else None
        )
        """Rank 0's queue consumer (None on the other ranks)."""
        reader = (QueueReader(self.queue, limits, cfg.algorithm.max_staleness, lrn.batch_size, cfg.queue.timeout_s,
                              self.process_images is not None, lrn.model_path, cfg.trainer.run_name, lrn.fill_staleness_window)
                  if self.queue is not None else None)
        self.feed = BatchFeed(self.info.rank, self.info.device, limits, reader)
        self.version = 0
        self._waiting_since: float | None = None
        """When the wait for the next batch began (``perf_counter``), across calls of :meth:`run`
        that returned without a batch (the driver's bounded waits): None while stepping."""
        self.uncommitted: list[str] = []
        self.counters: Counter[str] = Counter()
        self.head: Path | None = None
        """The checkpoint the weights continue from: the one loaded, then each one saved."""
        self.swept: list[str] = []
        """What the start's sweep of killed checkpoint saves did (rank 0), for the driver's console."""
        self.resharded: str | None = None
        """Rank 0, when the checkpoint loaded was saved by another number of ranks: what that
        changes (:func:`checkpoint.resharding_note`), for the driver's console."""
        self._resume()
        self.publication = Publication(self.info.rank, self.info.device, policy, cfg.sync.bucket_mb, self.counters, publisher,
                                       self.queue.publish_version if self.queue is not None else None, self.version, lora=lrn.lora)

    # -- lifecycle ----------------------------------------------------------------

    def _critic(self) -> tuple[nn.Module, torch.optim.Optimizer] | None:
        """The critic and its optimizer, checkpointed beside the policy (None without one)."""
        trainer = self.trainer
        return (trainer.critic, trainer.critic_optimizer) if trainer.critic is not None and trainer.critic_optimizer is not None else None

    def _resume(self) -> None:
        path = None
        if self.info.rank == 0:
            start = checkpoint.start(self.cfg.trainer.resume, self.output_dir)
            path, self.swept = start.path, start.swept
        chosen = collectives.broadcast_bytes(str(path).encode() if path else b"", self.info.device, self.info.rank).decode()
        if chosen:
            self.head = Path(chosen)
            if self.info.rank == 0:
                self.resharded = checkpoint.resharding_note(self.head, self.info.world_size)
                if self.resharded is not None:
                    log.info("%s", self.resharded)
            lrn = self.cfg.learner
            state = checkpoint.load(Path(chosen), self.trainer.policy, self.trainer.optimizer, self._critic(), lora=lrn.lora,
                                    model_path=lrn.model_path)
            self.trainer.scheduler.load_state_dict(state.scheduler)
            if self.trainer.critic_scheduler is not None:
                self.trainer.critic_scheduler.load_state_dict(state.critic_scheduler)
            self.version = state.version
            self.counters.update(state.counters)
            if self.trainer.kl_ctrl is not None and state.kl_ctrl:
                self.trainer.kl_ctrl.load_state_dict(state.kl_ctrl)
            if self.queue is not None:  # the checkpoint holds these; a crash may have come before the commit
                self.queue.commit(state.uncommitted_entry_ids)
        if self.feed.reader is not None:
            # Entries read but not in the checkpoint: train them first, in their original order.
            self.feed.reader.recover()

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
        self.publication.settle(wait=True)
        # The checkpoint of this version may exist on another line: only the head holds these weights.
        saved = self.head is not None and self.head.absolute() == checkpoint.checkpoint_dir(self.output_dir, self.version).absolute()
        if (self.uncommitted or not saved) and (self.version > 0 or self.uncommitted):
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
        if self._waiting_since is None:
            self._waiting_since = time.perf_counter()
        data = self.feed.next(self.cfg.learner.batch_size, self.version, self.publication, deadline)
        if data is None:
            return None  # the wait goes on in the next call: time/wait counts it from its start
        start, self._waiting_since = self._waiting_since, None
        wait_s = time.perf_counter() - start
        prepared = prepare(data.groups)
        self.counters.update({**{f"dropped/{k}": v for k, v in prepared.dropped.items()}, "groups_consumed": len(data.fed)})
        if prepared.batch is None:  # the screen let through only groups with a trainable sample
            raise RuntimeError(f"no trainable sample in a screened batch (dropped: {dict(prepared.dropped)}): a bug in the screen")
        batch = self._with_images(prepared.batch, prepared, data) if data.images else prepared.batch
        trained = [data.fed[i].screened.group for i in prepared.kept]
        metrics: dict[str, float] = staleness_metrics(trained, self.version)
        metrics.update(truncation_metrics(trained, self.cfg.rollout.env.max_turns if self.cfg.rollout.env.name is not None else None))
        result = self.trainer.step(batch, self.version)
        self.version += 1
        metrics["version"] = float(self.version)  # the version this step produced
        sync_s = self.publication.publish(self.version) if self.version % self.cfg.sync.every == 0 else 0.0
        step_s = time.perf_counter() - start
        metrics.update(result.metrics)
        metrics.update({
            "perf/tokens": float(result.tokens),
            "perf/tokens_per_s": result.tokens / max(step_s - wait_s, 1e-9),
            "time/prox": result.times.prox, "time/perception": result.times.perception, "time/fwd_bwd": result.times.fwd_bwd,
            "time/optim": result.times.optim, "time/sync": sync_s,
        })
        metrics.update({"time/wait": wait_s, "time/step": step_s, "perf/idle_fraction": wait_s / max(step_s, 1e-9)})
        metrics.update({**self.publication.take_metrics(), **{f"counters/{k}": float(v) for k, v in self.counters.items()}})
        self.uncommitted.extend(f.entry_id for f in data.fed)
        # Log before the checkpoint: a kill between the two then repeats the line (a resumed
        # run retrains the version; the last line counts) instead of losing the step's record.
        self._log(metrics, data)
        release_freed_heap()  # the step's freed activations and buffers: RSS stays flat over days
        if self.version % self.cfg.trainer.save_every == 0:
            started = time.perf_counter()
            self._save()
            # For the driver (its ETA); the line of learner_steps.jsonl is already written.
            metrics["time/checkpoint"] = time.perf_counter() - started
        return metrics

    def _with_images(self, batch: Batch, prepared: Prepared, data: StepData) -> Batch:
        """``batch`` with its groups' processed images: each rank decodes the PNG bytes the
        feed brought and processes them once per group."""
        if self.process_images is None:  # the reader dead-letters groups with images for a text model
            raise RuntimeError("images in a batch of a text model: a bug in the feed's screen")
        decoded = {sha: decode_blob(png, self.feed.limits.max_image_pixels) for sha, png in data.images.items()}
        groups = [data.fed[i].screened.group for i in prepared.kept]
        inputs = vision.VisionInputs.build(self.model_type, [[decoded[ref.sha256] for ref in g.images] for g in groups], self.process_images)
        return dataclasses.replace(batch, vision=inputs)

    def _save(self) -> None:
        trainer = self.trainer
        kl_ctrl = trainer.kl_ctrl.state_dict() if trainer.kl_ctrl is not None else {}
        critic_scheduler = trainer.critic_scheduler.state_dict() if trainer.critic_scheduler is not None else {}
        path = checkpoint.checkpoint_dir(self.output_dir, self.version)
        parent = None if self.head is None else checkpoint.reference(self.head, path.parent)
        state = checkpoint.TrainingState(self.version, trainer.scheduler.state_dict(), list(self.uncommitted), dict(self.counters), kl_ctrl,
                                         critic_scheduler, parent)
        checkpoint.save(path, trainer.policy, trainer.optimizer, state, self.cfg.learner.model_path, self.cfg.trainer.keep_checkpoints,
                        critic=self._critic(), lora=self.cfg.learner.lora)
        self.head = path
        if self.queue is not None:
            self.queue.commit(self.uncommitted)
        self.uncommitted = []

    def _log(self, metrics: dict[str, float], data: StepData) -> None:
        if self.info.rank != 0:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        record = {"version": self.version, "entry_ids": [f.entry_id for f in data.fed],
                  "prompt_ids": [f.screened.group.prompt_id for f in data.fed], "metrics": metrics}
        append_lines(self.output_dir / "learner_steps.jsonl", [json.dumps(record)])
