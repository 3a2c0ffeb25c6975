"""The order a worker serves dataset rows in: one seeded permutation per epoch, shared."""

import random

from async_rl.rollout.worker import epoch_order


def test_each_epoch_serves_every_row_once_in_its_own_seeded_order() -> None:
    first, second = epoch_order(7, 0, 1000), epoch_order(7, 1, 1000)
    assert sorted(first) == sorted(second) == list(range(1000))
    assert first != second
    assert epoch_order(8, 0, 1000) != first
    # the order a run's seed gave before the permutation was shared (resumed runs keep it)
    expected = list(range(1000))
    random.Random(7 * 1_000_003 + 1).shuffle(expected)
    assert list(second) == expected


def test_loops_of_one_process_share_the_permutation() -> None:
    assert epoch_order(3, 2, 50_000) is epoch_order(3, 2, 50_000)
