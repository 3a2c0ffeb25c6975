"""Every GPU-checkable part of the learner, proven phase by phase on a GPU machine (issue 33).

    bash scripts/gpu_acceptance.sh all                # on the GPU machine (installs the carried wheels first)
    bash scripts/gpu_acceptance.sh matrix vlm         # some phases
    bash scripts/gpu_acceptance.sh all --cpu-smoke    # the same code on the CPU, tiny shapes, gloo (CI)

One phase per call of this script (``PHASE``), each bounded by ``--budget-s`` (540 s: the GPU
machine allows 10 minutes a command); ``ASYNC_RL_STRICT_DEVICES=1`` (set by the shell script)
makes a tensor of the learner's group off its device fail loudly.

* ``matrix``: one learner step per loss x updates x KL combination, one with a critic and one
  of a LoRA policy
  (``learner_gpu.py --matrix`` on Qwen2.5-0.5B, NCCL): ``ok`` or the error, per cell;
* ``throughput``: ``learner_gpu.py`` on Qwen2.5-0.5B and on 1.5B (gradient checkpointing, the
  plain loop in a second process) against the plain packed loop: tokens/s, MFU, peak memory
  and the memory planner's estimate beside each measured peak; each peak is recorded in the
  planner's table (``async_rl/learner/memory_calibration.json``);
* ``vlm``: one learner step of a random Qwen2.5-VL (the real layout and token ids, small
  widths: the vision tower with windowed and full attention blocks, M-RoPE) on a batch with images;
* ``kernels``: the attention kernels present (flash-attn reported absent when not
  importable, flex attention only on a GPU) and the packed log-probs each gives against the
  model's own forward of each sample alone;
* ``handoff``: ``weight_handoff.py``: the one-GPU weight hand-off, 100 updates of the 0.5B
  shape from this process to a receiver process on the same GPU (the server's receiving
  code, loading into a transformers model), over CUDA IPC and over host shared memory:
  update and transfer time against a raw device-to-device copy, both processes' memory
  after the first and the last update (no growth), served weights equal to the sent ones.

Output: ``gpu_acceptance_<device slug>.json`` in ``--out-dir`` (``benchmarks/results``), the
phases merged into one file, written as each phase goes (a phase cut short says
``"status": "running"``), and ``gpu_acceptance_<slug>.md`` beside it (a short table); both,
and the calibration table when it changed, are copied into ``$OUT`` when it is set.
``--cpu-smoke``: a CPU "device", gloo, tiny shapes (a 512-token vocabulary; the VLM keeps the
real one for its token ids), four matrix cells (:data:`SMOKE_CELLS`), one timed step, five
host-route updates of the hand-off (CUDA IPC is reported not applicable); the
slug is ``cpu-smoke`` and the calibration table is a copy in ``--out-dir``.
Exit status 1 when the phase failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import learner_gpu  # noqa: E402
from _report import report_json  # noqa: E402

from async_rl.config import load_config  # noqa: E402
from async_rl.learner import memory  # noqa: E402
from async_rl.learner.attention import problem  # noqa: E402
from async_rl.learner.batching import Batch, prepare  # noqa: E402
from async_rl.learner.model import DistInfo, free_port, init_distributed, load_sharded  # noqa: E402
from async_rl.learner.screening import Limits, screen  # noqa: E402
from async_rl.learner.train_step import Trainer  # noqa: E402
from async_rl.records import ImageRef, RolloutGroup, Sample  # noqa: E402

PHASES = ("matrix", "throughput", "vlm", "kernels", "handoff")
SMOKE_CELLS = (0, len(learner_gpu.MATRIX) - 3, len(learner_gpu.MATRIX) - 2, len(learner_gpu.MATRIX) - 1)
"""The matrix cells of a CPU smoke run: plain PPO, the last loss with updates and KL, the critic,
LoRA (every cell but LoRA runs on CPU in ``tests/learner/test_collectives.py``; LoRA in
``tests/learner/test_lora.py``)."""
LOGP_TOLERANCE = {4: 1e-4, 2: 0.1}
"""Largest accepted difference (nats) between packed and per-sample log-probs by compute-dtype
bytes: float32 agrees to rounding; bfloat16 to 0.02-0.05 nats (GPU notes), 0.1 allowed."""
# Qwen2.5-VL's special token ids (its tokenizer's), kept so the model reads images as the real one does.
QWEN_VL_IMAGE, QWEN_VL_START, QWEN_VL_END, QWEN_VL_VIDEO = 151655, 151652, 151653, 151656


@dataclasses.dataclass(frozen=True)
class Run:
    """Where this run writes and on what it runs."""

    smoke: bool
    device: torch.device
    out_dir: Path
    slug: str
    budget_s: float
    calibration: Path
    started: float

    @property
    def json_path(self) -> Path:
        return self.out_dir / f"gpu_acceptance_{self.slug}.json"

    def left_s(self) -> float:
        """Seconds of this phase's budget left."""
        return self.budget_s - (time.monotonic() - self.started)


