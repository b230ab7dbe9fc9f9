"""KV-aware routing across kvstack replicas (era 4: llm-d, NVIDIA Dynamo, SGLang router).

A router sits in front of several ``kvstack serve`` replicas and picks one per request
so that requests sharing a prefix land where that prefix's KV blocks are already cached,
without piling every request onto one replica. It never places, scales or restarts
replicas; it only chooses among those it is given.

* ``policy``: the routing policies (``round_robin``, ``least_load``, ``prefix``,
  ``kv_events``) over plain ``Replica`` records, and their load-balance guard.
* ``kv_index``: what each replica caches, as the engine's block hash chain: an
  approximate, router-side LRU of hashes the router sent, and an exact index fed by
  each replica's KV event stream (``GET /v1/kv_events``).
* ``router_app`` / ``backends`` / ``events_client`` / ``cli``: the OpenAI-compatible
  router front (``kvstack router``), its replica clients and event subscribers, a Ray
  Serve deployment, and prefill/decode disaggregation across replica roles.

Importing this package imports nothing heavy: the policies are pure bookkeeping and are
tested on simulated replicas in milliseconds.
"""

from __future__ import annotations
