"""KV events: the SSE stream and vLLM's ZMQ publisher, with vLLM's block hashes."""
