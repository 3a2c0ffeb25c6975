"""Tiny assets for the quickstarts, tests and benchmarks: a tokenizer, a warm-started model and
a task's train/validation data, built deterministically on a CPU in about a minute.

``build_tiny_assets(out_dir, task=...)`` (``async-rl assets tiny --task``) picks the build:
``addition`` and ``multiturn`` (:mod:`async_rl.tiny.text`, a Qwen2 on the addition task of
:mod:`async_rl.tiny.addition`), ``running_sum`` (:mod:`async_rl.tiny.running_sum`, long written-out
responses), ``vlm`` (:mod:`async_rl.tiny.vlm`, an Idefics3 on coloured
shapes), ``served`` (:mod:`async_rl.tiny.served`, the addition assets with a distillation
teacher and a judge beside them); every build writes the layout and report of :mod:`async_rl.tiny.build`.

Only the CLI, the tests and the benchmarks import this package; the training path never does.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from async_rl.tiny.build import TinyAssetsReport, WarmStart
from async_rl.tiny.running_sum import build_running_sum_assets
from async_rl.tiny.served import build_served_assets
from async_rl.tiny.text import build_text_assets
from async_rl.tiny.vlm import build_vlm_assets

TASKS = ("addition", "multiturn", "running_sum", "vlm", "served")
"""What ``build_tiny_assets`` can build (``async-rl assets tiny --task``)."""


def build_tiny_assets(
    out_dir: str | Path,
    seed: int = 0,
    progress: Callable[[str], None] = print,
    warm_start: WarmStart | None = None,
    task: str = "addition",
) -> TinyAssetsReport:
    """Build the tiny assets of ``task`` (one of :data:`TASKS`) into ``out_dir`` (created;
    existing files overwritten). ``warm_start`` is the supervised schedule (None: the task's
    default, which gives the documented base model)."""
    if task not in TASKS:
        raise ValueError(f"unknown tiny task {task!r}; choose one of {', '.join(TASKS)}")
    if task == "vlm":
        return build_vlm_assets(out_dir, seed, progress, warm_start)
    if task == "running_sum":
        return build_running_sum_assets(out_dir, seed, progress, warm_start)
    if task == "served":
        return build_served_assets(out_dir, seed, progress, warm_start)
    return build_text_assets(out_dir, seed, progress, warm_start, multiturn=task == "multiturn")
