"""Pure batching: padded tensors from groups, micro-batch plans by token budget across ranks."""

from __future__ import annotations

import random

import pytest
import torch
from learner_helpers import make_groups, prepare_groups

from async_rl.learner.batching import pack, plan_micro_batches, split_groups, unpack
from async_rl.records import RolloutGroup, Sample


def test_prepare_pads_and_aligns_response_tensors() -> None:
    a = Sample.from_lists([7, 8, 9], [-0.1, -0.2, -0.3], [3, 4, 4], 1.0)
    b = Sample.from_lists([5], [-0.5], 2, 0.0)
    group = RolloutGroup.from_lists("r", "g", 0, [1, 2], [a, b], "s", 0.0)
    other = RolloutGroup.from_lists("r", "h", 1, [3], [Sample.from_lists([6, 6], [-1.0, -2.0], 4, 0.5)], "s", 0.0)
    batch = prepare_groups([group, other], max_tokens=16).batch
    assert batch.input_ids.tolist() == [[1, 2, 7, 8, 9], [1, 2, 5, 0, 0], [3, 6, 6, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0]]
    assert batch.response_positions.tolist() == [[2, 3, 4], [2, 0, 0], [1, 2, 0]]
    assert batch.response_mask.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert torch.allclose(batch.behav_logp[0], torch.tensor([-0.1, -0.2, -0.3]))
    assert batch.token_versions.tolist() == [[3, 4, 4], [2, -1, -1], [4, 4, -1]]
    assert batch.group_index.tolist() == [0, 0, 1]
    assert batch.rewards.tolist() == [1.0, 0.0, 0.5]
    assert batch.lengths.tolist() == [5, 3, 3]
    picked = batch.select([2, 1])
    assert picked.input_ids.tolist() == [[3, 6, 6], [1, 2, 5]] and picked.group_index.tolist() == [1, 0]


def test_a_multi_turn_response_trains_only_the_models_tokens() -> None:
    # model turn (versions 3, 3), env/template tokens (mask 0), model turn (version 5)
    episode = Sample.from_lists([7, 8, 40, 41, 42, 9], [-0.1, -0.2, 0.0, 0.0, 0.0, -0.3], [3, 3, 3, 3, 3, 5], 1.0,
                                mask=[1, 1, 0, 0, 0, 1])
    no_model_tokens = Sample.from_lists([40, 41], [0.0, 0.0], 3, 0.0, mask=[0, 0])
    group = RolloutGroup.from_lists("r", "g", 0, [1, 2], [episode, no_model_tokens], "s", 0.0)
    prepared = prepare_groups([group], max_tokens=16)
    assert prepared.batch.response_mask.tolist() == [[1, 1, 0, 0, 0, 1]]
    assert group.behaviour_version == 3  # the model's tokens' oldest version: template tokens are never older
    assert prepared.dropped == {"empty_response": 1}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_plan_covers_every_row_once_within_budget_and_balanced(world_size: int) -> None:
    rng = random.Random(world_size)
    lengths = [rng.randint(3, 40) for _ in range(37)]
    rows = list(range(37))
    plan = plan_micro_batches(lengths, rows, world_size, max_tokens=64)
    assert len({len(micro) for micro in plan}) == 1  # same number of micro-batches per rank
    flat = [r for rank in plan for micro in rank for r in micro]
    assert sorted(flat) == rows
    for rank in plan:
        for micro in rank:
            assert not micro or sum(lengths[r] for r in micro) <= 64  # one packed row, no padding
    loads = [sum(lengths[r] for micro in rank for r in micro) for rank in plan]
    assert max(loads) - min(loads) <= max(lengths)
    assert plan == plan_micro_batches(lengths, rows, world_size, max_tokens=64)
    micro_batches = sum(len(m) > 0 for rank in plan for m in rank)
    assert micro_batches <= -(-sum(lengths) // 64) + world_size  # first-fit packs rows nearly full


def test_plan_gives_empty_micro_batches_to_ranks_without_rows() -> None:
    plan = plan_micro_batches([10, 10, 10], [0], world_size=2, max_tokens=64)
    assert plan == [[[0]], [[]]]


def test_split_groups_in_near_equal_chunks() -> None:
    assert split_groups(5, 2) == [[0, 1, 2], [3, 4]]
    assert split_groups(4, 2, order=[3, 1, 0, 2]) == [[3, 1], [0, 2]]


def test_prepare_counts_and_returns_none_when_nothing_is_trainable() -> None:
    prepared = prepare_groups(make_groups(2, seed=0), max_tokens=3)  # every prompt alone has >= 3 tokens
    assert prepared.batch is None and prepared.kept == ()
    assert prepared.dropped == {"too_long": 8}


def test_pack_concatenates_samples_with_restarting_positions() -> None:
    batch = prepare_groups(make_groups(1, seed=4, samples=3), 64, 512).batch
    row = pack(batch)
    lengths = batch.lengths.tolist()
    assert row.bounds == (0, lengths[0], lengths[0] + lengths[1], sum(lengths))
    assert row.position_ids[0].tolist() == [p for n in lengths for p in range(n)]
    for i, (a, b) in enumerate(zip(row.bounds, row.bounds[1:])):
        assert row.input_ids[0, a:b].tolist() == batch.input_ids[i, : lengths[i]].tolist()
    # each response token is predicted by the logits one position earlier in the row
    assert row.targets.tolist() == row.input_ids[0, row.logit_rows + 1].tolist()
    grid = unpack(row.targets.float(), row)
    mask = batch.response_mask.bool()
    assert grid[mask].tolist() == batch.input_ids.gather(1, batch.response_positions)[mask].float().tolist()
    assert (grid[~mask] == 0).all()
