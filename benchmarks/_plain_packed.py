"""The plain packed training loop the learner is measured against (``learner_gpu.py``,
``learner_throughput.py``).

What a careful user writes by hand: a Hugging Face model, samples packed into rows with
restarting ``position_ids`` (transformers keeps them apart: flex attention on GPU, sdpa with
its packed mask on CPU), the LM head and log-softmax over the response positions in
checkpointed chunks, a REINFORCE-style loss, gradient clipping and AdamW. No FSDP, no
off-policy correction, no metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from async_rl.learner.batching import Batch, PackedRow, pack


def _chunk_logp(hidden: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
    logits = (hidden @ weight.T).float()
    return torch.log_softmax(logits, dim=-1).gather(1, targets[:, None])[:, 0]


def plain_packed_step(model: nn.Module, batch: Batch, plan: Sequence[Sequence[int]], device: torch.device,
                      chunk_tokens: int, dtype: torch.dtype) -> Callable[[], int]:
    """One optimizer step over ``batch``'s micro-batches ``plan`` (lists of rows), each packed
    into one row; returns a callable that runs it and returns the step's tokens."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=device.type == "cuda")
    rows: list[tuple[PackedRow, Tensor]] = []
    for micro_rows in plan:
        micro = batch.select(list(micro_rows))
        row = pack(micro)
        advantage = (micro.rewards - 0.5)[:, None].expand_as(micro.response_mask).reshape(-1)[row.dest]
        rows.append((row, advantage))
    total = float(batch.response_mask.sum())
    tokens = int(batch.lengths.sum())
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)

    def step() -> int:
        for row, advantage in rows:
            with autocast:
                hidden = model.model(input_ids=row.input_ids.to(device), position_ids=row.position_ids.to(device)).last_hidden_state
                hidden = hidden[0, row.logit_rows.to(device)]
                targets = row.targets.to(device)
                logp = torch.cat([
                    checkpoint(_chunk_logp, hidden[s:s + chunk_tokens], model.lm_head.weight, targets[s:s + chunk_tokens], use_reentrant=False)
                    for s in range(0, hidden.shape[0], chunk_tokens)
                ])
            (-(logp * advantage.to(device)).sum() / total).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return tokens

    return step
