"""Greedy evaluation of a model on the validation file with an offline vLLM engine.

Used by ``async-rl eval`` (and the pre-training quickstart): it runs the real generation
stack (chat template, vLLM, reward function) without the training machinery.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from async_rl.config import Config, save_resolved
from async_rl.data.prompts import ImageFields, PromptFormatter, PromptRow, read_prompt_rows, write_rejected
from async_rl.rewards import load_reward_function
from async_rl.rewards.scoring import score_output
from async_rl.rollout.engine_args import engine_kwargs

EPISODES_IN_FLIGHT = 64
"""Concurrent greedy episodes of an environment evaluation (vLLM batches their turns)."""


@dataclass
class EvalResult:
    """Outcome of one evaluation."""

    prompts: int
    """Validation prompts evaluated."""
    accuracy: float
    """Fraction of prompts whose greedy answer is solved, as the run's validation counts it
    (:attr:`~async_rl.rewards.scoring.Score.correct`: ``math``'s 0.1 format reward alone is not
    solved); with an environment (``rollout.env.name``), the success rate of greedy episodes."""
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


def base_engine_kwargs(cfg: Config) -> dict[str, Any]:
    """The engine arguments of an evaluation: ``learner.model_path`` as it is, without the
    LoRA serving a ``learner.lora`` run's servers get (a zero adapter would give the same
    tokens, only slower: vLLM on CPU runs without ``torch.compile`` with LoRA). To evaluate a
    trained adapter, export it merged."""
    return engine_kwargs(replace(cfg, learner=replace(cfg.learner, lora=None)))


def solved_fraction(outputs: list[dict[str, Any]]) -> float:
    """Fraction of a reward function's ``outputs`` that count as solved, by the validation's rule
    (:attr:`~async_rl.rewards.scoring.Score.correct`), not their mean reward."""
    return sum(score_output(out).correct for out in outputs) / len(outputs)


def evaluate(cfg: Config, out_dir: str | Path, limit: int | None = None, progress: Callable[[str], None] = print) -> EvalResult:
    """Greedy-decode ``cfg.data.val_files`` with ``cfg.learner.model_path``; write eval.json to out_dir."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    out = Path(out_dir)
    save_resolved(cfg, out)
    rows, rejected = read_prompt_rows(cfg.data.val_files, cfg.data.prompt_key, cfg.data.answer_key, ImageFields.from_config(cfg.data))
    write_rejected(rejected, out / "rejected_rows.jsonl")
    for row in rejected[:3]:
        progress(f"skipped malformed row: {row.reason}")
    rows = rows[:limit] if limit else rows
    if not rows:
        raise ValueError(f"no usable rows in {cfg.data.val_files} ({len(rejected)} rejected; see {out / 'rejected_rows.jsonl'})")

    if cfg.rollout.env.name:
        result = _evaluate_episodes(cfg, rows, len(rejected), progress)
        (out / "eval.json").write_text(json.dumps(asdict(result), indent=2))
        return result

    tokenizer = AutoTokenizer.from_pretrained(cfg.learner.model_path)
    formatter = PromptFormatter(tokenizer, cfg.data.system_prompt, cfg.data.format_prompt)
    reward_fn = load_reward_function(cfg.rollout.reward.function)

    progress(f"starting vLLM engine for {cfg.learner.model_path}")
    t0 = time.perf_counter()
    llm = LLM(**base_engine_kwargs(cfg))
    engine_start_s = time.perf_counter() - t0
    try:
        prompts = [{"prompt_token_ids": formatter.token_ids(r.prompt)} for r in rows]
        params = SamplingParams(temperature=0.0, max_tokens=cfg.rollout.max_response_length)
        progress(f"generating greedy answers for {len(rows)} validation prompts")
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        generate_s = time.perf_counter() - t0
    finally:
        # The engine's process ends here, not whenever the garbage collector finds the LLM.
        llm.llm_engine.engine_core.shutdown()

    completions = [o.outputs[0] for o in outputs]
    scores = reward_fn(
        [{"response": c.text, "response_length": len(c.token_ids), "ground_truth": r.answer} for c, r in zip(completions, rows)]
    )
    accuracy = solved_fraction(scores)
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


def _evaluate_episodes(cfg: Config, rows: list[PromptRow], rejected: int, progress: Callable[[str], None]) -> EvalResult:
    """One greedy episode of ``rollout.env`` per row, on an inference server in this process."""
    import asyncio

    from async_rl.envs import EnvPool
    from async_rl.envs.conversation import ChatEncoder
    from async_rl.rollout.episodes import Episode, EpisodeSampler
    from async_rl.rollout.server import InferenceServer
    from async_rl.rollout.types import Sampling

    async def run() -> tuple[list[Episode], float, float]:
        progress(f"starting vLLM engine for {cfg.learner.model_path}")
        t0 = time.perf_counter()
        server = InferenceServer("eval", base_engine_kwargs(cfg))
        envs = EnvPool(cfg.rollout.env)
        try:
            await envs.start()
            await server.start()
            start_s = time.perf_counter() - t0
            greedy = Sampling(temperature=0.0, max_tokens=cfg.rollout.max_response_length)
            sampler = EpisodeSampler(envs, cfg.rollout.env, ChatEncoder(server.tokenizer()), greedy, cfg.data.max_prompt_length)
            limit = asyncio.Semaphore(EPISODES_IN_FLIGHT)

            async def one(row: PromptRow) -> Episode:
                async with limit:
                    return await sampler.episode(row, server.generate)

            progress(f"playing greedy episodes of {cfg.rollout.env.name} for {len(rows)} validation rows")
            t0 = time.perf_counter()
            episodes = await asyncio.gather(*(one(r) for r in rows))
            return episodes, start_s, time.perf_counter() - t0
        finally:
            envs.close()
            await server.shutdown()

    episodes, engine_start_s, generate_s = asyncio.run(run())
    wins = [e.trajectory.failure is None and e.trajectory.success for e in episodes]
    return EvalResult(
        prompts=len(rows),
        accuracy=sum(wins) / len(rows),
        rejected_rows=rejected,
        generated_tokens=sum(sum(e.tokens.mask) for e in episodes if e.tokens is not None),
        generate_s=generate_s,
        engine_start_s=engine_start_s,
        examples=[
            {"prompt": r.prompt, "response": " | ".join(e.trajectory.actions) or f"(error: {e.trajectory.failure and e.trajectory.failure.signature})",
             "answer": r.answer, "reward": f"{e.trajectory.total_reward(cfg.rollout.env.reward):.2f}"}
            for r, e in list(zip(rows, episodes))[:5]
        ],
    )
