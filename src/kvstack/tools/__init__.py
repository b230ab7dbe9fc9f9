"""Offline tools around the engine, one package per tool.

* ``analyze``: ``kvstack analyze LOG.jsonl``, replays a request log through the engine's
  prefix cache and eviction policies (is my traffic cacheable?).
* ``bench``: ``kvstack bench serve``, an async benchmark client for any OpenAI-compatible
  server (vLLM's ``bench serve`` metrics).
* ``eval``: ``kvstack eval``, what a KV codec or press costs in quality, memory and speed.
* ``plan``: ``kvstack plan``, the KV-cache capacity planner (``data/``: its model and GPU
  registries).
* ``workloads``: deterministic synthetic workloads for prefix-cache studies (used by
  ``bench`` and ``eval``).

Each package runs as ``python -m kvstack.tools.<tool>`` with the same arguments as its
``kvstack`` sub-command (``workloads`` has no sub-command) and exports its ``add_*_args`` /
``run_*`` pair for ``kvstack.cli``. Layer rule: tools may import the engine, serve, model,
kv and config layers, never ``kvstack.cli``.
"""
