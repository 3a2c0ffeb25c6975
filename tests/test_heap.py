"""async_rl.heap: the trim hands freed heap pages back (glibc, in this process)."""

import os

from async_rl.heap import release_freed_heap


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_release_freed_heap_hands_back_the_holes_a_bulk_free_left():
    # 128 MiB of heap blocks (below the mmap threshold), each followed by a live 1 KiB one (too
    # big for Python's own allocator): freeing the blocks leaves holes the heap cannot shrink by itself.
    pairs = [(bytearray(64 << 10), bytearray(1 << 10)) for _ in range(2048)]
    keepers = [keeper for _, keeper in pairs]
    del pairs
    before = _rss_bytes()
    release_freed_heap()
    assert before - _rss_bytes() > 64 << 20, (before, _rss_bytes())
    del keepers
