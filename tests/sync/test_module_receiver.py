"""The receiving protocol without vLLM: a real sender and WeightUpdateServer loading into a
plain module (what the GPU machine's hand-off check runs), over each route."""

from __future__ import annotations

import pytest
import torch

from async_rl.sync.auth import RunSecret
from async_rl.sync.buckets import tensor_specs
from async_rl.sync.control import AdapterSpec
from async_rl.sync.sender import WeightSender
from module_servers import ModuleServer

SECRET = RunSecret.generate()


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8))
    model.register_buffer("steps", torch.tensor([seed]))
    return model


def _send(sender: WeightSender, model: torch.nn.Module, version: int, **kwargs):
    named = list(model.state_dict().items())
    return sender.send(iter(named), version, specs=tensor_specs(named), **kwargs)


@pytest.mark.dist
@pytest.mark.parametrize("backend", ["ipc", "gloo"])
def test_each_update_is_loaded_into_the_module(backend: str):
    """Three updates reach the module's parameters and buffers; over ``ipc`` from one reused
    shared-memory segment and no group, over ``gloo`` through a group built once."""
    sender = WeightSender(secret=SECRET, bucket_mb=1, backend=backend, timeout_s=60.0)  # type: ignore[arg-type]
    served = _model(0)
    server = ModuleServer(served, sender.address, SECRET)
    try:
        sender.wait_for_servers(1, 10.0)
        segments = set()
        for version in (1, 2, 3):
            trained = _model(version)
            result = _send(sender, trained, version)
            assert result.ok, result.failed
            assert (result.group_s > 0) == (backend == "gloo" and version == 1)
            for (name, want), got in zip(trained.state_dict().items(), served.state_dict().values(), strict=True):
                assert torch.equal(want, got), name
            if backend == "ipc":
                segments.add(server.receiver._wsync_shm._shm.name)  # type: ignore[union-attr]
        assert sender.servers == {"s0": 3} and server.receiver.loads == 3
        assert len(segments) == (1 if backend == "ipc" else 0)
    finally:
        server.close()
        sender.close()


def test_an_update_the_module_cannot_take_changes_nothing():
    """A tensor the module lacks fails the load before any copy (reported fatal: a load
    that raised); an adapter is declined at Ready. The module keeps its weights."""
    sender = WeightSender(secret=SECRET, bucket_mb=1, backend="ipc", timeout_s=60.0)
    served = _model(0)
    before = {k: v.clone() for k, v in served.state_dict().items()}
    server = ModuleServer(served, sender.address, SECRET)
    try:
        sender.wait_for_servers(1, 10.0)
        other = _model(1)
        other.add_module("extra", torch.nn.Linear(2, 2))
        result = _send(sender, other, 1)
        assert "does not have" in result.failed["s0"] and result.servers["s0"].fatal
        sender.wait_for_servers(1, 10.0)
        result = _send(sender, _model(2), 2, adapter=AdapterSpec(8, 16.0, ("q_proj",)))
        assert result.failed["s0"].startswith("declined: a LoRA adapter was sent to a receiver that serves none")
        assert all(torch.equal(before[k], v) for k, v in served.state_dict().items())
    finally:
        server.close()
        sender.close()
