"""The FSDP2 learner: the step loop of every rank, rank 0's feed (queue -> screened batches)
and weight publication, batching, sharded model, train step, checkpoints and its Ray actor
(see docs/learner.md). Never imports ``async_rl.rollout``."""
