"""``kvstack serve``: the OpenAI-compatible HTTP server over one engine.

* ``async_engine``: ``AsyncEngine``, the engine loop in one thread and every asyncio
  client; the only way in to the ``LLMEngine`` (``output_stream``: one request's
  outputs; ``request_log``: ``--request-log``);
* ``app``: ``create_app`` assembling the routes of ``routes_openai`` (completions,
  chat, models), ``routes_cache`` (pins, reset, KV events) and ``routes_ops`` (health,
  load, metrics, tokenize) over ``context.ServerContext`` (options, body parsing);
* ``openai_api``: engine outputs to OpenAI bodies and SSE chunks (``logprob_format``:
  logprobs, ``echo``'s prompt logprobs, vLLM's ``prompt_logprobs``); ``protocol``: the
  pydantic request bodies; ``http_errors``: OpenAI error objects, auth, body limits
  (shared with ``kvstack router``); ``kv_events_stream``: ``GET /v1/kv_events``;
  ``metrics``: the Prometheus registry;
* ``server``: building and running the server from its options (``kvstack serve``).

Layer rule: this package may import the engine, config, kv, model and request
modules, never ``kvstack.route``, ``kvstack.tools`` or ``kvstack.cli``.
"""

from __future__ import annotations
