"""One screening pass per group: verdicts for the group and its samples, arrays unpacked once."""

from __future__ import annotations

from learner_helpers import prepare_groups

from async_rl.learner.screening import Limits, Verdict, screen
from async_rl.records import RolloutGroup, Sample


def test_screen_dead_letters_bad_tokens_and_drops_untrainable_groups() -> None:
    ok = Sample.from_lists([5, 6], [-1.0, -1.0], 0, 1.0)

    def verdict(prompt: list[int], *samples: Sample) -> Verdict | None:
        return screen(RolloutGroup.from_lists("t", "g", 0, prompt, list(samples), "s", 0.0), Limits(64, 512)).verdict

    assert verdict([3, 4], ok) is None
    assert verdict([3, 512, 4], ok) == ("bad_token", "prompt token id 512 at position 1 is outside the vocabulary [0, 512)", True)
    reason, detail, malformed = verdict([3], ok, Sample.from_lists([7, -1], [-1.0, -1.0], 0, 1.0))
    assert (reason, malformed) == ("bad_token", True) and detail.startswith("sample 1: response token id -1 at position 1")
    # malformed data wins over a failed reward: it goes to the dead-letter stream
    assert verdict([3], Sample.from_lists([7], [-1.0], 0, 0.0, error="boom"), Sample.from_lists([600], [-1.0], 0, 1.0))[2] is True
    # one failed sample alone: nothing is trainable, and the verdict names its error
    assert verdict([3], Sample.from_lists([7], [-1.0], 0, 0.0, error="ValueError: boom")) == ("reward_error", "sample 0: ValueError: boom", False)
    assert verdict([3] * 60, Sample.from_lists([5] * 10, [-1.0] * 10, 0, 1.0)) == ("too_long", "no sample is trainable", False)


def test_screen_unpacks_each_sample_once_for_prepare() -> None:
    episode = Sample.from_lists([7, 8, 40, 9], [-0.1, -0.2, 0.0, -0.3], [3, 3, 3, 5], 1.0, mask=[1, 1, 0, 1])
    screened = screen(RolloutGroup.from_lists("r", "g", 0, [1, 2], [episode], "s", 0.0), Limits(16, 512))
    (sample,) = screened.samples
    assert screened.prompt == [1, 2] and sample.tokens == [7, 8, 40, 9] and sample.versions == [3, 3, 3, 5]
    assert sample.mask == [1, 1, 0, 1] and sample.problem is None and sample.reward == 1.0


def test_a_response_holding_the_image_token_is_not_trained() -> None:
    """A sampler may draw a vision-language model's image token; the model would then look for
    an image that is not there (a crash in its input merger), so the sample is dropped."""
    image_token = 9
    prompt = [3, image_token, image_token, 4]  # the prompt's image tokens are the images' places
    good, bad = Sample.from_lists([5, 6], [-1.0, -1.0], 0, 1.0), Sample.from_lists([5, image_token], [-1.0, -1.0], 0, 0.0)
    group = RolloutGroup.from_lists("t", "g", 0, prompt, [good, bad], "s", 0.0)
    prepared = prepare_groups([group], 64, 512, image_token)
    assert prepared.batch is not None and prepared.batch.size == 1 and prepared.dropped == {"image_token": 1}
    assert screen(group, Limits(64, 512, image_token)).verdict is None
    only_bad = RolloutGroup.from_lists("t", "g", 0, prompt, [bad], "s", 0.0)
    assert screen(only_bad, Limits(64, 512, image_token)).verdict == ("image_token", "no sample is trainable", False)
    assert prepare_groups([only_bad], 64, 512).batch is not None  # a text model has no image token


def test_a_failed_sample_leaves_its_group_unless_drop_group() -> None:
    """The user's code failed on one sample: by default the others train (the group's baseline
    over them, at least ``min_samples``); ``drop_group`` drops the group; the reason says whose code failed."""
    ok = Sample.from_lists([5, 6], [-1.0, -1.0], 0, 1.0)
    timed_out = Sample.from_lists([7], [-1.0], 0, 0.0, error="RewardTimeout: too slow", error_kind="reward_timeout")
    env_failed = Sample.from_lists([8], [-1.0], 0, 0.0, error="Env.step: KeyError: 'x'", error_kind="env_error")
    group = RolloutGroup.from_lists("t", "g", 0, [3], [ok, timed_out, ok, env_failed], "s", 0.0)
    screened = screen(group, Limits(64, 512, min_samples=2))
    assert screened.verdict is None
    assert [s.problem for s in screened.samples] == [None, "reward_timeout", None, "env_error"]
    prepared = prepare_groups([group], 64, 512)
    assert prepared.batch is not None and prepared.batch.size == 2 and prepared.dropped == {"reward_timeout": 1, "env_error": 1}
    assert screen(group, Limits(64, 512, failed_samples="drop_group")).verdict == (
        "reward_timeout", "sample 1: RewardTimeout: too slow", False)
    lonely = RolloutGroup.from_lists("t", "g", 0, [3], [ok, timed_out], "s", 0.0)
    assert screen(lonely, Limits(64, 512, min_samples=2)).verdict == (
        "too_few_samples", "1 trainable sample(s) < 2 for the group's baseline", False)
    assert screen(lonely, Limits(64, 512, min_samples=1)).verdict is None


def test_a_distilled_sample_needs_its_teachers_finite_log_probs() -> None:
    """``algorithm.distill``: a sample without teacher log-probs is not trained (``teacher_error``),
    one with a non-finite teacher log-prob takes its group (as a non-finite behaviour one);
    the teacher's log-probs reach the batch token for token."""
    taught = Sample.from_lists([5, 6], [-1.0, -1.0], 0, 1.0, teacher_logprobs=[-0.5, -2.0])
    bare = Sample.from_lists([5, 7], [-1.0, -1.0], 0, 0.0)
    limits = Limits(64, 512, needs_teacher=True)
    screened = screen(RolloutGroup.from_lists("t", "g", 0, [3, 4], [taught, bare], "s", 0.0), limits)
    assert screened.verdict is None and [s.problem for s in screened.samples] == [None, "teacher_error"]
    assert screened.samples[0].teacher == [-0.5, -2.0]
    nan = Sample.from_lists([5], [-1.0], 0, 1.0, teacher_logprobs=[float("nan")])
    assert screen(RolloutGroup.from_lists("t", "g", 0, [3], [nan], "s", 0.0), limits).verdict[0] == "nonfinite_logprob"
    from async_rl.learner.batching import prepare

    batch = prepare([screened]).batch
    assert batch.teacher_logp.tolist() == [[-0.5, -2.0]] and batch.behav_logp.tolist() == [[-1.0, -1.0]]
    assert prepare_groups([RolloutGroup.from_lists("t", "g", 0, [3], [bare], "s", 0.0)], 64, 512).batch.teacher_logp.tolist() == [[0.0, 0.0]]
