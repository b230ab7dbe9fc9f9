"""Workload files: one JSON object per request and line (``--out``, ``bench serve --dataset``)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstack.tools.workloads.spec import WorkloadRequest


def _to_json(req: WorkloadRequest) -> dict[str, Any]:
    body: dict[str, Any]
    body = {"prompt": req.prompt} if req.messages is None else {"messages": req.messages}
    row = {k: v for k, v in dataclasses.asdict(req).items() if k not in ("messages", "prompt")}
    for key in ("body_extra", "segments"):
        if row[key] is None:
            del row[key]  # files of the other workloads stay as they were
    full = {**body, "max_tokens": req.max_tokens, **(req.body_extra or {})}
    return {**row, **body, "prompt": req.prompt, "body": full}


def write_jsonl(requests: Sequence[WorkloadRequest], path: str | Path) -> None:
    """One JSON object per request and line: the fields, ``messages`` for chat requests,
    ``prompt`` (always, so that :func:`read_jsonl` round-trips exactly) and ``body``, the
    OpenAI-style request body (``{"messages" | "prompt", "max_tokens"}``, plus
    ``body_extra``: agent-loop's ``tools`` and ``tool_choice``, also kept as a field)."""
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(_to_json(r), ensure_ascii=False) + "\n" for r in requests)


def read_jsonl(path: str | Path) -> list[WorkloadRequest]:
    """The requests written by :func:`write_jsonl`."""
    names = [f.name for f in dataclasses.fields(WorkloadRequest)]
    with open(path, encoding="utf-8") as f:
        rows: list[dict[str, Any]] = [json.loads(line) for line in f if line.strip()]
    kwargs: list[dict[str, Any]] = [{k: row.get(k) for k in names} for row in rows]
    return [WorkloadRequest(**{**kw, "prompt": kw["prompt"] or ""}) for kw in kwargs]
