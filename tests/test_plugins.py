"""plugins.Registry: registering, listing, did-you-mean errors, resolving path/to/file.py:name."""

from __future__ import annotations

from pathlib import Path

import pytest

from async_rl.plugins import Registry, load_from_file


def _registry() -> Registry[object]:
    registry: Registry[object] = Registry("greeting", key="demo.greeting", accepts=callable, expected="a function")

    @registry.register("hello")
    def hello() -> str:
        return "hello"

    registry.add("hi", lambda: "hi")
    return registry


def test_register_names_and_get() -> None:
    registry = _registry()
    assert registry.names() == ["hello", "hi"]
    assert registry.get("hello")() == "hello"  # type: ignore[operator]
    with pytest.raises(ValueError, match="greeting 'hi' is already registered"):
        registry.add("hi", print)


def test_unknown_name_suggests_and_lists() -> None:
    registry = _registry()
    with pytest.raises(ValueError, match=r"unknown greeting 'helo' \(did you mean 'hello'\?\); valid names: hello, hi"):
        registry.get("helo")
    with pytest.raises(ValueError, match=r"unknown greeting 'helo' \(did you mean 'hello'\?\) \(from demo.greeting\); use a built-in \(hello, hi\)"):
        registry.resolve("helo")
    with pytest.raises(ValueError, match=r"valid names: none yet"):
        Registry("thing").get("x")


def test_resolve_a_built_in_or_a_file(tmp_path: Path) -> None:
    registry = _registry()
    assert registry.resolve("hi")() == "hi"  # type: ignore[operator]
    path = tmp_path / "mine.py"
    path.write_text("def greet():\n    return 'mine'\n\nNUMBER = 3\n")
    assert registry.resolve(f"{path}:greet")() == "mine"  # type: ignore[operator]
    with pytest.raises(ValueError, match=rf"demo.greeting='{path}:NUMBER' is not a function"):
        registry.resolve(f"{path}:NUMBER")
    with pytest.raises(ValueError, match=r"has no 'nope' \(from demo.greeting="):
        registry.resolve(f"{path}:nope")
    with pytest.raises(FileNotFoundError, match="greeting file .* not found"):
        registry.resolve(f"{tmp_path / 'missing.py'}:greet")
    assert "greet" not in registry.names()  # resolving a file registers nothing


def test_load_from_file_needs_the_form(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is not of the form path/to/file.py:name"):
        load_from_file(f"{tmp_path}/x.py:", "demo.key", "thing")



def test_where_in_user_code_is_the_innermost_frame_of_the_users_own_file(tmp_path) -> None:
    import json
    import os

    import async_rl.plugins as plugins

    user, ours, stdlib = str(tmp_path / "my_reward.py"), plugins.__file__, json.__file__
    assert plugins.where_in_user_code([(ours, 10, "call"), (user, 7, "score"), (stdlib, 99, "loads")]) == f"{user}:7 in score"
    assert plugins.where_in_user_code([(stdlib, 1, "x"), (ours, 12, "exact_match"), (stdlib, 99, "loads")]) == f"{ours}:12 in exact_match"
    assert plugins.where_in_user_code([(stdlib, 99, "loads")]) == f"{stdlib}:99 in loads"
    assert plugins.where_in_user_code([]) == ""
    assert plugins.is_user_file(user) and not plugins.is_user_file(os.__file__) and not plugins.is_user_file("<string>")
