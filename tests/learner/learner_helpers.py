"""Synthetic rollout groups, test configs, and the body of spawned learner ranks."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import torch.multiprocessing as mp

from async_rl.config import Config, LoraConfig, load_config
from async_rl.learner.batching import Prepared, prepare
from async_rl.learner.screening import Limits, screen
from async_rl.records import RolloutGroup, Sample

SPAWN = mp.get_context("spawn")


def make_groups(count: int, seed: int, samples: int = 4, vocab: int = 512, version: int = 0, run: str = "test") -> list[RolloutGroup]:
    """``count`` groups of ``samples`` random responses (1-12 tokens) to random prompts (3-8
    tokens), with random behaviour log-probs and rewards in [0, 1); equal seeds give equal groups."""
    rng = random.Random(seed)
    groups = []
    for g in range(count):
        prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(3, 8))]
        members = []
        for _ in range(samples):
            tokens = [rng.randrange(2, vocab) for _ in range(rng.randint(1, 12))]
            logp = [-rng.uniform(0.5, 3.0) for _ in tokens]
            members.append(Sample.from_lists(tokens, logp, version, rng.random()))
        groups.append(RolloutGroup.from_lists(run, f"g{seed}-{g}", g, prompt, members, "srv", 0.0, created_at=0.0))
    return groups


def prepare_groups(groups: list[RolloutGroup], max_tokens: int, vocab_size: int | None = None, image_token: int | None = None) -> Prepared:
    """:func:`prepare` of ``groups`` screened as a learner rank screens the groups it receives."""
    limits = Limits(max_tokens, vocab_size, image_token)
    return prepare([screen(group, limits) for group in groups])


def learner_config(model_path: str | Path, output_dir: str | Path, run: str, *overrides: str) -> Config:
    """A small valid config for the tiny model: batches of 4 groups x 4 samples, fp32 on CPU."""
    return load_config(None, [
        f"learner.model_path={model_path}", f"trainer.output_dir={output_dir}", f"trainer.run_name={run}",
        "data.max_prompt_length=16", "rollout.max_response_length=16", "rollout.n=4",
        "learner.batch_size=4", "learner.max_tokens_per_microbatch=64", "learner.optim.lr=1e-3",
        "learner.optim.weight_decay=0.0", "algorithm.max_staleness=100", "queue.max_depth=64",
        "queue.timeout_s=5.0", "sync.timeout_s=30.0", "trainer.save_every=2", "trainer.total_steps=4",
        *overrides,
    ])


def rank_main(rank: int, world_size: int, port: int, cfg: Config, redis_url: str, max_steps: int | None, done_file: str,
              finish: bool = False) -> None:
    """Body of one spawned learner rank: run the loop, then write ``done_file``.{rank}
    (``{"version", "pid", "resharded"}``). With ``max_steps`` the rank then waits to be killed
    (a crash after those steps), or with ``finish`` checkpoints what it trained and exits (a
    stop, as the driver's shutdown)."""
    from async_rl.learner.loop import LearnerLoop

    loop = LearnerLoop(cfg, rank, world_size, "127.0.0.1", port, redis_url)
    summary = loop.run(max_steps)
    if finish:
        loop.finish()
    Path(f"{done_file}.{rank}").write_text(json.dumps({"version": summary.version, "pid": os.getpid(), "resharded": loop.resharded}))
    if max_steps is not None and not finish:
        time.sleep(3600)
    loop.close()


def start_ranks(world_size: int, cfg: Config, redis_url: str, done_file: Path, max_steps: int | None = None,
                finish: bool = False) -> list[mp.Process]:
    """Spawn ``world_size`` ranks of :func:`rank_main` on a free port."""
    from async_rl.learner.model import free_port

    port = free_port()
    procs = [SPAWN.Process(target=rank_main, args=(r, world_size, port, cfg, redis_url, max_steps, str(done_file), finish), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    return procs


def gather_main(rank: int, world_size: int, port: int, model_dir: str, bucket_bytes: int, out: str) -> None:
    """Body of a rank that gathers its FSDP model bucket by bucket; rank 0 saves the buckets."""
    import torch

    from async_rl.config import LearnerConfig
    from async_rl.learner.model import init_distributed, iter_full_parameters, load_sharded

    info = init_distributed(rank, world_size, "127.0.0.1", port, 60.0)
    model = load_sharded(model_dir, LearnerConfig(), info.device, trainable=True)
    buckets = list(iter_full_parameters(model, bucket_bytes))
    if rank == 0:
        torch.save([[(name, t.clone()) for name, t in bucket] for bucket in buckets], out)


def bounded_wait_main(port: int, cfg: Config, redis_url: str, out: str) -> None:
    """One rank: a bounded wait on an empty queue returns without a step and keeps the groups
    read so far; once the batch is complete a step runs (its ``time/wait`` counting the first
    call's wait too); ``finish`` checkpoints and commits."""
    from async_rl.learner.loop import LearnerLoop
    from async_rl.queue import ReplayQueue

    loop = LearnerLoop(cfg, 0, 1, "127.0.0.1", port, redis_url)
    report: dict = {}
    with ReplayQueue(redis_url, cfg.trainer.run_name, max_depth=64) as q:
        groups = make_groups(4, seed=3, run=cfg.trainer.run_name)
        q.put(groups[0])  # 1 of 4: not a batch
        start = time.monotonic()
        report["empty"] = loop.run(max_steps=1, wait_s=1.0).steps
        report["waited_s"] = time.monotonic() - start
        report["held"] = len(loop.feed.reader.backlog)
        for g in groups[1:]:
            q.put(g)
        summary = loop.run(max_steps=1, wait_s=30.0)
        report["version"] = summary.version
        report["step_wait_s"], report["step_s"] = summary.steps[0]["time/wait"], summary.steps[0]["time/step"]
        report["finished"] = loop.finish()
        report["pending_after_finish"] = q.stats()["pending"]
    loop.close()
    Path(out).write_text(json.dumps(report))


def drop_streak_main(rank: int, world_size: int, port: int, cfg: Config, redis_url: str, out: str) -> None:
    """One rank of a run whose queue holds a malformed group, failed-reward groups and one
    good batch: train what is trainable, then stop on the run of drops; report the error."""
    from async_rl.learner.feed import NoTrainableDataError
    from async_rl.learner.loop import LearnerLoop

    loop = LearnerLoop(cfg, rank, world_size, "127.0.0.1", port, redis_url)
    report: dict = {}
    try:
        loop.run()
    except NoTrainableDataError as exc:
        report["error"] = str(exc)
    report["version"] = loop.version
    loop.close()
    Path(f"{out}.{rank}").write_text(json.dumps(report))


def failed_reward_groups(count: int, seed: int, run: str) -> list[RolloutGroup]:
    """Groups whose every sample carries a reward-function error."""
    groups = make_groups(count, seed, run=run)
    return [
        RolloutGroup.from_lists(run, g.group_id, g.prompt_id, list(g.prompt_array()),
                                [Sample.from_lists(list(s.token_array()), list(s.logprob_array()), 0, 0.0, error="ValueError: boom")
                                 for s in g.samples], "srv", 0.0, created_at=0.0)
        for g in groups
    ]


def save_killed_main(port: int, model_dir: str, out: str, kill_at: str, ready: str) -> None:
    """One rank: resume explicitly from ``step_1`` of ``out`` (leaving the line whose head is
    ``step_2``), then save a new ``step_2`` over the old one and stop at ``kill_at`` for the
    test to SIGKILL it: ``shards`` (the model's shards of the new checkpoint are written, the
    optimizer's not yet) or ``moved_aside`` (the new checkpoint is complete, the old ``step_2``
    was moved aside, the new one not yet renamed into place). Touches ``ready`` there."""
    import os as _os

    from async_rl.learner import checkpoint
    from async_rl.learner.model import init_distributed, load_sharded
    from async_rl.learner.train_step import Trainer

    cfg = learner_config(model_dir, out, "killed")
    info = init_distributed(0, 1, "127.0.0.1", port, 60.0)
    policy = load_sharded(model_dir, cfg.learner, info.device, trainable=True)
    trainer = Trainer(policy, None, cfg.learner, cfg.algorithm, info, 4, 1)
    start = checkpoint.start(str(checkpoint.checkpoint_dir(out, 1)), out)
    checkpoint.load(start.path, policy, trainer.optimizer)  # type: ignore[arg-type]

    def stop_here() -> None:
        Path(ready).touch()
        time.sleep(3600)

    if kill_at == "shards":
        real_save = checkpoint.dcp.save

        def save(state_dict: dict, checkpoint_id: Path) -> None:
            if checkpoint_id.name == "optim":
                stop_here()
            real_save(state_dict, checkpoint_id=checkpoint_id)

        checkpoint.dcp.save = save  # type: ignore[assignment]
    else:
        real_replace = _os.replace

        def replace(src: str, dst: str) -> None:
            real_replace(src, dst)
            if Path(dst).name.startswith(".old-"):
                stop_here()

        checkpoint.os.replace = replace  # type: ignore[attr-defined]
    state = checkpoint.TrainingState(2, trainer.scheduler.state_dict(), counters={"line": 2}, parent="step_00000001")
    checkpoint.save(checkpoint.checkpoint_dir(out, 2), policy, trainer.optimizer, state, model_dir, keep=5)
    raise AssertionError(f"not stopped at {kill_at}")


def lora_rank_main(rank: int, world_size: int, port: int, model_dir: str, out_dir: str) -> None:
    """Body of a rank of a LoRA policy (rank 4, alpha 8): two learner steps, then rank 0 saves
    ``{"params": the gathered parameters, "logp": the batch's packed log-probs, "batch": the
    batch}`` to ``out_dir``/lora.pt."""
    import torch

    from async_rl.config import LoraConfig
    from async_rl.learner.model import init_distributed, iter_full_parameters, load_sharded
    from async_rl.learner.train_step import Trainer

    cfg = learner_config(model_dir, out_dir, "lora", "learner.optim.lr=1e-2", "learner.ppo_mini_batches=2")
    info = init_distributed(rank, world_size, "127.0.0.1", port, 60.0)
    torch.manual_seed(0)  # the same A on every rank (each shards its own copy)
    policy = load_sharded(model_dir, cfg.learner, info.device, trainable=True, lora=LoraConfig(rank=4, alpha=8.0))
    trainer = Trainer(policy, None, cfg.learner, cfg.algorithm, info, cfg.trainer.total_steps, cfg.trainer.seed)
    batch = prepare_groups(make_groups(4, seed=7), 64, 512).batch
    for step in range(2):
        trainer.step(batch, step)
    logp = trainer._all_rows_logp(policy, batch)
    params = [(name, t.clone()) for bucket in iter_full_parameters(policy, 1 << 20) for name, t in bucket]
    if rank == 0:
        torch.save({"params": dict(params), "logp": logp, "batch": batch}, f"{out_dir}/lora.pt")


def lora_resume_main(rank: int, world_size: int, port: int, model_dir: str, lora: LoraConfig, ckpt: str, out: str) -> None:
    """Body of a rank that loads LoRA checkpoint ``ckpt`` into a fresh LoRA policy (another A
    than the saved one) and trains one step on it; rank 0 saves the loaded adapter and AdamW
    state, gathered, to ``out`` (``{"params": {name: tensor}, "exp_avg": {name: tensor}}``)."""
    import torch

    from async_rl.learner import checkpoint
    from async_rl.learner.lora import adapter_named_parameters
    from async_rl.learner.model import init_distributed, load_sharded
    from async_rl.learner.train_step import Trainer

    cfg = learner_config(model_dir, Path(out).parent, "lora-resume", "learner.optim.lr=1e-2")
    info = init_distributed(rank, world_size, "127.0.0.1", port, 60.0)
    torch.manual_seed(1)
    policy = load_sharded(model_dir, cfg.learner, info.device, trainable=True, lora=lora)
    trainer = Trainer(policy, None, cfg.learner, cfg.algorithm, info, cfg.trainer.total_steps, cfg.trainer.seed, lora=lora)
    checkpoint.load(Path(ckpt), policy, trainer.optimizer, lora=lora, model_path=model_dir)
    adapter = adapter_named_parameters(policy)
    params = {name: p.full_tensor().clone() for name, p in adapter}
    exp_avg = {name: trainer.optimizer.state[p]["exp_avg"].full_tensor().clone() for name, p in adapter}
    trainer.step(prepare_groups(make_groups(4, seed=3), 64, 512).batch, 1)  # the resharded state trains on
    if rank == 0:
        torch.save({"params": params, "exp_avg": exp_avg}, out)
