"""One screening pass per rollout group: its arrays unpacked once, a verdict for it and for each sample.

Rank 0 screens a group when it reads it from the queue (a group with nothing trainable is
dropped there, a malformed one dead-lettered), every other rank when it receives the
step's groups; :func:`async_rl.learner.batching.prepare` pads what the screen kept and never
looks at a record again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from async_rl.records import FAILURE_KINDS, RolloutGroup, Sample

#: Reasons a sample or a group is dropped before training (the keys of ``Prepared.dropped``):
#: the user's code failed (:data:`~async_rl.records.FAILURE_KINDS`: reward or environment,
#: raised or timed out), or the sample's data cannot be trained.
DROP_REASONS = (*FAILURE_KINDS, "empty_response", "nonfinite_reward", "nonfinite_logprob", "bad_token", "too_long", "image_token",
                "too_few_samples")


@dataclass(frozen=True)
class Limits:
    """What the learner's model and memory accept."""

    max_tokens: int
    """Prompt + response tokens of one sample at most (``learner.max_tokens_per_microbatch``)."""
    vocab_size: int | None = None
    """Token ids must lie in ``[0, vocab_size)`` (None: not checked)."""
    image_token: int | None = None
    """A vision-language model's image token: a response holding it is not trained (the
    model would look for an image that is not there); None for a text model."""
    failed_samples: str = "drop_sample"
    """``algorithm.failed_samples``: a sample the user's code failed on is left out of its
    group (``drop_sample``) or takes the whole group with it (``drop_group``)."""
    min_samples: int = 1
    """The fewest trainable samples a group needs (2 for an estimator whose baseline is
    the group's statistics: one sample alone has no baseline)."""
    max_image_pixels: int = 4194304
    """Pixels (width x height) of one stored image at most (``data.max_pixels``: images are
    resized into it before they are stored); a larger one is malformed data."""
    needs_teacher: bool = False
    """``algorithm.distill``: a sample must carry its teacher's log-probs (one without is
    not trained: ``teacher_error``)."""
    teacher_top_k: int = 0
    """``algorithm.distill.top_k``: a sample must carry the teacher's top-k of this k at each
    response token (one without is not trained: ``teacher_error``)."""


class Verdict(NamedTuple):
    """Why a whole group is not trained."""

    reason: str
    """One of :data:`DROP_REASONS`."""
    detail: str
    malformed: bool
    """Malformed data (a token id outside the vocabulary would crash the embedding): dead-letter it."""


@dataclass(frozen=True)
class ScreenedSample:
    """One response, unpacked: ``tokens``, ``logprobs`` (behaviour, natural log), ``versions``
    (policy version per token) and ``mask`` (1: trained) are per response token."""

    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    mask: list[int]
    reward: float
    problem: str | None
    """Why this sample is not trained (one of :data:`DROP_REASONS`), or None."""
    teacher: list[float] | None = None
    """The teacher's log-prob of each response token (``algorithm.distill``), or None."""
    teacher_top: tuple[list[list[int]], list[list[float]]] | None = None
    """The teacher's top-k ids and log-probs at each response token, ``[T][k]`` each
    (``algorithm.distill.top_k``), or None."""


@dataclass(frozen=True)
class ScreenedGroup:
    """A group with its prompt and samples unpacked and judged (:func:`screen`)."""

    group: RolloutGroup
    prompt: list[int]
    samples: tuple[ScreenedSample, ...]
    """Empty when the prompt alone condemns the group."""
    verdict: Verdict | None
    """None: the group yields at least one trainable sample."""


def _flat(top: tuple[list[list[int]], list[list[float]]] | None) -> list[float]:
    """The top-k log-probs of every position, in one list ([] for None)."""
    return [] if top is None else [x for row in top[1] for x in row]


