"""KV-aware routing across kvstack replicas (as llm-d, NVIDIA Dynamo, SGLang router do).

A router sits in front of several ``kvstack serve`` replicas and picks one per request
so that requests sharing a prefix land where that prefix's KV blocks are already cached,
without piling every request onto one replica. It never places, scales or restarts
replicas; it only chooses among those it is given.

* ``policy/``: the routing policies (``ROUTING_POLICIES``: ``round_robin``,
  ``least_load``, ``prefix``, ``kv_events``) over plain ``Replica`` records and their
  load-balance guard; the block-hash indexes they match against (an approximate,
  router-side LRU of hashes the router sent, and an exact index fed by each replica's
  ``GET /v1/kv_events``); router-side tokenizing of OpenAI bodies.
* ``router/``: ``kvstack router``, the OpenAI-compatible front (``app``, ``cli``), the
  proxy with prefill/decode sequencing (``proxy``, ``relay``), its replica pool
  (``backends``, ``discovery``), the KV event subscribers (``events_client``) and its
  Prometheus ``metrics``.
* ``ray/``: the same routing as a Ray Serve deployment.

``policy`` does no network I/O (``prompt`` parses bodies with ``kvstack.serve.api.protocol``);
``router`` and ``ray`` build on ``policy`` and ``kvstack.serve``'s protocol and errors
(the Ray router reuses ``router.events_client``).
Importing this package imports nothing heavy: the policies are pure bookkeeping and are
tested on simulated replicas in milliseconds.
"""

from __future__ import annotations
