"""Tool use: Hermes/Qwen tool calls parsed from the model's turn and run as Python functions.

The model calls a tool by writing, anywhere in its turn::

    <tool_call>
    {"name": "add", "arguments": {"a": 2, "b": 3}}
    </tool_call>

:class:`ToolEnvironment` runs every call of a turn in order and answers with one
``{"role": "tool", "content": ...}`` message per call (Qwen's template renders them as
``<tool_response>`` blocks). A turn without a tool call is the model's answer
(:meth:`ToolEnvironment.answer`). A bad call (not JSON, an unknown tool, wrong arguments, a
tool that raised) is answered with an ``Error: ...`` tool message and counted in the step's
``info["tool_errors"]``; it never ends the episode. Tools are typed Python functions with a
Google-style docstring; their JSON schemas (``transformers.utils.get_json_schema``) go into
the system prompt through the tokenizer's chat template (its ``tools`` argument), or as
Hermes-style text when the template takes no tools.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from async_rl.envs.base import BaseEnvironment, EnvironmentConfig

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
MAX_CALL_CHARS = 65536
"""Characters of one ``<tool_call>`` body at most: a longer one is answered with an error
before it is parsed (the model's text is untrusted: parsing cost stays linear and bounded)."""
MAX_RESULT_CHARS = 65536
"""Characters of one tool's answer at most; a longer one is cut (and says so) before the
chat template and the tokenizer see it."""
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "integer": (int,), "number": (int, float), "string": (str,), "boolean": (bool,), "array": (list,), "object": (dict,),
}


class ToolDefinitionError(ValueError):
    """A tool function cannot be described to the model (missing type hints or docstring)."""


