"""Token log-probabilities and entropies without the ``[tokens, vocab]`` tensor.

The causal LM's ``lm_head`` is replaced by :class:`LogProbHead` (same weight parameter, so
checkpoints, tying and FSDP sharding are unchanged). The model's forward then gathers the
hidden states of the wanted positions only (``logits_to_keep`` = their indices) and the head
returns, for each, the log-probability of its target token and the entropy of the predicted
distribution, computed by :class:`ChunkedLogProbs` over chunks of ``chunk_tokens`` positions:
LM head, temperature and log-softmax in float32 per chunk, recomputed in backward. The
largest tensor of a step is then ``[chunk, vocab]`` float32 (1.2 GB for 2048 x 151,936)
instead of several ``[tokens, vocab]`` ones (10 GB each for 16,384 tokens).

Shapes: ``M`` wanted positions, ``H`` hidden size, ``V`` vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


class ChunkedLogProbs(torch.autograd.Function):
    """``(hidden [M, H], weight [V, H], targets [M, K]) -> (logp [M, K], entropy [M])``, float32.

    ``K`` targets a position: the sampled token, and with a distillation teacher's top-k
    (``algorithm.distill.top_k``) the teacher's likeliest tokens too.

    ``logits = hidden @ weight.T`` in the weight's dtype, then ``/ temperature`` and
    log-softmax in float32, ``chunk`` rows at a time. Backward recomputes each chunk's
    logits; ``d logp_i / d z_j = 1[j = target] - p_j`` and
    ``d entropy / d z_j = -p_j (log p_j + entropy)`` for the temperature-scaled logits ``z``.
    The weight's gradient is accumulated over chunks in float32.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, chunk: int,  # type: ignore[override]
                with_entropy: bool) -> tuple[Tensor, Tensor]:
        m = hidden.shape[0]
        logp = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros(m, dtype=torch.float32, device=hidden.device)
        log_norm = torch.empty(m, dtype=torch.float32, device=hidden.device)
        for start in range(0, m, chunk):
            end = min(start + chunk, m)
            z = _scaled_logits(hidden[start:end], weight, temperature)
            log_norm[start:end] = torch.logsumexp(z, dim=-1)
            z.sub_(log_norm[start:end, None])  # now log p
            logp[start:end] = z.gather(1, targets[start:end])
            if with_entropy:  # H = -sum_j p_j log p_j, as a batched dot product (no second [c, V] temporary)
                entropy[start:end] = -torch.bmm(z.exp().unsqueeze(1), z.unsqueeze(2)).flatten()
        ctx.save_for_backward(hidden, weight, targets, log_norm, entropy)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not zeros
        ctx.mark_non_differentiable(*(() if with_entropy else (entropy,)))
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp: Tensor | None, grad_entropy: Tensor | None):  # type: ignore[override]
        hidden, weight, targets, log_norm, entropy = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        g_logp = grad_logp.float() if grad_logp is not None else torch.zeros(targets.shape, device=log_norm.device)
        g_sum = g_logp.sum(1)  # d/dz_j of sum_k g_k log p_k = sum_k g_k 1[j = t_k] - p_j sum_k g_k
        for start in range(0, hidden.shape[0], chunk):
            end = min(start + chunk, hidden.shape[0])
            h = hidden[start:end]
            grad = _scaled_logits(h, weight, temperature).sub_(log_norm[start:end, None])  # log p
            # dL/dz = sum_k g_k onehot_k - p * (sum_k g_k + g_ent * (log p + H)), built in place in ``grad``
            if grad_entropy is not None:
                probs = grad.exp()
                grad.add_(entropy[start:end, None]).mul_(grad_entropy[start:end, None].float())
                grad.add_(g_sum[start:end, None]).mul_(probs).neg_()
                del probs
            else:  # the usual case (entropy as a metric): one buffer, in place
                grad.exp_().mul_(-g_sum[start:end, None])
            grad.scatter_add_(1, targets[start:end], g_logp[start:end])
            if temperature != 1.0:
                grad.div_(temperature)
            grad = grad.to(weight.dtype)
            if grad_hidden is not None:
                grad_hidden[start:end] = grad @ weight
            if grad_weight is not None and grad.dtype == torch.float32:
                grad_weight.addmm_(grad.T, h)
            elif grad_weight is not None:
                grad_weight += (grad.T @ h).float()
        return grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype), None, None, None, None


