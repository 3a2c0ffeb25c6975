"""Redis Streams replay queue between rollout workers and the learner.

See docs/queue.md for semantics, durability and the Redis key layout.
"""

from async_rl.queue.client import QueueUnavailableError
from async_rl.queue.embedded import EmbeddedRedis, RedisExit, RedisNotInstalledError
from async_rl.queue.admission import Reconciled, Ticket
from async_rl.queue.replay import Check, Drop, ReplayQueue, ScreenReport, Staleness, TicketEndedError

__all__ = [
    "Check", "Drop", "EmbeddedRedis", "QueueUnavailableError", "Reconciled", "RedisExit", "RedisNotInstalledError", "ReplayQueue",
    "ScreenReport", "Staleness", "Ticket", "TicketEndedError",
]
