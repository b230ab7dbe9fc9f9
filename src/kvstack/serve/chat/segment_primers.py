"""Segment primers: what a tool schema is computed after when it is stored (segment reuse).

A segment's KV is computed standalone once and copied into any request
(``kv/segments.py``). Computed right after BOS, a tool schema is "the first thing in
the context"; in a real prompt it is the third tool of a list, after the template's
framing. The copy then lacks what the item before it gave its tokens, and the repair
(CacheBlend / EPIC rows) only mends part of it. A *primer* narrows that gap: the entry
is computed as ``[BOS][primer][segment]``, where the primer is one example item of the
same kind as the template renders it, followed by the template's text between two
items (kvstack has one for tools)::

    real prompt:  ... <tools>\\n [tool 7] \\n [tool 2] \\n [tool 15] \\n</tools> ...
    entry fill:   [BOS] [example tool] \\n [tool 2]      (tool 2's KV kept, re-rotated)

The primer is fixed per tokenizer (its tokens are part of the entry's key, so every
request computing or reusing the entry sees the same KV: no result depends on which
request stored it). The examples below are generic (a weather tool, a search tool) and
are not a request's. Measured on SmolLM2-135M (``benchmarks/segments.py``, bf16, 24
requests of ``agent-tools-shuffled``, README "Segment reuse"): teacher-forced KL to
full prefill 0.047 instead of 0.067 at recompute ratio 0.15, same run (top-1 0.923
instead of 0.905; the forced tool call equal to full prefill's in 45 % of requests
instead of 23 %). Documents get no primer: a generic encyclopedia paragraph made
``rag-shuffled`` worse (exploratory, float32: KL 0.082 instead of 0.070), and marked
content parts have no common form. This goes beyond EPIC and CacheBlend (both compute
a chunk after nothing or a sink); it is close to APE's shared prefix (Yang et al.,
ICLR 2025), made per kind. Offline, a mark's third element
is its primer (``LLM.generate(segments=[[start, end, primer_ids]])``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvstack.serve.api.protocol_tools import ToolDef
from kvstack.serve.chat.prompt import render_dicts
from kvstack.serve.chat.tool_calls import ToolPlan

if TYPE_CHECKING:
    from kvstack.model.tokenizer.tokenizer import Tokenizer

EXAMPLE_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_current_weather",
        "description": "Get the current weather in a given location. Returns the "
        "temperature, the sky conditions and the wind speed in the units the caller asks "
        "for. Use it whenever the user asks about the weather now or later today.",
        "parameters": {"type": "object", "properties": {
            "location": {"type": "string",
                         "description": "The city and state or country, e.g. Lyon, France"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"],
                     "description": "The temperature unit to use"},
        }, "required": ["location"]},
    }},
    {"type": "function", "function": {
        "name": "search_web",
        "description": "Search the web and return the titles and snippets of the best "
        "matching pages.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "What to search for"},
        }, "required": ["query"]},
    }},
]  # fmt: skip


def _between(tok: Tokenizer, text: str, first: str, second: str) -> tuple[int, ...]:
    """``first`` and the text up to ``second`` in ``text``, tokenized as
    ``serve/chat/segments.py`` does (``first`` on its own, then the text between); () if
    ``text`` does not show both in that order."""
    a = text.find(first)
    b = text.find(second, a + len(first)) if a >= 0 else -1
    if b < 0:
        return ()
    ids = tok.encode(first, add_special_tokens=False)
    return tuple(ids + tok.encode(text[a + len(first) : b], add_special_tokens=False))


def tool_primer(
    tok: Tokenizer, tool_texts: Callable[[dict[str, Any]], list[str]]
) -> tuple[int, ...]:
    """The tool primer of ``tok``'s template (cached on the tokenizer); () when the
    template shows the example tools in none of the forms ``tool_texts`` gives (how
    ``serve/chat/segments.py`` looks for a tool)."""
    cached = getattr(tok, "_kvstack_tool_primer", None)
    if cached is not None:
        return tuple(cached)
    plan = ToolPlan.build([ToolDef.model_validate(t) for t in EXAMPLE_TOOLS], None, None, "hermes")
    text = render_dicts(
        tok, [{"role": "user", "content": "Hello."}], add_generation_prompt=True, plan=plan
    )
    primer: tuple[int, ...] = ()
    for first, second in zip(*(tool_texts(t) for t in EXAMPLE_TOOLS), strict=True):
        primer = _between(tok, text, first, second)  # the same rendering of both
        if primer:
            break
    tok._kvstack_tool_primer = primer  # type: ignore[attr-defined]
    return primer
