"""Prometheus metrics under vLLM's names: the server's own families and the engine's snapshot."""
