"""Helpers for tests and benchmarks: multi-process gloo jobs with hard timeouts."""
