"""A private ``redis-server`` child process for runs without ``queue.redis_url``.

Binds 127.0.0.1 on a free port (another one if a process takes it first), requires a
generated password, and keeps an append-only file (AOF) in its data directory. With
``appendfsync="always"`` (the default) Redis fsyncs the AOF before it answers a write, so
anything a ``put`` returned for survives a crash of Redis *or* of the machine;
``"everysec"`` is faster but may lose the last second of writes on a power loss (a killed
Redis alone loses nothing, the data is already in the OS page cache).
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import quote

import redis

from async_rl.queue.client import connect

__all__ = ["EmbeddedRedis", "RedisExit", "RedisNotInstalledError"]

_INSTALL_HINT = (
    "redis-server was not found. Install it (Debian/Ubuntu: `apt-get install redis-server`; "
    "macOS: `brew install redis`) or set queue.redis_url to an existing Redis server."
)

_SAFE_PASSWORD = re.compile(r"[!#-\[\]-~]+")  # goes into redis.conf inside double quotes

PORT_ATTEMPTS = 5
"""Free ports tried when no port is given: another process may bind a port between the
moment it is found free and the moment redis-server binds it."""


class RedisNotInstalledError(FileNotFoundError):
    """No ``redis-server`` executable to start."""


@dataclass(frozen=True)
class RedisExit:
    """What :meth:`EmbeddedRedis.watch` reports when the server exited on its own."""

    pid: int
    """The process that exited."""
    returncode: int
    """Its exit status (negative: killed by that signal)."""
    restarts: int
    """Restarts so far, this one included when it succeeded."""
    new_pid: int | None
    """The restarted server's process, or None when the restart failed."""
    restart_s: float
    """Seconds from noticing the exit to the restarted server answering (or failing)."""
    error: str | None = None
    """Why the restart failed (the log's tail), or None."""
    cause: str = ""
    """What redis.log said before the exit (its warnings), e.g. "Error writing to the AOF file: No space left on device"."""
    disk_full: str | None = None
    """Set while the restart waits for disk space (the first of two reports): the disk and its free space."""

    def describe(self) -> str:
        """One line for the console."""
        how = f"killed by {signal.Signals(-self.returncode).name}" if self.returncode < 0 else f"exit status {self.returncode}"
        said = f": {self.cause}" if self.cause else ""
        if self.disk_full is not None:
            return (f"the embedded Redis (pid {self.pid}) stopped ({how}{said}); {self.disk_full}: free space there, the run waits "
                    f"up to {SPACE_WAIT_S / 60:.0f} min for it, then restarts Redis on its append-only file (nothing is lost)")
        if self.error is not None:
            return f"the embedded Redis (pid {self.pid}) stopped ({how}{said}) and could not be restarted: {self.error}"
        return (f"the embedded Redis (pid {self.pid}) stopped ({how}{said}); restarted on its append-only file in {self.restart_s:.1f} s "
                f"(pid {self.new_pid}, restart {self.restarts}); clients reconnect and retry")


SPACE_WAIT_S = 600.0
"""After the server exited for want of disk space, how long its restart waits for space, seconds."""
MIN_FREE_BYTES = 64 * 2**20
"""Free bytes on the data directory's disk below which a restart waits (a start writes a new AOF part)."""
SPACE_POLL_S = 1.0
NO_SPACE = "No space left on device"
"""strerror(ENOSPC), as it appears in an error's text."""


def disk_space(path: Path) -> tuple[str, int]:
    """``(mount point, free bytes)`` of ``path``'s file system."""
    free = shutil.disk_usage(path).free
    mount = path.absolute()
    while not os.path.ismount(mount):
        mount = mount.parent
    return str(mount), free


