"""Learner throughput and weight-publishing bandwidth against plain baselines.

    .venv/bin/python benchmarks/learner_throughput.py --json benchmarks/results/learner_throughput.json

1. Training: the learner (groups decoded from queue records -> ``screening.screen`` -> ``batching.prepare`` ->
   ``Trainer.step`` on an FSDP2 model) against the plain packed loop of ``_plain_packed.py``
   (HF model, packed rows, chunked log-softmax, AdamW) on the same model, micro-batches and tokens
   (``ratio_vs_plain``; target >= 0.9). One rank, float32, on this machine's CPU. The same
   learner with a critic (``algorithm.advantage.name=gae``: the critic's value pass, its
   value-loss update and GAE) gives ``critic_step_cost``: its step time over the plain
   learner's.
2. Publishing: gathering full parameters from the FSDP shards bucket by bucket
   (``iter_full_parameters``), packing and broadcasting the buckets on a
   ``sync.group.WeightGroup`` to a receiving process exactly as ``WeightSender`` does
   (``sync.streaming.stream_buckets``: packing overlaps the previous bucket's transfer), against a
   raw broadcast of the same bytes in the same bucket sizes on the same group
   (``sync_ratio_vs_raw``; target >= 0.8), on a 29 M-parameter model (118 MB per update;
   ``small_model_sync_ratio_vs_raw`` is the same on the 5.2 M training model, where the
   per-call latency of its few dozen small broadcasts weighs more). The ZeroMQ control round trips of a real
   ``WeightSender`` update are not included. Tensors of 512 KiB or more travel alone,
   straight from their memory (``sync.buckets.SOLO_BYTES``), in both.

3. ``--lora-rank R`` (instead of 1 and 2): the learner step on the 29 M-parameter model, full
   fine-tuning against LoRA (``learner.lora.rank=R``, ``alpha = 2 R``, the seven projections of
   every layer; the reference-free GRPO default), on the same batches, alternating:
   ``<full|lora>_tokens_per_s``, ``<full|lora>_step_s`` (median step), ``<full|lora>_trainable_params``,
   and memory: ``<full|lora>_held_gb``, the bytes of the tensors held between steps (parameters and
   optimizer state; gradients are freed after each step), counted exactly; ``<full|lora>_step_gb``,
   the most resident memory (RSS, sampled every 2 ms: ``learner_gpu.PeakMemory``) a step adds above
   what the process held before it (gradients, activations, temporaries; freed heap returned to
   the system before each step so that one side's freed memory does not hide the other's growth);
   ``<full|lora>_peak_gb``, their sum: the side's peak training memory less the process's
   fixed overhead. ``lora_vs_full_tokens_per_s`` and ``lora_vs_full_peak`` are LoRA over full.

       .venv/bin/python benchmarks/learner_throughput.py --lora-rank 8 --json benchmarks/results/learner_throughput_lora.json

Each comparison alternates the two sides round by round and rates each by its median
round, because these shared machines drift by tens of percent within a minute.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import datetime
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from _plain_packed import plain_packed_step  # noqa: E402
from _report import report  # noqa: E402
from learner_gpu import PeakMemory  # noqa: E402

from async_rl.config import load_config  # noqa: E402
from async_rl.learner.batching import plan_micro_batches, prepare  # noqa: E402
from async_rl.learner.screening import Limits, screen  # noqa: E402
from async_rl.learner.model import DistInfo, iter_full_parameters, load_sharded  # noqa: E402
from async_rl.learner.train_step import Trainer  # noqa: E402
from async_rl.records import RolloutGroup, Sample, decode, encode  # noqa: E402
from async_rl.sync.buckets import plan_buckets, tensor_specs  # noqa: E402
from async_rl.sync.group import Rendezvous, WeightGroup, connect_store, host_store, new_key_prefix  # noqa: E402
from async_rl.sync.streaming import stream_buckets  # noqa: E402

VOCAB, MAX_TOKENS = 4096, 2048


def build_model(out: Path, hidden: int = 256, layers: int = 4) -> None:
    """A random Qwen2 (vocab 4096): 5.2 M parameters with the defaults (training), 29 M with
    hidden 512 and 8 layers (publishing: 118 MB per update, so bandwidth rather than the
    per-call latency of a few dozen small broadcasts decides)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=hidden, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128,
                         num_hidden_layers=layers, intermediate_size=3 * hidden, vocab_size=VOCAB,
                         max_position_embeddings=512, tie_word_embeddings=False)
    Qwen2ForCausalLM(config).save_pretrained(out)


