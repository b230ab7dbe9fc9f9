"""Workloads whose shared text comes in any order: segment reuse.

Prefix caching only reuses a request's *prefix*; these two send the same pieces in
different subsets and orders, which only segment reuse (``kv/segments.py``) can share::

    agent-tools-shuffled  |H|sys|tool 7|tool 2|tool 15|tool 9|.user (20-60).|
                          3-8 of num_tools (20) schemas of 120-250 tokens, shuffled
    rag-shuffled          |H|sys|doc 12|doc 3|doc 27|.question.|
                          3-5 of num_docs (30) documents of about doc_len (200) tokens

Each request carries its pieces the way a client sends them: ``tools`` (an OpenAI body
field) or ``documents`` (vLLM's), in ``body_extra``; its ``prompt_token_ids`` and
``segments`` are what ``kvstack serve`` computes from that body (``serve/chat/segments.py``:
each piece tokenized on its own), so offline runs and the server see the same ids.
"""

from __future__ import annotations

import json
import random
from typing import TYPE_CHECKING, Any

from kvstack.tools.workloads.agent import parse_chat
from kvstack.tools.workloads.spec import WorkloadRequest, WorkloadSpec
from kvstack.tools.workloads.text import TextMaker, tool_schema

if TYPE_CHECKING:
    from kvstack.model.tokenizer.tokenizer import Tokenizer

TOOLS_PER_REQUEST = (3, 8)
TOOL_TOKENS = (120, 250)
USER_TOKENS = (20, 60)
DOCS_PER_REQUEST = (3, 5)


def _rng(spec: WorkloadSpec, *parts: object) -> random.Random:
    return random.Random("/".join(map(str, (spec.seed, spec.name, *parts))))


def sized_tool(rng: random.Random, maker: TextMaker, index: int, n_tokens: int) -> dict[str, Any]:
    """A function schema whose JSON is about ``n_tokens`` tokens."""
    bare = tool_schema(rng, maker, index, 1)
    short = maker.count(json.dumps(bare, ensure_ascii=False))
    bare["function"]["description"] = maker.text(rng, max(1, n_tokens - short))
    return bare


def segment_ids(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
) -> tuple[list[int], list[Any]]:
    """Ids and segment marks of a chat body exactly as ``kvstack serve`` computes them
    (``[start, end]``, a tool's with its primer: ``[start, end, primer ids]``)."""
    from kvstack.serve.chat.segments import chat_segments

    msgs, plan = parse_chat(messages, tools)
    found = chat_segments(
        tokenizer, msgs, plan=plan, documents=documents, add_generation_prompt=True
    )
    assert found is not None, "the rendered prompt shows none of the request's pieces"
    return found


def _request(
    spec: WorkloadSpec,
    tok: Tokenizer,
    i: int,
    messages: list[dict[str, Any]],
    extra: dict[str, Any],
) -> WorkloadRequest:
    ids, spans = segment_ids(tok, messages, extra.get("tools"), extra.get("documents"))
    text = tok.decode(ids, skip_special_tokens=False)
    rid = f"{spec.name}-{i}"
    return WorkloadRequest(
        rid, ids, messages, text, spec.max_tokens, None, 0, i, extra, [list(s) for s in spans]
    )


def agent_tools_shuffled(spec: WorkloadSpec, tok: Tokenizer) -> list[WorkloadRequest]:
    maker = TextMaker(tok)
    pool_rng = _rng(spec, "pool")
    num_tools = int(spec.num_tools or 20)
    pool = [
        sized_tool(pool_rng, maker, k, pool_rng.randint(*TOOL_TOKENS)) for k in range(num_tools)
    ]
    lead = "You are an agent. Call one of the tools when it helps."
    system = maker.text(_rng(spec, "system"), int(spec.system_len or 0), lead)
    out = []
    for i in range(spec.num_requests):
        rng = _rng(spec, "req", i)
        k = min(rng.randint(*TOOLS_PER_REQUEST), num_tools)
        tools = [pool[t] for t in rng.sample(range(num_tools), k)]
        user = maker.text(rng, rng.randint(*USER_TOKENS), "Please help:")
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        out.append(_request(spec, tok, i, msgs, {"tools": tools}))
    return out


def rag_shuffled(spec: WorkloadSpec, tok: Tokenizer) -> list[WorkloadRequest]:
    maker = TextMaker(tok)
    num_docs, doc_len = int(spec.num_docs or 30), int(spec.doc_len or 200)
    docs = [
        {"title": f"doc-{d}", "text": maker.text(_rng(spec, "doc", d), doc_len, f"Report {d}:")}
        for d in range(num_docs)
    ]
    lead = "Answer using only the documents given."
    system = maker.text(_rng(spec, "system"), int(spec.system_len or 0), lead)
    out = []
    for i in range(spec.num_requests):
        rng = _rng(spec, "req", i)
        k = min(rng.randint(*DOCS_PER_REQUEST), num_docs)
        chosen = [docs[d] for d in rng.sample(range(num_docs), k)]
        question = maker.text(rng, int(spec.question_len or 30), "Question:")
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        out.append(_request(spec, tok, i, msgs, {"documents": chosen}))
    return out
