"""The one-GPU hand-off's protocol, on CPU: the sender's CUDA IPC route (which servers take
it, buffer reuse, release after every reader's Ack, a silent reader, the fall back to host
shared memory) run with the host shared-memory buffers this machine has in place of the
device buffer. The CUDA calls themselves (export, open) run on the GPU machine:
``scripts/gpu_acceptance.sh handoff``."""

from __future__ import annotations

import pytest
import torch

from async_rl.sync.buckets import plan_buckets, tensor_specs
from async_rl.sync.control import Announce, Hello, Start, encode
from async_rl.sync.cuda_ipc import CudaHandle, CudaIpcWriter, CudaSource
from async_rl.sync.ipc import IpcUnavailable, ShmWriter, host_identity
from async_rl.sync.module_receiver import ModuleReceiver
from async_rl.sync.sender import WeightSender
from module_servers import ModuleServer
from test_control import SECRET, ShmServer

GPU = "GPU-00000000-test"
"""The GPU the sender and its CUDA IPC readers claim to share."""


class _DeviceBuffer(ShmWriter):
    """The device route's writer on CPU: a host segment with the CUDA writer's lifecycle."""

    gpu = GPU


class _ForeignGpuBuffer(_DeviceBuffer):
    """Names a real CUDA IPC handle the reader cannot open (no GPU here), as a server whose
    process does not see the sender's GPU would find it."""

    def prepare(self, buckets):
        real = super().prepare(buckets)
        return CudaSource(GPU, CudaHandle(0, bytes(64), real.nbytes, 0, bytes(64), 0, bytes(64), False), real.offsets, real.nbytes)


def _sender(device_writer) -> WeightSender:
    sender = WeightSender(secret=SECRET, bucket_mb=1, backend="ipc", timeout_s=3.0, control_timeout_s=1.0)
    sender._cuda = device_writer  # what a sender on a GPU makes for itself (torch.cuda.is_available())
    return sender


def _model(seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(64, 64)


def _send(sender: WeightSender, model: torch.nn.Module, version: int):
    named = list(model.state_dict().items())
    return sender.send(iter(named), version, specs=tensor_specs(named))


def _served(served: torch.nn.Module, trained: torch.nn.Module) -> bool:
    return all(torch.equal(a, b) for a, b in zip(served.state_dict().values(), trained.state_dict().values(), strict=True))


def test_a_server_on_the_senders_gpu_reads_one_reused_buffer_until_a_reader_stays_silent():
    sender = _sender(_DeviceBuffer())
    served = _model(0)
    server = ModuleServer(served, sender.address, SECRET, gpu=GPU)
    elsewhere = ModuleServer(_model(0), sender.address, SECRET, "other-gpu", gpu="GPU-another")
    silent = None
    try:
        sender.wait_for_servers(2, 10.0)
        names = []
        for version in (1, 2):
            result = _send(sender, trained := _model(version), version)
            assert result.ok and _served(served, trained), result.failed
            assert sender._pending is None  # complete: every reader acknowledged, the buffer may be rewritten
            names.append(sender._cuda._shm.name)
        assert names[0] == names[1]  # exported once, reused
        assert server.receiver._wsync_shm._shm.name == names[0]  # and opened once by its reader
        assert elsewhere.receiver._wsync_shm._shm.name != names[0]  # another GPU: host shared memory

        # A server on the sender's GPU that takes part (Ready) and never acknowledges: hung, or
        # still reading the buffer.
        silent = ShmServer(sender, "unused", None, Hello("silent", 1, 0, host_identity(), GPU), ack=False)
        result = _send(sender, trained := _model(3), 3)
        assert result.failed == {"silent": "no Ack within the timeout"} and _served(served, trained)
        assert silent.starts[-1].handoff.name == names[0]
        # It may still be reading the buffer: the next update writes a new one (the old one
        # is freed when its last reader lets go), and every other reader follows.
        result = _send(sender, trained := _model(4), 4)
        assert _served(served, trained) and result.servers["s0"].ok
        assert silent.starts[-1].handoff.name == server.receiver._wsync_shm._shm.name != names[0]
    finally:
        for s in (server, elsewhere, silent):
            if s is not None:
                s.close()
        sender.close()


def test_a_reader_that_cannot_open_the_gpu_buffer_gets_host_shared_memory_from_then_on():
    """The first update fails on that server (it serves the old weights), naming why; from
    the next one on it reads host shared memory. Nothing is retried on CUDA for it."""
    sender = _sender(_ForeignGpuBuffer())
    served = _model(0)
    server = ModuleServer(served, sender.address, SECRET, gpu=GPU)
    try:
        sender.wait_for_servers(1, 10.0)
        result = _send(sender, _model(1), 1)
        assert "this process sees no GPU" in result.failed["s0"] and not result.servers["s0"].fatal
        assert _served(served, _model(0)) and sender._no_cuda == {"s0"}
        for version in (2, 3):
            result = _send(sender, trained := _model(version), version)
            assert result.ok and _served(served, trained), result.failed
        assert sender._no_cuda == {"s0"} and server.receiver._wsync_cuda is not None
        assert server.receiver._wsync_shm._shm.name == sender._shm._shm.name
    finally:
        server.close()
        sender.close()


def test_a_gpu_buffer_that_cannot_be_made_sends_that_update_through_host_shared_memory(caplog):
    """No room for the buffer (here: a CPU, where CUDA IPC cannot export at all): that update
    goes through host shared memory, the next one tries the GPU again."""
    writer = CudaIpcWriter(torch.device("cpu"))
    writer.gpu = GPU
    sender = _sender(writer)
    served = _model(0)
    server = ModuleServer(served, sender.address, SECRET, gpu=GPU)
    try:
        sender.wait_for_servers(1, 10.0)
        for version in (1, 2):
            result = _send(sender, trained := _model(version), version)
            assert result.ok and _served(served, trained), result.failed
        assert caplog.text.count("CUDA IPC unusable (CUDA IPC needs a GPU") == 2 and sender._no_cuda == set()
    finally:
        server.close()
        sender.close()


def test_a_handle_is_refused_where_there_is_no_such_gpu():
    """On a machine without the sender's GPU the reader names it; on a CPU the writer refuses."""
    worker = ModuleReceiver(_model(0))
    specs = tensor_specs(_model(0).state_dict().items())
    buckets = plan_buckets(specs, 2**20)
    ann = Announce(1, 1, tuple(specs), tuple(buckets))
    source = CudaSource(GPU, CudaHandle(0, bytes(64), 1 << 20, 0, bytes(64), 0, bytes(64), False), (0,) * len(buckets), 1)
    worker.wsync_begin(encode(ann), encode(Start(1, None, 0, 10.0, handoff=source)))
    state, error, _, kind = worker.wsync_status(1)
    assert state == "failed" and kind == "ipc_unavailable" and GPU in error
    with pytest.raises(IpcUnavailable, match="needs a GPU"):
        CudaIpcWriter(torch.device("cpu")).prepare(buckets)
