"""Prompt datasets: reading EasyR1-style JSONL rows and rendering them as chat prompts.

A malformed row never stops a run: it is returned as a :class:`RejectedRow` (line number,
reason, raw text) that the caller counts and writes to a dead-letter file.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import jinja2


@dataclass(frozen=True)
class PromptRow:
    """One usable dataset row."""

    line: int
    """1-based line number in the source file."""
    prompt: str
    """Prompt text (before the chat template)."""
    answer: str
    """Reference answer, as a string, handed to the reward function as ``ground_truth``."""


@dataclass(frozen=True)
class RejectedRow:
    """A row that could not be used, with the reason and its raw text (for the dead-letter file)."""

    line: int
    reason: str
    raw: str


def read_prompt_rows(path: str | Path, prompt_key: str = "problem", answer_key: str = "answer") -> tuple[list[PromptRow], list[RejectedRow]]:
    """Read a JSONL file of objects with ``prompt_key`` and ``answer_key`` fields.

    Blank lines are ignored. Raises FileNotFoundError (with the path) if the file is missing.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"dataset file {str(p)!r} not found (check data.train_files / data.val_files)")
    rows: list[PromptRow] = []
    rejected: list[RejectedRow] = []
    with p.open(encoding="utf-8", errors="replace") as fh:
        for line_no, raw in enumerate(fh, start=1):
            text = raw.strip()
            if not text:
                continue
            row, reason = _parse_row(text, prompt_key, answer_key)
            if row is None:
                rejected.append(RejectedRow(line_no, f"{p.name} line {line_no}: {reason}", text))
            else:
                rows.append(PromptRow(line_no, *row))
    return rows, rejected


def _parse_row(text: str, prompt_key: str, answer_key: str) -> tuple[tuple[str, str] | None, str]:
    try:
        obj: Any = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, f"not valid JSON ({exc.msg} at column {exc.colno})"
    if not isinstance(obj, dict):
        return None, f"expected a JSON object, got {type(obj).__name__}"
    for key, setting in ((prompt_key, "data.prompt_key"), (answer_key, "data.answer_key")):
        if key not in obj:
            return None, f"no field {key!r} (fields: {', '.join(map(str, obj)) or 'none'}); set {setting} to the field that holds it"
    prompt, answer = obj[prompt_key], obj[answer_key]
    if not isinstance(prompt, str) or not prompt.strip():
        return None, f"field {prompt_key!r} must be a non-empty string, got {prompt!r:.60}"
    if isinstance(answer, (dict, list)) or answer is None:
        return None, f"field {answer_key!r} must be a string or a number, got {answer!r:.60}"
    return (prompt, str(answer)), ""


def write_rejected(rejected: list[RejectedRow], path: str | Path) -> None:
    """Append rejected rows to a JSONL dead-letter file (one object per row)."""
    if not rejected:
        return
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a", encoding="utf-8") as fh:
        for row in rejected:
            fh.write(json.dumps(asdict(row)) + "\n")


class PromptFormatter:
    """Renders prompt text into the model's chat format.

    ``format_prompt`` is the path of a Jinja template that receives ``content`` (the prompt
    text) and renders the user message, as EasyR1's ``format_prompt``; ``system_prompt`` is
    put first when given. The tokenizer's chat template does the rest.
    """

    def __init__(self, tokenizer: Any, system_prompt: str | None = None, format_prompt: str | Path | None = None):
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        self.template = None
        if format_prompt is not None:
            path = Path(format_prompt)
            if not path.is_file():
                raise FileNotFoundError(f"data.format_prompt template {str(path)!r} not found")
            self.template = jinja2.Environment(undefined=jinja2.StrictUndefined).from_string(path.read_text())
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template; add one to tokenizer_config.json (key 'chat_template')")

    def messages(self, text: str) -> list[dict[str, str]]:
        """Chat messages for one prompt."""
        content = self.template.render(content=text) if self.template is not None else text
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return msgs + [{"role": "user", "content": content}]

    def render(self, text: str) -> str:
        """Prompt string ending with the assistant turn's opening."""
        return self.tokenizer.apply_chat_template(self.messages(text), tokenize=False, add_generation_prompt=True)

    def token_ids(self, text: str) -> list[int]:
        """Token ids of :meth:`render` (no special tokens added beyond the template's)."""
        return self.tokenizer(self.render(text), add_special_tokens=False)["input_ids"]
