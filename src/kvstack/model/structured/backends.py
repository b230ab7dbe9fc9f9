"""``STRUCTURED_BACKENDS``: the registry of grammar backends (``--structured-outputs-backend``).

The protocol is ``backend.py``'s ``GrammarBackend``; each backend is one module here,
registered below (this module imports them all, so no backend imports the registry).
"""

from __future__ import annotations

from kvstack.core.registry import Registry
from kvstack.model.structured.backend import GrammarBackend
from kvstack.model.structured.llguidance_backend import LLGuidanceBackend

STRUCTURED_BACKENDS: Registry[type[GrammarBackend]] = Registry("structured outputs backend")
STRUCTURED_BACKENDS.add(
    "llguidance",
    LLGuidanceBackend,
    help="guidance-ai llguidance (Earley parser over a token trie; JSON schema, regex, Lark, GBNF)",
)
