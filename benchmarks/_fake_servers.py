"""Options shared by the benchmarks that run the real pool on :class:`~async_rl.rollout.fake_engine.FakeServer` actors."""

from __future__ import annotations

import argparse


def add_fake_server_args(parser: argparse.ArgumentParser) -> None:
    """``--tokens-per-s``, ``--n``, ``--max-tokens``, ``--max-inflight``: one fake server's rate and its groups."""
    parser.add_argument("--tokens-per-s", type=float, default=1024.0, help="throughput of one fake server")
    parser.add_argument("--n", type=int, default=4, help="samples per group")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per sample (fixed length)")
    parser.add_argument("--max-inflight", type=int, default=16, help="groups in flight per server")
