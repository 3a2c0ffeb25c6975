"""Fixtures of the learner tests: a tiny random Qwen2 with a tokenizer (the session's
redis-server, ``redis_url``, and the one-rank gloo process group, ``one_rank``, are in
tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


VOCAB = 512


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of a random tiny Qwen2 (hidden 128, 2 layers, vocab 512) with a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("tiny_qwen2")
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
                         intermediate_size=256, vocab_size=VOCAB, max_position_embeddings=256, tie_word_embeddings=False)
    Qwen2ForCausalLM(config).save_pretrained(out)
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>").save_pretrained(out)
    return out

