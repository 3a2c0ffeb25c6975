"""Learner step against a plain packed loop, on a random-init model of a real shape (no downloads).

    .venv/bin/python benchmarks/learner_gpu.py --shape tiny --json benchmarks/results/learner_gpu_tiny_cpu.json
    python3 benchmarks/learner_gpu.py --shape qwen2.5-1.5b --json benchmarks/results/learner_gpu_qwen2.5-1.5b_h100.json  # on a GPU

On a GPU machine ``scripts/gpu_acceptance.sh`` runs it (``matrix`` and ``throughput`` phases).

Batch: 16 prompts x 8 samples, prompts 128-384 tokens, responses 128-1024 (about 106k tokens;
``tiny``: 4 prompts, about 26k tokens), micro-batches of ``--micro-tokens`` (16384). The
learner (``screen`` -> ``prepare`` -> ``Trainer.step`` on an FSDP2 model, one rank, packed rows, chunked
log-probs, the shipped defaults) and the plain loop of ``_plain_packed.py`` train the same
tokens on the same device, alternating step by step; each is rated by its median step.
``tiny`` is 2 layers of hidden size 64 with the real 151,936-token vocabulary: one
``[16384, 151936]`` float32 tensor is 10 GB, so on a CPU the log-prob memory problem is real
in miniature (target: ``peak_memory_gb <= 6``, ``ratio_vs_plain >= 0.8``). ``smoke`` (a 512-token
vocabulary, 2 prompts of 8-24 tokens, responses of 8-48) only checks that the code runs
(``gpu_acceptance.sh --cpu-smoke``).

JSON: ``tokens_per_s``, ``plain_tokens_per_s``, ``ratio_vs_plain``, ``mfu`` (``6 * params *
tokens / time / peak``, peak bf16 dense FLOP/s of the GPU from a table; null on CPU),
``peak_memory_gb`` (GPU: peak allocated; CPU: peak resident memory the step adds, sampled
every 2 ms), the same for the plain loop (``plain_error`` instead when it fails, e.g. out of
memory), the learner's step-time split, and the memory planner's estimate for the same config
(``estimate_gb``, ``estimate_vs_peak``: estimate / measured peak; ``learner/memory.py``).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from _plain_packed import plain_packed_step  # noqa: E402
from _report import report, report_json  # noqa: E402

from async_rl.config import load_config  # noqa: E402
from async_rl.learner import memory  # noqa: E402
from async_rl.learner.batching import Batch, plan_micro_batches, prepare  # noqa: E402
from async_rl.learner.model import DistInfo, compute_dtype, free_port, init_distributed, load_sharded  # noqa: E402
from async_rl.learner.screening import Limits, screen  # noqa: E402
from async_rl.learner.train_step import StepTimes, Trainer  # noqa: E402
from async_rl.records import RolloutGroup, Sample  # noqa: E402

VOCAB = 151936
SHAPES: dict[str, dict[str, object]] = {
    "smoke": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
              "vocab_size": 512},
    "tiny": {"hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1},
    "qwen2.5-0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2},
    "qwen2.5-1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2},
}
PROMPTS = {"smoke": 2, "tiny": 4, "qwen2.5-0.5b": 16, "qwen2.5-1.5b": 16}
LENGTHS = {"smoke": ((8, 24), (8, 48))}
"""``((prompt min, max), (response min, max))`` tokens of a shape's samples; others: :data:`REAL_LENGTHS`."""
REAL_LENGTHS = ((128, 384), (128, 1024))
#: Dense bf16 tensor-core peak (FLOP/s) by a substring of the device name.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 125e12}


def vocab(shape: str) -> int:
    """The vocabulary of ``shape`` (the real 151,936 tokens unless the shape says otherwise)."""
    return int(SHAPES[shape].get("vocab_size", VOCAB))  # type: ignore[call-overload]


def build_model(shape: str, out: Path) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**{"vocab_size": VOCAB, "max_position_embeddings": 32768, "tie_word_embeddings": True, "rope_theta": 1e6,
                            **SHAPES[shape]})
    Qwen2ForCausalLM(config).save_pretrained(out)


