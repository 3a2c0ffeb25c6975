"""A master TCP store listens on the address it is given, not on every interface."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist
from listening import tree_listeners

from async_rl.netbind import master_store


def _listening_ports(port: int) -> list[str]:
    """Addresses this process listens on at ``port``."""
    return [x.address for x in tree_listeners(os.getpid()) if x.port == port and x.pid == os.getpid()]


def test_a_store_listens_on_its_host_only_and_serves_clients():
    store = master_store("127.0.0.1", 0, 10.0, world_size=2)
    assert _listening_ports(store.port) == ["127.0.0.1"]
    client = dist.TCPStore("127.0.0.1", store.port, 2, False, timeout=timedelta(seconds=10))
    client.set("greeting", "hello")
    assert store.get("greeting") == b"hello"
    del client, store


def test_a_plain_store_would_listen_everywhere():
    """Why :func:`master_store` exists: torch's own master binds the wildcard address whatever its host."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False, timeout=timedelta(seconds=10))
    assert _listening_ports(store.port) in (["::"], ["0.0.0.0"])
    del store


def test_the_store_owns_its_socket():
    # torch opens a pipe pair once per process with its first store and keeps it: warm up first,
    # or the test fails when it is the first store of its process (alone, or on an xdist worker)
    master_store("127.0.0.1", 0, 10.0)  # dropped at once: this store is not the one tested
    before = set(os.listdir("/proc/self/fd"))
    store = master_store("127.0.0.1", 0, 10.0)
    port = store.port
    del store
    assert set(os.listdir("/proc/self/fd")) <= before  # its listening socket closed with it
    assert _listening_ports(port) == []


def test_a_given_port_is_bound_and_a_taken_one_refused():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = master_store("127.0.0.1", port, 10.0)
    assert store.port == port and _listening_ports(port) == ["127.0.0.1"]
    with pytest.raises(OSError):
        master_store("127.0.0.1", port, 10.0)
    del store
