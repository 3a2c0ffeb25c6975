"""Token-exact multi-turn conversations: messages appended as token ids, one at a time.

The learner must train on exactly the tokens the model produced, so an episode's history is
never re-tokenised: the model's turns are kept as the token ids it generated (mask 1, with
their behaviour log-probs and versions) and everything else, the chat template's framing and
the environment's messages, is appended as the template renders it for those messages alone
(mask 0). Rendering "alone" is the difference between the template applied to a fixed anchor
conversation with and without the new messages, so templates that add a default system
prompt or number their turns still give the tokens they would give in the full conversation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from async_rl.envs.tools import tools_system_text

_ANCHOR = [{"role": "system", "content": "anchor"}, {"role": "user", "content": "anchor"}]
_MARK = "\u2063async-rl-reply\u2063"
_ANCHOR_REPLY = [*_ANCHOR, {"role": "assistant", "content": "anchor"}]
_APPEND_CACHE = 4096
"""Appended messages whose token ids are kept (the cache is cleared when full)."""


class TemplateError(ValueError):
    """The tokenizer's chat template does not render messages as a stable prefix extension."""


class ChatEncoder:
    """Token ids of chat messages for one tokenizer (HF API: ``apply_chat_template`` and ``__call__``)."""

    def __init__(self, tokenizer: Any):
        if getattr(tokenizer, "chat_template", None) is None:
            raise TemplateError("the tokenizer has no chat template; add one to tokenizer_config.json (key 'chat_template')")
        self.tokenizer = tokenizer
        closing = self._render([*_ANCHOR, {"role": "assistant", "content": _MARK}], False)
        if _MARK not in closing:
            raise TemplateError("the chat template drops the assistant's reply text")
        self.reply_suffix = closing.split(_MARK, 1)[1]
        """What the template puts after a reply's text (ChatML: ``<|im_end|>\\n``)."""
        eos = getattr(tokenizer, "eos_token", None)
        self.eos_token_id: int | None = getattr(tokenizer, "eos_token_id", None)
        self._after_eos = self.reply_suffix[len(eos):] if eos and self.reply_suffix.startswith(eos) else None
        self._anchor_text = self._render(_ANCHOR_REPLY, False)
        self._appended: dict[tuple[tuple[str, str], ...], list[int]] = {}
        self.append([{"role": "user", "content": "probe"}])  # a template that does not append fails here, before any episode

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool, tools: list[dict[str, Any]] | None = None) -> str:
        extra = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **extra)

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template renders a ``tools`` argument itself (Qwen2.5, Llama 3.1, ...)."""
        return "tools" in self.tokenizer.chat_template

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def start(self, messages: list[dict[str, str]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The prompt: ``messages`` rendered from the start, opening the assistant's turn.
        ``tools`` (JSON schemas) go to the template, or into the system message as text
        when the template takes none."""
        if tools and not self.template_takes_tools:
            text = tools_system_text(tools)
            if messages and messages[0]["role"] == "system":
                messages = [{"role": "system", "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
            else:
                messages = [{"role": "system", "content": text}, *messages]
            tools = None
        return self._ids(self._render(messages, True, tools))

    def append(self, messages: list[dict[str, str]]) -> list[int]:
        """Tokens that append ``messages`` (e.g. an observation) after a closed reply, opening
        the assistant's next turn."""
        key = tuple((m["role"], m["content"]) for m in messages)
        if (ids := self._appended.get(key)) is None:  # environments repeat their messages ("Higher.")
            after = self._render(_ANCHOR_REPLY + messages, True)
            if not after.startswith(self._anchor_text):
                raise TemplateError("the chat template renders earlier messages differently once more follow; "
                                    "multi-turn episodes need a template that only appends")
            ids = self._ids(after[len(self._anchor_text):])
            if len(self._appended) >= _APPEND_CACHE:
                self._appended.clear()
            self._appended[key] = ids
        return list(ids)

    def close_reply(self, reply_ids: list[int]) -> list[int]:
        """Tokens the template puts after the model's reply ``reply_ids``: after an EOS the
        model generated, what follows it (ChatML: ``\\n``); after a reply cut short, the
        whole suffix (``<|im_end|>\\n``)."""
        if reply_ids and self._after_eos is not None and reply_ids[-1] == self.eos_token_id:
            return self._ids(self._after_eos)
        return self._ids(self.reply_suffix)


@dataclass
class TokenTrajectory:
    """One episode as the learner sees it: ``prompt_ids`` (the first prompt, not trained),
    then ``token_ids`` with ``mask`` (1: generated by the model, 0: template or environment),
    ``logprobs`` (behaviour log-probs; 0.0 where the mask is 0) and ``versions`` (the policy
    version of each model token; the version of the turn before for the others)."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def context(self) -> list[int]:
        """Every token so far: what the next model turn is generated after."""
        return self.prompt_ids + self.token_ids

    def add_model(self, token_ids: list[int], logprobs: list[float], versions: list[int]) -> None:
        """Append a model turn exactly as generated."""
        if not len(token_ids) == len(logprobs) == len(versions):
            raise ValueError("a model turn needs one log-prob and one version per token")
        self.token_ids += token_ids
        self.mask += [1] * len(token_ids)
        self.logprobs += logprobs
        self.versions += versions

    def add_context(self, token_ids: list[int]) -> None:
        """Append template or environment tokens (not trained)."""
        version = self.versions[-1] if self.versions else 0
        self.token_ids += token_ids
        self.mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.versions += [version] * len(token_ids)
