"""The environment worker process: every episode's environment instance of one server lives here.

:class:`~async_rl.envs.runner.EnvPool` (the server's side) starts ``rollout.env.num_workers``
of these with multiprocessing's ``spawn`` context. Each loads the class itself by name
(``rollout.env.name``), holds ``episode id -> instance`` and answers calls over a socket
pair with length-prefixed msgspec MessagePack messages (never pickle). A synchronous method runs on a thread of
the process's own pool and an ``async`` one on the process's own event loop, so one slow
episode does not serialize the others, and nothing the environment does can block the
server's event loop.

What the server cannot do across a process boundary, this process reports: where a call
is stuck when the server gives up on it (a thread's current frame, or the suspended
coroutine's), and which ``async`` method blocks the event loop while it does (a monitor
thread watches a heartbeat on the loop and reads the loop thread's stack).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import socket
import struct
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from types import FrameType, TracebackType
from typing import Any

import msgspec

from async_rl.envs.base import BaseEnvironment
from async_rl.plugins import is_user_file, where_in_user_code
from async_rl.envs.registry import load_environment, make_environment
from async_rl.records import Failure

ENV_THREADS = 64
"""Threads for synchronous environment calls, per environment process."""
BEAT_S = 0.05
"""Seconds between the event loop's heartbeats (and the monitor thread's checks)."""
BLOCK_LIMIT_S = 1.0
"""An ``async`` environment method that keeps the process's event loop from running for this
many seconds fails its episode: it stalls every other episode of the process meanwhile."""
INPUT_CHARS = 200
SIGNATURE_CHARS = 500


# -- messages (parent -> child) ----------------------------------------------------------

class Call(msgspec.Struct, tag="call", frozen=True):
    """Run ``method`` of episode ``episode``: ``reset`` (makes the instance, then ``reset``,
    ``get_prompt_prefix`` and, for a :class:`~async_rl.envs.tools.ToolEnvironment`,
    ``tool_schemas``) or ``step`` (with ``action``)."""

    id: int
    episode: int
    method: str
    action: str = ""
    row: dict[str, Any] = {}


class Cancel(msgspec.Struct, tag="cancel", frozen=True):
    """The server gave up on call ``id``: abandon it and say where it was."""

    id: int


class Drop(msgspec.Struct, tag="drop", frozen=True):
    """Episode ``episode`` is over: forget its instance."""

    episode: int


# -- messages (child -> parent) ----------------------------------------------------------

class Ready(msgspec.Struct, tag="ready", frozen=True):
    """The class is loaded (``error``: why it could not be)."""

    class_name: str = ""
    error: str = ""
    traceback: str = ""


class Opening(msgspec.Struct, frozen=True):
    """An episode's start: the first observation, the system prompt and the tools' schemas."""

    observation: str
    prefix: str
    tools: list[dict[str, Any]] | None = None


class StepOut(msgspec.Struct, frozen=True):
    """``step``'s return, checked: the observation as chat messages."""

    messages: list[dict[str, str]]
    reward: float
    done: bool
    info: dict[str, Any]


class Reply(msgspec.Struct, tag="reply", frozen=True):
    id: int
    opening: Opening | None = None
    step: StepOut | None = None


class Error(msgspec.Struct, tag="error", frozen=True):
    """Call ``id`` failed (``failure.kind`` is ``env_error``); ``blocked``: it blocked the event loop."""

    id: int
    failure: Failure
    blocked: bool = False


class Stuck(msgspec.Struct, tag="stuck", frozen=True):
    """Answer to :class:`Cancel`: where the call was (``label``: ``Class.method``) and
    whether it is gone (``abandoned``: an ``async`` call was cancelled, or a queued one
    never started) or still holds a thread (the process must be replaced)."""

    id: int
    label: str
    where: str
    abandoned: bool


class Blocked(msgspec.Struct, tag="blocked", frozen=True):
    """Call ``id`` (``label``) has kept the event loop from running for ``seconds`` (and counting), at ``where``."""

    id: int
    label: str
    where: str
    seconds: float


ToChild = Call | Cancel | Drop
ToParent = Ready | Reply | Error | Stuck | Blocked


def _enc_hook(obj: Any) -> Any:
    """Values msgpack has no type for (numpy scalars in ``info``): their Python value, else their text."""
    item = getattr(obj, "item", None)
    return item() if callable(item) else str(obj)


ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_LENGTH = struct.Struct("<I")


def frame(msg: msgspec.Struct) -> bytes:
    """``msg`` encoded, prefixed with its length (4 bytes, little-endian): one message on the socket."""
    data = ENCODER.encode(msg)
    return _LENGTH.pack(len(data)) + data