def screen(group: RolloutGroup, limits: Limits) -> ScreenedGroup:
    """Judge ``group`` once.

    The whole group goes when a token id lies outside ``[0, vocab_size)`` (malformed), when a
    sample's reward is not finite or a behaviour log-probability is not finite (one NaN
    reaches every parameter), when the user's code failed on a sample and
    ``limits.failed_samples`` is ``drop_group``, or when fewer than ``limits.min_samples``
    samples are trainable (``too_few_samples``; the reason of the samples' problems when
    none is). A sample is not trained when the user's code failed on it (its
    ``error_kind``: the group's baseline is then computed over the other samples), when it
    has no token to train (an empty response, or a multi-turn episode whose environment
    failed before the model's first turn), when prompt + response exceed ``max_tokens`` (it
    fits no micro-batch) or when it holds ``image_token``.
    """
    prompt = list(group.prompt_array())
    bad = _out_of_vocab(prompt, limits.vocab_size)
    if bad is not None:
        return ScreenedGroup(group, prompt, (), Verdict(
            "bad_token", f"prompt token id {prompt[bad]} at position {bad} is outside the vocabulary [0, {limits.vocab_size})", True))
    samples: list[ScreenedSample] = []
    verdict: Verdict | None = None
    for k, record in enumerate(group.samples):
        tokens, logprobs = list(record.token_array()), list(record.logprob_array())
        teacher = list(t) if (t := record.teacher_array()) is not None else None
        top = record.teacher_top() if limits.teacher_top_k else None
        top_ids = [i for row in top[0] for i in row] if top is not None else []
        mask, versions = record.token_mask(), record.token_versions()
        bad = _out_of_vocab(tokens, limits.vocab_size)
        bad_top = _out_of_vocab(top_ids, limits.vocab_size)
        if bad is not None and (verdict is None or not verdict.malformed):
            verdict = Verdict("bad_token", f"sample {k}: response token id {tokens[bad]} at position {bad} is outside the vocabulary "
                                           f"[0, {limits.vocab_size})", True)
        elif bad_top is not None and (verdict is None or not verdict.malformed):
            verdict = Verdict("bad_token", f"sample {k}: the teacher's top-k token id {top_ids[bad_top]} is outside the vocabulary "
                                           f"[0, {limits.vocab_size})", True)
        elif verdict is None and record.error is not None and limits.failed_samples == "drop_group":
            verdict = Verdict(_failure_kind(record), f"sample {k}: {record.error}", False)
        elif verdict is None and record.error is None:
            reason = ("nonfinite_reward" if not math.isfinite(record.reward)
                      else "nonfinite_logprob" if not all(math.isfinite(x) for x in (*logprobs, *(teacher or ()), *_flat(top))) else None)
            if reason is not None:
                verdict = Verdict(reason, f"sample {k} has a {reason.replace('_', ' ')}", False)
        problem = _failure_kind(record) if record.error is not None else _sample_problem(len(prompt), tokens, mask, limits)
        if problem is None and limits.needs_teacher and teacher is None:
            problem = "teacher_error"  # generated without a teacher (before algorithm.distill was set)
        if problem is None and limits.teacher_top_k and (top is None or len(top[0][0]) != limits.teacher_top_k):
            problem = "teacher_error"  # generated with another algorithm.distill.top_k, or none
        samples.append(ScreenedSample(tokens, logprobs, versions, mask, record.reward, problem, teacher, top))
    trainable = sum(s.problem is None for s in samples)
    if verdict is None and trainable == 0:
        first = next(s for s in samples if s.problem)
        detail = next((f"sample {k}: {r.error}" for k, r in enumerate(group.samples) if r.error is not None), "no sample is trainable")
        verdict = Verdict(str(first.problem), detail, False)
    elif verdict is None and trainable < limits.min_samples:
        verdict = Verdict("too_few_samples", f"{trainable} trainable sample(s) < {limits.min_samples} for the group's baseline", False)
    return ScreenedGroup(group, prompt, tuple(samples), verdict)


def _failure_kind(record: Sample) -> str:
    """Whose code failed on ``record`` (records written before ``error_kind`` existed: the reward's)."""
    return record.error_kind or "reward_error"


def _out_of_vocab(tokens: list[int], vocab_size: int | None) -> int | None:
    """Position of the first token id outside ``[0, vocab_size)``, or None."""
    if vocab_size is None:
        return None
    return next((i for i, t in enumerate(tokens) if not 0 <= t < vocab_size), None)


def _sample_problem(prompt_len: int, tokens: list[int], mask: list[int], limits: Limits) -> str | None:
    if not tokens or not any(mask):
        return "empty_response"
    if _out_of_vocab(tokens, limits.vocab_size) is not None:
        return "bad_token"
    if prompt_len + len(tokens) > limits.max_tokens:
        return "too_long"
    if limits.image_token is not None and limits.image_token in tokens:
        return "image_token"
    return None
