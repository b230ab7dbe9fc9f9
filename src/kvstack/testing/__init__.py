"""Test fixtures shipped with the package, for kvstack's tests and benchmarks.

* ``tiny_models``: tiny random Llama models written as real GGUF files and Hugging Face
  folders (``tiny_llama_config``, ``random_llama_weights``, ``write_gguf``, ...).
* ``redis_server``: ``LocalRedis``, a throwaway ``redis-server`` on a free loopback port
  (needs a source tree: it runs ``scripts/redis.sh``).

Layer 4 (beside the engine): may import the model layer and below, nothing above. Nothing
in ``kvstack`` outside this package imports it; import the submodule you need (this
``__init__`` imports nothing, so it pulls in neither torch nor gguf).
"""
