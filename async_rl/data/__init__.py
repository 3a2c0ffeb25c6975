"""Datasets (text and images) and prompt formatting; the tiny assets live in ``async_rl.tiny``."""
