"""Full parameters gathered from FSDP shards of 2 ranks, bucket by bucket."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from learner_helpers import SPAWN, gather_main
from safetensors.torch import load_file

from async_rl.learner.model import free_port


@pytest.mark.integration
def test_buckets_hold_the_full_parameters_within_the_budget(tiny_model: Path, tmp_path: Path) -> None:
    budget = 200_000  # bytes: several buckets for the tiny model, one 256 KiB embedding alone
    port, out = free_port(), tmp_path / "buckets.pt"
    procs = [SPAWN.Process(target=gather_main, args=(r, 2, port, str(tiny_model), budget, str(out))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    buckets = torch.load(out)
    expected = load_file(tiny_model / "model.safetensors")
    assert len(buckets) > 3
    for bucket in buckets:
        nbytes = [t.numel() * t.element_size() for _, t in bucket]
        assert len(bucket) == 1 or sum(nbytes) <= budget
    gathered = dict(item for bucket in buckets for item in bucket)
    assert sorted(gathered) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(gathered[name], tensor, rtol=0, atol=0)
