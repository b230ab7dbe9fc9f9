"""Structured outputs: grammar backends (one registry) and the per-request manager.

``backend.py`` holds the protocols, ``backends.py`` the registry ``STRUCTURED_BACKENDS``,
``llguidance_backend.py`` the one backend registered today, ``manager.py`` the
``StructuredOutputManager`` the engine and runner share, and ``bitmask.py`` applies a
packed token bitmask to logits.
"""

from __future__ import annotations

from kvstack.model.structured.backend import GrammarBackend, GrammarMatcher
from kvstack.model.structured.backends import STRUCTURED_BACKENDS
from kvstack.model.structured.manager import StructuredOutputManager

__all__ = ["STRUCTURED_BACKENDS", "GrammarBackend", "GrammarMatcher", "StructuredOutputManager"]
