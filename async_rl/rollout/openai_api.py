"""vLLM's OpenAI-compatible HTTP API served from an engine that already runs.

The FastAPI app of ``vllm serve`` (``vllm.entrypoints.launchers``) is built around the
inference server's own ``AsyncLLM`` and served by uvicorn as a task on the caller's event
loop (the Ray actor's), so HTTP requests share the engine, its weights and its batch with
the token-in/token-out rollouts: no second engine is started.

Secure by default (docs/security.md): with a key, every route but ``/health`` answers 401
unless the request sends ``Authorization: Bearer <key>`` (:class:`BearerKeyMiddleware`; vLLM's
own ``--api-key`` middleware guards only ``/v1``, ``/v2``, ``/inference`` and ``/cohere``, not
``/invocations``, ``/tokenize`` or ``/metrics``); the elastic-EP admin routes are removed; and
the API refuses to start where ``VLLM_SERVER_DEV_MODE`` would add vLLM's unauthenticated
development routes (``/collective_rpc``, ``/sleep``, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ANY_ADDRESS = ("", "0.0.0.0", "::")
"""Bind addresses that mean every interface (the reported URL then names this node's IP)."""
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
"""vLLM's switch for its development routes (``/collective_rpc``, ``/sleep``, ``/reset_prefix_cache``,
``/server_info``, RL weight updates): unauthenticated by its own key, so a server refuses it."""
OPEN_PATHS = frozenset({"/health"})
"""Routes that answer without the key (liveness only, as with vLLM's own ``--api-key``)."""
ADMIN_PATHS = frozenset({"/scale_elastic_ep", "/is_scaling_elastic_ep", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
"""Routes of vLLM's app that the servers do not serve: the pool owns the engine's shape, and a
LoRA policy's one adapter slot is the learner's (vLLM adds the adapter routes only with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``; removed whatever the environment says)."""


class DevModeError(RuntimeError):
    """``VLLM_SERVER_DEV_MODE`` is on where an OpenAI-compatible API would start."""


def dev_mode_problem(environ: Mapping[str, str]) -> str | None:
    """Why the API must not start in ``environ`` (``VLLM_SERVER_DEV_MODE`` set to anything but
    empty or ``0``: vLLM's own reading, ``bool(int(...))``, fails on other words), or None."""
    value = environ.get(DEV_MODE_ENV, "").strip()
    if value in ("", "0"):
        return None
    return (f"{DEV_MODE_ENV}={value!r} is set: vLLM would add unauthenticated development routes (/collective_rpc, "
            "/sleep, weight updates) to the OpenAI-compatible API; unset it (or set rollout.openai_api=false)")


def refuse_dev_mode() -> None:
    """Raise :class:`DevModeError` when this process's environment turns vLLM's dev mode on."""
    if problem := dev_mode_problem(os.environ):
        raise DevModeError(problem)


Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
UNAUTHORIZED = json.dumps({"error": {"message": "Incorrect or missing API key: send the header 'Authorization: Bearer <key>'",
                                     "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}).encode()
"""Body of a 401 answer, in the OpenAI API's error shape (its clients raise ``AuthenticationError``)."""


class BearerKeyMiddleware:
    """ASGI middleware: an HTTP request or WebSocket to any path but :data:`OPEN_PATHS` passes
    only with ``Authorization: Bearer <key>``; others get 401 (a WebSocket: closed, code 1008).
    The key is compared as SHA-256 digests with :func:`hmac.compare_digest` (constant time,
    whatever the length sent)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], key: str):
        self.app = app
        self._digest = hashlib.sha256(key.encode()).digest()

    def authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether ``headers`` (an ASGI scope's) carry the key as a bearer token."""
        sent = next((value for name, value in headers if name.lower() == b"authorization"), b"")
        scheme, _, token = sent.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(hashlib.sha256(token.strip()).digest(), self._digest)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS or self.authorized(scope["headers"]):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(UNAUTHORIZED)).encode()),
                                    (b"www-authenticate", b"Bearer")]})
            await send({"type": "http.response.body", "body": UNAUTHORIZED})


@dataclass
class OpenAIApiSettings:
    """Where and how a server exposes the HTTP API (mirrors ``rollout.openai_*`` config keys)."""

    host: str = "127.0.0.1"
    """Address to bind."""
    port: int = 0
    """TCP port of server 0 (server ``i`` binds ``port + i``); 0 binds a free port per server."""
    model_name: str | None = None
    """Model name clients send in requests; None is the basename of the model path."""
    api_key: str | None = field(default=None, repr=False)
    """Key every request but ``/health`` must send (``Authorization: Bearer <key>``); None: no key."""
    start_timeout_s: float = 60.0
    """Longest the HTTP server may take to start listening, seconds."""
    stop_timeout_s: float = 10.0
    """Longest open connections may take to finish at shutdown before they are cut, seconds."""

    def for_server(self, index: int) -> OpenAIApiSettings:
        """The settings of server ``index`` (its own port when the port is fixed)."""
        return dataclasses.replace(self, port=self.port + index if self.port else 0)


@contextlib.contextmanager
def _root_logging_kept() -> Iterator[None]:
    """Give the root logger its level and its handlers theirs back on the way out. vLLM's API
    imports ``model_hosting_container_standards``, which sets the root logger (and its
    handlers) to ERROR at import (``LOG_LEVEL``, default ERROR): every warning of the server's
    process, ours included (a failed weight update, counters not flushed), would go unseen."""
    root = logging.getLogger()
    level, handlers = root.level, [(h, h.level) for h in root.handlers]
    try:
        yield
    finally:
        root.setLevel(level)
        for handler, handler_level in handlers:
            handler.setLevel(handler_level)


class OpenAIApi:
    """A running HTTP API; build it with :meth:`start`, stop it with :meth:`stop`."""

    def __init__(self, server: Any, task: asyncio.Task, sock: socket.socket, url: str, stop_timeout_s: float, model_name: str = "",
                 models: Any = None):
        self._server = server
        self._task = task
        self._sock = sock
        self.url = url
        """Base URL of the API, ``http://HOST:PORT/v1``."""
        self._stop_timeout_s = stop_timeout_s
        self.model_name = model_name
        """The model name requests send."""
        self._models = models
        """vLLM's ``OpenAIServingModels`` of the app (its adapters by name)."""

    def serve_adapter(self, lora_request: Any) -> None:
        """From now on, requests naming :attr:`model_name` are answered with the LoRA adapter of
        ``lora_request`` (a LoRA policy's, of the version the server holds; vLLM looks a
        request's model name up among its adapters before its base models)."""
        self._models.lora_requests[self.model_name] = lora_request

    @classmethod
    async def start(cls, engine: Any, model: str, settings: OpenAIApiSettings) -> OpenAIApi:
        """Serve the OpenAI API of ``engine`` (an ``AsyncLLM`` serving ``model``, a path or hub id).

        Raises :class:`DevModeError` when ``VLLM_SERVER_DEV_MODE`` is on in this process.
        """
        refuse_dev_mode()
        with _root_logging_kept():
            return await cls._start(engine, model, settings)

    @classmethod
    async def _start(cls, engine: Any, model: str, settings: OpenAIApiSettings) -> OpenAIApi:
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
        task: asyncio.Task | None = None
        try:
            async with asyncio.timeout(settings.start_timeout_s):  # the engine's answers (tasks, tokenizer, config) too
                tasks = await engine.get_supported_tasks()
                app = build_app(args, tasks, engine.model_config)
                app.router.routes[:] = [route for route in app.router.routes if getattr(route, "path", None) not in ADMIN_PATHS]
                # Outermost, around vLLM's own middleware (whose stack build_app has already built).
                asgi = app if settings.api_key is None else BearerKeyMiddleware(app, settings.api_key)
                await init_app_state(engine, app.state, args, tasks)
                config = uvicorn.Config(asgi, host=settings.host, port=sock.getsockname()[1], log_level="warning", access_log=False,
                                        timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE, timeout_graceful_shutdown=settings.stop_timeout_s)
                server = NoSignalServer(config)  # signals stay with the actor's process
                app.state.server = server  # vLLM's error handlers stop it if the engine has died
                task = asyncio.create_task(server.serve(sockets=[sock]))
                while not server.started:
                    if task.done():
                        raise RuntimeError(f"OpenAI API server exited at start: {task.exception()!r}")
                    await asyncio.sleep(0.05)
        except TimeoutError:
            if task is not None:
                task.cancel()
            sock.close()
            raise TimeoutError(f"OpenAI API server did not start within {settings.start_timeout_s} s") from None
        except BaseException:
            sock.close()
            raise
        host = get_ip() if settings.host in ANY_ADDRESS else settings.host
        host = f"[{host}]" if ":" in host else host
        url = f"http://{host}:{sock.getsockname()[1]}/v1"
        log.info("OpenAI-compatible API for model %r at %s (%s)", name, url, "API key required" if settings.api_key else "no API key")
        return cls(server, task, sock, url, settings.stop_timeout_s, name, app.state.openai_serving_models)

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
