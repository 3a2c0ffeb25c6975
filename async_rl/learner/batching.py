"""Rollout groups -> padded tensors -> token-budgeted micro-batches, balanced across ranks.

Pure functions, no distributed code: every learner rank receives the whole step's groups and
computes the same plan, so ranks agree on micro-batch counts without communicating (FSDP needs
every rank to run the same number of forward/backward passes).

Shapes: ``N`` samples, ``L`` prompt + response tokens (right-padded), ``T`` response tokens
(the longest response of the step; every response-aligned tensor uses the same ``T`` for the
whole step, so ``seq-mean-token-sum-norm`` divides by one constant).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
from torch import Tensor

from async_rl.learner.vision import VisionInputs
from async_rl.records import RolloutGroup

#: Reasons a sample or a group is dropped before training (the keys of ``DropCounts``).
DROP_REASONS = ("empty_response", "nonfinite_reward", "reward_error", "nonfinite_logprob", "bad_token", "too_long", "image_token")


@dataclass(frozen=True)
class Batch:
    """The trainable samples of one learner step (CPU tensors).

    ``input_ids`` and ``attention_mask`` are ``[N, L]`` int64 (prompt then response, right
    padding with token 0 and mask 0). ``response_positions`` ``[N, T]`` int64 is the index in
    ``input_ids`` of each response token (0 on padding); ``response_mask`` ``[N, T]`` float32
    is 1 on trained response tokens (0 on padding, and on the template's and environment's
    tokens inside a multi-turn response). ``behav_logp`` ``[N, T]`` float32 is the sampler's log-probability
    (natural log) and ``token_versions`` ``[N, T]`` int64 the policy version of each token
    (-1 on padding). ``rewards`` ``[N]`` float32, ``group_index`` ``[N]`` int64 (position of the
    sample's group in the step's list), ``behaviour_version`` ``[N]`` int64 (min token version),
    ``lengths`` ``[N]`` int64 (prompt + response tokens). ``vision`` holds the processed
    images of a vision-language batch's groups (indexed by ``group_index``), None for text.
    """

    input_ids: Tensor
    attention_mask: Tensor
    response_positions: Tensor
    response_mask: Tensor
    behav_logp: Tensor
    token_versions: Tensor
    rewards: Tensor
    group_index: Tensor
    behaviour_version: Tensor
    lengths: Tensor
    vision: VisionInputs | None = None

    @property
    def size(self) -> int:
        """Number of samples ``N``."""
        return int(self.lengths.shape[0])

    def select(self, rows: Sequence[int]) -> Batch:
        """The samples ``rows`` (in that order), with ``L`` cut to their longest sequence."""
        index = torch.as_tensor(list(rows), dtype=torch.long)
        width = int(self.lengths[index].max()) if len(rows) else 1
        picked = {f.name: getattr(self, f.name).index_select(0, index) for f in fields(self) if f.name != "vision"}
        picked["input_ids"] = picked["input_ids"][:, :width]
        picked["attention_mask"] = picked["attention_mask"][:, :width]
        return Batch(**picked, vision=self.vision)  # per group: group_index still indexes it

    def image_inputs(self, device: torch.device) -> dict[str, Tensor]:
        """The model's image keyword arguments for these samples packed in order ({} for text)."""
        return {} if self.vision is None else self.vision.for_samples(self.group_index.tolist(), device)


@dataclass(frozen=True)
class Prepared:
    """Result of :func:`prepare`: the batch (None when nothing is trainable) and the drop counts."""

    batch: Batch | None
    dropped: Counter[str]
    groups_used: int
    """Groups with at least one trainable sample."""
    kept: tuple[int, ...] = ()
    """Positions in the input list of those groups, in ``Batch.group_index`` order."""


def prepare(groups: Sequence[RolloutGroup], max_tokens: int, vocab_size: int | None = None, image_token: int | None = None) -> Prepared:
    """Validate and pad ``groups`` into a :class:`Batch`.

    A sample is dropped (counted under its reason) when its response is empty, a response
    token id is outside ``[0, vocab_size)`` (``bad_token``), or prompt + response exceed
    ``max_tokens`` (``too_long``: it fits no micro-batch), or the response holds a
    vision-language model's ``image_token`` (``image_token``: the model would look for an
    image there that does not exist; a sampler may draw it). A whole group is dropped when any
    sample has a non-finite reward, a failed reward (``reward_error``) or a non-finite
    behaviour log-probability: group baselines computed from such a group would be wrong, and
    one NaN reaches every parameter. Counts are in samples.
    """
    dropped: Counter[str] = Counter()
    rows: list[_Row] = []
    kept_groups: list[int] = []
    for position, group in enumerate(groups):
        prompt = list(group.prompt_array())
        reason = "bad_token" if _out_of_vocab(prompt, vocab_size) is not None else _group_problem(group)
        if reason is not None:
            dropped[reason] += len(group.samples)
            continue
        kept = 0
        for sample in group.samples:
            tokens = list(sample.token_array())
            problem = _sample_problem(len(prompt), tokens, max_tokens, vocab_size, any(sample.token_mask()), image_token)
            if problem is not None:
                dropped[problem] += 1
                continue
            rows.append(_Row(prompt, tokens, list(sample.logprob_array()), sample.token_versions(), sample.token_mask(), sample.reward,
                             len(kept_groups)))
            kept += 1
        if kept:
            kept_groups.append(position)
    if not rows:
        return Prepared(None, dropped, 0)
    return Prepared(_pad(rows), dropped, len(kept_groups), tuple(kept_groups))


