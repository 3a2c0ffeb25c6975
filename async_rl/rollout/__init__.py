"""Rollout: vLLM inference, generation loops and evaluation."""
