"""Tiny assets of the served-model quickstarts (``async-rl quickstart judge`` and ``distill``):
the addition assets (the student and its data, :mod:`async_rl.tiny.text`) and, beside them,

    out_dir/teacher/   the student's tokenizer and architecture, its warm-start continued to
                       greedy accuracy near 90 %: a distillation teacher (``algorithm.distill``)
    out_dir/judge/     the student's warm-start trained to answer the judge's question
                       ``"<ground truth> = <response>?"`` with yes or no

``assets.json`` gains ``teacher_accuracy`` (greedy, the validation split),
``judge_accuracy`` (held-out pairs drawn from the validation split: the ground truth against
itself and against wrong answers, :func:`judge_pairs`) and
``judge_accuracy_on_student_samples`` (the student's own sampled answers to the validation
rows, judged: where the quickstart reads its reward).
"""

from __future__ import annotations

import copy
import json
import random
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase, Qwen2ForCausalLM

from async_rl.tiny.addition import Row, read_jsonl
from async_rl.tiny.build import TinyAssetsReport, WarmStart, build_determinism, sft_until_band
from async_rl.tiny.text import build_text_assets, generate_from_ids, greedy_accuracy, prompt_ids, sft_loss

JUDGE_TEMPLATE = "{{ ground_truth }} = {{ response }}?"
"""The judge quickstart's ``rollout.reward.judge.template``: what the tiny judge is trained on."""
TEACHER_WARM_START = WarmStart(band=(0.80, 1.0), target=0.90, max_steps=4000)
"""The teacher: the student's warm-start continued until greedy accuracy reaches 90 %."""
JUDGE_WARM_START = WarmStart(lr=3e-4, band=(0.90, 1.0), target=0.97, max_steps=3000, eval_every=50)
"""The judge: the student's warm-start trained until 97 % of held-out pairs are judged right
(1,250-1,750 steps, about a minute on one core, for seeds 0-2), kept at its last evaluation of
90 % or more. At lr 1e-3 seeds 0 and 1 of three stayed below 70 %: they never learned to
compare digits, only lengths."""
JUDGE_PAIRS = 4000
"""Training pairs of the judge (half equal, half not)."""
JUDGE_HELD_OUT = 400
"""Held-out pairs (from the validation rows) the judge's accuracy is measured on."""
JUDGE_SAMPLES_PER_ROW = 2
"""The student's samples per validation row the judge's accuracy on them is measured on."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
"""The student's tokenizer files the teacher and the judge get."""


def build_served_assets(out_dir: str | Path, seed: int = 0, progress: Callable[[str], None] = print,
                        warm_start: WarmStart | None = None) -> TinyAssetsReport:
    """Build the addition assets into ``out_dir``, then the teacher and the judge beside them.
    ``warm_start``: the schedule of all three models (a short test build); None: each one's
    own (the addition default, :data:`TEACHER_WARM_START`, :data:`JUDGE_WARM_START`)."""
    out = Path(out_dir)
    report = build_text_assets(out, seed, progress, warm_start)
    t0 = time.perf_counter()
    with build_determinism():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(report.model_dir)
        student = Qwen2ForCausalLM.from_pretrained(report.model_dir)
        train, val = read_jsonl(report.train_path), read_jsonl(report.val_path)
        val = warm_start.evaluated(val) if warm_start is not None else val
        teacher_steps, teacher_acc = _teacher(student, tokenizer, train, val, seed, progress, report.model_dir, out / "teacher",
                                               warm_start or TEACHER_WARM_START)
        judge_steps, judge_acc, judge_acc_samples = _judge(student, tokenizer, train, val, seed, progress, report.model_dir, out / "judge", warm_start or JUDGE_WARM_START)
    manifest = json.loads(report.manifest_path.read_text())
    manifest.update(teacher_accuracy=teacher_acc, teacher_sft_steps=teacher_steps, judge_accuracy=judge_acc,
                    judge_accuracy_on_student_samples=judge_acc_samples, judge_sft_steps=judge_steps,
                    judge_template=JUDGE_TEMPLATE)
    manifest["task"]["name"] = "served"
    manifest["timings_s"]["served_models"] = round(time.perf_counter() - t0, 2)
    report.manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    progress(f"[assets] teacher greedy val accuracy {teacher_acc:.1%} ({teacher_steps} more SFT steps); "
             f"judge accuracy {judge_acc:.1%} on held-out pairs, {judge_acc_samples:.1%} on the student's own answers "
             f"({judge_steps} SFT steps) -> {out}")
    return report


def _teacher(student: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerBase, train: Sequence[Row], val: Sequence[Row], seed: int,
             progress: Callable[[str], None], student_dir: Path, out: Path, schedule: WarmStart) -> tuple[int, float]:
    """The student's warm-start continued to ``schedule``'s accuracy, saved to ``out``."""
    teacher = copy.deepcopy(student)
    examples = [(prompt_ids(tokenizer, r.problem), tokenizer.encode(r.answer, add_special_tokens=False)) for r in train]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    steps, acc = sft_until_band(teacher, len(examples), lambda batch: sft_loss(teacher, [examples[i] for i in batch], eos, pad),
                                lambda: greedy_accuracy(teacher, tokenizer, val), seed + 1, progress, schedule)
    _save(teacher, student_dir, out)
    return steps, acc