def _scaled_logits(hidden: Tensor, weight: Tensor, temperature: float) -> Tensor:
    """``[c, V]`` float32 logits of ``hidden`` ``[c, H]`` divided by ``temperature`` (a new tensor)."""
    z = (hidden @ weight.T).float()
    return z.div_(temperature) if temperature != 1.0 else z


@dataclass(frozen=True)
class _Request:
    targets: Tensor
    temperature: float
    with_entropy: bool
    entropy_grad: bool


class LogProbHead(nn.Module):
    """An ``lm_head`` that returns ``[1, M, K + 1]`` float32: per wanted position, the
    log-probability of each of its ``K`` targets (``[..., :K]``) and the entropy (``[..., K]``).

    Set up per call by :func:`token_logprobs`; the weight is the original head's parameter.
    """

    def __init__(self, weight: nn.Parameter, chunk_tokens: int) -> None:
        super().__init__()
        self.weight = weight
        self.chunk_tokens = chunk_tokens
        self.request: _Request | None = None

    def forward(self, hidden: Tensor) -> Tensor:
        """``hidden`` ``[1, M, H]`` (the model gathered the wanted positions)."""
        request = self.request
        if request is None:
            raise RuntimeError("LogProbHead computes log-probs only: call the model through learner.logprobs.token_logprobs")
        flat = hidden.reshape(-1, hidden.shape[-1])
        logp, entropy = ChunkedLogProbs.apply(flat, self.weight, request.targets, request.temperature, self.chunk_tokens,
                                              request.with_entropy)
        if request.with_entropy and not request.entropy_grad:
            entropy = entropy.detach()
        return torch.cat([logp, entropy[:, None]], dim=-1)[None]  # a new tensor, not a view (FSDP hooks the output)


def install_logprob_head(model: nn.Module, chunk_tokens: int) -> None:
    """Replace ``model.lm_head`` (a bias-free ``nn.Linear``) by a :class:`LogProbHead` sharing
    its weight; call before sharding."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise TypeError(f"{type(model).__name__}: expected a bias-free nn.Linear lm_head, got {type(head).__name__}")
    model.lm_head = LogProbHead(head.weight, chunk_tokens)


def token_logprobs(model: nn.Module, input_ids: Tensor, position_ids: Tensor, logit_rows: Tensor, targets: Tensor,
                   temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = False,
                   **attention_kwargs: object) -> tuple[Tensor, Tensor | None]:
    """Log-probabilities ``[M]`` float32 of ``targets`` ``[M]`` under ``model`` (with a
    :class:`LogProbHead`), or ``[M, K]`` of ``targets`` ``[M, K]`` (several tokens a
    position), and their entropies ``[M]`` if ``with_entropy``.

    ``input_ids`` and ``position_ids`` are ``[1, S]`` (one packed row); ``logit_rows`` ``[M]``
    indexes the row's positions whose logits predict ``targets`` ``[M]`` (target position
    minus one). ``temperature`` divides the logits, as the servers did when sampling. The
    entropy is differentiable only with ``entropy_grad`` (an entropy loss term).
    ``attention_kwargs`` go to the attention implementation (packed-sequence boundaries).
    """
    head = model.lm_head
    if not isinstance(head, LogProbHead):
        raise TypeError("the model has no LogProbHead: load it with learner.model.load_sharded")
    head.request = _Request(targets if targets.dim() == 2 else targets[:, None], temperature, with_entropy, entropy_grad)
    try:
        out = model(input_ids=input_ids, position_ids=position_ids, logits_to_keep=logit_rows, use_cache=False, **attention_kwargs).logits
    finally:
        head.request = None
    logp = out[0, :, :-1] if targets.dim() == 2 else out[0, :, 0]
    return logp, (out[0, :, -1] if with_entropy else None)