def slug(name: str) -> str:
    """A file-name part of a device name: ``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``."""
    return re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-")


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:500]


# --------------------------------------------------------------------------- output


def load(run: Run) -> dict[str, Any]:
    """The run's JSON so far (other phases' results kept), with this machine's facts."""
    doc: dict[str, Any] = json.loads(run.json_path.read_text()) if run.json_path.exists() else {}
    doc.update(device=torch.cuda.get_device_name() if run.device.type == "cuda" else "cpu", smoke=run.smoke,
               strict_devices=os.environ.get("ASYNC_RL_STRICT_DEVICES") == "1", torch=torch.__version__,
               transformers=__import__("transformers").__version__, python=sys.version.split()[0])
    doc.setdefault("phases", {})
    return doc


def markdown(doc: dict[str, Any]) -> str:
    """A short table of the phases' results."""
    lines = [f"# GPU acceptance: {doc['device']}{' (CPU smoke run)' if doc.get('smoke') else ''}", "",
             f"torch {doc['torch']}, transformers {doc['transformers']}, ASYNC_RL_STRICT_DEVICES={int(doc['strict_devices'])}", "",
             "| phase | date | result |", "| --- | --- | --- |"]
    for name in PHASES:
        phase = doc["phases"].get(name)
        if phase is None:
            continue
        status = "ok" if phase.get("ok") else phase.get("status", "FAILED")
        lines.append(f"| {name} | {phase.get('date', '')} | {status}: {phase_summary(name, phase).replace('|', '/')} |")
    throughput = doc["phases"].get("throughput", {}).get("runs", {})
    if throughput:
        lines += ["", "| run | tokens/s | plain tokens/s | ratio | MFU | peak GB | plain peak GB | planner estimate GB |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name, r in throughput.items():
            if "error" in r:
                lines.append(f"| {name} | {r['error']} | | | | | | |")
                continue
            lines.append(f"| {name} | {r['tokens_per_s']:.0f} | {_num(r['plain_tokens_per_s'], '.0f', r.get('plain_error'))} | "
                         f"{_num(r['ratio_vs_plain'], '.2f')} | {_num(r['mfu'], '.1%')} | {r['peak_memory_gb']:.1f} | "
                         f"{_num(r['plain_peak_memory_gb'], '.1f')} | {r['estimate_gb']:.1f} ({r['estimate_vs_peak']:.2f}x the peak) |")
    return "\n".join(lines) + "\n"


def _num(value: float | None, fmt: str, error: str | None = None) -> str:
    return (error or "n/a")[:80] if value is None else format(value, fmt)


def phase_summary(name: str, phase: dict[str, Any]) -> str:
    """One line of a phase's result."""
    if "error" in phase:
        return phase["error"]
    if name == "matrix":
        cells = phase.get("cells", {})
        bad = [f"{k}: {v}" for k, v in cells.items() if v != "ok"]
        return f"{len(cells) - len(bad)}/{phase.get('expected', len(cells))} cells ok" + (f"; {'; '.join(bad)}"[:300] if bad else "")
    if name == "throughput":
        return ", ".join(f"{k} {r['tokens_per_s']:.0f} tokens/s" if "error" not in r else f"{k} failed" for k, r in phase.get("runs", {}).items())
    if name == "vlm":
        if "step_s" not in phase:
            return "no step yet"
        return (f"{phase.get('images')} images, {phase.get('tokens')} tokens, step {phase.get('step_s', 0):.2f} s, "
                f"peak {phase.get('peak_memory_gb', 0):.1f} GB, loss {phase.get('loss') or 0:.3g}")
    if name == "handoff":
        return "; ".join(f"{k} n/a ({r['why']})" if r.get("ok") is None else
                         f"{k} {'ok' if r['ok'] else 'FAILED'}: update {r['update']['median_ms']:.1f} ms "
                         f"({r['update_vs_raw_copy']:.1f}x the raw copy), growth {max(r['growth_mb'].values()):.0f} MB"
                         if r.get("update") else f"{k}: {r.get('error')}" for k, r in phase.get("routes", {}).items())
    if name == "kernels":
        return ", ".join(f"{k} absent" if not v.get("present") else f"{k} error: {v['error']}" if "error" in v
                         else f"{k} {v['max_abs_diff']:.2g} nats" for k, v in phase.get("kernels", {}).items())
    return ""


class Writer:
    """Merges one phase's result into the run's JSON and markdown, every time it is called."""

    def __init__(self, run: Run, name: str) -> None:
        self.run, self.name = run, name
        self.phase: dict[str, Any] = {"ok": False, "status": "running", "date": datetime.date.today().isoformat()}

    def __call__(self, **update: Any) -> None:
        self.phase.update(update)
        doc = load(self.run)
        doc["phases"][self.name] = self.phase
        report_json(doc, self.run.json_path)
        self.run.json_path.with_suffix(".md").write_text(markdown(doc))


def copy_out(run: Run, extra: list[Path]) -> None:
    """Copy the results (and ``extra`` files) into ``$OUT`` when it is set."""
    out = os.environ.get("OUT")
    if not out:
        return
    for path in [run.json_path, run.json_path.with_suffix(".md"), *extra]:
        if path.exists():
            shutil.copy(path, Path(out) / path.name)


# --------------------------------------------------------------------------- phases


def _benchmark(run: Run, args: list[str], json_path: Path, script: str = "learner_gpu.py") -> tuple[dict[str, Any] | None, str | None]:
    """``SCRIPT ARGS --json JSON_PATH`` within the phase's budget: (its JSON, error)."""
    cmd = [sys.executable, str(HERE / script), *args, "--json", str(json_path)]
    print("$", " ".join(cmd[1:]), flush=True)
    error = None
    try:
        done = subprocess.run(cmd, check=False, stderr=subprocess.PIPE, text=True, timeout=max(1.0, run.left_s()))
        sys.stderr.write(done.stderr[-20000:])
        if done.returncode != 0:
            error = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1][:500]
    except subprocess.TimeoutExpired:
        error = f"out of the phase's time ({run.budget_s:.0f} s)"
    result = json.loads(json_path.read_text()) if json_path.exists() else None
    return result, error


