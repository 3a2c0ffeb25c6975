"""Tool use: parsing Hermes/Qwen tool calls, running typed tools, errors as feedback, and
token-exact episodes whose tools reach the prompt through the chat template."""

from __future__ import annotations

import asyncio
import copy
import time

import pytest

from async_rl.config import EnvConfig
from async_rl.envs import EnvPool, run_episode
from async_rl.envs.conversation import ChatEncoder, TokenTrajectory
from async_rl.envs.tools import MAX_CALL_CHARS, MAX_RESULT_CHARS, Tool, ToolCall, ToolDefinitionError, ToolEnvironment, parse_tool_calls

# Qwen2.5's handling of tools and tool messages (system block with <tools>, consecutive tool
# results grouped into one user turn of <tool_response> blocks), without its default system prompt.
QWEN_TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first addend
        b: the second addend
    """
    return a + b


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: the dividend
        b: the divisor
    """
    return a / b


class Calculator(ToolEnvironment):
    tools = (add, divide)

    def reset(self) -> str:
        return "What is 12+30?"

    def answer(self, text: str):
        return "", float(text.strip() == "42"), True, {"success": text.strip() == "42"}


def call(name: str, **arguments) -> str:
    import json

    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def test_parse_tool_calls_in_order_and_names_what_is_malformed():
    text = f"Let me add. {call('add', a=1, b=2)} and {call('divide', a=1, b=4)}"
    assert parse_tool_calls(text) == [ToolCall("add", {"a": 1, "b": 2}), ToolCall("divide", {"a": 1, "b": 4})]
    assert parse_tool_calls("no calls here") == []
    assert parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>') == [ToolCall("add", {"a": 1})]
    (bad,) = parse_tool_calls("<tool_call>{name: add}</tool_call>")
    assert isinstance(bad, str) and bad.startswith("the tool call is not valid JSON")
    assert parse_tool_calls('<tool_call>["add"]</tool_call>') == ['a tool call must be {"name": <tool name>, "arguments": {...}}']
    assert parse_tool_calls('<tool_call>{"name": "add", "arguments": [1]}</tool_call>') == ["the arguments of add must be a JSON object"]
    assert parse_tool_calls('<tool_call>{"name": "add"') == ["a <tool_call> is not closed by </tool_call>"]


def test_hostile_tool_call_text_is_answered_with_errors_in_linear_time():
    """The model's text is untrusted: deep JSON, huge calls and many unclosed tags are each an
    error for the model, never an exception out of the parser or a quadratic scan."""
    deep = "[" * 20_000 + "]" * 20_000
    assert parse_tool_calls(f'<tool_call>{{"name": "add", "arguments": {deep}}}</tool_call>') == ["the tool call nests JSON too deeply"]
    assert parse_tool_calls(f'<tool_call>{{"name": "add", "arguments": "{deep}"}}</tool_call>') == ["the arguments of add must be a JSON object"]
    huge = '{"name": "add", "arguments": {"a": "' + "x" * MAX_CALL_CHARS + '"}}'
    assert parse_tool_calls(f"<tool_call>{huge}</tool_call>") == [f"the tool call has {len(huge)} characters, more than the {MAX_CALL_CHARS} read"]
    started = time.monotonic()
    assert parse_tool_calls("<tool_call>" * 200_000) == ["a <tool_call> is not closed by </tool_call>"]
    assert time.monotonic() - started < 1.0  # the lazy regex took minutes on this


def test_a_long_tool_answer_is_cut_and_says_so():
    from async_rl.envs import EnvironmentConfig

    class Echo(Calculator):
        tools = (repeat,)

    observation, _, _, info = Echo(EnvironmentConfig()).step(call("repeat", text="y", times=MAX_RESULT_CHARS + 10))
    assert observation == [{"role": "tool", "content": "y" * MAX_RESULT_CHARS + "\n[... 10 more characters cut]"}]
    assert info == {"tool_calls": 1, "tool_errors": 0}


def repeat(text: str, times: int) -> str:
    """Repeat the text.

    Args:
        text: what to repeat
        times: how often
    """
    return text * times


def test_a_tool_is_described_by_its_type_hints_and_docstring():
    schema = Tool.from_function(add).schema
    assert schema == {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "the first addend"},
                                                         "b": {"type": "integer", "description": "the second addend"}},
                       "required": ["a", "b"]}}}

    def undocumented(x: int) -> int:
        return x

    with pytest.raises(ToolDefinitionError, match="tool 'undocumented'.*'Args:'"):
        Tool.from_function(undocumented)


