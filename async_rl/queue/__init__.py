"""Redis Streams replay queue between rollout workers and the learner.

See docs/queue.md for semantics, durability and the Redis key layout.
"""

from async_rl.queue.client import QueueUnavailableError
from async_rl.queue.embedded import EmbeddedRedis, RedisNotInstalledError
from async_rl.queue.replay import ReplayQueue

__all__ = ["EmbeddedRedis", "QueueUnavailableError", "RedisNotInstalledError", "ReplayQueue"]