def make_records(groups: int, samples: int, seed: int) -> list[bytes]:
    """Queue records (msgspec bytes): prompts of 32-64 tokens, responses of 64-192 tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(groups):
        prompt = torch.randint(2, VOCAB, (int(torch.randint(32, 65, (1,), generator=g)),), generator=g).tolist()
        members = []
        for _ in range(samples):
            n = int(torch.randint(64, 193, (1,), generator=g))
            members.append(Sample.from_lists(torch.randint(2, VOCAB, (n,), generator=g).tolist(), [-2.0] * n, 0, float(torch.rand(1, generator=g))))
        out.append(encode(RolloutGroup.from_lists("bench", f"g{i}", i, prompt, members, "s", 0.0)))
    return out


def learner_step(model_dir: Path, records: list[bytes], total_steps: int, *overrides: str) -> tuple[Callable[[], int], list[list[int]], int, Trainer]:
    """One learner step (records decoded -> ``screen`` -> ``prepare`` -> ``Trainer.step``) as a callable
    returning its tokens; also the micro-batch plan and token count of a step, and the trainer.
    ``overrides`` (e.g. ``algorithm.advantage.name=gae``: a critic beside the policy;
    ``learner.lora.rank=8``: LoRA adapters on the policy) change the config."""
    cfg = load_config(None, [f"learner.model_path={model_dir}", "learner.batch_size=8", "rollout.n=4",
                             f"learner.max_tokens_per_microbatch={MAX_TOKENS}", "data.max_prompt_length=64",
                             "rollout.max_response_length=192", "queue.max_depth=256", "learner.optim.lr=1e-5", *overrides])
    info = DistInfo(0, 1, torch.device("cpu"))
    policy = load_sharded(str(model_dir), cfg.learner, info.device, trainable=True, lora=cfg.learner.lora)
    critic = load_sharded(str(model_dir), cfg.learner, info.device, trainable=True, value_model=True) if cfg.algorithm.needs_critic else None
    trainer = Trainer(policy, None, cfg.learner, cfg.algorithm, info, total_steps, 1, critic=critic, lora=cfg.learner.lora)
    steps = iter(range(total_steps))

    def step() -> int:
        batch = prepare([screen(decode(r), Limits(MAX_TOKENS, VOCAB)) for r in records]).batch
        return trainer.step(batch, next(steps)).tokens

    batch = prepare([screen(decode(r), Limits(MAX_TOKENS, VOCAB)) for r in records]).batch
    plan = plan_micro_batches(batch.lengths.tolist(), range(batch.size), 1, MAX_TOKENS)[0]
    return step, plan, int(batch.lengths.sum()), trainer


def plain_step(model_dir: Path, records: list[bytes], plan: list[list[int]]) -> Callable[[], int]:
    """The plain packed loop (``_plain_packed.py``: HF model, packed rows, REINFORCE-style
    loss, AdamW) on the same micro-batches."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    batch = prepare([screen(decode(r), Limits(MAX_TOKENS, VOCAB)) for r in records]).batch
    return plain_packed_step(model, batch, plan, torch.device("cpu"), 4096, torch.float32)


def interleaved_rounds(runs: dict[str, Callable[[], int]], rounds: int, memory: bool = False) -> dict[str, tuple[float, int, float]]:
    """Per run: (median round in s, units of a round, most GB of resident memory a round added
    (``PeakMemory``; 0.0 unless ``memory``)), the runs alternating round by round (after one
    warm-up each, not counted) so that a noisy neighbour slows all of them alike. With
    ``memory``, freed heap is returned to the system before each round (glibc ``malloc_trim``),
    so that memory one run freed does not absorb the next one's growth."""
    trim = ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim if memory else None
    for fn in runs.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in runs}
    units: dict[str, int] = {}
    peaks = dict.fromkeys(runs, 0.0)
    for _ in range(rounds):
        for name, fn in runs.items():
            if trim is not None:
                trim(0)
            with PeakMemory(torch.device("cpu")) if memory else nullcontext() as peak:
                start = time.perf_counter()
                units[name] = fn()
                times[name].append(time.perf_counter() - start)
            if peak is not None:
                peaks[name] = max(peaks[name], peak.peak_gb)
    return {name: (statistics.median(t), units[name], peaks[name]) for name, t in times.items()}