@pytest.mark.parametrize(
    ("action", "reply"),
    [
        (call("add", a=2, b=3), "5"),
        (call("divide", a=1, b=0), "Error: divide raised ZeroDivisionError: division by zero"),
        (call("mul", a=1, b=2), "Error: unknown tool 'mul'; the tools are add, divide"),
        (call("add", a=1), "Error: add: missing argument(s) b"),
        (call("add", a=1, b=2, c=3), "Error: add: unknown argument(s) c; add takes a, b"),
        (call("add", a="1", b=2), 'Error: add: argument a must be of type integer, got "1"'),
        (call("add", a=True, b=2), "Error: add: argument a must be of type integer, got true"),
        ("<tool_call>{oops}</tool_call>", "Error: the tool call is not valid JSON (Expecting property name enclosed in double quotes at character 1)"),
    ],
)
def test_each_tool_call_gets_a_tool_message_and_bad_ones_an_error(action: str, reply: str):
    from async_rl.envs import EnvironmentConfig

    observation, reward, done, info = Calculator(EnvironmentConfig()).step(action)
    assert observation == [{"role": "tool", "content": reply}] and reward == 0.0 and not done
    assert info == {"tool_calls": 1, "tool_errors": int(reply.startswith("Error"))}


def test_a_turn_without_a_tool_call_is_the_answer_and_too_many_calls_are_refused():
    from async_rl.envs import EnvironmentConfig

    env = Calculator(EnvironmentConfig())
    assert env.step("42") == ("", 1.0, True, {"tool_calls": 0, "tool_errors": 0, "success": True})
    env.max_calls_per_turn = 1
    observation, _, _, info = env.step(call("add", a=1, b=1) + call("add", a=2, b=2))
    assert [m["content"] for m in observation] == ["2", "Error: more than 1 tool calls in one turn"]
    assert info == {"tool_calls": 2, "tool_errors": 1}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory):
    """The tiny assets' tokenizer (its template takes no tools) and a copy with a Qwen2.5-style one."""
    from async_rl.tiny.addition import make_splits
    from async_rl.tiny.text import N_TRAIN, N_VAL, TASK, _build_tokenizer

    train, _ = make_splits(TASK, 0, N_TRAIN, N_VAL)
    plain = _build_tokenizer(train, tmp_path_factory.mktemp("tokenizer"))
    qwen = copy.deepcopy(plain)
    qwen.chat_template = QWEN_TOOLS_TEMPLATE
    return {"plain": plain, "qwen": qwen}


@pytest.mark.parametrize("template", ["plain", "qwen"])
def test_a_tool_episode_is_token_exact_and_its_tools_are_in_the_prompt(tokenizers, template: str):
    """A tool call, two results in one turn, then the answer: the tokens equal the template's
    rendering of the whole conversation (tools included), and only the model's are trained."""
    from async_rl.envs import EnvironmentConfig

    tokenizer = tokenizers[template]
    encoder = ChatEncoder(tokenizer)
    schemas = Calculator(EnvironmentConfig()).tool_schemas()
    replies = [call("add", a=12, b=30) + call("divide", a=84, b=2), "42"]
    rendered: list[dict[str, str]] = []
    traj: TokenTrajectory | None = None

    async def act(new):
        nonlocal traj
        rendered.extend(new)
        if traj is None:
            assert env.tools == schemas  # what the environment process sent with the first observation
            traj = TokenTrajectory(encoder.start(new, env.tools))
        else:
            traj.add_context(encoder.append(new))
        reply = replies[sum(m["role"] == "assistant" for m in rendered)]
        ids = tokenizer(reply, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        traj.add_model(ids, [-1.0] * len(ids), [0] * len(ids))
        traj.add_context(encoder.close_reply(ids))
        rendered.append({"role": "assistant", "content": reply})
        return reply

    async def go():
        nonlocal env
        async with EnvPool(EnvConfig(name=f"{__file__}:Calculator", num_workers=1)) as pool:
            env = pool.open()
            try:
                return await run_episode(env, act, max_turns=4)
            finally:
                env.close()

    env = None
    trajectory = asyncio.run(go())
    assert trajectory.success and trajectory.info_total("tool_calls") == 2 and trajectory.info_total("tool_errors") == 0
    assert rendered[0]['role'] == 'system' and rendered[3:5] == [{"role": "tool", "content": "42"}, {"role": "tool", "content": "42.0"}]
    if template == "qwen":
        full = tokenizer.apply_chat_template(rendered, tools=schemas, tokenize=False)
    else:  # the template takes no tools: their description follows the system prompt
        assert not encoder.template_takes_tools
        from async_rl.envs.tools import tools_system_text

        system = {"role": "system", "content": f"{rendered[0]['content']}\n\n{tools_system_text(schemas)}"}
        full = tokenizer.apply_chat_template([system, *rendered[1:]], tokenize=False)
    assert '"name": "add"' in tokenizer.decode(traj.prompt_ids)
    assert traj.context() == tokenizer(full, add_special_tokens=False)["input_ids"]
    trained = [t for t, m in zip(traj.token_ids, traj.mask) if m]
    assert tokenizer.decode(trained) == "".join(r + "<|im_end|>" for r in replies)
