"""Bucket planning, packing and unpacking (pure)."""

import pytest
import torch

from async_rl.sync.buckets import (
    ALIGN_BYTES,
    bucket_in_place,
    iter_bucket_tensors,
    pack_bucket,
    plan_buckets,
    tensor_specs,
    unpack_bucket,
)


def _tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(3, 5, generator=g)),
        ("a.bias", torch.randn(5, generator=g).to(torch.bfloat16)),
        ("scalar", torch.tensor(7, dtype=torch.int64)),
        ("mask", torch.rand(9, generator=g) > 0.5),
        ("empty", torch.empty(0, 4)),
        ("big", torch.randn(64, 64, generator=g)),  # 16 KiB: larger than a bucket
        ("half", torch.randn(2, 3, 4, generator=g).half()),
        ("tail", torch.arange(10, dtype=torch.int32)),
    ]


def test_round_trip_is_bit_exact_and_respects_bucket_size():
    named = _tensors()
    specs = tensor_specs(named)
    bucket_bytes = 256
    buckets = plan_buckets(specs, bucket_bytes)
    placed = [e.index for b in buckets for e in b.entries]
    assert placed == list(range(len(specs)))  # every tensor once, in order
    out = {}
    for bucket, tensors in iter_bucket_tensors(named, specs, buckets):
        if len(bucket.entries) > 1:
            assert bucket.nbytes <= bucket_bytes
        assert all(e.offset % ALIGN_BYTES == 0 for e in bucket.entries)
        buf = pack_bucket(bucket, specs, tensors, torch.empty(bucket.nbytes + 8, dtype=torch.uint8))
        assert buf.numel() == bucket.nbytes
        out.update(unpack_bucket(bucket, specs, buf.clone()))
    big = [b for b in buckets if any(specs[e.index].name == "big" for e in b.entries)]
    assert len(big) == 1 and len(big[0].entries) == 1 and big[0].nbytes == 64 * 64 * 4
    for name, t in named:
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name], t), name


def test_one_bucket_when_everything_fits():
    specs = tensor_specs(_tensors())
    (bucket,) = plan_buckets(specs, 2**20)
    assert bucket.nbytes >= sum(s.nbytes for s in specs)


def test_large_tensors_travel_alone_without_a_copy():
    named = _tensors()
    specs = tensor_specs(named)
    buckets = plan_buckets(specs, 2**20, solo_bytes=1024)  # only "big" (16 KiB) is large
    assert [len(b.entries) for b in buckets] == [5, 1, 2]
    cpu = torch.device("cpu")
    for bucket, tensors in iter_bucket_tensors(named, specs, buckets):
        buf = bucket_in_place(bucket, specs, tensors, cpu)
        if len(bucket.entries) == 1:
            assert buf is not None and buf.data_ptr() == tensors[0].data_ptr()  # the tensor's own bytes
        else:
            assert buf is None  # several tensors: packed
            buf = pack_bucket(bucket, specs, tensors, torch.empty(bucket.nbytes, dtype=torch.uint8))
        assert all(torch.equal(dict(unpack_bucket(bucket, specs, buf))[specs[e.index].name], t)
                   for e, t in zip(bucket.entries, tensors))
    transposed = [("t", named[5][1].t())]  # not contiguous: must be packed
    (bucket,) = plan_buckets(tensor_specs(transposed), 2**20, solo_bytes=1024)
    assert bucket_in_place(bucket, tensor_specs(transposed), [transposed[0][1]], cpu) is None


def test_tensors_are_consumed_one_bucket_at_a_time():
    named = _tensors()
    specs = tensor_specs(named)
    buckets = plan_buckets(specs, 256)
    consumed = []

    def lazy():
        for name, t in named:
            consumed.append(name)
            yield name, t

    it = iter_bucket_tensors(lazy(), specs, buckets)
    first, _ = next(it)
    assert consumed == [specs[e.index].name for e in first.entries]


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda n: n[:-1], "ended before"),
        (lambda n: n + [("extra", torch.zeros(1))], "more tensors"),
        (lambda n: [(k, v.double() if k == "a.weight" else v) for k, v in n], "does not match"),
        (lambda n: [("renamed" if k == "mask" else k, v) for k, v in n], "does not match"),
    ],
)
def test_mismatch_with_specs_is_rejected(mutate, message):
    named = _tensors()
    specs = tensor_specs(named)
    buckets = plan_buckets(specs, 256)
    with pytest.raises(ValueError, match=message):
        for _ in iter_bucket_tensors(mutate(named), specs, buckets):
            pass


def test_specs_need_no_data():
    meta = torch.empty(1024, 1024, dtype=torch.bfloat16, device="meta")
    (spec,) = tensor_specs([("w", meta)])
    assert (spec.dtype, spec.shape, spec.nbytes) == ("bfloat16", (1024, 1024), 2 * 2**20)
