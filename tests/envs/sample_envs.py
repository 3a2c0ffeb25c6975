"""Environments the tests load by name (``path/to/sample_envs.py:Class``) into real
environment processes: each is written as a user would, including the faulty ones."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time

from async_rl.envs import BaseEnvironment, EnvironmentConfig
from async_rl.envs.tools import ToolEnvironment


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

    def get_prompt_prefix(self) -> str:
        return "Play the game."


class RowEnv(BaseEnvironment):
    """``async`` methods and ``reset(row)``: the episode's dataset row."""

    async def reset(self, row: dict) -> str:
        self.answer = row["answer"]
        return row["problem"]

    async def step(self, action: str) -> tuple[str, float, bool, dict]:
        await asyncio.sleep(0.01)
        return "", float(action == self.answer), True, {}


class Faulty(BaseEnvironment):
    """Answers each action by its word: ``raise`` raises, ``hang`` sleeps forever (on its
    thread), ``spawn`` starts a child process and hangs, ``exit`` ends the process, ``shape`` returns a 2-tuple,
    ``slow`` takes 0.3 s, ``flood`` answers with 2 million characters; anything else is a normal turn (done on turn ``config.turns``, default 2)."""

    def __init__(self, config: EnvironmentConfig):
        super().__init__(config)
        self.mode = config.get("mode", "")
        self.turns = 0

    def reset(self, row: dict) -> str:
        if self.mode == "reset":
            raise KeyError("no such level")
        return row.get("problem", "start")

    def step(self, action: str):
        self.turns += 1
        if action == "raise":
            raise RuntimeError(f"cannot apply {action!r} on turn {self.turns}")
        if action == "hang":
            time.sleep(3600)
        if action == "spawn":
            child = subprocess.Popen(["sleep", "3600"])
            with open(self.config.pid_file, "w") as f:
                f.write(str(child.pid))
            time.sleep(3600)
        if action == "exit":
            os._exit(3)  # a crash (a segfault in an extension, the OOM killer) as the server sees it
        if action == "shape":
            return "obs", 1.0
        if action == "flood":
            return "x" * 2_000_000, 0.0, False, {}
        if action == "slow":
            time.sleep(0.3)
        return f"turn {self.turns} from {os.getpid()}", 1.0, self.turns >= self.config.get("turns", 2), {"success": True}


class AsyncFaulty(BaseEnvironment):
    """``async`` methods: ``block`` calls time.sleep (blocks the event loop) for
    ``config.block_s`` seconds, ``raise`` raises, ``hang`` awaits forever."""

    async def reset(self) -> str:
        return "start"

    async def step(self, action: str):
        if action == "block":
            time.sleep(float(self.config.get("block_s", 3600)))  # noqa: ASYNC251 - the fault under test
        if action == "raise":
            raise ValueError("async boom")
        if action == "hang":
            await asyncio.sleep(3600)
        await asyncio.sleep(0.05)
        return f"ok from {os.getpid()}", 1.0, True, {}


class Countdown(BaseEnvironment):
    """Done when the model says the row's answer; a reward of 1 then."""

    def __init__(self, config: EnvironmentConfig):
        super().__init__(config)
        self.fail_at = config.get("fail_at")

    def reset(self, row: dict) -> str:
        if self.fail_at == "reset":
            raise RuntimeError("no level")
        self.answer = row["answer"]
        return row["problem"]

    def step(self, action: str):
        if self.fail_at == "step":
            raise RuntimeError("crashed")
        return "try again", float(action == self.answer), action == self.answer, {}

    def get_prompt_prefix(self) -> str:
        return "Say the number."


def add(a: int, b: int) -> int:
    """Add.

    Args:
        a: first
        b: second
    """
    return a + b


class AddTool(ToolEnvironment):
    """The answer after a calculator call; the tools reach the first prompt."""

    tools = (add,)

    def reset(self, row: dict) -> str:
        self.answer_text = row["answer"]
        return row["problem"]

    def answer(self, text: str):
        return "", float(text == self.answer_text), True, {}
