"""EmbeddedRedis lifecycle, safety checks, AOF durability across a SIGKILL, and TLS URLs."""

from __future__ import annotations

import contextlib
import os
import queue as stdlib_queue
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import pytest
import redis
from queue_workers import SPAWN, make_group, produce

from async_rl.queue import EmbeddedRedis, RedisNotInstalledError, ReplayQueue, embedded
from async_rl.queue.client import connect


def test_missing_redis_server_says_what_to_install() -> None:
    hint = r"apt-get install redis-server.*queue\.redis_url"
    with pytest.raises(RedisNotInstalledError, match=hint):
        EmbeddedRedis(executable="redis-server-that-does-not-exist").start()


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "redis.example.com"])
def test_refuses_non_loopback_bind_without_password(host: str) -> None:
    with pytest.raises(ValueError, match="without a password"):
        EmbeddedRedis(host=host, auth=False)


def test_rejects_password_that_breaks_the_config() -> None:
    with pytest.raises(ValueError, match="password"):
        EmbeddedRedis(password='a" b')


@pytest.mark.redis
def test_requires_generated_password_and_stops_on_exit() -> None:
    server = EmbeddedRedis()
    with server as url:
        data_dir, port, pid = server.data_dir, server.port, server.pid
        assert url.startswith("redis://:") and "@127.0.0.1:" in url
        with pytest.raises(redis.AuthenticationError):
            connect(f"redis://127.0.0.1:{port}/0", socket_timeout_s=2.0).ping()
        client = connect(url, socket_timeout_s=2.0)
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("appendfsync") == {"appendfsync": "always"}
        assert client.config_get("bind")["bind"] == "127.0.0.1"
        client.close()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not data_dir.exists()  # its temporary directory is removed
    with pytest.raises(redis.ConnectionError):
        connect(f"redis://127.0.0.1:{port}/0", socket_timeout_s=1.0).ping()


@pytest.mark.redis
def test_redis_dies_with_a_sigkilled_owner(tmp_path: Path) -> None:
    """A driver killed with SIGKILL cannot stop its Redis: the kernel does (PDEATHSIG)."""
    owner = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom async_rl.queue import EmbeddedRedis\n"
         "r = EmbeddedRedis(); r.start(); print(r.pid, flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        pid = int(owner.stdout.readline())
        os.kill(pid, 0)  # running
        owner.kill()
        owner.wait(30)
        deadline = time.monotonic() + 10
        while True:
            try:
                if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                    break  # exited; a zombie until init reaps it
            except FileNotFoundError:
                break  # gone
            assert time.monotonic() < deadline, f"redis-server {pid} outlived its owner"
            time.sleep(0.05)
    finally:
        owner.kill()


@pytest.mark.redis
def test_port_held_by_another_redis_is_an_error() -> None:
    first = EmbeddedRedis()
    with first:
        assert first.port is not None
        with pytest.raises(RuntimeError, match=str(first.port)):
            EmbeddedRedis(port=first.port).start()


@contextlib.contextmanager
def _port_held(by: str) -> Iterator[int]:
    """A port of 127.0.0.1 bound by a plain socket, a listening socket or another Redis."""
    if by == "redis":
        other = EmbeddedRedis()
        with other:
            assert other.port is not None
            yield other.port
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        if by == "listening socket":
            sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.redis
@pytest.mark.parametrize("by", ["socket", "listening socket", "redis"])
def test_a_free_port_taken_before_redis_binds_it_is_replaced(monkeypatch: pytest.MonkeyPatch, by: str) -> None:
    """The race of a probed port: another process binds it first; the server starts on another one."""
    probe = embedded._free_port
    with _port_held(by) as taken:
        first = iter([taken])
        monkeypatch.setattr(embedded, "_free_port", lambda host: next(first, None) or probe(host))
        server = EmbeddedRedis()
        with server as url:
            assert server.port != taken
            client = connect(url, socket_timeout_s=2.0)
            assert int(client.info("server")["process_id"]) == server.pid
            client.close()


@pytest.mark.redis
def test_a_given_port_or_every_probed_port_taken_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with _port_held("socket") as taken:
        with pytest.raises(RuntimeError, match=f"port {taken} is held by another process"):
            EmbeddedRedis(port=taken).start()  # a port given is not replaced
        calls = []
        monkeypatch.setattr(embedded, "_free_port", lambda host: calls.append(host) or taken)
        with pytest.raises(RuntimeError, match=f"port {taken} is held by another process"):
            EmbeddedRedis().start()
        assert len(calls) == embedded.PORT_ATTEMPTS


@pytest.mark.redis
def test_loopback_without_auth_is_allowed(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path, auth=False) as url:
        assert "@" not in url
        assert connect(url, socket_timeout_s=2.0).ping()
    assert (tmp_path / "appendonlydir").is_dir()  # a given data dir is kept


