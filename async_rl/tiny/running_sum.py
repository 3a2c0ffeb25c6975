"""Tiny long-response task: a running sum written out line by line, the final answer boxed.

Why this task. Issue 44's regime: responses long and uneven, so that generation costs as
much as training. The answer is reached only by written-out reasoning, one line per addend,
so the response's length is set by the problem (a long-tailed number of addends), not by
the model's whim, and every line is a step the tiny model can get wrong::

    problem   Add:\\na3\\nb7\\nc2\\nd9
    response  a3:0+3=3\\nb7:3+7=10\\nc2:10+2=12\\nd9:12+9=21\\n\\boxed{21}
    answer    21

Each line copies the next prompt line (its key, ``a``..``z``, ``A``..``Z``, then its digit;
each one token), then the sum so far, adds the digit and writes the new sum. The line starts
with the prompt's own two tokens so that fetching the digit is the plain induction-head copy
(after ``k``, write what followed ``k`` in the prompt), not a lookup from a later position: with
lines written ``key:sum+digit`` the warm-started model read the first four digits by position
and got 68 % of the later ones wrong (teacher-forced, 2026-12-07), and RL barely moved it.

The rows are EasyR1's (``{"problem", "answer"}``); the built-in ``math`` reward scores the
last ``\\boxed{}``, and :func:`is_correct` judges the same way for the warm-start.

The number of addends is lognormal (median :data:`MEDIAN_ADDENDS`, sigma
:data:`SIGMA_ADDENDS`) clipped to ``[MIN_ADDENDS, MAX_ADDENDS]``: about 12 on average (a
response of ~148 tokens), 5 % of problems over 30, the longest 48 (~600 tokens).
"""

from __future__ import annotations

import math
import random
import string
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM

from async_rl.rewards.builtin import last_boxed
from async_rl.tiny.addition import Row, make_splits, write_jsonl
from async_rl.tiny.build import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    PASS_AT_K,
    TinyAssetsReport,
    WarmStart,
    build_determinism,
    finish_build,
    make_layout,
    sample_stats,
    sft_until_band,
    text_model_sizes,
    write_tokenizer,
)
from async_rl.tiny.text import CHAT_TEMPLATE, generate_completions, prompt_ids, sft_loss

KEYS = string.ascii_lowercase + string.ascii_uppercase
"""The addends' names, in order: one token each, so a key in the response matches its prompt line."""
MIN_ADDENDS, MAX_ADDENDS = 2, len(KEYS) - 4  # 48: prompt + response stay under MAX_MODEL_LEN
MEDIAN_ADDENDS, SIGMA_ADDENDS = 10.5, 0.65
N_TRAIN, N_VAL = 4000, 1000
MAX_MODEL_LEN = 1024  # max_position_embeddings: the longest prompt is ~155 tokens, its response ~560
MAX_NEW_TOKENS = 640  # generation budget of the warm-start's evaluations (the longest response and some junk)
BUDGET_MARGIN = 16  # tokens an evaluation may write past the longest worked answer of its rows
PASS_ROWS = 50  # validation rows sampled PASS_AT_K times for the headroom estimate (long sequences: fewer than the others)
QUICK_VAL = 200  # rows of data/val.jsonl (the first of val_1000.jsonl): what the quickstart and the warm-start evaluate

WARM_START = WarmStart(lr=1e-3, warmup_steps=50, batch_size=16, eval_every=50, band=(0.15, 0.35), target=0.25, max_steps=6000)
"""The task's supervised schedule: long sequences, so smaller batches evaluated less often."""


@dataclass(frozen=True)
class RunningSumTask:
    """Sums of single-digit addends (1-9), their count drawn per problem."""

    min_addends: int = MIN_ADDENDS
    max_addends: int = MAX_ADDENDS
    median_addends: float = MEDIAN_ADDENDS
    sigma: float = SIGMA_ADDENDS

    def sample(self, rng: random.Random) -> Row:
        count = round(math.exp(rng.gauss(math.log(self.median_addends), self.sigma)))
        digits = [rng.randint(1, 9) for _ in range(min(self.max_addends, max(self.min_addends, count)))]
        return Row(problem=problem_text(digits), answer=str(sum(digits)))

    @property
    def num_problems(self) -> int:
        """Number of distinct problems the task can produce (9 digits per addend)."""
        return sum(9**k for k in range(self.min_addends, self.max_addends + 1))


def problem_text(digits: Sequence[int]) -> str:
    """``Add:`` then one ``<key><digit>`` line per addend."""
    if not 1 <= len(digits) <= len(KEYS):
        raise ValueError(f"{len(digits)} addends; the task names at most {len(KEYS)}")
    return "Add:\n" + "\n".join(f"{key}{d}" for key, d in zip(KEYS, digits))


def parse_problem(problem: str) -> list[int]:
    """The addends of a :func:`problem_text`, in order (``ValueError`` for any other text)."""
    head, *lines = problem.split("\n")
    if head != "Add:" or not lines or any(len(line) != 2 or line[0] != key or not line[1].isdigit()
                                          for key, line in zip(KEYS, lines)) or len(lines) > len(KEYS):
        raise ValueError(f"not a running-sum problem: {problem[:80]!r}")
    return [int(line[1]) for line in lines]


