"""Greedy evaluation of a model on the validation file with an offline vLLM engine.

Used by ``async-rl eval`` (and the pre-training quickstart): it runs the real generation
stack (chat template, vLLM, reward function) without the training machinery.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from async_rl.config import Config, save_resolved
from async_rl.data.prompts import PromptFormatter, read_prompt_rows, write_rejected
from async_rl.rewards import load_reward_function
from async_rl.rollout.engine_args import engine_kwargs


@dataclass
class EvalResult:
    """Outcome of one evaluation."""

    prompts: int
    """Validation prompts evaluated."""
    accuracy: float
    """Mean of the reward function's ``overall`` over prompts (greedy decoding), in [0, 1] for 0/1 rewards."""
    rejected_rows: int
    """Malformed rows skipped (written to ``rejected_rows.jsonl``)."""
    generated_tokens: int
    """Response tokens generated."""
    generate_s: float
    """Wall time of generation, seconds."""
    engine_start_s: float
    """Wall time of building the vLLM engine, seconds."""
    examples: list[dict[str, str]] = field(default_factory=list)
    """A few (prompt, response, answer, reward) examples."""


def evaluate(cfg: Config, out_dir: str | Path, limit: int | None = None, progress: Callable[[str], None] = print) -> EvalResult:
    """Greedy-decode ``cfg.data.val_files`` with ``cfg.learner.model_path``; write eval.json to out_dir."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    out = Path(out_dir)
    save_resolved(cfg, out)
    rows, rejected = read_prompt_rows(cfg.data.val_files, cfg.data.prompt_key, cfg.data.answer_key)
    write_rejected(rejected, out / "rejected_rows.jsonl")
    for row in rejected[:3]:
        progress(f"skipped malformed row: {row.reason}")
    rows = rows[:limit] if limit else rows
    if not rows:
        raise ValueError(f"no usable rows in {cfg.data.val_files} ({len(rejected)} rejected; see {out / 'rejected_rows.jsonl'})")

    tokenizer = AutoTokenizer.from_pretrained(cfg.learner.model_path)
    formatter = PromptFormatter(tokenizer, cfg.data.system_prompt, cfg.data.format_prompt)
    reward_fn = load_reward_function(cfg.rollout.reward.function)

    progress(f"starting vLLM engine for {cfg.learner.model_path}")
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(cfg))
    engine_start_s = time.perf_counter() - t0

    prompts = [{"prompt_token_ids": formatter.token_ids(r.prompt)} for r in rows]
    params = SamplingParams(temperature=0.0, max_tokens=cfg.rollout.max_response_length)
    progress(f"generating greedy answers for {len(rows)} validation prompts")
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.perf_counter() - t0

    completions = [o.outputs[0] for o in outputs]
    scores = reward_fn(
        [{"response": c.text, "response_length": len(c.token_ids), "ground_truth": r.answer} for c, r in zip(completions, rows)]
    )
    accuracy = sum(s["overall"] for s in scores) / len(scores)
    examples = [
        {"prompt": r.prompt, "response": c.text, "answer": r.answer, "reward": f"{s['overall']:.2f}"}
        for r, c, s in list(zip(rows, completions, scores))[:5]
    ]
    result = EvalResult(
        prompts=len(rows),
        accuracy=accuracy,
        rejected_rows=len(rejected),
        generated_tokens=sum(len(c.token_ids) for c in completions),
        generate_s=generate_s,
        engine_start_s=engine_start_s,
        examples=examples,
    )
    (out / "eval.json").write_text(json.dumps(asdict(result), indent=2))
    return result
