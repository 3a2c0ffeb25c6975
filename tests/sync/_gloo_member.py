"""A receiving member of the weight group, run as its own process by test_group.py.

argv: Announce and Start (msgpack, hex), final_wait_s. Receives every bucket of the
announced layout, then waits ``final_wait_s`` for one more broadcast that never comes;
prints one JSON line with the received tensors' checksums and the error of that wait.
"""

import json
import sys
import time

import torch

from async_rl.sync.buckets import unpack_bucket
from async_rl.sync.control import Announce, Start, decode
from async_rl.sync.group import WeightGroup, connect_store


def main() -> None:
    announce, start = decode(bytes.fromhex(sys.argv[1])), decode(bytes.fromhex(sys.argv[2]))
    assert isinstance(announce, Announce) and isinstance(start, Start)
    rank = start.rank_offset
    rv = start.rendezvous
    group = WeightGroup.join(rv, rank, connect_store(rv, start.timeout_s), start.timeout_s)
    sums = {}
    for bucket in announce.buckets:
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8)
        group.broadcast(buf, start.timeout_s)
        for name, t in unpack_bucket(bucket, announce.specs, buf):
            sums[name] = t.double().sum().item()
    t0 = time.monotonic()
    try:
        group.broadcast(torch.empty(8, dtype=torch.uint8), float(sys.argv[3]))
        error = None
    except Exception as e:
        error = type(e).__name__
    print(json.dumps({"rank": rank, "sums": sums, "error": error, "waited_s": time.monotonic() - t0}))


if __name__ == "__main__":
    main()
