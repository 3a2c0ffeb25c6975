"""Datasets, prompt formatting and the tiny task/model assets used by tests and quickstart."""
