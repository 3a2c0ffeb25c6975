"""The environment interface, registry, episode runner and token-exact conversations.

Environments are real user-style classes; the model is a scripted ``act`` (this tests the
runner and the token bookkeeping, not generation). The tokenizer is the tiny assets' real
byte-level BPE with its ChatML template.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from async_rl.envs import (
    BaseEnvironment,
    EnvironmentConfig,
    EnvTimeout,
    Trajectory,
    load_environment,
    make_environment,
    run_episode,
)
from async_rl.envs.conversation import ChatEncoder, TokenTrajectory

GUESS_ENV = '''
from async_rl.envs import BaseEnvironment, EnvironmentConfig


class GuessEnv(BaseEnvironment):
    """Written exactly in the users' form: synchronous, reset() without arguments."""

    def __init__(self, config: EnvironmentConfig):
        super().__init__(config)
        self.secret = config.secret

    def reset(self) -> str:
        return "Guess my number."

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        guess = int(action)
        if guess == self.secret:
            return "Correct!", 1.0, True, {"success": True}
        return ("higher" if guess < self.secret else "lower"), 0.0, False, {}

    def get_state_description(self) -> str:
        return f"secret {self.secret}"

    def get_prompt_prefix(self) -> str:
        return "Play the game."
'''


@pytest.fixture()
def guess_env_file(tmp_path: Path) -> Path:
    path = tmp_path / "guess.py"
    path.write_text(GUESS_ENV)
    return path


def _scripted(replies: list[str]):
    seen: list[list[dict[str, str]]] = []

    async def act(new_messages: list[dict[str, str]]) -> str:
        seen.append(new_messages)
        return replies[len(seen) - 1]

    return act, seen


def test_an_environment_in_the_users_form_runs_unchanged(guess_env_file: Path):
    cls = load_environment(f"{guess_env_file}:GuessEnv")
    env = make_environment(cls, {"secret": 7})
    assert env.config.secret == 7 and env.config.get("missing", 3) == 3 and env.get_state_description() == "secret 7"
    act, seen = _scripted(["3", "9", "7", "1"])
    traj = asyncio.run(run_episode(env, act, max_turns=5, step_timeout_s=5.0))
    assert traj.actions == ["3", "9", "7"] and traj.states == ["Guess my number.", "higher", "lower"]
    assert traj.rewards == [0.0, 0.0, 1.0] and traj.dones == [False, False, True] and traj.done and traj.error is None
    assert traj.total_reward() == 1.0 and traj.total_reward("final") == 1.0 and traj.success and traj.num_turns == 3
    # the model sees the system prompt and the first observation, then each observation alone
    assert seen[0] == [{"role": "system", "content": "Play the game."}, {"role": "user", "content": "Guess my number."}]
    assert seen[1:] == [[{"role": "user", "content": "higher"}], [{"role": "user", "content": "lower"}]]


def test_the_turn_limit_ends_an_episode(guess_env_file: Path):
    env = make_environment(load_environment(f"{guess_env_file}:GuessEnv"), {"secret": 7})
    traj = asyncio.run(run_episode(env, _scripted(["1", "2", "3"])[0], max_turns=2, step_timeout_s=5.0))
    assert traj.num_turns == 2 and not traj.done and not traj.success and traj.error is None


class RowEnv(BaseEnvironment):
    """``async`` methods and ``reset(row)``: the episode's dataset row."""

    async def reset(self, row: dict) -> str:
        self.answer = row["answer"]
        return row["problem"]

    async def step(self, action: str) -> tuple[str, float, bool, dict]:
        return "", float(action == self.answer), True, {}


def test_async_methods_and_reset_with_the_row():
    env = RowEnv(EnvironmentConfig())
    traj = asyncio.run(run_episode(env, _scripted(["5"])[0], max_turns=3, step_timeout_s=5.0, row={"problem": "2+3?", "answer": "5"}))
    assert traj.states == ["2+3?"] and traj.rewards == [1.0] and traj.success
    # an empty prompt prefix is no system message
    assert make_environment(RowEnv, {}).get_prompt_prefix() == "You are a helpful assistant."


class Broken(BaseEnvironment):
    def __init__(self, config: EnvironmentConfig):
        super().__init__(config)
        self.mode = config.mode

    def reset(self) -> str:
        if self.mode == "reset":
            raise KeyError("no such level")
        return "start"

    def step(self, action: str):
        if self.mode == "hang":
            time.sleep(3)
        if self.mode == "shape":
            return "obs", 1.0
        raise RuntimeError("boom")


@pytest.mark.parametrize("mode, message", [
    ("reset", "Broken.reset: KeyError: 'no such level'"),
    ("step", "Broken.step: RuntimeError: boom"),
    ("shape", "step must return (observation, reward, done, info)"),
    ("hang", "Broken.step took longer than 0.3 s"),
])
def test_a_failing_environment_ends_its_episode_with_the_error(mode: str, message: str):
    start = time.monotonic()
    traj = asyncio.run(run_episode(Broken(EnvironmentConfig(mode=mode)), _scripted(["x"])[0], max_turns=3, step_timeout_s=0.3))
    assert traj.error is not None and message in traj.error, traj.error
    assert time.monotonic() - start < 2.0  # a hung step is abandoned at its timeout
    assert traj.rewards == [] and not traj.success


def test_a_hung_environment_does_not_hold_up_the_event_loop():
    async def go() -> float:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        ticker = asyncio.create_task(tick())
        with pytest.raises(EnvTimeout):
            from async_rl.envs import call_env

            await call_env(time.sleep, 2, timeout_s=0.3)
        ticker.cancel()
        return ticks

    assert asyncio.run(go()) >= 10


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
