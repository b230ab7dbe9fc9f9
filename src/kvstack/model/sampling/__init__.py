"""Sampling: per-step sampling metadata, the vectorized sampler, whole-distribution capture."""
