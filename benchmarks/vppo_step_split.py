"""VPPO's cost: the learner step-time split with ``algorithm.use_vppo_on_perception`` on and off.

    .venv/bin/python benchmarks/vppo_step_split.py --json benchmarks/results/vppo_step_split.json

The tiny vision-language model (``async-rl assets tiny --task vlm``; built into ``--assets``
if absent) trains on batches of ``--groups`` prompts of the shapes task x ``--samples``
responses of ``--response`` tokens, each prompt with its 32x32 image, on one CPU rank. Per
round, alternating (these shared machines drift by tens of percent within a minute; each
figure is the median over rounds):

* ``forward_s``: one no-grad forward of the policy over the whole batch with the real images
  (``Trainer._all_rows_logp``): the unit "one forward pass";
* a step with VPPO (selection, advantage shaping, entropy penalty): ``perception_s`` is its
  ``time/perception`` (the blackened images processed and one no-grad forward over the batch),
  beside ``fwd_bwd_s`` and the whole ``step_vppo_s``;
* the same step without VPPO: ``step_plain_s``.

Targets: ``perception_over_forward`` <= 1.25 (one extra forward, plus processing the
blackened images); ``vppo_step_overhead`` = ``step_vppo_s / step_plain_s - 1`` is what VPPO
adds to a step of this size.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from _report import report  # noqa: E402

from async_rl.config import load_config  # noqa: E402
from async_rl.data.images import PixelBounds, image_blob, load_image  # noqa: E402
from async_rl.data.prompts import PromptFormatter, read_prompt_rows  # noqa: E402
from async_rl.tiny import build_tiny_assets  # noqa: E402
from async_rl.learner.batching import Batch, prepare  # noqa: E402
from async_rl.learner.model import DistInfo, load_sharded  # noqa: E402
from async_rl.learner.screening import Limits, screen  # noqa: E402
from async_rl.learner.train_step import Trainer  # noqa: E402
from async_rl.learner.vision import VisionInputs, load_image_processor  # noqa: E402
from async_rl.records import ImageRef, RolloutGroup, Sample  # noqa: E402

VPPO = ("algorithm.use_vppo_on_perception=true", "algorithm.top_p_perception_tokens=0.4", "algorithm.use_advantage_shaping=true",
        "algorithm.advantage_scaling_min=0.9", "algorithm.use_entropy_penalty=true")


def make_batch(model_dir: Path, train: Path, groups: int, samples: int, response: int, seed: int) -> Batch:
    """``groups`` prompts of the training split with their images (the prompt expanded as the
    servers record it) x ``samples`` responses of ``response`` random word tokens."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    formatter = PromptFormatter(processor.tokenizer)
    rows, _ = read_prompt_rows(train)
    special = set(processor.tokenizer.all_special_ids) | {processor.tokenizer.convert_tokens_to_ids("<image>")}
    words = [t for t in range(len(processor.tokenizer)) if t not in special]
    rng = random.Random(seed)
    out, images = [], []
    for i, row in enumerate(rows[:groups]):
        pil = [load_image(ref, PixelBounds(1, 1 << 20)) for ref in row.images]  # the 32x32 images as built
        prompt = processor(text=formatter.render(row.prompt, len(pil)), images=pil)["input_ids"][0]
        group_samples = [Sample.from_lists(rng.choices(words, k=response), [-2.0] * response, 0, float(rng.random() < 0.5))
                         for _ in range(samples)]
        refs = [ImageRef((b := image_blob(im)).sha256, b.width, b.height) for im in pil]
        out.append(RolloutGroup.from_lists("bench", f"bench:{i}", i, list(prompt), group_samples, "s", 0.0, images=refs))
        images.append(pil)
    prepared = prepare([screen(g, Limits(1 << 16)) for g in out])
    vision = VisionInputs.build("idefics3", [images[i] for i in prepared.kept], load_image_processor(str(model_dir)))
    return dataclasses.replace(prepared.batch, vision=vision)  # type: ignore[arg-type]


def trainer(model_dir: Path, out: Path, *overrides: str) -> Trainer:
    cfg = load_config(None, [f"learner.model_path={model_dir}", f"trainer.output_dir={out}", "learner.max_tokens_per_microbatch=2048",
                             "learner.optim.lr=1e-5", "rollout.n=8", *overrides])
    info = DistInfo(0, 1, torch.device("cpu"))
    policy = load_sharded(str(model_dir), cfg.learner, info.device, trainable=True)
    return Trainer(policy, None, cfg.learner, cfg.algorithm, info, cfg.trainer.total_steps, cfg.trainer.seed, cfg.rollout.temperature)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--assets", type=Path, default=Path("runs/vlm/assets"))
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--response", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if not (args.assets / "assets.json").is_file():
        build_tiny_assets(args.assets, seed=0, task="vlm")
    model_dir = args.assets / "model"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=600))
    batch = make_batch(model_dir, args.assets / "data" / "train.jsonl", args.groups, args.samples, args.response, seed=0)
    out = Path("runs/bench_vppo")
    vppo_trainer, plain_trainer = trainer(model_dir, out, *VPPO), trainer(model_dir, out)
    forward, perception, fwd_bwd, step_vppo, step_plain = [], [], [], [], []
    for step in range(args.rounds + 1):  # round 0 warms up
        t0 = time.perf_counter()
        vppo_trainer._all_rows_logp(vppo_trainer.policy, batch)
        t1 = time.perf_counter()
        result = vppo_trainer.step(batch, step)
        t2 = time.perf_counter()
        plain_trainer.step(batch, step)
        t3 = time.perf_counter()
        if step:
            forward.append(t1 - t0)
            perception.append(result.times.perception)
            fwd_bwd.append(result.times.fwd_bwd)
            step_vppo.append(t2 - t1)
            step_plain.append(t3 - t2)
    med = statistics.median
    report({
        "groups": args.groups, "samples": args.samples, "response_tokens": args.response,
        "batch_tokens": int(batch.lengths.sum()), "rounds": args.rounds,
        "forward_s": med(forward), "perception_s": med(perception), "perception_over_forward": med(perception) / med(forward),
        "fwd_bwd_s": med(fwd_bwd), "step_vppo_s": med(step_vppo), "step_plain_s": med(step_plain),
        "vppo_step_overhead": med(step_vppo) / med(step_plain) - 1,
        "selected_fraction": result.metrics["vppo/selected_fraction"],
        "per_round": {"forward_s": forward, "perception_s": perception, "step_vppo_s": step_vppo, "step_plain_s": step_plain},
        "device": "cpu (1 thread)", "torch": torch.__version__, "date": datetime.date.today().isoformat(),
    }, args.json)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
