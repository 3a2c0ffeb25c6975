"""Dataset rows (malformed ones rejected with reasons, dead-lettered) and chat formatting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jinja2.exceptions import SecurityError

from async_rl.data.prompts import PromptFormatter, read_prompt_rows, write_rejected


def test_malformed_rows_are_rejected_with_line_and_reason(tmp_path: Path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join([
        '{"problem": "What is 1+2?", "answer": "3"}',
        '{"problem": "What is 2+2?", "answer": 4}',
        "not json at all",
        '["a", "list"]',
        '{"question": "What?", "answer": "1"}',
        '{"problem": "", "answer": "1"}',
        '{"problem": "What is 5+5?", "answer": null}',
        "",
    ]) + "\n")
    rows, rejected = read_prompt_rows(path)
    assert [(r.line, r.prompt, r.answer) for r in rows] == [(1, "What is 1+2?", "3"), (2, "What is 2+2?", "4")]
    reasons = {r.line: r.reason for r in rejected}
    assert set(reasons) == {3, 4, 5, 6, 7}
    assert "train.jsonl line 3: not valid JSON" in reasons[3]
    assert "expected a JSON object, got list" in reasons[4]
    assert "no field 'problem' (fields: question, answer); set data.prompt_key" in reasons[5]
    assert "must be a non-empty string" in reasons[6]
    assert "must be a string or a number" in reasons[7]

    dead = tmp_path / "run" / "rejected_rows.jsonl"
    write_rejected(rejected, dead)
    lines = [json.loads(line) for line in dead.read_text().splitlines()]
    assert [d["line"] for d in lines] == [3, 4, 5, 6, 7] and lines[0]["raw"] == "not json at all"


def test_custom_keys_and_missing_file(tmp_path: Path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"question": "Q?", "solution": "A"}\n')
    rows, rejected = read_prompt_rows(path, prompt_key="question", answer_key="solution")
    assert rows[0].prompt == "Q?" and rows[0].answer == "A" and not rejected
    with pytest.raises(FileNotFoundError, match="data.train_files"):
        read_prompt_rows(tmp_path / "missing.jsonl")


@pytest.mark.assets
def test_formatter_chat_template_system_prompt_and_jinja(tiny_assets, tmp_path: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_assets.model_dir)
    template = tmp_path / "fmt.jinja"
    template.write_text("Solve: {{ content }}")
    fmt = PromptFormatter(tok, system_prompt="Be brief.", format_prompt=template)
    assert fmt.messages("1+1?") == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Solve: 1+1?"}]
    text = fmt.render("1+1?")
    assert "Solve: 1+1?" in text and "Be brief." in text and text.endswith("<|im_start|>assistant\n")
    assert tok.decode(fmt.token_ids("1+1?")) == text
    with pytest.raises(FileNotFoundError, match="data.format_prompt"):
        PromptFormatter(tok, format_prompt=tmp_path / "missing.jinja")
    template.write_text("{{ content.__class__.__mro__[1].__subclasses__() }}")  # the sandbox keeps Python's internals out
    with pytest.raises(SecurityError, match="__class__"):
        PromptFormatter(tok, format_prompt=template).messages("1+1?")