@pytest.mark.redis
def test_its_data_is_this_users_only_even_in_a_directory_made_readable(tmp_path: Path) -> None:
    """The AOF holds every prompt and response, redis.conf the password: 0700 / 0600, also
    over a directory and a config an older version left readable."""
    data = tmp_path / "redis"
    data.mkdir(mode=0o755)
    data.chmod(0o755)
    (data / "redis.conf").write_text("")
    (data / "redis.conf").chmod(0o644)
    with EmbeddedRedis(data) as url:
        with ReplayQueue(url, "private") as q:
            q.put(make_group(0))
    assert data.stat().st_mode & 0o777 == 0o700
    files = [p for p in data.rglob("*") if p.is_file()]
    assert {"redis.conf", "redis.log"} <= {p.name for p in files} and any(p.suffix == ".aof" for p in files)
    assert {p.name: oct(p.stat().st_mode & 0o777) for p in files} == {p.name: "0o600" for p in files}


def _take(returned: Any, producer: BaseProcess, count: int, what: str) -> list[str]:
    try:
        return [returned.get(timeout=60.0) for _ in range(count)]
    except stdlib_queue.Empty:
        raise AssertionError(f"producer stalled {what} (exit code {producer.exitcode})") from None


@pytest.mark.redis
@pytest.mark.integration
def test_sigkilled_redis_restarted_on_its_aof_keeps_every_put(tmp_path: Path) -> None:
    """A producer process keeps putting while Redis is SIGKILLed and restarted."""
    first = EmbeddedRedis(tmp_path)
    url = first.start()
    second = EmbeddedRedis(tmp_path, port=first.port, password=first.password)

    def kill_and_restart() -> None:
        os.kill(first.pid, signal.SIGKILL)  # no shutdown, no final fsync
        first.stop()  # reaps the dead process
        time.sleep(0.5)  # the producer is now retrying against a dead port
        second.start()

    try:
        _puts_survive(url, "durable", 600, kill_and_restart)
    finally:
        second.stop()


def _puts_survive(url: str, run: str, total: int, fault: Callable[[], None]) -> None:
    """A producer process puts ``total`` groups; ``fault`` strikes Redis after the first
    third. Every acknowledged put is stored, none twice (retries add no twins)."""
    returned = SPAWN.Queue()
    producer = SPAWN.Process(target=produce, args=(url, run, range(total), returned, total), daemon=True)
    producer.start()
    acknowledged = _take(returned, producer, total // 3, "before the fault")
    fault()
    acknowledged += _take(returned, producer, total - total // 3, "after the fault")
    producer.join(30.0)
    assert producer.exitcode == 0
    with ReplayQueue(url, run) as q:
        stored = [group.group_id for _, group in q.get(2 * total, timeout=1.0)]
    assert sorted(acknowledged) == sorted(stored)
    assert len(acknowledged) == total


@pytest.mark.redis
@pytest.mark.integration
def test_a_watched_redis_restarts_itself_on_its_aof_and_keeps_every_put(tmp_path: Path) -> None:
    """The driver's case: the same URL keeps working across a SIGKILL, with no manual restart."""
    exits: list[embedded.RedisExit] = []
    server = EmbeddedRedis(tmp_path)
    with server as url:
        server.watch(exits.append)
        killed = server.pid
        _puts_survive(url, "healing", 400, lambda: os.kill(killed, signal.SIGKILL))
        assert [(e.pid, e.returncode, e.restarts, e.error) for e in exits] == [(killed, -signal.SIGKILL, 1, None)]
        assert exits[0].new_pid == server.pid != killed and exits[0].restart_s < 10
        assert "(killed by SIGKILL); restarted on its append-only file" in exits[0].describe()


@pytest.mark.redis
@pytest.mark.integration
def test_a_restart_that_fails_is_reported_once_with_the_reason(tmp_path: Path) -> None:
    exits: list[embedded.RedisExit] = []
    server = EmbeddedRedis(tmp_path)
    with server as url:
        server.watch(exits.append)
        with ReplayQueue(url, "broken") as q:
            q.publish_version(1)
        for manifest in (tmp_path / "appendonlydir").glob("*.manifest"):
            manifest.write_text("not a manifest\n")  # the restart cannot load its AOF
        killed = server.pid
        os.kill(killed, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not exits and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # no second report comes
        assert len(exits) == 1 and exits[0].pid == killed and exits[0].new_pid is None
        assert exits[0].error is not None and "could not be restarted" in exits[0].describe()


@pytest.mark.redis
@pytest.mark.integration
def test_rediss_url_with_password(tmp_path: Path) -> None:
    """A TLS-only Redis (started by hand: EmbeddedRedis is plain TCP) via a rediss:// URL."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    password = secrets.token_urlsafe(16)
    proc = subprocess.Popen(
        ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-auth-clients", "no",
         "--requirepass", password, "--save", "", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL,
    )
    try:
        url = f"rediss://:{password}@127.0.0.1:{port}/0?ssl_ca_certs={cert}"
        with ReplayQueue(url, "tls", op_timeout_s=10.0) as q:  # retries until it listens
            q.put(make_group(0, run="tls"))
            assert [g.group_id for _, g in q.get(1, timeout=2.0)] == ["g0"]
        with pytest.raises(redis.ConnectionError):  # the server speaks only TLS
            connect(f"redis://:{password}@127.0.0.1:{port}/0", socket_timeout_s=1.0).ping()
    finally:
        proc.terminate()
        proc.wait(10)
