"""The KV cache: block pool, paged and contiguous managers, prefix reuse (hashes, radix
tree, eviction policies, pins), the hybrid manager for sliding-window layers, segment
entries, KV storage, events; codecs (``codecs/``), presses (``press/``) and tiers below
the pool (``tiers/``). Bookkeeping here is plain Python; tensors live in ``storage.py``,
``codecs/``, ``tiers/`` and the press math.
"""