def screen_group(group: RolloutGroup, max_tokens: int, vocab_size: int, image_token: int | None = None) -> tuple[str, str, bool] | None:
    """Why the learner must not train ``group`` at all, or None: ``(reason, detail, malformed)``.

    Malformed (to be dead-lettered): a prompt or response token id outside ``[0, vocab_size)``
    (it would crash the embedding). Dropped: the group problems of :func:`prepare` (a failed
    or non-finite reward, a non-finite log-probability), or no sample :func:`prepare` would
    keep. A group that passes yields at least one trainable sample.
    """
    prompt = list(group.prompt_array())
    bad = _out_of_vocab(prompt, vocab_size)
    if bad is not None:
        return "bad_token", f"prompt token id {prompt[bad]} at position {bad} is outside the vocabulary [0, {vocab_size})", True
    for k, sample in enumerate(group.samples):
        tokens = list(sample.token_array())
        bad = _out_of_vocab(tokens, vocab_size)
        if bad is not None:
            return "bad_token", f"sample {k}: response token id {tokens[bad]} at position {bad} is outside the vocabulary [0, {vocab_size})", True
    reason = _group_problem(group)
    if reason is not None:
        error = next((s.error for s in group.samples if s.error is not None), None)
        return reason, error or f"a sample has a {reason.replace('_', ' ')}", False
    problems = [_sample_problem(len(prompt), list(s.token_array()), max_tokens, vocab_size, any(s.token_mask()), image_token)
                for s in group.samples]
    if all(problems):
        return str(problems[0]), "no sample is trainable", False
    return None


def _out_of_vocab(tokens: list[int], vocab_size: int | None) -> int | None:
    """Position of the first token id outside ``[0, vocab_size)``, or None."""
    if vocab_size is None:
        return None
    return next((i for i, t in enumerate(tokens) if not 0 <= t < vocab_size), None)


def _group_problem(group: RolloutGroup) -> str | None:
    for sample in group.samples:
        if sample.error is not None:
            return "reward_error"
        if not math.isfinite(sample.reward):
            return "nonfinite_reward"
        if not all(math.isfinite(x) for x in sample.logprob_array()):
            return "nonfinite_logprob"
    return None


def _sample_problem(prompt_len: int, tokens: list[int], max_tokens: int, vocab_size: int | None, trained: bool = True,
                    image_token: int | None = None) -> str | None:
    """Why a sample cannot be trained, or None; ``trained``: it has a token to train (a
    multi-turn episode whose environment failed before the model's first turn has none)."""
    if not tokens or not trained:
        return "empty_response"
    if _out_of_vocab(tokens, vocab_size) is not None:
        return "bad_token"
    if prompt_len + len(tokens) > max_tokens:
        return "too_long"
    if image_token is not None and image_token in tokens:
        return "image_token"
    return None


class _Row(NamedTuple):
    """One kept sample, as :func:`_pad` lays it out."""

    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    mask: list[int]
    """1: a trained token; 0: a multi-turn episode's template or environment token."""
    reward: float
    group: int


def _pad(rows: list[_Row]) -> Batch:
    n = len(rows)
    width = max(len(row.prompt) + len(row.tokens) for row in rows)
    resp = max(len(row.tokens) for row in rows)
    input_ids = torch.zeros(n, width, dtype=torch.long)
    attention_mask = torch.zeros(n, width, dtype=torch.long)
    positions = torch.zeros(n, resp, dtype=torch.long)
    response_mask = torch.zeros(n, resp)
    behav_logp = torch.zeros(n, resp)
    versions = torch.full((n, resp), -1, dtype=torch.long)
    for i, row in enumerate(rows):
        p, r = len(row.prompt), len(row.tokens)
        input_ids[i, : p + r] = torch.tensor(row.prompt + row.tokens, dtype=torch.long)
        attention_mask[i, : p + r] = 1
        positions[i, :r] = torch.arange(p, p + r)
        response_mask[i, :r] = torch.tensor(row.mask, dtype=response_mask.dtype)
        behav_logp[i, :r] = torch.tensor(row.logprobs)
        versions[i, :r] = torch.tensor(row.versions)
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_positions=positions,
        response_mask=response_mask,
        behav_logp=behav_logp,
        token_versions=versions,
        rewards=torch.tensor([row.reward for row in rows], dtype=torch.float32),
        group_index=torch.tensor([row.group for row in rows], dtype=torch.long),
        # the oldest policy among the model's own tokens (template and environment tokens
        # carry the version of the turn before them, never an older one)
        behaviour_version=torch.tensor([min(v for v, m in zip(row.versions, row.mask) if m) for row in rows], dtype=torch.long),
        lengths=attention_mask.sum(-1),
    )


