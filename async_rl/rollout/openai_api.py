"""vLLM's OpenAI-compatible HTTP API served from an engine that already runs.

The FastAPI app of ``vllm serve`` (``vllm.entrypoints.launchers``) is built around the
inference server's own ``AsyncLLM`` and served by uvicorn as a task on the caller's event
loop (the Ray actor's), so HTTP requests share the engine, its weights and its batch with
the token-in/token-out rollouts: no second engine is started.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ANY_ADDRESS = ("", "0.0.0.0", "::")
"""Bind addresses that mean every interface (the reported URL then names this node's IP)."""


@dataclass
class OpenAIApiSettings:
    """Where and how a server exposes the HTTP API (mirrors ``rollout.openai_*`` config keys)."""

    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = 0
    """TCP port of server 0 (server ``i`` binds ``port + i``); 0 binds a free port per server."""
    model_name: str | None = None
    """Model name clients send in requests; None is the basename of the model path."""
    start_timeout_s: float = 60.0
    """Longest the HTTP server may take to start listening, seconds."""
    stop_timeout_s: float = 10.0
    """Longest open connections may take to finish at shutdown before they are cut, seconds."""

    def for_server(self, index: int) -> OpenAIApiSettings:
        """The settings of server ``index`` (its own port when the port is fixed)."""
        return dataclasses.replace(self, port=self.port + index if self.port else 0)


class OpenAIApi:
    """A running HTTP API; build it with :meth:`start`, stop it with :meth:`stop`."""

    def __init__(self, server: Any, task: asyncio.Task, sock: socket.socket, url: str, stop_timeout_s: float):
        self._server = server
        self._task = task
        self._sock = sock
        self.url = url
        """Base URL of the API, ``http://HOST:PORT/v1``."""
        self._stop_timeout_s = stop_timeout_s

    @classmethod
    async def start(cls, engine: Any, model: str, settings: OpenAIApiSettings) -> OpenAIApi:
        """Serve the OpenAI API of ``engine`` (an ``AsyncLLM`` serving ``model``, a path or hub id)."""
        import uvicorn
        from vllm import envs
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.app import build_app
        from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.entrypoints.launchers.launcher import NoSignalServer, create_server_socket
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        from vllm.utils.network_utils import get_ip

        name = settings.model_name or Path(model).name
        args = make_arg_parser(FlexibleArgumentParser()).parse_args([
            "--model", model, "--served-model-name", name, "--host", settings.host, "--port", str(settings.port),
            "--disable-log-stats", "--disable-uvicorn-access-log",
        ])
        validate_parsed_serve_args(args)
        sock = create_server_socket((settings.host, settings.port), reuse_port=False)
        try:
            tasks = await engine.get_supported_tasks()
            app = build_app(args, tasks, engine.model_config)
            await init_app_state(engine, app.state, args, tasks)
            config = uvicorn.Config(app, host=settings.host, port=sock.getsockname()[1], log_level="warning", access_log=False,
                                    timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE, timeout_graceful_shutdown=settings.stop_timeout_s)
            server = NoSignalServer(config)  # signals stay with the actor's process
            app.state.server = server  # vLLM's error handlers stop it if the engine has died
            task = asyncio.create_task(server.serve(sockets=[sock]))
            deadline = asyncio.get_running_loop().time() + settings.start_timeout_s
            while not server.started:
                if task.done():
                    raise RuntimeError(f"OpenAI API server exited at start: {task.exception()!r}")
                if asyncio.get_running_loop().time() > deadline:
                    task.cancel()
                    raise TimeoutError(f"OpenAI API server did not start within {settings.start_timeout_s} s")
                await asyncio.sleep(0.05)
        except BaseException:
            sock.close()
            raise
        host = get_ip() if settings.host in ANY_ADDRESS else settings.host
        host = f"[{host}]" if ":" in host else host
        url = f"http://{host}:{sock.getsockname()[1]}/v1"
        log.info("OpenAI-compatible API for model %r at %s", name, url)
        return cls(server, task, sock, url, settings.stop_timeout_s)

    @property
    def stopped(self) -> bool:
        """True once the HTTP server no longer runs."""
        return self._task.done()

    async def stop(self) -> None:
        """Stop accepting connections, let open ones finish (up to ``stop_timeout_s``), close the socket."""
        self._server.should_exit = True
        done, _ = await asyncio.wait({self._task}, timeout=self._stop_timeout_s + 1.0)  # uvicorn cuts connections at stop_timeout_s
        if not done:
            self._task.cancel()
        self._sock.close()
