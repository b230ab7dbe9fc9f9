"""``kvstack router``: an OpenAI-compatible HTTP front that routes each request to a replica.

* ``cli``: ``add_router_args`` / ``run_router`` (options, validation, uvicorn, signals);
* ``app``: the FastAPI app (``create_router_app``) and its routes;
* ``proxy``: ``Router``, one request's policy decision, prefill/decode sequencing, retry;
* ``relay``: streaming a backend's answer to the client;
* ``backends`` / ``discovery``: the replica pool (health, ``/load``, DNS discovery);
* ``event_sources``: the ``EventSource`` protocol and ``EVENT_SOURCES`` (``sse`` |
  ``zmq``), which backends are followed over ZMQ (``--kv-events-endpoint``,
  ``--kv-events-port``);
* ``events_client``: following a replica's ``GET /v1/kv_events`` into a policy's index
  (also used by the Ray Serve router);
* ``events_zmq``: following a backend's ZMQ PUB socket (vLLM's ``KVEventBatch``) and its
  replay socket into the policy's ``VllmEventIndex``;
* ``metrics``: the router's own ``kvstack_router:*`` Prometheus registry.
"""

from __future__ import annotations
