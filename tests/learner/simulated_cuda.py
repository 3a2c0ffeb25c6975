"""Run learner code on the CPU as if its device were CUDA, to prove where tensors are put.

Inside :func:`simulated_cuda`, every request for a CUDA tensor (``.to("cuda")``, ``.cuda()``,
``device="cuda"`` in a factory) gives a CPU tensor tagged as CUDA; the tag follows the tensor
through every torch operation that has a tagged input, and ``.cpu()`` / ``.to("cpu")`` drop it.
``collectives.tensor_device`` reports the tag, so the learner's collectives, in strict mode
with the group's device declared ``cuda``, fail on any tensor that would be on the CPU on a
real GPU (as NCCL does). The model itself stays an ordinary CPU model: its inputs are tagged
when the learner moves them to its device, so its outputs are too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from async_rl.learner import collectives

_TAG = "_simulated_cuda"
_CUDA = torch.device("cuda")


def _is_cuda(value: Any) -> bool:
    return (isinstance(value, torch.device) and value.type == "cuda") or (isinstance(value, str) and value.startswith("cuda"))


def _is_cpu(value: Any) -> bool:
    return (isinstance(value, torch.device) and value.type == "cpu") or value == "cpu"


def _tagged(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and getattr(value, _TAG, False)


def _tag(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        try:
            setattr(value, _TAG, True)
        except (AttributeError, RuntimeError):  # some C++-owned results take no attributes
            pass
    return value


class _SimulatedCuda(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = dict(kwargs or {})
        to_cuda = to_cpu = False
        if func is torch.Tensor.cuda:
            return _tag(args[0].view_as(args[0]))
        if func is torch.Tensor.cpu:
            return _untag_copy(func(*args, **kwargs), args[0])
        if _is_cuda(kwargs.get("device")):
            kwargs["device"], to_cuda = torch.device("cpu"), True
        if func is torch.Tensor.to:
            rest = list(args[1:])
            for i, a in enumerate(rest):
                if _is_cuda(a):
                    rest[i], to_cuda = torch.device("cpu"), True
                elif _is_cpu(a):
                    to_cpu = True
            if _is_cpu(kwargs.get("device")):
                to_cpu = True
            args = (args[0], *rest)
        result = func(*args, **kwargs)
        if to_cpu:
            return _untag_copy(result, args[0])
        if to_cuda or any(_tagged(a) for a in tree_flatten((args, kwargs))[0]):
            if to_cuda and args and result is args[0]:  # .to() of a tensor already there returns it: tag a view
                result = result.view_as(result)
            tree_map(_tag, result)
        return result


def _untag_copy(result: Any, source: Any) -> Any:
    """``.cpu()`` of a (simulated) CUDA tensor is a new, untagged tensor, as on a GPU."""
    if isinstance(result, torch.Tensor) and result is source:
        result = result.view_as(result)
    if isinstance(result, torch.Tensor) and getattr(result, _TAG, False):
        delattr(result, _TAG)
    return result


def _device(tensor: torch.Tensor) -> torch.device:
    return _CUDA if getattr(tensor, _TAG, False) else tensor.device


def _like_nccl(op: Any) -> Any:
    """``op`` refusing a tensor that is not (simulated) CUDA, with NCCL's message."""
    def checked(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _device(tensor).type != "cuda":
            raise RuntimeError("No backend type associated with device type cpu")
        return op(tensor, *args, **kwargs)
    return checked


@contextlib.contextmanager
def simulated_cuda() -> Iterator[torch.device]:
    """Yield the declared device ``cuda``: collectives are strict and see the tags, and a
    direct ``torch.distributed.all_reduce`` or ``broadcast`` of a CPU tensor fails as on NCCL."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(collectives, "tensor_device", _device)
        for name in ("all_reduce", "broadcast"):
            patch.setattr(torch.distributed, name, _like_nccl(getattr(torch.distributed, name)))
        with collectives.strict_devices(), _SimulatedCuda():
            yield _CUDA