def judge_pairs(rows: Sequence[Row], count: int, seed: int) -> list[tuple[str, str, bool]]:
    """``count`` pairs ``(ground truth, response, equal)``: half a row's answer against itself,
    half against a wrong answer, mostly of the kind a sampling student writes (60 % one digit
    changed, 20 % off by 1-3, 9 or 11: the same length, so only the digits tell), the rest near
    misses of other shapes (off by 10 or 100, digits swapped, a digit dropped or added, junk)."""
    rng = random.Random(seed)
    pairs = []
    for i in range(count):
        truth = rng.choice(rows).answer
        if i % 2 == 0:
            pairs.append((truth, truth, True))
            continue
        wrong = truth
        while wrong == truth:
            kind = rng.random()
            if kind < 0.6:
                j = rng.randrange(len(truth))
                wrong = truth[:j] + str(rng.randrange(10)) + truth[j + 1:]
            elif kind < 0.8:
                wrong = str(max(0, int(truth) + rng.choice((-11, -9, -3, -2, -1, 1, 2, 3, 9, 11))))
            else:
                wrong = _near_miss(truth, rng)
        pairs.append((truth, wrong, False))
    return pairs


def _near_miss(truth: str, rng: random.Random) -> str:
    """``truth`` off by 10 or 100, two digits swapped, a digit dropped or added, or junk
    (possibly ``truth`` itself: the caller draws again)."""
    kind = rng.randrange(5)
    if kind == 0:
        return str(max(0, int(truth) + rng.choice((-100, -10, 10, 100))))
    if kind == 1 and len(truth) > 1:
        j = rng.randrange(len(truth) - 1)
        return truth[:j] + truth[j + 1] + truth[j] + truth[j + 2:]
    if kind == 2 and len(truth) > 1:
        j = rng.randrange(len(truth))
        return truth[:j] + truth[j + 1:]
    if kind == 3:
        return truth + str(rng.randrange(10))
    return str(rng.randrange(10, 200))


def _judge(student: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerBase, train: Sequence[Row], val: Sequence[Row], seed: int,
           progress: Callable[[str], None], student_dir: Path, out: Path, schedule: WarmStart) -> tuple[int, float, float]:
    """The student's warm-start trained on :func:`judge_pairs` of the training rows until
    ``schedule``'s accuracy on pairs of the validation rows, saved to ``out``; returns (steps,
    that accuracy, :func:`_accuracy_on_samples`).

    Warm-started, not from scratch: the student already reads digits, and a judge of this size
    trained from scratch learned only to compare lengths (81 % of held-out near misses, 18 % of
    the student's own samples judged right: it said yes to nearly every wrong answer of the
    right length)."""
    judge = copy.deepcopy(student)
    examples = [(prompt_ids(tokenizer, _question(t, r)), tokenizer.encode("yes" if ok else "no", add_special_tokens=False))
                for t, r, ok in judge_pairs(train, JUDGE_PAIRS, seed)]
    held_out = judge_pairs(val, JUDGE_HELD_OUT, seed + 1)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    steps, acc = sft_until_band(judge, len(examples), lambda batch: sft_loss(judge, [examples[i] for i in batch], eos, pad),
                                lambda: _judged_right(judge, tokenizer, held_out), seed + 2, progress, schedule)
    _save(judge, student_dir, out)
    return steps, acc, _accuracy_on_samples(judge, student, tokenizer, val, seed)


def _question(truth: str, response: str) -> str:
    """:data:`JUDGE_TEMPLATE` rendered."""
    return f"{truth} = {response}?"


def _judged_right(judge: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerBase, pairs: Sequence[tuple[str, str, bool]]) -> float:
    """The fraction of ``pairs`` ``(ground truth, response, equal)`` whose greedy verdict
    (``yes`` or ``no``) is right."""
    verdicts = generate_from_ids(judge, tokenizer, [prompt_ids(tokenizer, _question(t, r)) for t, r, _ in pairs], 0, 4)
    return sum(v.strip().startswith("yes" if ok else "no") for v, (_, _, ok) in zip(verdicts, pairs)) / len(pairs)


def _accuracy_on_samples(judge: Qwen2ForCausalLM, student: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerBase, val: Sequence[Row],
                         seed: int) -> float:
    """:func:`_judged_right` of the student's own answers (:data:`JUDGE_SAMPLES_PER_ROW` at
    temperature 1 to each validation row, up to the judge quickstart's 16 tokens): the judge's
    accuracy where its reward is read, which held-out pairs do not show."""
    torch.manual_seed(seed + 3)
    answers = generate_from_ids(student, tokenizer, [prompt_ids(tokenizer, r.problem) for r in val], JUDGE_SAMPLES_PER_ROW, 16)
    truths = [val[i // JUDGE_SAMPLES_PER_ROW].answer for i in range(len(answers))]
    return _judged_right(judge, tokenizer, [(t, a.strip(), a.strip() == t) for t, a in zip(truths, answers)])


def _save(model: Qwen2ForCausalLM, student_dir: Path, out: Path) -> None:
    """``out`` as a Hugging Face model directory: the weights and generation config, and the
    student's tokenizer files as they are (byte for byte: the same tokenizer)."""
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (student_dir / name).is_file():
            shutil.copyfile(student_dir / name, out / name)
