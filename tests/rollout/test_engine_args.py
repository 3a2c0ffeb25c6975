"""Engine arguments from the config: what a request to the OpenAI-compatible API may make the
server read (vLLM's own media connector, built with the engine's values)."""

from __future__ import annotations

import base64
import io
import socket

import pytest
from PIL import Image

from async_rl.config import load_config
from async_rl.rollout.engine_args import engine_kwargs, openai_api_settings


def test_the_key_reaches_the_server_settings_and_no_repr_shows_it() -> None:
    key = "k3y-0123456789abcdef"
    settings = openai_api_settings(load_config(None, ["rollout.openai_host=0.0.0.0", f"rollout.openai_api_key={key}"]))
    assert settings is not None and settings.api_key == key and settings.for_server(1).api_key == key
    assert key not in repr(settings)


def test_media_urls_and_local_files_are_refused_data_uris_are_read(tmp_path) -> None:
    from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY, ImageMediaIO

    kwargs = engine_kwargs(load_config())
    connector = MEDIA_CONNECTOR_REGISTRY.load("http", allowed_local_media_path=kwargs["allowed_local_media_path"],
                                              allowed_media_domains=kwargs["allowed_media_domains"])
    with socket.create_server(("127.0.0.1", 0)) as listener:  # a URL that would answer, were it fetched
        listener.settimeout(0.2)
        with pytest.raises(ValueError, match="allowed domains"):
            connector.load_from_url(f"http://127.0.0.1:{listener.getsockname()[1]}/cat.png", ImageMediaIO())
        with pytest.raises(TimeoutError):
            listener.accept()  # nothing connected
    image = tmp_path / "cat.png"
    Image.new("RGB", (4, 4), "red").save(image)
    with pytest.raises(RuntimeError, match="allowed-local-media-path"):
        connector.load_from_url(image.as_uri(), ImageMediaIO())
    png = io.BytesIO()
    Image.new("RGB", (4, 4), "red").save(png, format="PNG")
    data_uri = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    assert connector.load_from_url(data_uri, ImageMediaIO()).size == (4, 4)


def test_lora_engines_get_the_smallest_max_lora_rank_vllm_accepts() -> None:
    import typing

    from vllm.config.lora import MaxLoRARanks

    from async_rl.config import VLLM_LORA_RANKS
    from async_rl.rollout.engine_args import vllm_max_lora_rank

    assert VLLM_LORA_RANKS == typing.get_args(MaxLoRARanks)  # vLLM's list, still
    assert [vllm_max_lora_rank(r) for r in (1, 2, 8, 9, 16, 300, 321, 512)] == [1, 8, 8, 16, 16, 320, 512, 512]
    with pytest.raises(ValueError, match="LoRA rank 513 is above vLLM's largest max_lora_rank"):
        vllm_max_lora_rank(513)
    kwargs = engine_kwargs(load_config(None, ["learner.lora.rank=12", "rollout.openai_api=false"]))
    assert {k: kwargs[k] for k in ("enable_lora", "max_lora_rank", "max_loras", "max_cpu_loras")} == {
        "enable_lora": True, "max_lora_rank": 16, "max_loras": 1, "max_cpu_loras": 1}
    assert "enable_lora" not in engine_kwargs(load_config())