def phase_matrix(run: Run, write: Writer, tmp: Path) -> bool:
    cells = SMOKE_CELLS if run.smoke else range(len(learner_gpu.MATRIX))
    args = ["--shape", "smoke", "--micro-tokens", "512", "--cells", ",".join(map(str, cells))] if run.smoke else ["--shape", "qwen2.5-0.5b"]
    write(expected=len(cells), shape=args[1])
    result, error = _benchmark(run, [*args, "--matrix"], tmp / "matrix.json")
    found = (result or {}).get("cells", {})
    ok = error is None and len(found) == len(cells) and all(v == "ok" for v in found.values())
    write(cells=found, **({"error": error} if error else {}))
    return ok


def phase_throughput(run: Run, write: Writer, tmp: Path) -> bool:
    if run.smoke:
        small = ["--shape", "smoke", "--micro-tokens", "512", "--steps", "1"]
        plan = {"smoke": small, "smoke-checkpointed": [*small, "--sequential", "--set", "learner.fsdp.gradient_checkpointing=on"]}
    else:
        plan = {"qwen2.5-0.5b": ["--shape", "qwen2.5-0.5b"],
                "qwen2.5-1.5b-checkpointed": ["--shape", "qwen2.5-1.5b", "--sequential", "--set", "learner.fsdp.gradient_checkpointing=on"]}
    runs: dict[str, Any] = {}
    recorded = []
    for name, args in plan.items():
        result, error = _benchmark(run, args, tmp / f"{name}.json")
        if result is None:  # learner_gpu.py writes its JSON at the end (a failing plain loop is in it)
            runs[name] = {"error": error or "no result"}
        else:
            runs[name] = result
            measured = memory.Measurement(result["peak_memory_gb"], result["setup"]["device"], result["setup"]["date"],
                                          f"benchmarks/results/{run.json_path.name} (throughput: {name})")
            memory.record_measurement(result["calibration_key"], measured, run.calibration)
            recorded.append(memory.last_measured(result["calibration_key"], run.calibration) == measured)
        write(runs=runs)
    return len(recorded) == len(plan) and all(recorded)