def make_groups(shape: str, prompts: int, samples: int, seed: int) -> list[RolloutGroup]:
    """``prompts`` groups of ``samples`` responses of :data:`LENGTHS` (prompts 128-384 tokens,
    responses 128-1024 for the real shapes)."""
    rng = random.Random(seed)
    (p_low, p_high), (r_low, r_high) = LENGTHS.get(shape, REAL_LENGTHS)
    top = vocab(shape)
    groups = []
    for g in range(prompts):
        prompt = [rng.randrange(2, top) for _ in range(rng.randint(p_low, p_high))]
        members = []
        for _ in range(samples):
            n = rng.randint(r_low, r_high)
            members.append(Sample.from_lists([rng.randrange(2, top) for _ in range(n)], [-2.0] * n, 0, rng.random()))
        groups.append(RolloutGroup.from_lists("bench", f"g{g}", g, prompt, members, "s", 0.0, created_at=0.0))
    return groups


class PeakMemory:
    """Peak memory a block adds: CUDA peak allocated, or resident set size sampled every 2 ms."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.peak_gb = device, 0.0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            return self
        self._base, self._peak, self._stop = _rss(), _rss(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._peak = max(self._peak, _rss())

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak_gb = torch.cuda.max_memory_allocated() / 1e9
            return
        self._stop.set()
        self._thread.join()
        self.peak_gb = (max(self._peak, _rss()) - self._base) / 1e9


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


MATRIX = [
    (f"algorithm.loss.name={loss}", *(("algorithm.recompute_proximal=false",) if loss == "tis" else ()), *updates, *kl)
    for loss in ("ppo", "decoupled_ppo", "tis", "gspo", "cispo")
    for updates in ((), ("learner.ppo_mini_batches=2", "learner.ppo_epochs=2"))
    for kl in ((), ("algorithm.loss.kl_coef=0.1", "algorithm.loss.entropy_coef=0.01", "algorithm.advantage.name=reinforce_pp"))
] + [("algorithm.advantage.name=gae", "learner.critic.ppo_mini_batches=2"),
       ("learner.lora.rank=8", "rollout.openai_api=false", "algorithm.loss.kl_coef=0.1", "learner.ppo_mini_batches=2")]
"""Config overrides of ``--matrix``: every loss, with one or several updates per step (recomputed
proximal log-probs), with and without the reference model; PPO with a critic (``gae``); and a
LoRA policy (bf16 base, fp32 adapter) whose KL reference is itself with the adapter disabled."""


def run_matrix(model_dir: Path, base: list[str], info: DistInfo, args: argparse.Namespace) -> None:
    """One step per :data:`MATRIX` entry; writes ``{"ok": n, "failed": {combination: error},
    "cells": {combination: "ok" or the error}}`` after every combination (a run cut short keeps
    what it did)."""
    top = vocab(args.shape)
    batch = prepare([screen(g, Limits(args.micro_tokens, top)) for g in make_groups(args.shape, 4, 8, seed=1)]).batch
    cells: dict[str, str] = {}
    result: dict[str, object] = {"device": torch.cuda.get_device_name() if info.device.type == "cuda" else "cpu",
                                 "shape": args.shape, "date": datetime.date.today().isoformat(), "cells": cells}
    for overrides in [MATRIX[i] for i in args.cells] if args.cells else MATRIX:
        name = " ".join(overrides)
        cfg = load_config(None, [*base, *overrides])
        try:
            lora = cfg.learner.lora
            policy = load_sharded(str(model_dir), cfg.learner, info.device, trainable=True, lora=lora)
            reference = (load_sharded(str(model_dir), cfg.learner, info.device, trainable=False)
                         if cfg.algorithm.needs_reference and lora is None else None)
            critic = load_sharded(str(model_dir), cfg.learner, info.device, trainable=True, value_model=True) if cfg.algorithm.needs_critic else None
            Trainer(policy, reference, cfg.learner, cfg.algorithm, info, 2, 1, critic=critic, lora=lora).step(batch, 0)
            cells[name] = "ok"
        except Exception as exc:  # report every combination, then the failures
            cells[name] = f"{type(exc).__name__}: {exc}"
        print(f"{'ok' if cells[name] == 'ok' else 'FAILED':8s}{name}{'' if cells[name] == 'ok' else ': ' + cells[name]}", flush=True)
        failed = {k: v for k, v in cells.items() if v != "ok"}
        result.update(ok=len(cells) - len(failed), failed=failed)
        report_json(result, args.json)
    report({k: v for k, v in result.items() if k != "cells"}, None)


def base_overrides(model_dir: Path, args: argparse.Namespace, cuda: bool) -> list[str]:
    """The benchmark's config: the shape's batch, its sequence bounds, ``--micro-tokens`` and ``--set``."""
    (_, prompt_max), (_, response_max) = LENGTHS.get(args.shape, REAL_LENGTHS)
    return [f"learner.model_path={model_dir}", f"learner.batch_size={PROMPTS[args.shape]}", "rollout.n=8",
            f"learner.max_tokens_per_microbatch={args.micro_tokens}", f"data.max_prompt_length={prompt_max}",
            f"rollout.max_response_length={response_max}", "queue.max_depth=256", "learner.optim.lr=1e-6",
            f"learner.gpus_per_rank={1 if cuda else 0}", *args.set]


def bench_batch(args: argparse.Namespace) -> tuple[Batch, list[list[int]]]:
    """The timed batch (the same in every process: seeded) and its micro-batch plan."""
    batch = prepare([screen(g, Limits(args.micro_tokens, vocab(args.shape))) for g in make_groups(args.shape, PROMPTS[args.shape], 8, seed=0)]).batch
    plan = plan_micro_batches(batch.lengths.tolist(), range(batch.size), 1, args.micro_tokens)[0]
    return batch, [list(rows) for rows in plan]


def build_plain(model_dir: Path, batch: Batch, plan: list[list[int]], device: torch.device, checkpointing: bool,
                dtype: torch.dtype) -> Callable[[], int]:
    from transformers import AutoModelForCausalLM

    plain_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                       attn_implementation="flex_attention" if device.type == "cuda" else "sdpa").to(device)
    if checkpointing:
        plain_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return plain_packed_step(plain_model, batch, plan, device, 4096, dtype)


class Rounds:
    """Times each round of a step function and its peak memory; round 0 is the warm-up."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: dict[str, list[float]] = {"learner": [], "plain": []}
        self.peaks: dict[str, float] = {"learner": 0.0, "plain": 0.0}

    def timed(self, name: str, fn: Callable[[], int], round_: int) -> None:
        with PeakMemory(self.device) as peak:
            start = time.perf_counter()
            fn()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
        self.peaks[name] = max(self.peaks[name], peak.peak_gb)
        if round_:
            self.times[name].append(elapsed)
        print(f"{name:8s} round {round_}: {elapsed:7.2f} s, peak {peak.peak_gb:6.2f} GB", flush=True)


