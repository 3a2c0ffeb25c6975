"""Prompt datasets: reading EasyR1-style JSONL rows and rendering them as chat prompts.

A malformed row never stops a run: it is returned as a :class:`RejectedRow` (line number,
reason, raw text) that the caller counts and writes to a dead-letter file. A row with an
``images`` list (``data.image_key``) is a vision-language row: each image is opened and
checked when the file is read (:mod:`async_rl.data.images`), so a missing or undecodable
image, or a prompt whose ``<image>`` placeholders do not match its images, rejects the row.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from async_rl.appendlog import append_lines
from async_rl.data.images import ImageError, PixelBounds, chat_content, load_image, normalise_ref

if TYPE_CHECKING:
    from async_rl.config import DataConfig


@dataclass(frozen=True)
class PromptRow:
    """One usable dataset row."""

    line: int
    """1-based line number in the source file."""
    prompt: str
    """Prompt text (before the chat template)."""
    answer: str
    """Reference answer, as a string, handed to the reward function as ``ground_truth``."""
    images: tuple[str, ...] = ()
    """Image references (data URIs or absolute paths), one per ``<image>`` in ``prompt``."""


@dataclass(frozen=True)
class RejectedRow:
    """A row that could not be used, with the reason and its raw text (for the dead-letter file)."""

    line: int
    reason: str
    raw: str


@dataclass(frozen=True)
class ImageFields:
    """Where a row's images are and how they are checked (``data.image_key``,
    ``data.image_dir``, ``data.min_pixels``/``max_pixels``)."""

    key: str = "images"
    base_dir: str | None = None
    """Folder of relative image paths; None: the dataset file's folder."""
    bounds: PixelBounds = PixelBounds(1, 2**31 - 1)

    @classmethod
    def from_config(cls, data: DataConfig) -> ImageFields:
        """The image fields of the ``data`` config section (how :func:`read_prompt_rows` finds
        and checks that dataset's images)."""
        return cls(data.image_key, data.image_dir, PixelBounds(data.min_pixels, data.max_pixels))


def read_prompt_rows(
    path: str | Path, prompt_key: str = "problem", answer_key: str = "answer", images: ImageFields = ImageFields()
) -> tuple[list[PromptRow], list[RejectedRow]]:
    """Read a JSONL file of objects with ``prompt_key`` and ``answer_key`` fields (and,
    for vision-language rows, a list of images under ``images.key``).

    Blank lines are ignored. Raises FileNotFoundError (with the path) if the file is missing.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"dataset file {str(p)!r} not found (check data.train_files / data.val_files)")
    base_dir = Path(images.base_dir) if images.base_dir else p.resolve().parent
    rows: list[PromptRow] = []
    rejected: list[RejectedRow] = []
    with p.open(encoding="utf-8", errors="replace") as fh:
        for line_no, raw in enumerate(fh, start=1):
            text = raw.strip()
            if not text:
                continue
            row, reason = _parse_row(text, prompt_key, answer_key, images, base_dir)
            if row is None:
                rejected.append(RejectedRow(line_no, f"{p.name} line {line_no}: {reason}", text))
            else:
                rows.append(PromptRow(line_no, *row))
    return rows, rejected


def _parse_row(
    text: str, prompt_key: str, answer_key: str, images: ImageFields, base_dir: Path
) -> tuple[tuple[str, str, tuple[str, ...]] | None, str]:
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
    refs = obj.get(images.key) or []
    if not isinstance(refs, list):
        return None, f"field {images.key!r} must be a list of images (data.image_key), got {type(refs).__name__}"
    try:
        normalised = tuple(normalise_ref(ref, base_dir) for ref in refs)
        chat_content(prompt, len(normalised))
        for ref in normalised:
            load_image(ref, images.bounds)
    except ImageError as exc:
        return None, str(exc)
    return (prompt, str(answer), normalised), ""


def write_rejected(rejected: list[RejectedRow], path: str | Path) -> None:
    """Append rejected rows to a JSONL dead-letter file (one object per row)."""
    if not rejected:
        return
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    append_lines(out, [json.dumps(asdict(row)) for row in rejected])


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
            # Sandboxed: a template reaches no Python internals (``content.__class__`` ...).
            self.template = ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined).from_string(path.read_text())
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("the tokenizer has no chat template; add one to tokenizer_config.json (key 'chat_template')")

    def messages(self, text: str, num_images: int = 0) -> list[dict[str, Any]]:
        """Chat messages for one prompt; with images, the user content is EasyR1's list of
        text and image parts (split at each ``<image>``)."""
        content = self.template.render(content=text) if self.template is not None else text
        msgs: list[dict[str, Any]] = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return msgs + [{"role": "user", "content": chat_content(content, num_images)}]

    def render(self, text: str, num_images: int = 0) -> str:
        """Prompt string ending with the assistant turn's opening (one image token per image,
        not yet expanded: the inference server and the learner's processor expand it)."""
        return self.tokenizer.apply_chat_template(self.messages(text, num_images), tokenize=False, add_generation_prompt=True)

    def token_ids(self, text: str, num_images: int = 0) -> list[int]:
        """Token ids of :meth:`render` (no special tokens added beyond the template's)."""
        return self.tokenizer(self.render(text, num_images), add_special_tokens=False)["input_ids"]
