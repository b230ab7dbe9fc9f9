"""The scheduler: which requests run in a step and how many tokens each (continuous
batching, chunked prefill, preemption, draft rows, segment imports), its limits
(``config.py``) and its output (``output.py``).
"""