def phase_handoff(run: Run, write: Writer, tmp: Path) -> bool:
    """``weight_handoff.py``: 100 updates of the 0.5B shape to a receiver process on this GPU,
    over CUDA IPC and over host shared memory (on a CPU: the host route, tiny, 5 updates)."""
    args = ["--shape", "smoke", "--updates", "5"] if run.smoke else ["--shape", "qwen2.5-0.5b", "--updates", "100"]
    write(shape=args[1], updates=int(args[3]))
    result, error = _benchmark(run, args, tmp / "handoff.json", "weight_handoff.py")
    write(**(result or {}), **({"error": error} if error else {}))
    routes = (result or {}).get("routes", {})
    return error is None and bool(routes) and all(r["ok"] is not False for r in routes.values()) and any(r["ok"] for r in routes.values())


def _process_group(device: torch.device) -> DistInfo:
    """A one-rank group: NCCL on the GPU (the learner's own init), gloo on the CPU."""
    if device.type == "cuda":
        return init_distributed(0, 1, "127.0.0.1", free_port(), 600.0)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(seconds=600))
    return DistInfo(0, 1, device)


def _peak(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """``fn()``, its seconds and its peak allocated GB (GPU; the resident set it adds on CPU)."""
    with learner_gpu.PeakMemory(device) as peak:
        start = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    return out, seconds, peak.peak_gb


def build_qwen_vl(out: Path, smoke: bool) -> None:
    """A random Qwen2.5-VL of the real layout and token ids with small widths: the text decoder
    (GQA, M-RoPE sections 16/8/8 of 64-wide heads) and the vision tower (14-pixel patches, 2x2
    merge, 2-frame patches, windowed blocks with full-attention ones between, SwiGLU MLPs),
    and its image processor (a ``preprocessor_config.json``; no tokenizer is needed)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    hidden, layers, depth, vision_hidden = (128, 2, 2, 64) if smoke else (896, 8, 8, 320)
    config = Qwen2_5_VLConfig(
        text_config={"vocab_size": 151936, "hidden_size": hidden, "intermediate_size": 4 * hidden, "num_hidden_layers": layers,
                     "num_attention_heads": hidden // 64, "num_key_value_heads": 1 if smoke else 2, "max_position_embeddings": 32768,
                     "rope_theta": 1e6, "tie_word_embeddings": True, "bos_token_id": 151643, "eos_token_id": 151645,
                     "rope_scaling": {"type": "mrope", "mrope_section": [16, 8, 8]}},
        vision_config={"depth": depth, "hidden_size": vision_hidden, "intermediate_size": 4 * vision_hidden, "num_heads": vision_hidden // 64,
                       "out_hidden_size": hidden, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
                       "fullatt_block_indexes": [depth // 2 - 1, depth - 1], "hidden_act": "silu"},
        image_token_id=QWEN_VL_IMAGE, vision_start_token_id=QWEN_VL_START, vision_end_token_id=QWEN_VL_END,
        video_token_id=QWEN_VL_VIDEO, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(out)
    side = 112 if smoke else 448
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 56 * 56, "max_pixels": side * side, "patch_size": 14,
        "merge_size": 2, "temporal_patch_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}))


def vlm_batch(model_dir: Path, smoke: bool) -> tuple[Batch, int]:
    """Groups with one or two random-noise images of different sizes each, their prompts laid out
    as Qwen2.5-VL's processor expands them (start, one image token per merged patch, end), and
    random responses; returns the batch and its images."""
    import numpy as np
    from PIL import Image

    from async_rl.data.images import image_blob
    from async_rl.learner.vision import VisionInputs, load_image_processor

    rng = np.random.default_rng(0)
    process = load_image_processor(str(model_dir))
    sizes = [[(56, 56)], [(112, 56), (56, 84)]] if smoke else [[(448, 448)], [(336, 224), (224, 336)], [(448, 280)], [(224, 224), (392, 392)]]
    samples = 2 if smoke else 4
    groups, images = [], []
    for g, shapes in enumerate(sizes):
        pil = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for w, h in shapes]
        tokens = [151644, *rng.integers(100, 151000, 8).tolist()]
        for im in pil:
            grid = process([im])["image_grid_thw"]
            tokens += [QWEN_VL_START] + [QWEN_VL_IMAGE] * (int(grid.prod()) // 4) + [QWEN_VL_END]
        tokens += rng.integers(100, 151000, 16).tolist()
        members = [Sample.from_lists([*rng.integers(100, 151000, 24 + 8 * k).tolist(), 151645], [-1.0] * (25 + 8 * k), 0, float(k % 2))
                   for k in range(samples)]
        refs = [ImageRef((b := image_blob(im)).sha256, b.width, b.height) for im in pil]
        groups.append(RolloutGroup.from_lists("gpu-acceptance", f"vlm:{g}", g, tokens, members, "s", 0.0, images=refs, created_at=0.0))
        images.append(pil)
    prepared = prepare([screen(group, Limits(4096, 151936, QWEN_VL_IMAGE)) for group in groups])
    batch = dataclasses.replace(prepared.batch, vision=VisionInputs.build("qwen2_5_vl", [images[i] for i in prepared.kept], process))
    return batch, sum(len(images[i]) for i in prepared.kept)


def phase_vlm(run: Run, write: Writer, tmp: Path, info: DistInfo) -> bool:
    model_dir = tmp / "qwen2.5-vl"
    build_qwen_vl(model_dir, run.smoke)
    batch, n_images = vlm_batch(model_dir, run.smoke)
    cfg = load_config(None, [f"learner.model_path={model_dir}", f"learner.batch_size={batch.size // (2 if run.smoke else 4)}",
                             f"rollout.n={2 if run.smoke else 4}", "learner.max_tokens_per_microbatch=4096", "data.max_prompt_length=2048",
                             "rollout.max_response_length=256", f"learner.gpus_per_rank={int(info.device.type == 'cuda')}",
                             "learner.optim.lr=1e-6", "queue.max_depth=64"])
    policy = load_sharded(str(model_dir), cfg.learner, info.device, trainable=True)
    trainer = Trainer(policy, None, cfg.learner, cfg.algorithm, info, 2, 1)
    config = json.loads((model_dir / "config.json").read_text())
    write(model={"model_type": config["model_type"], "text": {k: config["text_config"][k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")},
                 "vision": {k: config["vision_config"][k] for k in ("depth", "hidden_size", "window_size", "fullatt_block_indexes")},
                 "params": sum(p.numel() for p in policy.parameters())},
          images=n_images, samples=batch.size, tokens=int(batch.lengths.sum()), image_tokens=int((batch.input_ids == QWEN_VL_IMAGE).sum()),
          attention=policy.config._attn_implementation)
    result, seconds, peak = _peak(info.device, lambda: trainer.step(batch, 0))
    loss = result.metrics.get("actor/pg_loss")
    write(step_s=seconds, peak_memory_gb=peak, loss=loss, grad_norm=result.metrics.get("actor/grad_norm"))
    return (loss is not None and math.isfinite(loss) and result.metrics.get("actor/updates", 0) >= 1
            and math.isfinite(result.metrics.get("actor/grad_norm", float("nan"))))


def _reference_logp(model_dir: Path, batch: Batch, device: torch.device) -> list[torch.Tensor]:
    """Log-probs of each sample's response tokens from the Hugging Face model's own forward of
    that sample alone (float32, stock sdpa, no packing)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").to(device).eval()
    out = []
    for i in range(batch.size):
        ids = batch.input_ids[i : i + 1, : int(batch.lengths[i])].to(device)
        with torch.no_grad():
            logp = model(input_ids=ids).logits[0].float().log_softmax(-1)
        positions = batch.response_positions[i][batch.response_mask[i] > 0].to(device)
        out.append(logp[positions - 1].gather(1, ids[0, positions][:, None])[:, 0].cpu())
    del model
    return out


def phase_kernels(run: Run, write: Writer, tmp: Path, info: DistInfo) -> bool:
    shape = "smoke" if run.smoke else "qwen2.5-0.5b"
    model_dir = tmp / shape
    learner_gpu.build_model(shape, model_dir)
    micro = 512 if run.smoke else 16384
    groups = learner_gpu.make_groups(shape, 2 if run.smoke else 4, 4, seed=2)
    batch = prepare([screen(g, Limits(micro, learner_gpu.vocab(shape))) for g in groups]).batch
    reference = _reference_logp(model_dir, batch, info.device)
    import importlib.util

    has_flash = importlib.util.find_spec("flash_attn") is not None
    kernels: dict[str, dict[str, Any]] = {}
    ok = True
    for name in ("flash_attention_2", "flex_attention", "sdpa"):
        bench = argparse.Namespace(shape=shape, micro_tokens=micro, set=[f"learner.kernels.attention={name}"])
        cfg = load_config(None, learner_gpu.base_overrides(model_dir, bench, info.device.type == "cuda"))
        why = problem(cfg.learner.kernels, info.device.type, has_flash)
        if why is not None:
            kernels[name] = {"present": False, "why": why}
            write(kernels=kernels, samples=batch.size, tokens=int(batch.lengths.sum()), shape=shape)
            continue
        try:
            policy = load_sharded(str(model_dir), cfg.learner, info.device, trainable=True)
            trainer = Trainer(policy, None, cfg.learner, cfg.algorithm, info, 2, 1)
            packed, seconds, _ = _peak(info.device, functools.partial(trainer._all_rows_logp, policy, batch))
            diffs = [float((packed[i, : len(ref)] - ref).abs().max()) for i, ref in enumerate(reference)]
            tolerance = LOGP_TOLERANCE[memory.compute_bytes(cfg.learner, info.device.type)]
            equal = max(diffs) <= tolerance
            kernels[name] = {"present": True, "implementation": policy.config._attn_implementation, "max_abs_diff": max(diffs),
                             "mean_max_abs_diff": sum(diffs) / len(diffs), "tolerance": tolerance, "equal": equal, "logp_pass_s": seconds}
            del trainer, policy
        except Exception as exc:  # a kernel that is present but fails is this phase's finding
            kernels[name], equal = {"present": True, "error": _error(exc), "equal": False}, False
        ok = ok and equal
        write(kernels=kernels, samples=batch.size, tokens=int(batch.lengths.sum()), shape=shape)
    return ok and any(k["present"] for k in kernels.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=PHASES)
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU with gloo (CI)")
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    parser.add_argument("--budget-s", type=float, default=540.0, help="the phase's time (the GPU machine allows 600 s a command)")
    args = parser.parse_args()
    if not args.cpu_smoke and not torch.cuda.is_available():
        parser.error("no GPU here: run with --cpu-smoke, or on the GPU machine")
    device = torch.device("cpu") if args.cpu_smoke else torch.device("cuda", 0)
    name = "cpu-smoke" if args.cpu_smoke else slug(torch.cuda.get_device_name())
    calibration = args.out_dir / "memory_calibration.json" if args.cpu_smoke else memory.CALIBRATION_PATH
    run = Run(args.cpu_smoke, device, args.out_dir, name, args.budget_s, calibration, time.monotonic())
    write = Writer(run, args.phase)
    write()
    ok = False
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if args.phase in ("matrix", "throughput", "handoff"):  # benchmark processes, each with its own group
                ok = {"matrix": phase_matrix, "throughput": phase_throughput, "handoff": phase_handoff}[args.phase](run, write, Path(tmp))
            else:
                info = _process_group(device)
                try:
                    ok = (phase_vlm if args.phase == "vlm" else phase_kernels)(run, write, Path(tmp), info)
                finally:
                    dist.destroy_process_group()
    except Exception as exc:  # the phase's failure is its result; the next phase still runs
        write(error=_error(exc))
        raise
    finally:
        write(ok=ok, status="ok" if ok else "failed", seconds=round(time.monotonic() - run.started, 1))
        copy_out(run, [calibration] if args.phase == "throughput" else [])
        print(markdown(load(run)), flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
