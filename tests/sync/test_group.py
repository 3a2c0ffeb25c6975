"""A real gloo weight group: the test process (rank 0) and two receiver processes."""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from async_rl.sync.buckets import iter_bucket_tensors, pack_bucket, plan_buckets, tensor_specs
from async_rl.sync.control import Announce, Start, encode
from async_rl.sync.group import GroupTimeout, Rendezvous, WeightGroup, connect_store, host_store, new_key_prefix

pytestmark = [pytest.mark.dist]

MEMBER = Path(__file__).with_name("_gloo_member.py")


def _intrude(rv: Rendezvous, found: list[bool]) -> None:
    """Reach the group's store without the secret, once rank 0 registered in it (the test
    knows the real prefix only to time this): the address and epoch are known, the key prefix
    is not. Look for rank 0's gloo address under the prefix an intruder can guess, then
    overwrite every guessable member address with junk."""
    store = connect_store(rv, 10.0)
    while not store.check([f"{rv.key_prefix}/0/0"]):
        time.sleep(0.05)
    guessed = f"wsync/{rv.epoch}/0"
    found.append(store.check([f"{guessed}/0"]))
    for rank in range(rv.world_size):
        store.set(f"{guessed}/{rank}", b"junk")


@pytest.mark.integration
def test_gloo_group_broadcasts_buckets_and_times_out():
    """Two receivers get every bucket; a process that reaches the store without the key
    prefix (sent only inside the sealed Start) cannot join in a member's place."""
    timeout_s = 3.0
    named = [(f"w{i}", torch.randn(100, 37 + i, generator=torch.Generator().manual_seed(i))) for i in range(6)]
    specs = tensor_specs(named)
    buckets = plan_buckets(specs, 40_000)
    assert len(buckets) > 1
    announce = Announce(1, 1, tuple(specs), tuple(buckets))
    store = host_store("127.0.0.1", 60.0)
    rv = Rendezvous("127.0.0.1", store.port, epoch=1, world_size=3, backend="gloo", key_prefix=new_key_prefix(1))
    intruder: list[bool] = []
    thread = threading.Thread(target=_intrude, args=(rv, intruder))
    thread.start()
    # Import time of the children (torch) counts against rendezvous: give it room.
    children = [
        subprocess.Popen(
            [sys.executable, str(MEMBER), encode(announce).hex(), encode(Start(1, rv, rank, 60.0)).hex(), str(timeout_s)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in (1, 2)
    ]
    try:
        group = WeightGroup.join(rv, 0, store, timeout_s=60.0)
        buf = torch.empty(max(b.nbytes for b in buckets), dtype=torch.uint8)
        for bucket, tensors in iter_bucket_tensors(named, specs, buckets):
            group.broadcast(pack_bucket(bucket, specs, tensors, buf), timeout_s)
        # The sender now stops; each child must give up on its own timeout.
        results = [json.loads(c.communicate(timeout=120)[0]) for c in children]
    finally:
        for c in children:
            c.kill()
        thread.join(10)
    assert intruder == [False]  # the guessable name holds nothing; the junk changed nothing below
    expected = {name: t.double().sum().item() for name, t in named}
    for r in results:
        assert r["sums"] == pytest.approx(expected, rel=1e-12)
        assert r["error"] == "GroupTimeout"
        assert timeout_s * 0.9 <= r["waited_s"] <= timeout_s + 2.0
    group.close()


@pytest.mark.integration
def test_rendezvous_with_a_missing_member_times_out():
    store = host_store("127.0.0.1", 10.0)
    rv = Rendezvous("127.0.0.1", store.port, epoch=7, world_size=2, backend="gloo", key_prefix=new_key_prefix(7))
    t0 = time.monotonic()
    with pytest.raises(GroupTimeout):
        WeightGroup.join(rv, 0, store, timeout_s=1.0)
    assert time.monotonic() - t0 < 5.0
