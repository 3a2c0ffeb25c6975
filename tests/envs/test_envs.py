"""The environment interface, registry, episode runner and token-exact conversations.

Environments are real user-style classes (``sample_envs.py``), run in real environment
processes; the model is a scripted ``act`` (this tests the runner and the token bookkeeping,
not generation; ``test_env_processes.py`` tests the containment of faulty environments).
The tokenizer is the tiny assets' real byte-level BPE with its ChatML template.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from async_rl.config import EnvConfig
from async_rl.envs import EnvPool, Trajectory, load_environment, make_environment, run_episode
from async_rl.envs.conversation import ChatEncoder, TokenTrajectory

SAMPLES = Path(__file__).with_name("sample_envs.py")


@pytest.fixture()
def guess_env_file() -> Path:
    return SAMPLES


def _scripted(replies: list[str]):
    seen: list[list[dict[str, str]]] = []

    async def act(new_messages: list[dict[str, str]]) -> str:
        seen.append(new_messages)
        return replies[len(seen) - 1]

    return act, seen


def _episode(cls: str, act, max_turns: int, row: dict | None = None, **kwargs) -> Trajectory:
    """One episode in a real environment process."""

    async def go() -> Trajectory:
        async with EnvPool(EnvConfig(name=f"{SAMPLES}:{cls}", kwargs=kwargs, num_workers=1)) as pool:
            env = pool.open()
            try:
                return await run_episode(env, act, max_turns=max_turns, row=row)
            finally:
                env.close()

    return asyncio.run(go())


def test_an_environment_in_the_users_form_runs_unchanged():
    env = make_environment(load_environment(f"{SAMPLES}:GuessEnv"), {"secret": 7})
    assert env.config.secret == 7 and env.config.get("missing", 3) == 3
    act, seen = _scripted(["3", "9", "7", "1"])
    traj = _episode("GuessEnv", act, 5, secret=7)
    assert traj.actions == ["3", "9", "7"] and traj.states == ["Guess my number.", "higher", "lower"]
    assert traj.rewards == [0.0, 0.0, 1.0] and traj.dones == [False, False, True] and traj.done and traj.failure is None
    assert traj.total_reward() == 1.0 and traj.total_reward("final") == 1.0 and traj.success and traj.num_turns == 3
    # the model sees the system prompt and the first observation, then each observation alone
    assert seen[0] == [{"role": "system", "content": "Play the game."}, {"role": "user", "content": "Guess my number."}]
    assert seen[1:] == [[{"role": "user", "content": "higher"}], [{"role": "user", "content": "lower"}]]


def test_the_turn_limit_ends_an_episode():
    traj = _episode("GuessEnv", _scripted(["1", "2", "3"])[0], 2, secret=7)
    assert traj.num_turns == 2 and not traj.done and not traj.success and traj.failure is None


def test_async_methods_and_reset_with_the_row():
    traj = _episode("RowEnv", _scripted(["5"])[0], 3, row={"problem": "2+3?", "answer": "5"})
    assert traj.states == ["2+3?"] and traj.rewards == [1.0] and traj.success
    # the base class's prompt prefix becomes the system message
    assert make_environment(load_environment(f"{SAMPLES}:RowEnv"), {}).get_prompt_prefix() == "You are a helpful assistant."


def test_registry_errors_name_the_key(guess_env_file: Path, tmp_path: Path):
    with pytest.raises(ValueError, match="unknown environment 'nope'"):
        load_environment("nope")
    with pytest.raises(FileNotFoundError, match="rollout.env.name"):
        load_environment(f"{tmp_path / 'missing.py'}:Env")
    with pytest.raises(ValueError, match="has no 'Nope'"):
        load_environment(f"{guess_env_file}:Nope")
    with pytest.raises(ValueError, match="not a subclass"):
        load_environment(f"{guess_env_file}:EnvironmentConfig")


def test_trajectory_reward_modes():
    traj = Trajectory(states=["a", "b"], actions=["x", "y"], rewards=[0.5, 0.25], dones=[False, True], infos=[{}, {}])
    assert traj.total_reward() == 0.75 and traj.total_reward("final") == 0.25 and not traj.success
    with pytest.raises(ValueError, match="sum"):
        traj.total_reward("max")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from async_rl.tiny.addition import make_splits
    from async_rl.tiny.text import TASK, N_TRAIN, N_VAL, _build_tokenizer

    train, _ = make_splits(TASK, 0, N_TRAIN, N_VAL)
    return _build_tokenizer(train, tmp_path_factory.mktemp("tokenizer"))


def test_a_five_turn_episode_is_token_exact(tokenizer):
    """Model tokens as generated, template and environment tokens per message: together they
    are the chat template's rendering of the whole conversation, token by token, and the mask
    marks exactly the model's tokens."""
    encoder = ChatEncoder(tokenizer)
    messages = [{"role": "system", "content": "Play the game."}, {"role": "user", "content": "What is 12+30?"}]
    traj = TokenTrajectory(encoder.start(messages))
    replies = ["42", "17", "99", "5", "3"]
    generated = []
    for turn, reply in enumerate(replies):
        ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
        if turn != 3:  # turn 3 is cut short by max_tokens: no EOS
            ids = ids + [tokenizer.eos_token_id]
        generated.append(ids)
        traj.add_model(ids, [-0.5] * len(ids), [turn] * len(ids))
        traj.add_context(encoder.close_reply(ids))
        messages.append({"role": "assistant", "content": reply})
        if turn < len(replies) - 1:
            observation = {"role": "user", "content": f"no, try {turn}"}
            traj.add_context(encoder.append([observation]))
            messages.append(observation)
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.decode(traj.prompt_ids + traj.token_ids) == full
    assert traj.prompt_ids + traj.token_ids == tokenizer(full, add_special_tokens=False)["input_ids"]
    model_tokens = [t for t, m in zip(traj.token_ids, traj.mask) if m]
    assert model_tokens == [t for ids in generated for t in ids]  # exactly what the model produced, in order
    assert all(lp == -0.5 for lp, m in zip(traj.logprobs, traj.mask) if m) and all(lp == 0.0 for lp, m in zip(traj.logprobs, traj.mask) if not m)
    assert len(traj.token_ids) == len(traj.mask) == len(traj.logprobs) == len(traj.versions)
    assert traj.context() == traj.prompt_ids + traj.token_ids


def test_a_template_that_rewrites_earlier_messages_is_refused_when_the_encoder_is_made(tokenizer):
    import copy

    from async_rl.envs.conversation import TemplateError

    marking = copy.deepcopy(tokenizer)  # marks the last message: earlier ones render differently once more follow
    marking.chat_template = "{% for m in messages %}{% if loop.last %}[last]{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(TemplateError, match="only appends"):
        ChatEncoder(marking)
    marking.chat_template = None
    with pytest.raises(TemplateError, match="no chat template"):
        ChatEncoder(marking)
