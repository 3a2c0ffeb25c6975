"""Screened rollout groups -> padded tensors -> token-budgeted micro-batches, balanced across ranks.

Pure functions, no distributed code: every learner rank receives the whole step's groups and
computes the same plan, so ranks agree on micro-batch counts without communicating (FSDP needs
every rank to run the same number of forward/backward passes).

Shapes: ``N`` samples, ``L`` prompt + response tokens (right-padded), ``T`` response tokens
(the longest response of the step; every response-aligned tensor uses the same ``T`` for the
whole step, so ``seq-mean-token-sum-norm`` divides by one constant).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from async_rl.learner.screening import ScreenedGroup, ScreenedSample
from async_rl.learner.vision import VisionInputs


@dataclass(frozen=True)
class Batch:
    """The trainable samples of one learner step (CPU tensors).

    ``input_ids`` and ``attention_mask`` are ``[N, L]`` int64 (prompt then response, right
    padding with token 0 and mask 0). ``response_positions`` ``[N, T]`` int64 is the index in
    ``input_ids`` of each response token (0 on padding); ``response_mask`` ``[N, T]`` float32
    is 1 on trained response tokens (0 on padding, and on the template's and environment's
    tokens inside a multi-turn response). ``behav_logp`` ``[N, T]`` float32 is the sampler's log-probability
    (natural log) and ``token_versions`` ``[N, T]`` int64 the policy version of each token
    (-1 on padding). ``teacher_logp`` ``[N, T]`` float32 is a distillation teacher's log-probability
    of each token (``algorithm.distill``; 0 without one); ``teacher_top_ids`` ``[N, T, K]`` int64 and
    ``teacher_top_logp`` ``[N, T, K]`` float32 its ``K`` likeliest tokens at each position and their
    log-probabilities (``algorithm.distill.top_k``; ``K`` = 0 without, 0 on padding). ``rewards`` ``[N]`` float32, ``group_index`` ``[N]`` int64 (position of the
    sample's group in the step's list), ``lengths`` ``[N]`` int64 (prompt + response tokens). ``vision`` holds the processed
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
    lengths: Tensor
    teacher_logp: Tensor
    teacher_top_ids: Tensor
    teacher_top_logp: Tensor
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
    """Samples not trained, by reason (:data:`~async_rl.learner.screening.DROP_REASONS`)."""
    kept: tuple[int, ...] = ()
    """Positions in the input list of the groups with a trainable sample, in ``Batch.group_index`` order."""


def prepare(groups: Sequence[ScreenedGroup]) -> Prepared:
    """Pad the trainable samples of screened ``groups`` into a :class:`Batch`.

    A group with a verdict counts all its samples under the verdict's reason; a sample with
    a problem counts under that problem (:func:`~async_rl.learner.screening.screen`).
    """
    dropped: Counter[str] = Counter()
    rows: list[tuple[list[int], ScreenedSample, int]] = []
    kept: list[int] = []
    for position, screened in enumerate(groups):
        if screened.verdict is not None:
            dropped[screened.verdict.reason] += len(screened.group.samples)
            continue
        for sample in screened.samples:
            if sample.problem is not None:
                dropped[sample.problem] += 1
            else:
                rows.append((screened.prompt, sample, len(kept)))
        kept.append(position)  # a group without a verdict has a trainable sample
    if not rows:
        return Prepared(None, dropped)
    return Prepared(_pad(rows), dropped, tuple(kept))


