"""`async-rl scale`'s side of a request (``launch/scale.py``) against a real redis-server; a
thread plays the driver (the whole path, with a real driver, is tests/launch/test_live_run.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import yaml

from typer.testing import CliRunner

from async_rl.cli import app
from async_rl.launch.scale import REDIS_GONE_S, RunEndedError, ScaleError, request_scale
from async_rl.queue import EmbeddedRedis
from async_rl.queue.keys import RunKeys
from async_rl.queue.ownership import LEASE_BACK_S
from async_rl.queue.requests import Requests, ScaleReply

pytestmark = [pytest.mark.redis]

RUN = "scale-test"


@pytest.fixture()
def run_dir(tmp_path: Path) -> Iterator[tuple[Path, str, redis.Redis]]:
    """A run directory whose driver holds the lease ``driver-1`` on a real Redis."""
    (tmp_path / "resolved_config.yaml").write_text(yaml.safe_dump({"trainer": {"run_name": RUN}, "queue": {"redis_url": "redis://:***@h:1/0"}}))
    with EmbeddedRedis(tmp_path / "external-redis") as url:  # not the run directory's own (redis/): an external one
        client = redis.Redis.from_url(url)
        client.set(RunKeys(RUN).lease, b"driver-1")
        yield tmp_path, url, client
        client.close()


def _driver(client: redis.Redis, then) -> threading.Thread:
    """A thread that takes the next request and does ``then(request)``."""
    def serve() -> None:
        requests = Requests(client, RUN)
        while (request := requests.take()) is None:
            time.sleep(0.05)
        then(requests, request)
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_the_drivers_answer_comes_back(run_dir) -> None:
    path, url, client = run_dir
    _driver(client, lambda requests, r: requests.answer(r.request_id, ScaleReply(True, r.servers, ("server-1 added",))))
    assert request_scale(path, 2, redis_url=url, timeout_s=30) == ScaleReply(True, 2, ("server-1 added",))


def test_a_driver_that_dies_with_the_request_is_noticed_not_waited_for(run_dir) -> None:
    path, url, client = run_dir
    _driver(client, lambda requests, r: client.set(RunKeys(RUN).lease, b"driver-2"))  # killed; a resumed driver took over
    start = time.monotonic()
    with pytest.raises(ScaleError, match="stopped before it answered request"):
        request_scale(path, 2, redis_url=url, timeout_s=600)
    assert time.monotonic() - start < 10


def test_no_driver_no_request(run_dir) -> None:
    path, url, client = run_dir
    client.delete(RunKeys(RUN).lease)
    with pytest.raises(ScaleError, match="no driver runs 'scale-test'"):
        request_scale(path, 2, redis_url=url)
    assert Requests(client, RUN).take() is None
    with pytest.raises(ScaleError, match="pass --redis-url"):  # the config's URL holds a redacted password
        request_scale(path, 2)


def test_a_lease_lapsed_while_redis_was_away_is_waited_for(run_dir) -> None:
    """A Redis away for longer than the lease's TTL (a full disk, a restart) dropped the lease;
    the live driver holds it again within LEASE_BACK_S: before the request and during its wait,
    a lease missing for less than that is not read as "no driver"."""
    path, url, client = run_dir
    lease = RunKeys(RUN).lease
    client.delete(lease)
    threading.Timer(LEASE_BACK_S / 2, client.set, (lease, b"driver-1")).start()

    def answer_after_a_lapse(requests, r) -> None:
        client.delete(lease)
        time.sleep(LEASE_BACK_S / 2)
        client.set(lease, b"driver-1")
        requests.answer(r.request_id, ScaleReply(True, r.servers, ("server-1 added",)))

    _driver(client, answer_after_a_lapse)
    assert request_scale(path, 2, redis_url=url, timeout_s=30).ok


def test_a_run_that_ends_before_answering_says_so_with_exit_3(run_dir) -> None:
    """The driver releases its lease at the end of the run: the command says the run ended
    (exit 3), not that a Redis or a driver failed."""
    path, url, client = run_dir
    _driver(client, lambda requests, r: client.delete(RunKeys(RUN).lease))
    start = time.monotonic()
    done = CliRunner().invoke(app, ["scale", str(path), "--servers", "2", "--redis-url", url])
    assert done.exit_code == 3, done.output
    assert "the run ended before answering request" in done.output and "released its lease" in done.output
    assert time.monotonic() - start < 10


@pytest.mark.slow
def test_a_run_whose_embedded_redis_stops_before_answering_ended(tmp_path: Path) -> None:
    """With the run's own Redis (redis/ in the run directory), a Redis that stays gone longer
    than a restart takes means the run ended (its driver stops the Redis last)."""
    (tmp_path / "resolved_config.yaml").write_text(yaml.safe_dump({"trainer": {"run_name": RUN}, "queue": {"redis_url": None}}))
    redis_server = EmbeddedRedis(tmp_path / "redis")
    client = redis.Redis.from_url(redis_server.start())
    client.set(RunKeys(RUN).lease, b"driver-1")
    _driver(client, lambda requests, r: redis_server.stop())
    start = time.monotonic()
    with pytest.raises(RunEndedError, match="its Redis stopped"):
        request_scale(tmp_path, 2, timeout_s=600)
    assert REDIS_GONE_S <= time.monotonic() - start < REDIS_GONE_S + 10
    client.close()


def test_a_served_models_scale_names_the_model(run_dir) -> None:
    """``async-rl scale RUN_DIR --model judge --servers 2`` asks for the servers of
    ``models.judge``; the request the driver takes names it (a policy request names none)."""
    path, url, client = run_dir
    taken = []

    def answer(requests, r) -> None:
        taken.append(r)
        requests.answer(r.request_id, ScaleReply(True, r.servers, ("models.judge: judge-1 added",)))

    _driver(client, answer)
    result = CliRunner().invoke(app, ["scale", str(path), "--model", "judge", "--servers", "2", "--redis-url", url, "--timeout-s", "30"])
    assert result.exit_code == 0 and "judge-1 added" in result.output and "2 servers of models.judge" in result.output, result.output
    assert taken[0].model == "judge" and taken[0].servers == 2
    Requests(client, RUN).post(3, 1.0)
    assert Requests(client, RUN).take().model is None