@dataclass(frozen=True)
class Tool:
    """A Python function the model may call, with its JSON schema (OpenAI function format)."""

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]

    @classmethod
    def from_function(cls, fn: Callable[..., Any]) -> Tool:
        """Describe ``fn`` from its type hints and its Google-style docstring (``Args:``)."""
        from transformers.utils import get_json_schema

        try:
            schema = get_json_schema(fn)
        except Exception as exc:  # noqa: BLE001 - transformers raises several types; one message for all
            raise ToolDefinitionError(
                f"tool {getattr(fn, '__name__', fn)!r}: {exc}. A tool needs a type hint for every argument and a "
                "docstring with a description and an 'Args:' line per argument"
            ) from None
        schema["function"].pop("return", None)
        return cls(schema["function"]["name"], fn, schema)

    def check_arguments(self, arguments: Mapping[str, Any]) -> str | None:
        """What is wrong with ``arguments`` for this tool, or None."""
        params = self.schema["function"]["parameters"]
        props: dict[str, Any] = params.get("properties", {})
        if missing := [k for k in params.get("required", []) if k not in arguments]:
            return f"missing argument(s) {', '.join(missing)}"
        if unknown := [k for k in arguments if k not in props]:
            return f"unknown argument(s) {', '.join(unknown)}; {self.name} takes {', '.join(props) or 'none'}"
        for key, value in arguments.items():
            types = _JSON_TYPES.get(props[key].get("type", ""))
            if types and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
                return f"argument {key} must be of type {props[key]['type']}, got {json.dumps(value)}"
        return None


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its arguments."""

    name: str
    arguments: dict[str, Any]


def _bodies(text: str) -> tuple[list[str], bool]:
    """The bodies of the ``<tool_call>...</tool_call>`` blocks of ``text``, in order, and
    whether a ``<tool_call>`` is left unclosed. One pass (a lazy regex over many unclosed
    tags is quadratic)."""
    bodies, start = [], text.find(_OPEN)
    while start != -1:
        end = text.find(_CLOSE, start + len(_OPEN))
        if end == -1:
            return bodies, True
        bodies.append(text[start + len(_OPEN) : end])
        start = text.find(_OPEN, end + len(_CLOSE))
    return bodies, False


def _json(body: str) -> Any:
    """``json.loads(body)``; :class:`ValueError` with the reason for the model."""
    try:
        return json.loads(body)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})") from None
    except RecursionError:  # nesting deeper than the interpreter's stack
        raise ValueError("the tool call nests JSON too deeply") from None


def parse_tool_calls(text: str) -> list[ToolCall | str]:
    """The tool calls in ``text``, in order; a call that cannot be parsed is its error message."""
    out: list[ToolCall | str] = []
    bodies, unclosed = _bodies(text)
    for body in bodies:
        if len(body) > MAX_CALL_CHARS:
            out.append(f"the tool call has {len(body)} characters, more than the {MAX_CALL_CHARS} read")
            continue
        try:
            call = _json(body)
        except ValueError as exc:
            out.append(str(exc))
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            out.append('a tool call must be {"name": <tool name>, "arguments": {...}}')
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = _json(arguments)
            except ValueError:
                pass
        if not isinstance(arguments, dict):
            out.append(f"the arguments of {call['name']} must be a JSON object")
            continue
        out.append(ToolCall(call["name"], arguments))
    if unclosed:
        out.append("a <tool_call> is not closed by </tool_call>")
    return out


def tools_system_text(schemas: Sequence[dict[str, Any]]) -> str:
    """The Hermes-style description of ``schemas`` for templates without tool support
    (the text Qwen2.5's own template writes)."""
    listed = "\n".join(json.dumps(s, ensure_ascii=False) for s in schemas)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


class ToolEnvironment(BaseEnvironment):
    """An environment whose model may call tools before it answers.

    Subclasses list their tools in ``tools`` (or override :meth:`get_tools`) and implement
    ``reset`` and :meth:`answer` (the turn without a tool call). ``step`` is this class's:
    each tool call gets a tool message; ``info`` carries ``tool_calls`` and ``tool_errors``.
    """

    tools: Sequence[Callable[..., Any]] = ()
    max_calls_per_turn: int = 8
    """Tool calls run per turn at most; the rest are answered with an error."""

    def __init__(self, config: EnvironmentConfig):
        super().__init__(config)
        self._tools = {t.name: t for t in map(Tool.from_function, self.get_tools())}

    def get_tools(self) -> Sequence[Callable[..., Any]]:
        """The functions the model may call."""
        return self.tools

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools' JSON schemas (OpenAI function format), for the chat template."""
        return [t.schema for t in self._tools.values()]

    @abc.abstractmethod
    def answer(self, text: str) -> tuple[str | list[dict[str, str]], float, bool, dict[str, Any]]:
        """The model's turn without a tool call: ``(observation, reward, done, info)`` as ``step``."""

    def step(self, action: str) -> tuple[str | list[dict[str, str]], float, bool, dict[str, Any]]:
        calls = parse_tool_calls(action)
        if not calls:
            observation, reward, done, info = self.answer(action)
            return observation, reward, done, {"tool_calls": 0, "tool_errors": 0, **info}
        results = [self._run(call) if i < self.max_calls_per_turn else (False, f"more than {self.max_calls_per_turn} tool calls in one turn")
                   for i, call in enumerate(calls)]
        messages = [{"role": "tool", "content": text if ok else f"Error: {text}"} for ok, text in results]
        return messages, 0.0, False, {"tool_calls": len(calls), "tool_errors": sum(not ok for ok, _ in results)}

    def _run(self, call: ToolCall | str) -> tuple[bool, str]:
        """``(ok, result text)`` of one call."""
        if isinstance(call, str):
            return False, call
        tool = self._tools.get(call.name)
        if tool is None:
            return False, f"unknown tool {call.name!r}; the tools are {', '.join(self._tools) or 'none'}"
        if problem := tool.check_arguments(call.arguments):
            return False, f"{call.name}: {problem}"
        try:
            result = tool.fn(**call.arguments)
        except Exception as exc:  # noqa: BLE001 - the tool's failure is the model's feedback, not the run's
            return False, f"{call.name} raised {type(exc).__name__}: {exc}"
        text = result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)
        if len(text) > MAX_RESULT_CHARS:
            text = f"{text[:MAX_RESULT_CHARS]}\n[... {len(text) - MAX_RESULT_CHARS} more characters cut]"
        return True, text
