"""``documents`` (RAG) in a chat: the template's own section, or a documented fallback.

transformers' chat templates take ``documents`` (a list of dicts, usually ``title`` and
``text``) next to ``messages`` (Command R, Granite and Llama 3.1 RAG templates render
them). vLLM passes them through and a template without a documents section drops them
silently; kvstack instead puts them in the system message when the template does not
reference ``documents``, so the model sees them either way::

    # Documents

    <document index="1" title="Opening hours">
    The museum opens at 10.
    </document>

Each document's text is ``text`` (else ``content``, else its JSON); ``title`` is optional.
At most ``MAX_DOCUMENTS`` documents.
"""

from __future__ import annotations

import json
from typing import Any

from kvstack.core.errors import InvalidRequestError

MAX_DOCUMENTS = 64


def template_supports_documents(template: str) -> bool:
    return "documents" in template


def check_documents(documents: list[dict[str, Any]]) -> None:
    if len(documents) > MAX_DOCUMENTS:
        raise InvalidRequestError(f"at most {MAX_DOCUMENTS} documents", param="documents")


def _text(doc: dict[str, Any]) -> str:
    for key in ("text", "content"):
        if isinstance(doc.get(key), str):
            return str(doc[key])
    return json.dumps(doc, ensure_ascii=False)


def documents_section(documents: list[dict[str, Any]]) -> str:
    parts = ["# Documents"]
    for i, doc in enumerate(documents, 1):
        title = doc.get("title")
        attrs = f'index="{i}"' + (f" title={json.dumps(str(title))}" if title else "")
        parts.append(f"<document {attrs}>\n{_text(doc)}\n</document>")
    return "\n\n".join(parts)


def with_documents(
    messages: list[dict[str, Any]], documents: list[dict[str, Any]] | None, template: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, the template's ``documents`` argument) for one request."""
    if not documents:
        return messages, None
    check_documents(documents)
    if template_supports_documents(template):
        return messages, documents
    section = documents_section(documents)
    out = list(messages)
    if out and out[0].get("role") == "system":
        system = out[0].get("content") or ""
        out[0] = {**out[0], "content": f"{system}\n\n{section}" if system else section}
    else:
        out.insert(0, {"role": "system", "content": section})
    return out, None
