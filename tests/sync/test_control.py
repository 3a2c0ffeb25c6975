"""Control messages and the sender's handling of unresponsive or vanished servers."""

import time

import pytest
import torch
import zmq

from async_rl.sync.buckets import plan_buckets, tensor_specs
from async_rl.sync.control import Ack, Announce, ControlTimeout, Hello, Start, decode, encode
from async_rl.sync.group import Rendezvous
from async_rl.sync.sender import WeightSender


def test_messages_round_trip_as_msgpack():
    specs = tensor_specs([("w", torch.zeros(2, 3, dtype=torch.bfloat16))])
    msgs = [
        Hello("s0", 2, None),
        Announce(3, 7, tuple(specs), tuple(plan_buckets(specs, 1024))),
        Start(3, Rendezvous("10.0.0.1", 1234, 5, 3, "nccl"), 1, 12.5),
        Ack(3, "s0", 7, None, False, 0.1, 0.2, 0.05),
    ]
    for m in msgs:
        assert decode(encode(m)) == m
    assert b"\x80\x04" not in encode(msgs[1])  # MessagePack, never a pickle


def _registered(sender: WeightSender) -> zmq.Socket:
    """A server that registers and then never answers (hung process)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(sender.address)
    sock.send(encode(Hello("mute", 1, None)))
    sender.wait_for_servers(1, timeout_s=5.0)
    return sock


def test_unresponsive_server_is_reported_within_the_control_timeout():
    sender = WeightSender(backend="gloo", timeout_s=30.0, control_timeout_s=0.5)
    sock = _registered(sender)
    assert sender.behind(1) == ["mute"]
    named = [("w", torch.ones(4))]
    t0 = time.monotonic()
    result = sender.send(iter(named), 1, specs=tensor_specs(named))
    assert time.monotonic() - t0 < 3.0
    assert not result.ok and "no Ready" in result.failed["mute"]
    assert sender.servers == {}  # dropped until its next Hello
    assert isinstance(decode(sock.recv(zmq.NOBLOCK)), Announce)
    sock.close()
    sender.close()


def test_wait_for_servers_times_out():
    sender = WeightSender(backend="gloo", timeout_s=5.0)
    with pytest.raises(ControlTimeout):
        sender.wait_for_servers(1, timeout_s=0.3)
    sender.close()
