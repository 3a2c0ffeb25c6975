"""Wire records: field round-trips, packed arrays, version spans, schema errors."""

from __future__ import annotations

import pickle
import struct

import msgspec
import pytest

from async_rl.records import (
    RecordDecodeError,
    RolloutGroup,
    Sample,
    VersionSpan,
    decode,
    encode,
    pack_f32,
    pack_i32,
    unpack_f32,
    unpack_i32,
)


def _group() -> RolloutGroup:
    samples = [
        Sample.from_lists(
            token_ids=[7, 8, 9, 2**31 - 1],
            logprobs=[-0.5, -1.25, 0.0, -3.0],
            versions=[4, 4, 5, 5],
            reward=1.0,
            reward_components={"format": 0.25, "answer": 0.75},
            finish_reason="stop",
        ),
        Sample.from_lists(
            token_ids=[-1, 11],
            logprobs=[-2.0, -0.125],
            versions=3,
            reward=0.0,
            finish_reason="length",
            error="reward timed out",
        ),
    ]
    return RolloutGroup.from_lists(
        run_id="run-1", group_id="g-42", prompt_id=42, prompt_token_ids=[1, 2, 3],
        samples=samples, server_id="srv-0", generation_s=1.5, created_at=1700000000.25,
    )


def test_round_trip_keeps_every_field() -> None:
    group = _group()
    back = decode(encode(group))
    assert back == group
    assert back.run_id == "run-1" and back.group_id == "g-42" and back.prompt_id == 42
    assert list(back.prompt_array()) == [1, 2, 3]
    assert back.server_id == "srv-0"
    assert back.generation_s == 1.5 and back.created_at == 1700000000.25
    first, second = back.samples
    assert list(first.token_array()) == [7, 8, 9, 2**31 - 1]
    assert list(first.logprob_array()) == [-0.5, -1.25, 0.0, -3.0]
    assert first.token_versions() == [4, 4, 5, 5]
    assert first.reward == 1.0
    assert first.reward_components == {"format": 0.25, "answer": 0.75}
    assert first.finish_reason == "stop" and first.error is None
    assert list(second.token_array()) == [-1, 11]
    assert second.version_spans == [VersionSpan(3, 2)]
    assert second.finish_reason == "length" and second.error == "reward timed out"


def test_mask_spans_round_trip_and_default_to_all_trained() -> None:
    masked = Sample.from_lists([1, 2, 3, 4, 5], [-1.0, 0.0, 0.0, -1.0, -1.0], 2, 1.0, mask=[1, 0, 0, 1, 1])
    assert masked.token_mask() == [1, 0, 0, 1, 1] and len(masked.mask_spans) == 3
    group = RolloutGroup.from_lists("r", "g", 0, [1], [masked, Sample.from_lists([6], [-0.5], 2, 0.0, mask=[1])], "s", 0.0)
    back = decode(encode(group))
    assert back.samples[0].token_mask() == [1, 0, 0, 1, 1]
    assert back.samples[1].mask_spans == [] and back.samples[1].token_mask() == [1]  # all trained: nothing stored
    with pytest.raises(ValueError, match="mask spans"):
        Sample(masked.token_ids, masked.logprobs, masked.version_spans, 1.0, mask_spans=masked.mask_spans[:1])


def test_behaviour_version_is_min_token_version() -> None:
    assert _group().behaviour_version == 3


def test_empty_response_sample_has_no_version_and_is_skipped() -> None:
    empty = Sample.from_lists([], [], versions=0, reward=0.0, finish_reason="abort")
    assert empty.behaviour_version is None and empty.version_spans == []
    group = RolloutGroup.from_lists("r", "g", 0, [1], [empty, _group().samples[0]], "s", 0.1)
    assert group.behaviour_version == 4


def test_version_spans_are_run_length() -> None:
    sample = Sample.from_lists([0] * 6, [0.0] * 6, versions=[1, 1, 2, 2, 2, 1], reward=0.0)
    assert sample.version_spans == [VersionSpan(1, 2), VersionSpan(2, 3), VersionSpan(1, 1)]
    assert sample.token_versions() == [1, 1, 2, 2, 2, 1]
    assert sample.behaviour_version == 1