def split_groups(num_groups: int, parts: int, order: Sequence[int] | None = None) -> list[list[int]]:
    """Split group positions ``order`` (default ``0..num_groups-1``) into ``parts`` contiguous
    chunks whose sizes differ by at most one (PPO mini-batches)."""
    order = list(range(num_groups)) if order is None else list(order)
    base, extra = divmod(len(order), parts)
    chunks, start = [], 0
    for i in range(parts):
        end = start + base + (i < extra)
        chunks.append(order[start:end])
        start = end
    return chunks


def plan_micro_batches(lengths: Sequence[int], rows: Sequence[int], world_size: int, max_tokens: int) -> list[list[list[int]]]:
    """Assign samples ``rows`` (with ``lengths[row]`` tokens) to ranks and pack them into micro-batches.

    Returns ``plan[rank][micro_batch] = [row, ...]``. Ranks get balanced token counts (longest
    first to the least-loaded rank); each rank packs its samples first-fit, longest first,
    into micro-batches of at most ``max_tokens`` tokens in all (they become one packed row,
    :func:`pack`). Every rank gets the same number of micro-batches: a rank that needs fewer
    gets empty ones at the end (it still runs a zero-weight pass so collectives match).
    Deterministic: equal inputs give equal plans on every rank.
    """
    by_length = sorted(rows, key=lambda r: (-lengths[r], r))
    per_rank: list[list[int]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    for row in by_length:
        rank = min(range(world_size), key=lambda k: (load[k], k))
        per_rank[rank].append(row)
        load[rank] += lengths[row]
    packed = [_pack(rank_rows, lengths, max_tokens) for rank_rows in per_rank]
    count = max(1, max(len(p) for p in packed))
    return [p + [[] for _ in range(count - len(p))] for p in packed]


def _pack(rows: list[int], lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """First-fit over rows sorted longest first: each row goes to the first bin with room."""
    bins: list[list[int]] = []
    used: list[int] = []
    for row in rows:
        k = next((i for i, u in enumerate(used) if u + lengths[row] <= max_tokens), len(bins))
        if k == len(bins):
            bins.append([])
            used.append(0)
        bins[k].append(row)
        used[k] += lengths[row]
    return bins


@dataclass(frozen=True)
class PackedRow:
    """The samples of a micro-batch concatenated into one row, without padding (CPU tensors).

    ``input_ids`` and ``position_ids`` ``[1, S]`` (positions restart at 0 for each sample);
    ``bounds`` the sample boundaries ``[0, ..., S]``. For the ``M`` response tokens:
    ``logit_rows`` ``[M]`` the row position whose logits predict each (its position minus
    one), ``targets`` ``[M]`` the token ids and ``dest`` ``[M]`` its index in the flattened
    ``[n, T]`` response grid of the micro-batch (:func:`unpack`).
    """

    input_ids: Tensor
    position_ids: Tensor
    bounds: tuple[int, ...]
    logit_rows: Tensor
    targets: Tensor
    dest: Tensor
    grid: tuple[int, int]
    """``(n, T)``: samples and response width of the micro-batch."""


def pack(micro: Batch) -> PackedRow:
    """One packed row of ``micro``'s samples (in order). A sample's response tokens are those
    with a position > 0 (``response_mask`` may be zero, as in a filler pass)."""
    n, width = micro.response_positions.shape
    ids, pos, logit_rows, targets, dest, bounds = [], [], [], [], [], [0]
    for i in range(n):
        length = int(micro.lengths[i])
        responses = micro.response_positions[i]
        count = int((responses > 0).sum())
        offset = bounds[-1]
        ids.append(micro.input_ids[i, :length])
        pos.append(torch.arange(length))
        logit_rows.append(responses[:count] - 1 + offset)
        targets.append(micro.input_ids[i].index_select(0, responses[:count]))
        dest.append(torch.arange(count) + i * width)
        bounds.append(offset + length)
    return PackedRow(
        input_ids=torch.cat(ids).unsqueeze(0), position_ids=torch.cat(pos).unsqueeze(0), bounds=tuple(bounds),
        logit_rows=torch.cat(logit_rows), targets=torch.cat(targets), dest=torch.cat(dest), grid=(n, width),
    )


def unpack(values: Tensor, row: PackedRow) -> Tensor:
    """Per-response-token ``values`` ``[M]`` of :func:`pack`'s order as the ``[n, T]`` grid
    (0 on padding); differentiable."""
    n, width = row.grid
    grid = values.new_zeros(n * width)
    return grid.index_copy(0, row.dest.to(values.device), values).view(n, width)