MAX_FRAME_BYTES = 16 << 20
"""Longest message either side accepts: an observation's 1,000,000 characters
(:data:`MAX_OBSERVATION_CHARS`) are at most 4 MB of UTF-8; a longer length prefix is a broken peer."""


class Frames:
    """Splits the bytes read from the socket into messages' bytes."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """The messages completed by ``data``; ``msgspec.DecodeError`` for a length over
        :data:`MAX_FRAME_BYTES` (before any of it is buffered)."""
        self._buf += data
        out = []
        while len(self._buf) >= _LENGTH.size:
            (n,) = _LENGTH.unpack_from(self._buf)
            if n > MAX_FRAME_BYTES:
                raise msgspec.DecodeError(f"a message of {n} bytes announced, more than {MAX_FRAME_BYTES}")
            if len(self._buf) < _LENGTH.size + n:
                break
            out.append(bytes(self._buf[_LENGTH.size:_LENGTH.size + n]))
            del self._buf[:_LENGTH.size + n]
        return out


TO_CHILD = msgspec.msgpack.Decoder(ToChild)  # type: ignore[arg-type]
TO_PARENT = msgspec.msgpack.Decoder(ToParent)  # type: ignore[arg-type]


# -- where the user's code is -----------------------------------------------------------

_THIS_FILE = os.path.realpath(__file__)


def _where(frames: list[tuple[str, int, str]]) -> str:
    """Where the user's code is among ``frames`` (outermost first), this module's own frames left out."""
    return where_in_user_code(f for f in frames if os.path.realpath(f[0]) != _THIS_FILE)


def _frames_of_traceback(tb: TracebackType | None) -> list[tuple[str, int, str]]:
    return [(f.filename, f.lineno or 0, f.name) for f in traceback.extract_tb(tb)]


def _frames_of_stack(frame: FrameType | None) -> list[tuple[str, int, str]]:
    """The frames from the outermost to ``frame``."""
    out = []
    while frame is not None:
        out.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return out[::-1]


def _user_traceback(exc: BaseException) -> str:
    """``exc``'s traceback from the first frame outside this module (the user's call on)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and not is_user_file(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _frames_of_coroutine(coro: Any) -> list[tuple[str, int, str]]:
    """The frames of a suspended coroutine and those it awaits, outermost first
    (``Task.get_stack`` gives only the outermost)."""
    out = []
    while coro is not None and (frame := getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)) is not None:
        out.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return out


def _definition(fn: Callable[..., Any]) -> str:
    """``path/file.py:LINE in name`` of a function's ``def`` (for a wrong return value: no traceback)."""
    code = getattr(fn, "__code__", None)
    return "" if code is None else f"{code.co_filename}:{code.co_firstlineno} in {code.co_name}"


class _BadReturn(Exception):
    """The environment returned something the runner cannot use."""


class _LoopBlocked(Exception):
    """An ``async`` method kept the event loop from running for at least :data:`BLOCK_LIMIT_S`."""


def blocked_message(label: str, seconds: float) -> str:
    """The fix-naming text of a blocking ``async`` method (the server's message uses it too)."""
    return (f"{label} blocked the event loop for {seconds:.1f} s: make it a plain def (it then runs on a thread) "
            "or await its I/O")


# -- checking what the environment returned ----------------------------------------------

MAX_OBSERVATION_CHARS = 1_000_000
"""Characters of one observation (all its messages) at most. A longer one ends the episode
as an ``env_error`` before it is sent, rendered or tokenised (no turn could hold it: the
episode's tokens are bounded by ``rollout.max_response_length``)."""


def _check_size(observation: str, what: str) -> str:
    if len(observation) > MAX_OBSERVATION_CHARS:
        raise _BadReturn(f"{what} returned an observation of {len(observation)} characters, more than {MAX_OBSERVATION_CHARS}")
    return observation


def _messages(observation: Any) -> list[dict[str, str]]:
    """An observation as chat messages: a string is the user's message; a list must hold
    ``{"role": str, "content": str}`` dicts; at most :data:`MAX_OBSERVATION_CHARS` in all."""
    if not isinstance(observation, list):
        return [{"role": "user", "content": _check_size(str(observation), "step")}]
    for i, m in enumerate(observation):
        if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise _BadReturn(f"step returned observation message {i} that is not {{'role': str, 'content': str}}: {m!r:.80}")
    if not observation:
        raise _BadReturn("step returned an empty list of observation messages")
    _check_size("".join(m["content"] for m in observation), "step")
    return [{"role": m["role"], "content": m["content"]} for m in observation]


