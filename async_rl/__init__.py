"""async-rl: asynchronous actor-learner RL post-training for language models."""

__version__ = "0.1.0"
