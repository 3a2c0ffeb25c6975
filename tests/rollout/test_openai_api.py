"""The OpenAI-compatible API's guards without an engine: the bearer-key middleware on a small
ASGI app, and the refusal of vLLM's dev mode (the API on the real engine: test_rollout_pool.py)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI

from async_rl.rollout.openai_api import (
    BearerKeyMiddleware,
    DevModeError,
    OpenAIApiSettings,
    dev_mode_problem,
)
from async_rl.rollout.server import InferenceServer

KEY = "k3y-0123456789abcdef"


def _app() -> BearerKeyMiddleware:
    app = FastAPI()
    app.add_api_route("/health", lambda: {"ok": True})
    app.add_api_route("/v1/models", lambda: {"data": []})
    app.add_api_route("/invocations", lambda: {"done": True}, methods=["POST"])
    return BearerKeyMiddleware(app, KEY)


def _statuses(requests: list[tuple[str, str, dict[str, str]]]) -> list[int]:
    async def go() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=_app()), base_url="http://api") as client:
            return [(await client.request(method, path, headers=headers)).status_code for method, path, headers in requests]

    return asyncio.run(go())


def test_every_route_but_health_needs_the_bearer_key() -> None:
    right = {"Authorization": f"Bearer {KEY}"}
    assert _statuses([
        ("GET", "/v1/models", {}),
        ("GET", "/v1/models", {"Authorization": "Bearer wrong-key-0123456789"}),
        ("GET", "/v1/models", {"Authorization": f"Basic {KEY}"}),
        ("GET", "/v1/models", {"Authorization": f"Bearer {KEY}x"}),
        ("POST", "/invocations", {}),  # outside vLLM's own guarded prefixes
        ("GET", "/nowhere", {}),
        ("GET", "/health", {}),
        ("GET", "/v1/models", right),
        ("GET", "/v1/models", {"authorization": f"bearer {KEY}"}),
        ("POST", "/invocations", right),
    ]) == [401, 401, 401, 401, 401, 401, 200, 200, 200, 200]


def test_a_401_says_how_to_authenticate_in_the_openai_error_shape() -> None:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=_app()), base_url="http://api") as client:
            return await client.get("/v1/models")

    res = asyncio.run(go())
    assert res.status_code == 401 and res.headers["www-authenticate"] == "Bearer"
    assert res.json()["error"]["code"] == "invalid_api_key" and "Authorization: Bearer" in res.json()["error"]["message"]


@pytest.mark.parametrize(("value", "refused"), [("", False), ("0", False), (" 0 ", False), ("1", True), ("true", True), ("2", True)])
def test_dev_mode_is_refused_when_set_to_anything_but_zero(value: str, refused: bool) -> None:
    problem = dev_mode_problem({"VLLM_SERVER_DEV_MODE": value})
    assert (problem is not None) == refused
    if refused:
        assert "VLLM_SERVER_DEV_MODE" in problem and "/collective_rpc" in problem and "rollout.openai_api=false" in problem
    assert dev_mode_problem({}) is None


def test_a_server_refuses_dev_mode_before_it_builds_its_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    server = InferenceServer("server-0", {"model": "/no/such/model"}, openai_api=OpenAIApiSettings(api_key=KEY))
    with pytest.raises(DevModeError, match="VLLM_SERVER_DEV_MODE='1' is set"):
        asyncio.run(server.start())
    assert KEY not in repr(server.openai_api)
