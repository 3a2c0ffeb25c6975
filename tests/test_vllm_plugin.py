"""The AMX-permission and compile-cache fixes are installed as a vLLM general plugin (loaded in every vLLM process)."""

import os
from importlib.metadata import entry_points

from async_rl import vllm_plugin


def test_entry_point_registered():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("async_rl_cpu_fixes") == "async_rl.vllm_plugin:register"


def test_vllm_loads_our_plugin():
    from vllm.plugins import load_plugins_by_group

    plugins = load_plugins_by_group("vllm.general_plugins")
    assert plugins["async_rl_cpu_fixes"] is vllm_plugin.register


def test_register_is_idempotent(monkeypatch):
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)  # register() sets it: not for the rest of the session
    first = vllm_plugin.request_amx_permission()
    vllm_plugin.register()
    assert vllm_plugin.request_amx_permission() == first


def test_aot_compile_is_off_on_cpu_unless_the_user_set_it(monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    assert vllm_plugin.keep_the_compile_cache_on_cpu() == current_platform.is_cpu()  # a GPU's compile cache loads
    assert os.environ.get("VLLM_USE_AOT_COMPILE") == ("0" if current_platform.is_cpu() else None)
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    assert not vllm_plugin.keep_the_compile_cache_on_cpu()
    assert os.environ["VLLM_USE_AOT_COMPILE"] == "1"
