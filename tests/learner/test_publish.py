"""Publishing weights: full parameters gathered from FSDP shards of 2 ranks bucket by bucket,
and the publication's rules (a version published for admission once every server holds it,
catch-up of a late server) against a recording sender."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from learner_helpers import SPAWN, gather_main, learner_config
from safetensors.torch import load_file

from async_rl.learner.model import DistInfo, free_port, load_sharded
from async_rl.learner.publish import Publication
from async_rl.sync.sender import PendingSend, SendResult, ServerReport

pytestmark = [pytest.mark.dist]


@pytest.mark.slow
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


class RecordingSender:
    """The sender's interface over a dict of servers; every update is acknowledged when
    ``complete`` is called, by the servers in ``ok``."""

    def __init__(self, servers: dict[str, int | None], ok: set[str]) -> None:
        self._servers, self.ok, self.sent, self.adapters = servers, ok, [], []

    @property
    def servers(self) -> dict[str, int | None]:
        return dict(self._servers)

    def behind(self, version: int) -> list[str]:
        return [s for s, v in self._servers.items() if v != version]

    @property
    def dropped(self) -> dict[str, int]:
        return {}

    def begin(self, named_tensors, version, *, specs, servers=None, adapter=None):  # type: ignore[no-untyped-def]
        names = [name for name, _ in named_tensors]
        targets = sorted(self._servers if servers is None else servers)
        self.sent.append((version, targets, len(names) == len(specs)))
        self.adapters.append(adapter)
        return PendingSend(version, len(self.sent), 0.0, 0.0, 0.0, 0.0, 0, 0.0, {}, {})

    def complete(self, pending: PendingSend, wait: bool = True) -> SendResult:
        targets = self.sent[pending.update_id - 1][1]
        for s in targets:
            if s in self.ok:
                self._servers[s] = pending.version
        reports = {s: ServerReport(s, s in self.ok, receive_s=0.1, load_s=0.2, pause_s=0.3) for s in targets}
        return SendResult(pending.version, pending.update_id, 0.0, 0.0, 0.0, 0.5, 1.0, 0, reports)


def test_a_version_is_published_for_admission_once_every_server_holds_it(tiny_model, one_rank: DistInfo) -> None:
    cfg = learner_config(tiny_model, "/tmp", "pub")
    policy = load_sharded(str(tiny_model), cfg.learner, one_rank.device, trainable=True)
    sender, announced, counters = RecordingSender({"a": 0, "b": 0}, ok={"a"}), [], Counter()
    publication = Publication(0, one_rank.device, policy, 1, counters, sender, announced.append, 0)
    assert publication.active and not publication.loading
    publication.publish(1)
    assert sender.sent == [(1, ["a", "b"], True)] and publication.loading  # every tensor of the specs, to every server
    publication.settle(wait=True)
    assert announced == [] and counters["sync_failed"] == 1  # b failed: version 1 has not reached every server
    assert publication.take_metrics()["sync/pause_s"] == 0.3 and publication.take_metrics() == {}
    sender.ok.add("b")
    publication.catch_up(2)  # the learner is at 2 by now: the late server gets the current weights
    assert sender.sent[-1] == (2, ["b"], True) and counters["sync_catch_up"] == 1
    publication.settle(wait=True)
    assert announced == [1]  # every server holds at least the served version
    publication.catch_up(2)
    assert len(sender.sent) == 2  # nobody lags: no send


def test_without_a_sender_nothing_is_gathered_or_sent(tiny_model, one_rank: DistInfo) -> None:
    cfg = learner_config(tiny_model, "/tmp", "pub")
    policy = load_sharded(str(tiny_model), cfg.learner, one_rank.device, trainable=True)
    publication = Publication(0, one_rank.device, policy, 1, Counter(), None, None, 0)
    assert not publication.active and publication.publish(1) == 0.0 and publication.take_metrics() == {}


def test_a_restarted_learner_catches_up_servers_ahead_of_it(tiny_model, one_rank: DistInfo) -> None:
    """A learner restarted from its version-3 checkpoint: a server holding version 5 (sent by
    the dead learner, a line now abandoned) gets version 3 back; one holding 3 is left alone."""
    cfg = learner_config(tiny_model, "/tmp", "pub")
    policy = load_sharded(str(tiny_model), cfg.learner, one_rank.device, trainable=True)
    sender, announced = RecordingSender({"a": 5, "b": 3}, ok={"a", "b"}), []
    publication = Publication(0, one_rank.device, policy, 1, Counter(), sender, announced.append, 3)
    publication.catch_up(3)
    assert sender.sent == [(3, ["a"], True)]
    publication.settle(wait=True)
    publication.catch_up(3)
    assert len(sender.sent) == 1  # both hold 3 now
