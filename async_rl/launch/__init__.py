"""Orchestration of a training run: plan, driver, tracking."""
