"""The user's files and code, opened and checked before Redis, Ray and vLLM start: the
tokenizer and prompt format, the training and validation rows (malformed rows to
``rejected_rows.jsonl``), the environment (validation episodes) and the reward function
(probed on the answers). What can fail on them fails here, as a :class:`StartupError`."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, replace
from pathlib import Path

from async_rl.config import Config
from async_rl.data.images import load_image
from async_rl.data.prompts import ImageFields, PromptFormatter, PromptRow, read_prompt_rows, write_rejected
from async_rl.envs import EnvPool, EnvStartupError
from async_rl.launch.plan import StartupError
from async_rl.rewards.pool import RewardPool
from async_rl.rewards.scoring import RewardScorer, RewardStartupError, check_reward_function
from async_rl.rollout.validation import ValPrompt

log = logging.getLogger(__name__)


@dataclass
class RunInputs:
    formatter: PromptFormatter
    rows: list[PromptRow]
    """The training prompts."""
    val_rows: list[PromptRow]
    """The validation prompts (empty: ``data.val_files`` unset)."""
    val_prompts: list[ValPrompt]
    """``val_rows`` tokenized, their images loaded."""
    rewards: RewardPool
    envs: EnvPool | None
    """One environment process for validation episodes (None: single-turn prompts)."""

    def scorer(self, cfg: Config) -> RewardScorer:
        return RewardScorer(self.rewards, cfg.rollout.reward, cfg.rollout.max_response_length)


async def open_inputs(cfg: Config, run_dir: Path, stack: contextlib.AsyncExitStack) -> RunInputs:
    """Open the run's inputs; the environment and the reward pool close with ``stack``."""
    from transformers import AutoTokenizer

    formatter = PromptFormatter(AutoTokenizer.from_pretrained(cfg.learner.model_path), cfg.data.system_prompt, cfg.data.format_prompt)
    rows = read_rows(cfg, cfg.data.train_files, run_dir)
    val_rows = read_rows(cfg, cfg.data.val_files, run_dir) if cfg.data.val_files else []
    bounds = ImageFields.from_config(cfg.data).bounds
    val_prompts = [ValPrompt(formatter.token_ids(r.prompt, len(r.images)), r.answer, [load_image(ref, bounds) for ref in r.images] or None)
                   for r in val_rows]
    envs: EnvPool | None = None
    if cfg.rollout.env.name is not None:
        envs = EnvPool(replace(cfg.rollout.env, num_workers=1))  # validation episodes only
        try:
            await envs.start()
        except EnvStartupError as exc:
            raise StartupError(str(exc)) from None
        stack.callback(envs.close)
        if any(r.images for r in (*rows, *val_rows)):
            raise StartupError(f"rollout.env.name={cfg.rollout.env.name!r}: multi-turn environments take text prompts only; "
                               f"the dataset has rows with images ({cfg.data.image_key!r}): train them without rollout.env")
    inputs = RunInputs(formatter, rows, val_rows, val_prompts, stack.enter_context(RewardPool(cfg.rollout.reward)), envs)
    try:
        await check_reward_function(inputs.scorer(cfg), [r.answer for r in (val_rows or rows)])
    except RewardStartupError as exc:
        raise StartupError(str(exc)) from None
    return inputs


def read_rows(cfg: Config, path: str, run_dir: Path) -> list[PromptRow]:
    """The usable rows of a prompt file; malformed ones go to ``rejected_rows.jsonl`` (said, counted)."""
    rows, rejected = read_prompt_rows(path, cfg.data.prompt_key, cfg.data.answer_key, ImageFields.from_config(cfg.data))
    if rejected:
        write_rejected(rejected, run_dir / "rejected_rows.jsonl")
        log.warning("%s: %d malformed rows skipped (first: %s); see %s", path, len(rejected), rejected[0].reason, run_dir / "rejected_rows.jsonl")
    if not rows:
        raise StartupError(f"{path} has no usable rows ({len(rejected)} rejected)")
    return rows
