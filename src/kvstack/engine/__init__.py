"""The engine: ``LLMEngine`` (schedule, run, sample, detokenize), the offline ``LLM`` API, and
their counters.
"""
