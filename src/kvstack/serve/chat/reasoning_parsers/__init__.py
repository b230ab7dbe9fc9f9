"""Reasoning parsers (``--reasoning-parser``): a thinking model's output to ``reasoning``
plus ``content``, as vLLM's parsers of the same names do (``base.py`` for the contract).

============  ==========================================================================
name          format
============  ==========================================================================
deepseek_r1   ``[<think>]reasoning</think>content``; no ``</think>``: all reasoning
qwen3         ``<think>reasoning</think>content``; no leading ``<think>``: all content
============  ==========================================================================

``reasoning_parser(name)`` gives a parser (stateless); ``parser.stream()`` the per-choice
streaming state; ``check_template(name, template)`` the start-up check that the model's
chat template writes the parser's markers.
"""

from __future__ import annotations

import re

from kvstack.core.errors import ConfigError
from kvstack.core.registry import Registry
from kvstack.serve.chat.reasoning_parsers.base import (
    ReasoningParser,
    ReasoningSplit,
    ReasoningStream,
)
from kvstack.serve.chat.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from kvstack.serve.chat.reasoning_parsers.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: Registry[type[ReasoningParser]] = Registry("--reasoning-parser")
REASONING_PARSERS.add(
    "deepseek_r1", DeepSeekR1ReasoningParser, "[<think>]reasoning</think>content (DeepSeek-R1)"
)
REASONING_PARSERS.add("qwen3", Qwen3ReasoningParser, "<think>reasoning</think>content (Qwen3)")

# Tag-like markers of a chat template (<|im_start|>, <think>, [INST], <start_of_turn>...).
_MARKER = re.compile(r"<\|[^|<>\s]{1,40}\|>|</?[A-Za-z_][\w-]{0,30}>|\[/?[A-Z_]{2,20}\]")


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser registered as ``name``; ``ConfigError`` listing the choices if none."""
    return REASONING_PARSERS.get(name)()


def template_markers(template: str) -> list[str]:
    """The distinct tag-like markers a chat template writes, in order of appearance."""
    return list(dict.fromkeys(_MARKER.findall(template)))


def check_template(name: str, template: str | None, model: str) -> ReasoningParser:
    """The parser ``name`` if the model's chat template writes its markers; else a
    ``ConfigError`` naming the markers the template does have (the wrong parser for the
    model would leave every answer in ``reasoning`` or never split it)."""
    parser = reasoning_parser(name)
    missing = parser.template_markers_missing(template or "")
    if missing:
        found = template_markers(template or "")
        raise ConfigError(
            f"--reasoning-parser {name} reads {parser.start}…{parser.end}, but the chat "
            f"template of {model} never writes {' or '.join(missing)}; its markers are: "
            f"{', '.join(found) if found else '(none: the model has no chat template)'}"
        )
    return parser


__all__ = [
    "REASONING_PARSERS",
    "DeepSeekR1ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "ReasoningSplit",
    "ReasoningStream",
    "check_template",
    "reasoning_parser",
    "template_markers",
]
