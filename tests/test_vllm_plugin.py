"""The AMX-permission fix is installed as a vLLM general plugin (loaded in every vLLM process)."""

from importlib.metadata import entry_points

from async_rl import vllm_plugin


def test_entry_point_registered():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("async_rl_cpu_fixes") == "async_rl.vllm_plugin:register"


def test_vllm_loads_our_plugin():
    from vllm.plugins import load_plugins_by_group

    plugins = load_plugins_by_group("vllm.general_plugins")
    assert plugins["async_rl_cpu_fixes"] is vllm_plugin.register


def test_register_is_idempotent():
    first = vllm_plugin.request_amx_permission()
    vllm_plugin.register()
    assert vllm_plugin.request_amx_permission() == first
