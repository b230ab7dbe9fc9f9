"""Segments of a chat request (segment reuse): each tool, each document, each content part
marked ``"kvstack_segment": true`` becomes a reusable segment (``kv/segments.py``).

The conversation is rendered to text once (``chat_prompt_text``); every segment's text is
found in it (a tool as its template or the fallback renders it: ``json.dumps`` of the
tool or of its ``function``, compact or indented; a document's ``text``/``content``; a
part's text) and the text is tokenized piece by piece, each segment on its own::

    text:    <|im_start|>system ... <tools>\\n{"type": "function", ...}\\n{...}</tools> ...
    pieces:  [ before                      ][ tool 0 (segment)         ][..][tool 1]...
    ids:     encode(before) + encode(tool 0) + encode(between) + ...

so a segment has the same token ids wherever it sits. The ids may differ from
tokenizing the whole text at a piece boundary (BPE merges stop there); a full prefill of
the same request uses the same ids. Text not found (a template that renders a tool
otherwise) is simply not a segment. Without segments (``--segment-cache none``, or none
found) the ids are exactly ``chat_prompt_ids``'.
"""

from __future__ import annotations

import bisect
import json
from typing import TYPE_CHECKING, Any

from kvstack.core.errors import InvalidRequestError
from kvstack.model.tokenizer.tokenizer import Tokenizer
from kvstack.serve.chat.prompt import chat_prompt_text
from kvstack.serve.chat.segment_primers import tool_primer

if TYPE_CHECKING:
    from kvstack.serve.chat.messages import ChatMessage
    from kvstack.serve.chat.tool_calls import ToolPlan

MIN_SEGMENT_TOKENS = 8  # shorter texts are not worth a standalone prefill
# Content parts one request may mark ``kvstack_segment``: a RAG prompt marks one per
# retrieved passage (tens); each is located in the rendered text and prefilled standalone.
MAX_MARKED_PARTS = 256
Mark = tuple[int, int] | tuple[int, int, list[int]]  # [start, end) and a primer's ids


def _tool_texts(tool: dict[str, Any]) -> list[str]:
    """How templates render one tool (the fallback and ``tojson`` variants)."""
    objs = [tool] + ([tool["function"]] if isinstance(tool.get("function"), dict) else [])
    return [json.dumps(o, ensure_ascii=False, indent=i) for o in objs for i in (None, 4, 2)]


def segment_candidates(
    tools: list[dict[str, Any]] | None,
    documents: list[dict[str, Any]] | None,
    messages: list[ChatMessage],
) -> list[list[str]]:
    """Per segment, the texts it may appear as (first found wins), in request order.

    Raises ``InvalidRequestError`` (``param`` ``messages``) for more than
    ``MAX_MARKED_PARTS`` marked content parts: checked here, before any templating or
    tokenizing (tools and documents have their own caps, ``MAX_TOOLS``, ``MAX_DOCUMENTS``).
    """
    marked = sum(
        1 for m in messages if isinstance(m.content, list) for p in m.content if p.kvstack_segment
    )
    if marked > MAX_MARKED_PARTS:
        raise InvalidRequestError(
            f"{marked} content parts are marked kvstack_segment; a request may mark at most "
            f"{MAX_MARKED_PARTS}",
            param="messages",
        )
    out: list[list[str]] = [_tool_texts(t) for t in tools or []]
    for doc in documents or []:
        for key in ("text", "content"):
            if isinstance(doc.get(key), str) and doc[key]:
                out.append([doc[key]])
                break
    for m in messages:
        if isinstance(m.content, list):
            out.extend([p.text] for p in m.content if p.kvstack_segment and p.text)
    return out


def _free_at(text: str, piece: str, lo: int, hi: int, starts: list[int], ends: list[int]) -> int:
    """The first occurrence of ``piece`` starting in ``[lo, hi)`` that overlaps no found
    segment (``starts``/``ends``: sorted, disjoint), or -1. An occurrence that overlaps
    segment ``i`` moves the search to ``ends[i]``: no position inside a found segment is
    scanned twice for the same piece."""
    n = len(piece)
    at = text.find(piece, lo, min(hi + n - 1, len(text)))
    while at >= 0:
        i = bisect.bisect_left(starts, at + n) - 1
        if i < 0 or ends[i] <= at:
            return at
        at = text.find(piece, ends[i], min(hi + n - 1, len(text)))
    return -1


def locate_segments(text: str, candidates: list[list[str]]) -> list[tuple[int, int, int]]:
    """Character ranges of the segments found in ``text`` with their candidate's index,
    sorted, not overlapping.

    Templates render segments in request order, so each candidate is searched from where
    the previous one ended (one pass over the text for the usual layout), and only one not
    found after it is searched before it; a search never rescans a found segment. That is
    O(len(text)) per candidate at worst (a text not found at all), bounded by the caps on
    tools, documents and marked parts; the first-occurrence search this replaced rescanned
    every found segment for every candidate, cubic in the number of parts (1,000 marked
    parts took 31 s).
    """
    starts: list[int] = []
    ends: list[int] = []
    tags: list[int] = []
    cursor = 0
    for ci, options in enumerate(candidates):
        for piece in options:
            at = _free_at(text, piece, cursor, len(text), starts, ends)
            if at < 0 and cursor:
                at = _free_at(text, piece, 0, cursor, starts, ends)
            if at >= 0:
                i = bisect.bisect_left(starts, at)
                starts.insert(i, at)
                ends.insert(i, at + len(piece))
                tags.insert(i, ci)
                cursor = at + len(piece)
                break
    return list(zip(starts, ends, tags, strict=True))


def split_tokenize(
    tok: Tokenizer, text: str, ranges: list[tuple[int, int, int]]
) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Ids of ``text`` with each character range tokenized on its own, and the token
    ranges of those that are long enough to be segments (with the range's tag)."""
    ids: list[int] = []
    spans: list[tuple[int, int, int]] = []
    at = 0
    for start, end, tag in ranges:
        ids += tok.encode(text[at:start], add_special_tokens=False) if start > at else []
        seg = tok.encode(text[start:end], add_special_tokens=False)
        if len(seg) >= MIN_SEGMENT_TOKENS:
            spans.append((len(ids), len(ids) + len(seg), tag))
        ids += seg
        at = end
    ids += tok.encode(text[at:], add_special_tokens=False) if at < len(text) else []
    return ids, spans


def chat_segments(
    tok: Tokenizer,
    messages: list[ChatMessage],
    *,
    plan: ToolPlan | None,
    documents: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], list[Mark]] | None:
    """The conversation's ids and segment marks (arguments as ``chat_prompt_ids``): a
    tool's mark carries the tool primer (``serve/chat/segment_primers.py``), the others are
    ``(start, end)``; None when it marks no segment its rendered prompt shows (then
    ``chat_prompt_ids`` applies unchanged)."""
    tools = [t.model_dump(exclude_none=True) for t in plan.tools] if plan is not None else None
    candidates = segment_candidates(tools, documents, messages)
    if not candidates:
        return None
    text = chat_prompt_text(
        tok, messages, add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        chat_template_kwargs=chat_template_kwargs, plan=plan, documents=documents,
    )  # fmt: skip
    ranges = locate_segments(text, candidates)
    if not ranges:
        return None
    ids, spans = split_tokenize(tok, text, ranges)
    if not spans:
        return None
    num_tools = len(tools or [])
    primer = tool_primer(tok, _tool_texts) if num_tools else ()
    marks: list[Mark] = [
        (a, b, list(primer)) if tag < num_tools and primer else (a, b) for a, b, tag in spans
    ]
    return ids, marks
