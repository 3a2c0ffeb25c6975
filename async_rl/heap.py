"""Returning freed heap memory to the kernel in long-lived processes that reallocate in bulk.

glibc serves allocations below its mmap threshold (which rises up to 32 MB as large blocks
are freed) from heaps that only shrink at their top: a process that frees and reallocates
many tensors between other allocations (a vLLM worker reloading its weights, a learner
rank's step) keeps the holes resident, and its RSS creeps up over days. ``malloc_trim(0)``
hands every free page of every arena back (``MADV_DONTNEED``); it costs a few milliseconds.
"""

from __future__ import annotations

import ctypes

_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)
"""glibc's ``malloc_trim`` (None elsewhere, e.g. musl)."""


def release_freed_heap() -> None:
    """Hand the free pages of this process's heaps back to the kernel (a no-op without glibc)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
