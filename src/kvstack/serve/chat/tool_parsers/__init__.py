"""Tool-call parsers (``--tool-call-parser``): model text to OpenAI ``tool_calls``.

vLLM's ``--tool-call-parser`` choices of the same names, rewritten as pure Python with no
tokenizer (see ``base.py`` for the contract every parser keeps):

============  ==========================================================================
name          format
============  ==========================================================================
hermes        ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, several allowed
              (Hermes 2 Pro, Qwen 2.5 / 3, and kvstack's fallback prompt)
llama3_json   ``[<|python_tag|>]{"name": ..., "parameters": {...}}`` joined by ``;``
mistral       ``[TOOL_CALLS][{...}, ...]`` or ``[TOOL_CALLS]name[ARGS]{...}`` per call
pythonic      ``[f(a=1, b="x"), g()]`` (Llama 3.2 / 4 pythonic), read with ``ast``
============  ==========================================================================

``tool_parser(name)`` gives a parser (parsers are stateless); ``ToolStreamer(parser)`` is
the per-choice streaming state (``streaming.py``).
"""

from __future__ import annotations

from kvstack.core.registry import Registry
from kvstack.serve.chat.tool_parsers.base import (
    ParsedOutput,
    RawCall,
    ScanningToolParser,
    ScanResult,
    ToolCall,
    ToolParser,
    make_tool_call_id,
)
from kvstack.serve.chat.tool_parsers.hermes import HermesToolParser
from kvstack.serve.chat.tool_parsers.llama3_json import Llama3JsonToolParser
from kvstack.serve.chat.tool_parsers.mistral import MistralToolParser
from kvstack.serve.chat.tool_parsers.pythonic import PythonicToolParser
from kvstack.serve.chat.tool_parsers.streaming import (
    ContentDelta,
    StreamEvent,
    ToolCallDelta,
    ToolStreamer,
)

TOOL_PARSERS: Registry[type[ToolParser]] = Registry("--tool-call-parser")
TOOL_PARSERS.add(
    "hermes", HermesToolParser, "<tool_call>{json}</tool_call> (Hermes 2 Pro, Qwen 2.5/3)"
)
TOOL_PARSERS.add(
    "llama3_json", Llama3JsonToolParser, "[<|python_tag|>]{json}; {json} (Llama 3.x JSON)"
)
TOOL_PARSERS.add(
    "mistral", MistralToolParser, "[TOOL_CALLS][{json}] or [TOOL_CALLS]name[ARGS]{json}"
)
TOOL_PARSERS.add("pythonic", PythonicToolParser, "[f(a=1), g()] (Llama 3.2/4 pythonic)")


def tool_parser(name: str) -> ToolParser:
    """A parser registered as ``name``; ``ConfigError`` listing the choices if none."""
    return TOOL_PARSERS.get(name)()


__all__ = [
    "TOOL_PARSERS",
    "ContentDelta",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "ParsedOutput",
    "PythonicToolParser",
    "RawCall",
    "ScanResult",
    "ScanningToolParser",
    "StreamEvent",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolStreamer",
    "make_tool_call_id",
    "tool_parser",
]
