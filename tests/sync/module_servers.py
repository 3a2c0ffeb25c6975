"""A real :class:`~async_rl.sync.server.WeightUpdateServer` over a :class:`ModuleReceiver`,
serving in a thread of its own: the whole receiving side of weight sync without vLLM."""

from __future__ import annotations

import asyncio
import threading

import torch

from async_rl.sync.auth import RunSecret, SyncEndpoint
from async_rl.sync.module_receiver import LocalEngine, ModuleReceiver
from async_rl.sync.server import UpdateOutcome, WeightUpdateServer


class ModuleServer:
    """Serves updates into ``module`` until :meth:`close`; ``outcomes`` lists what it saw.
    ``gpu`` overrides the GPU the receiver reports (e.g. the sender's, to be its CUDA IPC reader)."""

    def __init__(self, module: torch.nn.Module, address: str, secret: RunSecret, server_id: str = "s0",
                 gpu: str | None = None, **kwargs) -> None:
        self.receiver = ModuleReceiver(module)
        if gpu is not None:
            self.receiver.wsync_gpu = lambda: gpu  # type: ignore[method-assign]
        self.outcomes: list[UpdateOutcome] = []
        self._loop = asyncio.new_event_loop()
        self.server = WeightUpdateServer(LocalEngine(self.receiver), SyncEndpoint(address, secret), server_id, version=0,
                                         **kwargs)
        self._loop.run_until_complete(self.server.start())
        self._task: asyncio.Task | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._task = self._loop.create_task(self.server.serve(self.outcomes.append))
        try:
            self._loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass

    def close(self) -> None:
        """Stop serving and close the socket (without a Leave: as if the process died)."""
        if self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(10)
        self.server.close()
        self._loop.close()
