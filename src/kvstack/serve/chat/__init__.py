"""Chat requests: prompts through templates, documents, tools (prompt, constraint, parsers) and
segments.
"""