def test_arrays_are_packed_little_endian() -> None:
    assert pack_i32([1, -2]) == struct.pack("<ii", 1, -2)
    assert pack_f32([0.5, -1.0]) == struct.pack("<ff", 0.5, -1.0)
    assert list(unpack_i32(struct.pack("<ii", 3, -4))) == [3, -4]
    assert list(unpack_f32(struct.pack("<ff", 2.5, -0.25))) == [2.5, -0.25]
    sample = _group().samples[0]
    assert sample.token_ids[:4] == struct.pack("<i", 7)
    assert sample.num_tokens == 4


@pytest.mark.parametrize(
    ("token_ids", "logprobs", "spans", "message"),
    [
        (b"\x00" * 6, b"\x00" * 6, [VersionSpan(0, 1)], "multiple of 4"),
        (b"\x00" * 8, b"\x00" * 4, [VersionSpan(0, 2)], "one float32"),
        (b"\x00" * 8, b"\x00" * 8, [VersionSpan(0, 1)], "cover every"),
        (b"\x00" * 8, b"\x00" * 8, [VersionSpan(-1, 2)], "version >= 0"),
    ],
)
def test_malformed_sample_is_rejected(
    token_ids: bytes, logprobs: bytes, spans: list[VersionSpan], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Sample(token_ids=token_ids, logprobs=logprobs, version_spans=spans, reward=0.0)


def test_group_without_tokens_is_rejected() -> None:
    empty = Sample.from_lists([], [], versions=0, reward=0.0)
    with pytest.raises(ValueError, match="at least one response token"):
        RolloutGroup.from_lists("r", "g", 0, [1], [empty], "s", 0.0)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1 not msgpack",
        msgspec.msgpack.encode({"schema": "rollout_group.v0", "run_id": "r"}),
        msgspec.msgpack.encode([1, 2, 3]),
        pickle.dumps(_group()),
    ],
    ids=["empty", "garbage", "other-schema", "wrong-shape", "pickle"],
)
def test_decode_failure_is_a_typed_error(data: bytes) -> None:
    with pytest.raises(RecordDecodeError):
        decode(data)


def test_decode_validates_contents_not_just_shape() -> None:
    raw = msgspec.msgpack.decode(encode(_group()))
    raw["samples"][0]["logprobs"] = b"\x00" * 4  # one log-prob for four tokens
    with pytest.raises(RecordDecodeError, match="one float32"):
        decode(msgspec.msgpack.encode(raw))


def test_teacher_log_probs_travel_with_the_sample_or_are_refused() -> None:
    """``Sample.teacher_logprobs`` (``algorithm.distill``): one float32 per response token, or
    none (records written before it decode as none)."""
    group = RolloutGroup.from_lists("r", "g", 0, [1], [Sample.from_lists([5, 6], [-1.0, -2.0], 0, 1.0, teacher_logprobs=[-0.25, -3.0])], "s", 0.0)
    back = decode(encode(group))
    assert list(back.samples[0].teacher_array()) == [-0.25, -3.0]
    assert Sample.from_lists([5], [-1.0], 0, 1.0).teacher_array() is None
    with pytest.raises(ValueError, match="teacher_logprobs must be empty or hold one float32 per response token"):
        Sample.from_lists([5, 6], [-1.0, -2.0], 0, 1.0, teacher_logprobs=[-1.0])


def test_the_teachers_top_k_travels_with_the_sample_or_is_refused() -> None:
    """``Sample.teacher_top_ids`` / ``teacher_top_logprobs`` (``algorithm.distill.top_k``): k
    per response token, beside the sampled tokens' teacher log-probs."""
    top = ([[5, 9], [6, 1]], [[-0.5, -1.5], [-0.25, -2.0]])
    sample = Sample.from_lists([5, 6], [-1.0, -2.0], 0, 1.0, teacher_logprobs=[-0.5, -0.25], teacher_top=top)
    back = decode(encode(RolloutGroup.from_lists("r", "g", 0, [1], [sample], "s", 0.0)))
    assert back.samples[0].teacher_top() == top
    assert Sample.from_lists([5], [-1.0], 0, 1.0, teacher_logprobs=[-1.0]).teacher_top() is None
    with pytest.raises(ValueError, match="k int32 per response token"):
        Sample.from_lists([5, 6], [-1.0, -2.0], 0, 1.0, teacher_logprobs=[-0.5, -0.25], teacher_top=([[5, 9, 1]], [[-0.5, -1.5, -3.0]]))
    with pytest.raises(ValueError, match="beside teacher_logprobs"):
        Sample.from_lists([5, 6], [-1.0, -2.0], 0, 1.0, teacher_top=top)
