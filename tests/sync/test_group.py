"""A real gloo weight group: the test process (rank 0) and two receiver processes."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from async_rl.sync.buckets import iter_bucket_tensors, pack_bucket, plan_buckets, tensor_specs
from async_rl.sync.control import Announce, Start, encode
from async_rl.sync.group import GroupTimeout, Rendezvous, WeightGroup, host_store

MEMBER = Path(__file__).with_name("_gloo_member.py")


@pytest.mark.integration
def test_gloo_group_broadcasts_buckets_and_times_out():
    timeout_s = 3.0
    named = [(f"w{i}", torch.randn(100, 37 + i, generator=torch.Generator().manual_seed(i))) for i in range(6)]
    specs = tensor_specs(named)
    buckets = plan_buckets(specs, 40_000)
    assert len(buckets) > 1
    announce = Announce(1, 1, tuple(specs), tuple(buckets))
    store = host_store("127.0.0.1", 60.0)
    rv = Rendezvous("127.0.0.1", store.port, epoch=1, world_size=3, backend="gloo")
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
    expected = {name: t.double().sum().item() for name, t in named}
    for r in results:
        assert r["sums"] == pytest.approx(expected, rel=1e-12)
        assert r["error"] == "GroupTimeout"
        assert timeout_s * 0.9 <= r["waited_s"] <= timeout_s + 2.0
    group.close()


@pytest.mark.integration
def test_rendezvous_with_a_missing_member_times_out():
    store = host_store("127.0.0.1", 10.0)
    rv = Rendezvous("127.0.0.1", store.port, epoch=7, world_size=2, backend="gloo")
    t0 = time.monotonic()
    with pytest.raises(GroupTimeout):
        WeightGroup.join(rv, 0, store, timeout_s=1.0)
    assert time.monotonic() - t0 < 5.0
