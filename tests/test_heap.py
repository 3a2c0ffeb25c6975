"""async_rl.heap: the trim cadence (pure logic) and the trim itself (glibc, in this process)."""

import os
import sys

import pytest

from async_rl.heap import EveryNth, release_freed_heap


def test_every_nth_says_yes_to_the_first_call_and_then_once_in_n():
    due = EveryNth(8)
    assert [i for i in range(25) if due()] == [0, 8, 16, 24]
    assert due.calls == 25


def test_every_nth_of_one_is_every_call_and_zero_is_refused():
    every = EveryNth(1)
    assert all(every() for _ in range(5))
    with pytest.raises(ValueError, match="n >= 1, got 0"):
        EveryNth(0)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim and /proc are Linux's")
def test_release_freed_heap_hands_back_the_holes_a_bulk_free_left():
    blocks = [bytearray(64 << 10) for _ in range(2048)]  # 128 MiB of heap blocks (below the mmap threshold)
    keeper = bytearray(64 << 10)  # above them all: the heap's top cannot shrink by itself
    del blocks
    before = _rss_bytes()
    release_freed_heap()
    assert before - _rss_bytes() > 64 << 20, (before, _rss_bytes())
    del keeper