def interleaved_rates(runs: dict[str, Callable[[], int]], rounds: int) -> dict[str, float]:
    """Units/s of each run from its median round (:func:`interleaved_rounds`)."""
    return {name: n / median for name, (median, n, _) in interleaved_rounds(runs, rounds).items()}


def held_bytes(trainer: Trainer) -> int:
    """Bytes of the tensors a trainer holds between steps: its policy's parameters (local shards)
    and optimizer state (gradients are freed after each step)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    tensors = [local(p) for p in trainer.policy.parameters()]
    tensors += [local(v) for state in trainer.optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def lora_vs_full(model_dir: Path, records: list[bytes], rank: int, steps: int) -> dict[str, object]:
    """``--lora-rank``: the learner step with full fine-tuning and with rank-``rank`` LoRA
    (``alpha = 2 rank``, the default seven projections), alternating (see the module docstring)."""
    full_fn, plan, tokens, full = learner_step(model_dir, records, steps + 1)
    # openai_api=false: the config refuses LoRA with the OpenAI-compatible API (no rollout here)
    lora_fn, _, _, lora = learner_step(model_dir, records, steps + 1, f"learner.lora.rank={rank}", f"learner.lora.alpha={2.0 * rank}",
                                       "rollout.openai_api=false")
    rounds = interleaved_rounds({"full": full_fn, "lora": lora_fn}, steps, memory=True)
    result: dict[str, object] = {}
    rate: dict[str, float] = {}
    peak: dict[str, float] = {}
    for name, trainer in (("full", full), ("lora", lora)):
        step_s, n, step_gb = rounds[name]
        held_gb = held_bytes(trainer) / 1e9
        rate[name], peak[name] = n / step_s, held_gb + step_gb
        result.update({f"{name}_tokens_per_s": rate[name], f"{name}_step_s": step_s,
                       f"{name}_trainable_params": sum(p.numel() for p in trainer.policy.parameters() if p.requires_grad),
                       f"{name}_held_gb": held_gb, f"{name}_step_gb": step_gb, f"{name}_peak_gb": peak[name]})
    result["lora_vs_full_tokens_per_s"] = rate["lora"] / rate["full"]
    result["lora_vs_full_peak"] = peak["lora"] / peak["full"]
    result["setup"] = {"device": "cpu", "threads": torch.get_num_threads(), "ranks": 1, "lora_rank": rank, "lora_alpha": 2.0 * rank,
                       "params_m": round(sum(p.numel() for p in full.policy.parameters()) / 1e6, 2),
                       "tokens_per_step": tokens, "micro_batches": len(plan), "steps": steps,
                       "memory": "held: parameters + optimizer state (tensor bytes); step: most RSS a timed step adds "
                                 "(sampled every 2 ms, after malloc_trim); peak = held + step",
                       "method": "median of interleaved rounds, after one warm-up each"}
    return result


def _receiver(rv: Rendezvous, sizes: list[int], rounds: int) -> None:
    group = WeightGroup.join(rv, 1, connect_store(rv, 60.0), 60.0)
    bufs = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    for _ in range(rounds):
        for buf in bufs:
            group.broadcast(buf, 60.0)


def sync_rates(model_dir: Path, bucket_bytes: int, rounds: int) -> tuple[float, float, int]:
    """(publishing GB/s, raw broadcast GB/s, bytes per update) over a gloo WeightGroup of 2."""
    from async_rl.config import LearnerConfig

    policy = load_sharded(str(model_dir), LearnerConfig(), torch.device("cpu"), trainable=True)
    specs = tensor_specs(policy.named_parameters())
    buckets = plan_buckets(specs, bucket_bytes)
    sizes = [b.nbytes for b in buckets]
    store = host_store("127.0.0.1", 60.0)
    rv = Rendezvous("127.0.0.1", store.port, 0, 2, "gloo", new_key_prefix(0))
    proc = mp.get_context("spawn").Process(target=_receiver, args=(rv, sizes, 2 * rounds + 2))  # + warm-ups
    proc.start()
    group = WeightGroup.join(rv, 0, store, 60.0)

    def publish() -> None:
        named = (item for bucket in iter_full_parameters(policy, bucket_bytes) for item in bucket)
        stream_buckets(group, named, specs, buckets, time.monotonic() + 60.0)

    raw = [torch.zeros(n, dtype=torch.uint8) for n in sizes]

    def broadcast_raw() -> None:
        for buf in raw:
            group.broadcast(buf, 60.0)

    total = sum(sizes)

    def timed(fn: Callable[[], None]) -> Callable[[], int]:
        return lambda: (fn(), total)[1]

    rates = interleaved_rates({"publish": timed(publish), "raw": timed(broadcast_raw)}, rounds)
    proc.join(60)
    return rates["publish"] / 1e9, rates["raw"] / 1e9, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True, help="write the results here")
    parser.add_argument("--steps", type=int, default=8, help="timed steps of each (interleaved; the median counts)")
    parser.add_argument("--sync-rounds", type=int, default=15, help="timed updates of each (interleaved; the median counts)")
    parser.add_argument("--bucket-mb", type=int, default=8, help="bucket size in MiB")
    parser.add_argument("--lora-rank", type=int, default=None,
                        help="instead: the learner step on the 29 M model, full fine-tuning vs LoRA of this rank (alpha 2x rank)")
    args = parser.parse_args()
    torch.manual_seed(0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=300))
    if args.lora_rank is not None:
        with tempfile.TemporaryDirectory() as tmp:
            build_model(Path(tmp), hidden=512, layers=8)
            report(lora_vs_full(Path(tmp), make_records(8, 4, seed=0), args.lora_rank, args.steps), args.json)
        dist.destroy_process_group()
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, sync_dir = Path(tmp) / "train", Path(tmp) / "sync"
        build_model(model_dir)
        build_model(sync_dir, hidden=512, layers=8)
        records = make_records(8, 4, seed=0)
        learner_fn, plan, tokens, _ = learner_step(model_dir, records, args.steps + 1)
        gae_fn, _, _, _ = learner_step(model_dir, records, args.steps + 1, "algorithm.advantage.name=gae")
        rates = interleaved_rates({"learner": learner_fn, "plain": plain_step(model_dir, records, plan), "learner_gae": gae_fn}, args.steps)
        learner, plain, gae = rates["learner"], rates["plain"], rates["learner_gae"]
        sync, raw, nbytes = sync_rates(sync_dir, args.bucket_mb << 20, args.sync_rounds)
        small_sync, small_raw, small_bytes = sync_rates(model_dir, args.bucket_mb << 20, args.sync_rounds)
    result = {
        "learner_tokens_per_s": learner, "plain_tokens_per_s": plain, "ratio_vs_plain": learner / plain,
        "gae_tokens_per_s": gae, "critic_step_cost": learner / gae,
        "sync_gb_per_s": sync, "raw_broadcast_gb_per_s": raw, "sync_ratio_vs_raw": sync / raw,
        "small_model_sync_ratio_vs_raw": small_sync / small_raw,
        "setup": {"device": "cpu", "threads": torch.get_num_threads(), "ranks": 1, "train_params_m": round(small_bytes / 4 / 1e6, 2),
                  "tokens_per_step": tokens, "micro_batches": len(plan), "steps": args.steps,
                  "optimizer": "learner: AdamW(fused=True) on FSDP2 shards; plain: torch's default AdamW",
                  "sync_params_m": round(nbytes / 4 / 1e6, 2), "update_bytes": nbytes, "small_update_bytes": small_bytes,
                  "bucket_mb": args.bucket_mb, "sync_backend": "gloo", "sync_rounds": args.sync_rounds,
                  "method": "median of interleaved rounds, after one warm-up each"},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