class _PortTaken(RuntimeError):
    """Another process holds the port redis-server was to bind."""


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a hostname: it could resolve to anything
        return False


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def url_of(data_dir: str | os.PathLike[str]) -> str:
    """The ``redis://`` URL of the embedded server whose data directory is ``data_dir``, read
    from its ``redis.conf`` (host, port, password): how another process of the run's user
    reaches it. ``FileNotFoundError`` when there is none; ``PermissionError`` for another user."""
    conf = dict(line.split(" ", 1) for line in (Path(data_dir) / "redis.conf").read_text().splitlines() if " " in line)
    password = conf.get("requirepass", "").strip('"')
    auth = f":{quote(password, safe='')}@" if password else ""
    return f"redis://{auth}{conf['bind']}:{conf['port']}/0"


class EmbeddedRedis:
    """Context manager running ``redis-server``; ``__enter__`` returns its ``redis://`` URL.

    ``data_dir`` holds the AOF, config and log; pass the same directory (and ``port`` and
    ``password``) to a new instance to restart on the old data. Without one, a temporary
    directory is created and removed on exit. ``auth=False`` disables the password and is
    only allowed on a loopback address.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        password: str | None = None,
        auth: bool = True,
        appendfsync: Literal["always", "everysec"] = "always",
        executable: str = "redis-server",
        startup_timeout_s: float = 15.0,
    ) -> None:
        if not auth and password is not None:
            raise ValueError("password given with auth=False")
        if not auth and not _is_loopback(host):
            raise ValueError(f"refusing to bind {host!r} without a password: use auth=True")
        if password is not None and not _SAFE_PASSWORD.fullmatch(password):
            raise ValueError("password must be 1+ printable characters without quotes or spaces")
        self.host = host
        self.port = port
        self.password = (password or secrets.token_urlsafe(24)) if auth else None
        self.appendfsync = appendfsync
        self.executable = executable
        self.startup_timeout_s = startup_timeout_s
        self._data_dir = Path(data_dir) if data_dir is not None else None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        """Held while the process is swapped: by a restart, and by :meth:`stop` to end watching."""
        self._stopping = False
        self._watcher: threading.Thread | None = None
        self.restarts = 0
        """Times :meth:`watch` restarted the server."""
        self.waiting_for_space = False
        """A restart waits for disk space (:data:`SPACE_WAIT_S`): clients cannot reach the server meanwhile."""
        self._log_start = 0
        """Where the running server's lines of redis.log begin."""

    @property
    def url(self) -> str:
        """``redis://[:password@]host:port/0`` of the running server."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    @property
    def pid(self) -> int:
        """Process id of the running server."""
        if self._proc is None:
            raise RuntimeError("EmbeddedRedis is not running")
        return self._proc.pid

    @property
    def data_dir(self) -> Path:
        """Directory holding redis.conf, redis.log and the AOF."""
        if self._data_dir is None:
            raise RuntimeError("EmbeddedRedis is not running")
        return self._data_dir

    def start(self) -> str:
        """Start the server and wait until it answers; returns :attr:`url`."""
        binary = self._binary()
        self._stopping = False
        if self._data_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="async-rl-redis-")
            self._data_dir = Path(self._tmp.name)
        # Every prompt, response and reward of the run is in the AOF: this user's only.
        self._data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._data_dir.chmod(0o700)
        pick = self.port is None
        attempts = PORT_ATTEMPTS
        try:
            while True:
                if pick:
                    self.port = _free_port(self.host)
                try:
                    self._launch(binary)
                    return self.url
                except _PortTaken:
                    attempts -= 1
                    if not pick or attempts == 0:
                        raise
                    self._terminate()  # it lost the race for the port: try another one
        except BaseException:
            self.stop()
            raise

    def _binary(self) -> str:
        binary = shutil.which(self.executable)
        if binary is None:
            raise RedisNotInstalledError(_INSTALL_HINT)
        return binary

    def watch(self, on_exit: Callable[[RedisExit], None]) -> None:
        """Restart the server whenever it exits on its own (killed, crashed), on the same port,
        password and AOF, so every client's URL stays valid and nothing acknowledged is lost
        (``appendfsync always``); clients see a connection loss and retry (queue.client).

        ``on_exit`` is called from the watching thread after each restart, or once when a
        restart fails (then watching ends). The watching thread starts the new process and
        lives until :meth:`stop`, so the new server still dies with its owner (PR_SET_PDEATHSIG
        follows the thread that started it).
        """
        if self._proc is None:
            raise RuntimeError("EmbeddedRedis is not running")
        if self._watcher is not None:
            raise RuntimeError("EmbeddedRedis is already watched")
        self._watcher = threading.Thread(target=self._watch, args=(on_exit,), name="embedded-redis-watch", daemon=True)
        self._watcher.start()

    def _watch(self, on_exit: Callable[[RedisExit], None]) -> None:
        while True:
            with self._lock:
                proc = self._proc
            if proc is None:
                return
            returncode = proc.wait()
            with self._lock:
                if self._stopping or self._proc is not proc:
                    return
            cause = self._cause(self._log_start)
            mount, free = disk_space(self.data_dir)
            if NO_SPACE in cause or free < MIN_FREE_BYTES:
                full = f"the disk of {self.data_dir} (mounted at {mount}) is full: {free / 2**20:.0f} MB free"
                on_exit(RedisExit(proc.pid, returncode, self.restarts, None, 0.0, cause=cause, disk_full=full))
                if not self._wait_for_space():
                    if not self._stopping:
                        mount, free = disk_space(self.data_dir)
                        on_exit(RedisExit(proc.pid, returncode, self.restarts, None, SPACE_WAIT_S, cause=cause,
                                          error=f"the disk of {self.data_dir} (mounted at {mount}) stayed full for {SPACE_WAIT_S:.0f} s "
                                                f"({free / 2**20:.0f} MB free, {MIN_FREE_BYTES / 2**20:.0f} MB needed)"))
                    return
            with self._lock:
                if self._stopping or self._proc is not proc:
                    return
                started = time.monotonic()
                try:
                    self._launch(self._binary())  # the same port: the clients' URL
                except Exception as exc:  # noqa: BLE001 - reported to the owner, who ends the run
                    self._terminate()  # a server that never answered must not linger
                    on_exit(RedisExit(proc.pid, returncode, self.restarts, None, time.monotonic() - started, f"{type(exc).__name__}: {exc}",
                                      cause=cause))
                    return
                self.restarts += 1
                event = RedisExit(proc.pid, returncode, self.restarts, self._proc.pid if self._proc else None, time.monotonic() - started,
                                  cause=cause)
            on_exit(event)

    def _wait_for_space(self) -> bool:
        """Wait up to :data:`SPACE_WAIT_S` until the data directory's disk has
        :data:`MIN_FREE_BYTES` free; False when it did not (or :meth:`stop` was called)."""
        self.waiting_for_space = True
        try:
            deadline = time.monotonic() + SPACE_WAIT_S
            while not self._stopping and time.monotonic() < deadline:
                if disk_space(self.data_dir)[1] >= MIN_FREE_BYTES:
                    return True
                time.sleep(SPACE_POLL_S)
            return False
        finally:
            self.waiting_for_space = False

    def _launch(self, binary: str) -> None:
        """Start redis-server on :attr:`port` and wait until it answers."""
        conf = self.data_dir / "redis.conf"
        # The password goes in a 0600 file, not argv, so `ps` does not show it.
        conf.touch(mode=0o600)
        conf.chmod(0o600)  # also one an older version left readable
        conf.write_text(self._config())
        log = self.data_dir / "redis.log"
        log_start = self._log_start = log.stat().st_size if log.exists() else 0
        self._proc = subprocess.Popen(
            [binary, str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            # Its own process group: a Ctrl-C or SIGTERM sent to the owner's group must not stop
            # Redis before the owner's shutdown has committed to it (it still dies with the owner:
            # PR_SET_PDEATHSIG). Not a session: the kernel's scheduler autogroups would schedule
            # it as a group of its own, starved on a loaded machine (launch/reaper.py).
            preexec_fn=_own_group,
            umask=0o077,  # its AOF and log: 0600
        )
        self._wait_ready(self._proc, log_start)

    def _config(self) -> str:
        lines = [
            f"bind {self.host}",
            f"port {self.port}",
            f"dir {self._data_dir}",
            "logfile redis.log",
            "daemonize no",
            "appendonly yes",
            f"appendfsync {self.appendfsync}",
            'save ""',  # the AOF is the persistence; no RDB snapshots forking the server
            "protected-mode no" if self.password else "protected-mode yes",
        ]
        if self.password:
            lines.append(f'requirepass "{self.password}"')
        return "\n".join(lines) + "\n"

    def _wait_ready(self, proc: subprocess.Popen[bytes], log_start: int) -> None:
        """Wait until ``proc`` answers on :attr:`port`; :class:`_PortTaken` if another
        process holds the port (``log_start``: where this start's lines of redis.log begin)."""
        client = connect(self.url, socket_timeout_s=1.0)
        deadline = time.monotonic() + self.startup_timeout_s
        try:
            while True:
                if proc.poll() is not None:
                    log = self._log_tail(log_start)
                    if "Address already in use" in log:
                        raise _PortTaken(f"port {self.port} is held by another process: {log}")
                    raise RuntimeError(f"redis-server exited with code {proc.returncode}: {self._cause(log_start) or log}")
                try:
                    if client.ping():
                        pid = int(client.info("server")["process_id"])
                        if pid != proc.pid:
                            raise _PortTaken(f"port {self.port} is held by another Redis (pid {pid})")
                        return
                except redis.AuthenticationError as exc:
                    raise _PortTaken(f"port {self.port} is held by another Redis") from exc
                except redis.RedisError:
                    pass  # not listening yet, replaying the AOF, or another server answered (then ours exits)
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"redis-server not ready after {self.startup_timeout_s} s: "
                        f"{self._log_tail(log_start)}"
                    )
                time.sleep(0.02)
        finally:
            client.close()

    def _log_since(self, start: int) -> list[str]:
        """The lines redis.log got after byte ``start``."""
        log = self.data_dir / "redis.log"
        if not log.exists():
            return []
        with log.open("rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace").splitlines()

    def _cause(self, start: int, lines: int = 2) -> str:
        """The last ``lines`` warnings (``#`` lines) redis.log got after byte ``start``, after the
        server said it was ready if it did: why it exited, not its start-up notices ("" when it
        said nothing, as when it was killed)."""
        logged = self._log_since(start)
        ready = max((i for i, line in enumerate(logged) if "Ready to accept connections" in line), default=-1)
        warnings = [line.split(" # ", 1)[1] for line in logged[ready + 1:] if " # " in line]
        return " | ".join(warnings[-lines:])

    def _log_tail(self, start: int, lines: int = 5) -> str:
        """The last ``lines`` lines of redis.log written after byte ``start``."""
        return " | ".join(self._log_since(start)[-lines:]) or "(no log)"

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (Redis flushes the AOF and exits), SIGKILL after ``timeout_s``."""
        with self._lock:  # a restart under way finishes first, then is stopped
            self._stopping = True
        self._terminate(timeout_s)
        if self._watcher is not None:
            self._watcher.join(timeout_s)
            self._watcher = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
            self._data_dir = None

    def _terminate(self, timeout_s: float = 10.0) -> None:
        """Stop the server process (its data directory stays)."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.send_signal(signal.SIGTERM)
                try:
                    self._proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            self._proc = None

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _own_group() -> None:
    """In the forked child: a process group of its own, dying with its parent where it can."""
    os.setpgrp()
    _die_with_parent()


def _die_with_parent() -> None:
    """In the forked child: have the kernel SIGTERM it when its parent dies, so a driver
    killed with SIGKILL leaves no redis-server behind (Linux; the signal follows the
    *thread* that started it, so start the server from a long-lived thread). Redis saves
    nothing on SIGTERM that the AOF does not already hold."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
