"""The FSDP2 learner: batching, sharded model, train step, checkpoints, the loop of one rank
and its Ray actor (see docs/learner.md). Never imports ``async_rl.rollout``."""
