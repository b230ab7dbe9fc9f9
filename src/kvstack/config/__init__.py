"""Engine options: ``EngineConfig`` and its parts, checked against the registries, and vLLM's
spellings.
"""