def solution(problem: str) -> str:
    """The worked response: one ``<key><digit>:sum+digit=new sum`` line per addend, then ``\\boxed{sum}``."""
    total, lines = 0, []
    for key, d in zip(KEYS, parse_problem(problem)):
        lines.append(f"{key}{d}:{total}+{d}={total + d}")
        total += d
    return "\n".join(lines) + f"\n\\boxed{{{total}}}"


def is_correct(completion: str, answer: str) -> bool:
    """The last ``\\boxed{}`` of the completion holds the answer (as the ``math`` reward judges)."""
    boxed = last_boxed(completion)
    return boxed is not None and boxed.strip() == answer.strip()


def build_running_sum_assets(
    out_dir: str | Path,
    seed: int = 0,
    progress: Callable[[str], None] = print,
    warm_start: WarmStart | None = None,
) -> TinyAssetsReport:
    """Build the running-sum assets into ``out_dir`` (the layout of :mod:`async_rl.tiny.build`;
    ``data/val_1000.jsonl`` holds :data:`N_VAL` validation rows, ``data/val.jsonl`` their first
    :data:`QUICK_VAL`, which the warm-start evaluates). ``warm_start`` is the supervised schedule
    (None: :data:`WARM_START`, which gives the documented base model)."""
    warm_start = warm_start or WARM_START
    task = RunningSumTask()
    out = Path(out_dir)
    model_dir, data_dir = make_layout(out)
    timings: dict[str, float] = {}
    t_start = time.perf_counter()
    with build_determinism():
        train, val = make_splits(task, seed, N_TRAIN, N_VAL)
        write_jsonl(train, data_dir / "train.jsonl")
        write_jsonl(val, data_dir / f"val_{N_VAL}.jsonl")
        val = val[:QUICK_VAL]
        write_jsonl(val, data_dir / "val.jsonl")
        corpus = [f"user\n{r.problem}\nassistant\n{solution(r.problem)}\n" for r in train]
        tokenizer = write_tokenizer(model_dir, corpus, (ENDOFTEXT, IM_START, IM_END), CHAT_TEMPLATE, MAX_MODEL_LEN)
        progress(f"[assets] tokenizer: {len(tokenizer)} tokens -> {model_dir}")

        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(Qwen2Config(**{**text_model_sizes(tokenizer), "max_position_embeddings": MAX_MODEL_LEN},
                                             dtype="float32"))
        progress(f"[assets] model: Qwen2, {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
        examples = [(prompt_ids(tokenizer, r.problem), tokenizer.encode(solution(r.problem), add_special_tokens=False))
                    for r in train]
        lengths = sorted(len(c) + 1 for _, c in examples)
        progress(f"[assets] responses: mean {sum(lengths) / len(lengths):.0f} tokens, median "
                 f"{lengths[len(lengths) // 2]}, longest {lengths[-1]}")

        t0 = time.perf_counter()
        eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
        steps, base_acc = sft_until_band(
            model, len(examples),
            lambda batch: sft_loss(model, [examples[i] for i in batch], eos, pad),
            lambda: greedy_accuracy(model, tokenizer, warm_start.evaluated(val)),
            seed, progress, warm_start,
        )
        timings["warm_start"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        rows = warm_start.evaluated(val)[:PASS_ROWS]
        samples = generate_completions(model, tokenizer, [r.problem for r in rows], num_samples=PASS_AT_K,
                                       max_new_tokens=budget(tokenizer, rows))
        sampled_acc, pass_at_k = sample_stats(samples, [r.answer for r in rows], is_correct)
        timings["pass_at_k"] = time.perf_counter() - t0
        return finish_build(
            out, model, tokenizer, seed=seed, base_accuracy=base_acc, sampled_accuracy=sampled_acc,
            pass_at_k=pass_at_k, sft_steps=steps, timings=timings, t_start=t_start, warm_start=warm_start,
            task={"name": "running_sum", "min_addends": task.min_addends, "max_addends": task.max_addends,
                  "median_addends": task.median_addends, "sigma": task.sigma,
                  "response_tokens": {"mean": round(sum(lengths) / len(lengths), 1), "max": lengths[-1]},
                  "pass_at_k_rows": PASS_ROWS},
            sizes={"train": N_TRAIN, "val": QUICK_VAL, f"val_{N_VAL}": N_VAL},
            progress=progress,
        )


def greedy_accuracy(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerBase, rows: Sequence[Row]) -> float:
    """Fraction of rows whose greedy response boxes the right sum."""
    completions = generate_completions(model, tokenizer, [r.problem for r in rows], max_new_tokens=budget(tokenizer, rows))
    return sum(is_correct(c, r.answer) for c, r in zip(completions, rows)) / len(rows)


def budget(tokenizer: PreTrainedTokenizerBase, rows: Sequence[Row]) -> int:
    """New tokens an evaluation of ``rows`` decodes: the longest worked answer among them, its
    end of turn and :data:`BUDGET_MARGIN` (a response past it is wrong anyway), at most
    :data:`MAX_NEW_TOKENS`. A batch decodes until its last sequence stops, and a derailed sample
    never does: without the bound every evaluation ran to 640 tokens."""
    longest = max(len(tokenizer.encode(solution(r.problem), add_special_tokens=False)) for r in rows)
    return min(MAX_NEW_TOKENS, longest + 1 + BUDGET_MARGIN)