def _step_out(out: Any) -> StepOut:
    """``step``'s return checked; :class:`_BadReturn` names what is wrong."""
    if not isinstance(out, tuple) or len(out) != 4:
        raise _BadReturn(f"step must return (observation, reward, done, info), got {type(out).__name__} {out!r:.80}")
    observation, reward, done, info = out
    messages = _messages(observation)
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        raise _BadReturn(f"step returned a reward that is not a number: {reward!r:.80}") from None
    if not isinstance(info, Mapping):
        raise _BadReturn(f"step returned info of type {type(info).__name__}, not a dict")
    return StepOut(messages, reward, bool(done), {str(k): v for k, v in info.items()})


def _takes_row(reset: Callable[..., Any]) -> bool:
    """Whether ``reset`` accepts the dataset row (a bound method with a parameter)."""
    return any(p.kind is not p.VAR_KEYWORD for p in inspect.signature(reset).parameters.values())


# -- the process ------------------------------------------------------------------------

class _Server:
    """The event loop side of one environment process."""

    def __init__(self, sock: socket.socket, cls: type[BaseEnvironment], kwargs: dict[str, Any]):
        self.sock = sock
        self.frames = Frames()
        self.cls = cls
        self.kwargs = kwargs
        self.envs: dict[int, BaseEnvironment] = {}
        self.threads = ThreadPoolExecutor(ENV_THREADS, thread_name_prefix="env")
        self.send_lock = threading.Lock()  # the monitor thread sends too
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.running: dict[int, tuple[str, int | None]] = {}
        """call id -> (``Class.method`` now running, the thread ident of a synchronous one)."""
        self.blocked: dict[int, float] = {}
        """call id -> when (monotonic) the loop last ran before that call blocked it."""
        self.block_where: dict[int, str] = {}
        """call id -> where its blocking ``async`` method was when the monitor looked."""
        self.beat = time.monotonic()
        self.loop_thread = threading.get_ident()
        self.closed = asyncio.Event()

    def send(self, msg: ToParent) -> None:
        data = frame(msg)
        with self.send_lock:  # the server always reads, so a blocking send only waits for it briefly
            self.sock.sendall(data)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_reader(self.sock.fileno(), self._on_readable)
        loop.call_soon(self._heartbeat)
        threading.Thread(target=self._monitor, name="env-loop-monitor", daemon=True).start()
        await self.closed.wait()

    def _heartbeat(self) -> None:
        self.beat = time.monotonic()
        asyncio.get_running_loop().call_later(BEAT_S, self._heartbeat)

    def _on_readable(self) -> None:
        try:
            data = self.sock.recv(1 << 16)
        except OSError:
            data = b""
        if not data:  # the server closed the socket: this process is done
            self.closed.set()
            return
        for raw in self.frames.feed(data):
            msg = TO_CHILD.decode(raw)
            if isinstance(msg, Call):
                self.tasks[msg.id] = asyncio.get_running_loop().create_task(self._handle(msg))
            elif isinstance(msg, Cancel):
                self._cancel(msg.id)
            else:
                self.envs.pop(msg.episode, None)

    # -- calls --------------------------------------------------------------------------

    async def _handle(self, call: Call) -> None:
        label = f"{self.cls.__name__}.{call.method}"
        try:
            if call.method == "reset":
                reply: ToParent = Reply(call.id, opening=await self._reset(call))
            else:
                env = self.envs.get(call.episode)
                if env is None:
                    raise LookupError(f"episode {call.episode} has no environment (its reset failed or it ended)")
                label = f"{self.cls.__name__}.step"
                out = await self._invoke(call.id, label, env.step, call.action)
                try:
                    reply = Reply(call.id, step=_step_out(out))
                except _BadReturn as exc:
                    reply = self._error(call, exc, _definition(env.step))
        except asyncio.CancelledError:
            return  # abandoned at the server's request: it has answered for this call already
        except _LoopBlocked as exc:
            reply = Error(call.id, Failure("env_error", f"EnvBlockedLoop: {exc.args[0]}"[:SIGNATURE_CHARS],
                                           exc.args[1], _input(call)), blocked=True)
        except BaseException as exc:  # noqa: BLE001 - the user's code (also SystemExit): a failed episode, not a dead process
            reply = self._error(call, exc, _where(_frames_of_traceback(exc.__traceback__)))
        finally:
            self.tasks.pop(call.id, None)
            self.running.pop(call.id, None)
            self.blocked.pop(call.id, None)
            self.block_where.pop(call.id, None)
        try:
            self.send(reply)
        except (msgspec.EncodeError, TypeError, ValueError) as exc:  # e.g. an info value msgpack cannot hold
            self.send(self._error(call, exc, ""))

    def _error(self, call: Call, exc: BaseException, where: str) -> Error:
        signature = f"{type(exc).__name__}: {exc}" if not isinstance(exc, _BadReturn) else f"EnvBadReturn: {exc}"
        tb = "" if isinstance(exc, _BadReturn) else _user_traceback(exc)
        return Error(call.id, Failure("env_error", signature[:SIGNATURE_CHARS], where, _input(call), tb))

    async def _reset(self, call: Call) -> Opening:
        name = self.cls.__name__
        env = await self._invoke(call.id, f"{name}.__init__", make_environment, self.cls, self.kwargs)
        args = (dict(call.row),) if _takes_row(env.reset) else ()
        observation = await self._invoke(call.id, f"{name}.reset", env.reset, *args)
        prefix = await self._invoke(call.id, f"{name}.get_prompt_prefix", env.get_prompt_prefix)
        schemas = getattr(env, "tool_schemas", None)
        tools = await self._invoke(call.id, f"{name}.tool_schemas", schemas) if callable(schemas) else None
        opening = Opening(_check_size(str(observation), "reset"), _check_size(str(prefix or ""), "get_prompt_prefix"), list(tools) if tools else None)
        self.envs[call.episode] = env
        return opening

    async def _invoke(self, call_id: int, label: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``: an ``async`` one on this loop, a plain one on a thread."""
        self.running[call_id] = (label, None)
        if inspect.iscoroutinefunction(fn):
            return await self._run_async(call_id, label, fn(*args))
        return await asyncio.get_running_loop().run_in_executor(self.threads, self._run_sync, call_id, label, fn, args)

    async def _run_async(self, call_id: int, label: str, coro: Any) -> Any:
        # The monitor finds this frame on the loop thread's stack to name a blocking method.
        result = await coro
        if (since := self.blocked.pop(call_id, None)) is not None:
            seconds = time.monotonic() - since
            raise _LoopBlocked(blocked_message(label, seconds), self.block_where.pop(call_id, ""))
        return result

    def _run_sync(self, call_id: int, label: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        self.running[call_id] = (label, threading.get_ident())
        return fn(*args)

    def _cancel(self, call_id: int) -> None:
        """Abandon call ``call_id`` and tell the server where it was."""
        task = self.tasks.get(call_id)
        label, thread = self.running.get(call_id, ("", None))
        if task is None:  # it finished as the server gave up: its reply is on the way
            self.send(Stuck(call_id, label, "", abandoned=True))
            return
        if thread is not None:
            frame = sys._current_frames().get(thread)
            where = _where(_frames_of_stack(frame))
        else:
            where = _where(_frames_of_coroutine(task.get_coro()))
        task.cancel()  # a thread cannot be stopped: its result is dropped when it returns
        self.send(Stuck(call_id, label, where, abandoned=thread is None))

    # -- the monitor thread ---------------------------------------------------------------

    def _monitor(self) -> None:
        """Every :data:`BEAT_S`: when the loop has missed its heartbeat for :data:`BLOCK_LIMIT_S`,
        find the call whose ``async`` method is running on it, and report it once per stretch."""
        reported_beat = None
        while True:
            time.sleep(BEAT_S)
            beat = self.beat
            lag = time.monotonic() - beat
            if lag < BLOCK_LIMIT_S or beat == reported_beat:
                continue
            frame = sys._current_frames().get(self.loop_thread)
            frames = []
            call_id = None
            while frame is not None:
                if frame.f_code is _Server._run_async.__code__:
                    call_id = frame.f_locals.get("call_id")
                    break
                frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
                frame = frame.f_back
            if call_id is None:
                continue  # the loop is held up by something else (e.g. the GIL): no method to name
            reported_beat = beat
            label = self.running.get(call_id, ("", None))[0]
            where = _where(frames[::-1])
            self.block_where[call_id] = where
            self.blocked[call_id] = beat
            try:
                self.send(Blocked(call_id, label, where, lag))
            except OSError:
                return


def _input(call: Call) -> str:
    return "reset" if call.method == "reset" else call.action[:INPUT_CHARS]


_PR_SET_PDEATHSIG = 1


def main(sock: socket.socket, spec: str, kwargs: dict[str, Any], parent_pid: int) -> None:
    """The process: its own process group (so a kill takes the environment's own children
    too), load the class, serve calls until the pipe closes."""
    os.setpgid(0, 0)
    if sys.platform.startswith("linux"):  # SIGKILLed when the server thread that started it dies
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the server decides
    try:
        cls = load_environment(spec)
    except BaseException as exc:  # noqa: BLE001 - reported to the server, which refuses to start
        sock.sendall(frame(Ready(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())))
        return
    sock.sendall(frame(Ready(class_name=cls.__name__)))
    asyncio.run(_Server(sock, cls, kwargs).serve())