def _pad(rows: list[tuple[list[int], ScreenedSample, int]]) -> Batch:
    """``(prompt, sample, group position)`` rows as right-padded tensors."""
    n = len(rows)
    width = max(len(prompt) + len(sample.tokens) for prompt, sample, _ in rows)
    resp = max(len(sample.tokens) for _, sample, _ in rows)
    input_ids = torch.zeros(n, width, dtype=torch.long)
    attention_mask = torch.zeros(n, width, dtype=torch.long)
    positions = torch.zeros(n, resp, dtype=torch.long)
    response_mask = torch.zeros(n, resp)
    behav_logp = torch.zeros(n, resp)
    teacher_logp = torch.zeros(n, resp)
    k = next((len(sample.teacher_top[0][0]) for _, sample, _ in rows if sample.teacher_top is not None), 0)
    top_ids = torch.zeros(n, resp, k, dtype=torch.long)
    top_logp = torch.zeros(n, resp, k)
    versions = torch.full((n, resp), -1, dtype=torch.long)
    for i, (prompt, sample, _) in enumerate(rows):
        p, r = len(prompt), len(sample.tokens)
        input_ids[i, : p + r] = torch.tensor(prompt + sample.tokens, dtype=torch.long)
        attention_mask[i, : p + r] = 1
        positions[i, :r] = torch.arange(p, p + r)
        response_mask[i, :r] = torch.tensor(sample.mask, dtype=response_mask.dtype)
        behav_logp[i, :r] = torch.tensor(sample.logprobs)
        if sample.teacher is not None:
            teacher_logp[i, :r] = torch.tensor(sample.teacher)
        if sample.teacher_top is not None:
            top_ids[i, :r] = torch.tensor(sample.teacher_top[0], dtype=torch.long)
            top_logp[i, :r] = torch.tensor(sample.teacher_top[1])
        versions[i, :r] = torch.tensor(sample.versions)
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_positions=positions,
        response_mask=response_mask,
        behav_logp=behav_logp,
        token_versions=versions,
        rewards=torch.tensor([sample.reward for _, sample, _ in rows], dtype=torch.float32),
        group_index=torch.tensor([group for _, _, group in rows], dtype=torch.long),
        lengths=attention_mask.sum(-1),
        teacher_logp=teacher_logp,
        teacher_top_ids=top_ids,
        teacher_top_logp=top_logp,
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
    one), ``targets`` ``[M]`` the token ids, ``top_targets`` ``[M, K]`` the teacher's top-k ids
    at each (``Batch.teacher_top_ids``; ``K`` = 0 without) and ``dest`` ``[M]`` its index in the
    flattened ``[n, T]`` response grid of the micro-batch (:func:`unpack`).
    """

    input_ids: Tensor
    position_ids: Tensor
    bounds: tuple[int, ...]
    logit_rows: Tensor
    targets: Tensor
    top_targets: Tensor
    dest: Tensor
    grid: tuple[int, int]
    """``(n, T)``: samples and response width of the micro-batch."""


def pack(micro: Batch) -> PackedRow:
    """One packed row of ``micro``'s samples (in order). A sample's response tokens are those
    with a position > 0 (``response_mask`` may be zero, as in a filler pass)."""
    n, width = micro.response_positions.shape
    ids, pos, logit_rows, targets, top, dest, bounds = [], [], [], [], [], [], [0]
    for i in range(n):
        length = int(micro.lengths[i])
        responses = micro.response_positions[i]
        count = int((responses > 0).sum())
        offset = bounds[-1]
        ids.append(micro.input_ids[i, :length])
        pos.append(torch.arange(length))
        logit_rows.append(responses[:count] - 1 + offset)
        targets.append(micro.input_ids[i].index_select(0, responses[:count]))
        top.append(micro.teacher_top_ids[i, :count])
        dest.append(torch.arange(count) + i * width)
        bounds.append(offset + length)
    return PackedRow(
        input_ids=torch.cat(ids).unsqueeze(0), position_ids=torch.cat(pos).unsqueeze(0), bounds=tuple(bounds),
        logit_rows=torch.cat(logit_rows), targets=torch.cat(targets), top_targets=torch.cat(top), dest=torch.cat(dest), grid=(n, width),
    )


def unpack(values: Tensor, row: PackedRow) -> Tensor:
    """Per-response-token ``values`` ``[M, ...]`` of :func:`pack`'s order as the ``[n, T, ...]``
    grid (0 on padding); differentiable."""
    n, width = row.grid
    grid = values.new_zeros((n * width, *values.shape[1:]))
    return grid.index_copy(0, row.dest.to(values.device), values).view(n, width, *values.shape[1:])
