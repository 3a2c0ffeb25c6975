"""The straightforward computation the learner's packed, chunked log-probs must equal: one
padded forward pass, the whole ``[n, T, V]`` float32 logits, log-softmax and softmax."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def padded_logprobs(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, positions: Tensor,
                    temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """Log-probs and entropies ``[n, T]`` of the tokens at ``positions`` ``[n, T]`` of the
    right-padded ``input_ids`` ``[n, L]``, under a plain Hugging Face causal LM."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    rows = (positions - 1).clamp_min(0)
    picked = logits.gather(1, rows.unsqueeze(-1).expand(-1, -1, logits.shape[-1])).float() / temperature
    log_probs = torch.log_softmax(picked, dim=-1)
    logp = log_probs.gather(-1, input_ids.gather(1, positions).unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logp, entropy