def plain_only(args: argparse.Namespace) -> None:
    """``--sequential``'s second process: the plain loop's rounds alone on the device (a process
    that held the learner keeps some of its memory however it frees it); writes its times and peak."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    cfg = load_config(None, base_overrides(args.plain_only, args, device.type == "cuda"))
    batch, plan = bench_batch(args)
    plain = build_plain(args.plain_only, batch, plan, device, args.plain_checkpointing, compute_dtype(cfg.learner.fsdp, device))
    rounds = Rounds(device)
    for round_ in range(args.steps + 1):
        rounds.timed("plain", plain, round_)
    args.json.write_text(json.dumps({"times": rounds.times["plain"], "peak_gb": rounds.peaks["plain"]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--json", type=Path, required=True, help="write the results here")
    parser.add_argument("--steps", type=int, default=2, help="timed steps of each (after one warm-up each)")
    parser.add_argument("--micro-tokens", type=int, default=16384, help="learner.max_tokens_per_microbatch")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides (learner.kernels.attention=sdpa, ...)")
    parser.add_argument("--sequential", action="store_true", help="all learner steps, then free the learner and run the plain loop's "
                        "(when both do not fit in memory at once); default: interleaved")
    parser.add_argument("--matrix", action="store_true", help="instead: one learner step per loss x updates x KL combination "
                        "(the NCCL device check; 4 prompts of the batch), each reported as ok or its error")
    parser.add_argument("--cells", type=lambda s: [int(i) for i in s.split(",")], help="with --matrix: only these "
                        "combinations (indices into MATRIX, e.g. 0,19,20; the CPU smoke run's sample)")
    parser.add_argument("--plain-only", type=Path, help=argparse.SUPPRESS)  # --sequential's child: the model directory
    parser.add_argument("--plain-checkpointing", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain_only:
        plain_only(args)
        return

    cuda = torch.cuda.is_available()
    info = init_distributed(0, 1, "127.0.0.1", free_port(), 600.0) if cuda else DistInfo(0, 1, torch.device("cpu"))
    if not cuda:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=600))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / args.shape
        build_model(args.shape, model_dir)
        overrides = base_overrides(model_dir, args, cuda)
        if args.matrix:
            run_matrix(model_dir, overrides, info, args)
            dist.destroy_process_group()
            return
        cfg = load_config(None, overrides)
        lrn = cfg.learner
        policy = load_sharded(str(model_dir), lrn, info.device, trainable=True)
        checkpointing = bool(policy.is_gradient_checkpointing)
        params = sum(p.numel() for p in policy.parameters())
        attention = policy.config._attn_implementation
        trainer = Trainer(policy, None, lrn, cfg.algorithm, info, args.steps + 2, 1)
        batch, plan = bench_batch(args)
        tokens = int(batch.lengths.sum())
        rounds = Rounds(info.device)
        splits: list[StepTimes] = []
        counter = iter(range(10**6))

        def learner() -> int:
            result = trainer.step(batch, next(counter))
            splits.append(result.times)
            return result.tokens

        dtype = compute_dtype(lrn.fsdp, info.device)
        model_config = json.loads((model_dir / "config.json").read_text())
        planned = memory.estimate(model_config, lrn, checkpointing, memory.budget_gb(lrn, info.device.type), info.device.type)
        plain_error: str | None = None
        if args.sequential:  # both models and optimizers do not fit at once (1.5B on 80 GB): all learner steps, then the plain loop's
            for round_ in range(args.steps + 1):
                rounds.timed("learner", learner, round_)
            del trainer, policy
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
            plain_json = Path(tmp) / "plain.json"
            child = [sys.executable, __file__, "--shape", args.shape, "--json", str(plain_json), "--steps", str(args.steps),
                     "--micro-tokens", str(args.micro_tokens), "--plain-only", str(model_dir),
                     *(["--plain-checkpointing"] if checkpointing else []), *(f"--set={s}" for s in args.set)]
            done = subprocess.run(child, stderr=subprocess.PIPE, text=True)
            sys.stderr.write(done.stderr)
            if done.returncode == 0:
                plain_result = json.loads(plain_json.read_text())
                rounds.times["plain"], rounds.peaks["plain"] = plain_result["times"], plain_result["peak_gb"]
            else:  # the learner's figures stand; the plain loop's failure (out of memory at 1.5B) is the result
                plain_error = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        else:
            plain = build_plain(model_dir, batch, plan, info.device, checkpointing, dtype)
            for round_ in range(args.steps + 1):  # round 0 warms up
                rounds.timed("learner", learner, round_)
                rounds.timed("plain", plain, round_)

    rate = {name: tokens / statistics.median(t) if t else None for name, t in rounds.times.items()}
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak_flops = next((v for k, v in PEAK_FLOPS.items() if k in name), None) if cuda else None
    timed = splits[1:]
    learner_rate, plain_rate = rate["learner"] or 0.0, rate["plain"]
    result = {
        "tokens_per_s": learner_rate, "plain_tokens_per_s": plain_rate, "ratio_vs_plain": learner_rate / plain_rate if plain_rate else None,
        "mfu": 6 * params * learner_rate / peak_flops if peak_flops else None,
        "plain_mfu": 6 * params * plain_rate / peak_flops if peak_flops and plain_rate else None,
        "peak_memory_gb": rounds.peaks["learner"], "plain_peak_memory_gb": rounds.peaks["plain"] if plain_error is None else None,
        **({"plain_error": plain_error} if plain_error is not None else {}),
        "estimate_gb": planned.total_gb, "estimate_vs_peak": planned.total_gb / rounds.peaks["learner"],
        "step_time_split_s": {k: statistics.median(getattr(t, k) for t in timed) for k in ("prox", "fwd_bwd", "optim")},
        "calibration_key": memory.setting_key(model_config, lrn, checkpointing, info.device.type),
        "setup": {"shape": args.shape, "device": name, "params": params, "tokens_per_step": tokens, "samples": batch.size,
                  "micro_batches": len(plan), "max_tokens_per_microbatch": args.micro_tokens, "gradient_checkpointing": checkpointing,
                  "logprob_chunk_tokens": lrn.logprob_chunk_tokens, "attention": attention,
                  "compute_dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(), "steps": args.steps,
                  "overrides": args.set, "plain": "HF model, packed rows, flex_attention (GPU) / sdpa (CPU), autocast, "
                  "LM head + log-softmax in checkpointed 4096-token chunks, AdamW",
                  "method": f"median of {'sequential (the plain loop in a second process)' if args.sequential else 'interleaved'} steps after one warm-up each", "date": datetime.date.today().isoformat()},
    }
    report(result, args.json)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
