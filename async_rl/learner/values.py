"""Token values of the critic (PPO with a critic, ``algorithm.advantage.name: gae``).

The critic is a Hugging Face ``*ForTokenClassification`` model with one label
(:func:`async_rl.learner.model.load_sharded` with ``value_model=True``). The value of a
response token is the critic's output at the position before it: the state from which the
policy sampled that token, the same position whose logits give its log-probability
(``logit_rows``), as in verl's ``values[:, -response_length - 1:-1]``.
"""

from __future__ import annotations

from torch import Tensor, nn


def token_values(model: nn.Module, input_ids: Tensor, position_ids: Tensor, logit_rows: Tensor, **attention_kwargs: object) -> Tensor:
    """Values ``[M]`` float32 of one packed row's wanted positions.

    ``input_ids`` and ``position_ids`` are ``[1, S]``; ``logit_rows`` ``[M]`` indexes the
    positions that precede each response token (as for :func:`~async_rl.learner.logprobs.token_logprobs`).
    ``attention_kwargs`` go to the attention implementation (packed-sequence boundaries).
    The score head maps each of the ``S`` hidden states to one number, which costs ``S x H``
    multiply-adds: no gathering before the head is needed.
    """
    out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **attention_kwargs).logits  # [1, S, 1]
    return out[0, logit_rows, 0].float()
